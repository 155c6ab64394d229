"""From an ``EngineConfig`` to the parts the engine core drives: the model loaded with its
tokenizer and end-of-sequence ids, the pools planned from the memory budget and allocated
(the cache coordinator over them, the runner's tensors), the scheduler, and the disk tier.

Everything here runs once, at start-up; nothing here runs during a step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from hyprefix.cache.checkpoint_policy import CheckpointPolicy
from hyprefix.cache.coordinator import CacheCoordinator
from hyprefix.cache.events import EventLog
from hyprefix.cache.kv_eviction import KVEvictionPolicy
from hyprefix.cache.plan import PoolPlan, build_cache, plan_pools
from hyprefix.disk.connector import DiskConnector
from hyprefix.engine_config import EngineConfig
from hyprefix.engine_stats import recompute_cost
from hyprefix.kernels import decode_attention, kv_write
from hyprefix.models import kv_quant
from hyprefix.models.loader import LoadedModel, gguf_parsed_once, load_model, load_tokenizer
from hyprefix.runner.model_runner import ModelRunner, PoolSizes
from hyprefix.scheduler import Scheduler

log = logging.getLogger("hyprefix")

# Speculative decoding on models with recurrent layers: memory for the scratch states of the rows
# verifying drafts (k states a row); it bounds how many rows a step verifies.
SPEC_SCRATCH_BYTES = 1 << 30


@dataclass
class EngineParts:
    loaded: LoadedModel
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    cache: CacheCoordinator
    cache_events: EventLog
    scheduler: Scheduler
    runner: ModelRunner
    disk: DiskConnector | None
    state_bytes_per_slot: int
    memory_bytes: dict[str, int]  # by pool: what ``/metrics`` and the start-up log report


def load_parts(config: EngineConfig) -> EngineParts:
    """Load the model and build every part around it (``config`` validated already)."""
    t0 = time.perf_counter()
    model_config, runner_config = config.model, config.runner
    device = torch.device(runner_config.device)
    with gguf_parsed_once():
        loaded = load_model(model_config.model, model_config.dtype, device, model_config.max_model_len,
                            model_config.revision, quantization=model_config.quantization,
                            compiled_decode=runner_config.compile, lm_head_fp32=model_config.lm_head_fp32,
                            batch_invariant=runner_config.batch_invariant)
        tokenizer = load_tokenizer(model_config.tokenizer or loaded.path)
    max_model_len = model_config.max_model_len or loaded.max_position_embeddings
    cache_config, model = config.cache, loaded.model
    kv_dtype = kv_cache_storage(cache_config.kv_cache_dtype, model, device, loaded.dtype)
    if kv_dtype != loaded.dtype:  # the K/V's format is part of every block's identity: memory, disk, events
        loaded = replace(loaded, identity=f"{loaded.identity}|kv={cache_config.kv_cache_dtype}/{kv_quant.FORMAT}")
    state_dtype = getattr(torch, cache_config.state_dtype)
    state_bytes = ModelRunner.state_bytes_per_slot(model, loaded.dtype, state_dtype)
    layout = model.kv_layout

    def kv_bytes_per_block(which: str) -> int:
        return ModelRunner.kv_bytes_per_block(model, kv_dtype, cache_config.block_size, which)

    plan = plan_pools(cache_config, config.scheduler.max_num_batched_tokens,
                      [layout.window(i) for i in range(layout.num_layers)], max_model_len, kv_bytes_per_block,
                      state_bytes)
    events = EventLog(enabled=config.events is not None)
    max_seqs = config.scheduler.max_num_seqs
    cost = recompute_cost(model)  # what a state checkpoint's hit or a KV block's recompute is worth
    cache = build_cache(plan.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                        loaded.identity, events, max_seqs, attention=bool(layout.num_layers), window=plan.window,
                        window_blocks=plan.num_window_blocks,
                        checkpoints=plan.num_checkpoints if model.state_layout is not None else None,
                        checkpoint_policy=CheckpointPolicy(cache_config.state_eviction_policy, cost),
                        kv_eviction=KVEvictionPolicy(cache_config.kv_eviction_policy, cost, cache_config.block_size))
    k = config.speculative.k if config.speculative is not None else 0
    # Hybrids verify drafts in as many rows a step as their scratch states fit in its budget.
    draft_rows = min(max_seqs, max(1, SPEC_SCRATCH_BYTES // (k * state_bytes))) if k and state_bytes else None
    scheduler = Scheduler(replace(config.scheduler, max_draft_rows=draft_rows, drafts_within_block=bool(state_bytes)),
                          cache)
    num_live = max_seqs if state_bytes else 0
    eos_token_ids = end_of_sequence_ids(loaded, tokenizer)
    pools = PoolSizes(loaded.dtype, plan.num_blocks, cache_config.block_size, plan.num_window_blocks, num_live,
                      plan.num_checkpoints, state_dtype, k, draft_rows or 0, kv_dtype)
    runner = ModelRunner(model, pools, runner_config, eos_token_ids)
    disk = DiskConnector.create(cache_config.disk, cache, runner, loaded.identity) if cache_config.disk else None
    memory = {"weights": loaded.weight_bytes, "kv_pool": plan.num_blocks * plan.bytes_per_block,
              "swa_pool": plan.num_window_blocks * plan.bytes_per_window_block,
              "live_states": num_live * state_bytes, "checkpoint_pool": plan.num_checkpoints * state_bytes,
              "draft_scratch_states": (draft_rows or 0) * k * state_bytes}
    log.info("loaded %s (%s, %s) in %.1fs", loaded.path, type(model).__name__,
             str(loaded.dtype).replace("torch.", ""), time.perf_counter() - t0)
    _log_memory(plan, memory, cache_config.block_size, num_live, state_bytes)
    if plan.bytes_per_block:
        log.info("K/V cache dtype %s: %.0f blocks (%.0f tokens) per GiB", cache_config.kv_cache_dtype if
                 kv_dtype != loaded.dtype else str(kv_dtype).replace("torch.", ""),
                 2**30 / plan.bytes_per_block, 2**30 * cache_config.block_size / plan.bytes_per_block)
    return EngineParts(loaded, tokenizer, eos_token_ids, max_model_len, cache, events, scheduler, runner, disk,
                       state_bytes, memory)


def kv_cache_storage(kv_cache_dtype: str, model: torch.nn.Module, device: torch.device,
                     dtype: torch.dtype) -> torch.dtype:
    """The K/V tensors' dtype for ``--kv-cache-dtype``: the model's for "auto", else the 8-bit
    format's (``kv_quant``; a latent (MLA) cache too, its rows rotated per part:
    ``deepseek.LatentAttention.rotated``), refused with the reason where nothing here reads it:
    off the CPU (the fused reads are CPU kernels) or without the decode-attention and K/V write
    kernels."""
    storage = kv_quant.storage_dtype(kv_cache_dtype)
    if storage is None:
        return dtype
    flag = f"--kv-cache-dtype {kv_cache_dtype}"
    if device.type != "cpu":
        raise ValueError(f"{flag} runs on the CPU only: its fused reads are CPU kernels (device {device.type}); "
                         f"use --kv-cache-dtype auto")
    if not decode_attention.available(dtype) or not kv_write.available():
        raise ValueError(f"{flag} needs the decode-attention and K/V write kernels, and one did not build here "
                         f"(see the warning above); use --kv-cache-dtype auto")
    return storage


def end_of_sequence_ids(loaded: LoadedModel, tokenizer) -> frozenset[int]:
    """Every id the model's configs (its own, its text config's, its generation config's) and
    its tokenizer name as end of sequence."""
    ids: set[int] = set()
    for source in (loaded.hf_config, loaded.hf_config.get_text_config(), _generation_config(loaded.path)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _generation_config(path):
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        return None


def _log_memory(plan: PoolPlan, memory: dict[str, int], block_size: int, num_live: int, state_bytes: int) -> None:
    mib = 2**20
    if plan.window is not None:
        log.info("sliding-window layers (window %d) keep their K/V in a pool of their own: %d blocks = %.1f MiB",
                 plan.window, plan.num_window_blocks, memory["swa_pool"] / mib)
    per_token = memory["kv_pool"] // max(1, plan.num_blocks * block_size)  # a latent cache (MLA): the latent once
    log.info("memory: weights %.1f MiB | KV pool %d blocks x %d tokens (%d B a token) = %.1f MiB | live recurrent "
             "states %d x %.2f MiB = %.1f MiB | state checkpoints %d x %.2f MiB = %.1f MiB",
             memory["weights"] / mib, plan.num_blocks, block_size, per_token, memory["kv_pool"] / mib,
             num_live, state_bytes / mib, memory["live_states"] / mib, plan.num_checkpoints, state_bytes / mib,
             memory["checkpoint_pool"] / mib)
