"""What the engine reports about itself: the loaded model's sizes (``ModelFacts``), its cumulative
counters and pool usage (``engine_stats``, docs/architecture.md "Stats"), and the periodic log line
(``StatsLogger``). Reads the engine's parts; changes nothing."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hyprefix.cache.checkpoint_policy import RecomputeCost
from hyprefix.cache.coordinator import CacheCoordinator
from hyprefix.models.deepseek import LatentAttention
from hyprefix.models.llama import Attention
from hyprefix.runner.model_runner import ModelRunner
from hyprefix.scheduler import Scheduler

log = logging.getLogger("hyprefix")


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of the loaded model that a benchmark or a capacity plan needs, read from
    the model the engine runs (never re-derived from ``config.json``)."""

    dtype: str
    vocab_size: int
    matmul_params: int  # weights of every linear layer but the LM head: multiply-adds per token
    lm_head_params: int
    attention_layers: int
    attention_width: int  # query heads x head dim of one attention layer (0 without attention; MLA: the latent's)
    kv_bytes_per_token: int  # K + V of every attention layer as stored (MLA: the latent, once; 8-bit: codes, scales)
    state_bytes_per_sequence: int  # state of every recurrent layer (Mamba2, Gated DeltaNet; 0 for dense models)
    decode_weight_bytes: int = 0  # weights one decode step reads (linears and LM head as stored, norms)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype


def model_facts(model: torch.nn.Module, dtype: torch.dtype, hidden_size: int, vocab_size: int,
                state_bytes: int, quantization: str | None, kv_dtype: torch.dtype | None = None,
                kv_cache_dtype: str = "auto") -> ModelFacts:
    """``kv_dtype``: the K/V tensors' (None: ``dtype``)."""
    attention = _attention_modules(model)
    return ModelFacts(
        dtype=str(dtype).replace("torch.", ""),
        vocab_size=vocab_size,
        matmul_params=_matmul_params(model),
        lm_head_params=hidden_size * vocab_size,
        attention_layers=len(attention),
        attention_width=attention[0].q_size if attention else 0,
        kv_bytes_per_token=ModelRunner.kv_bytes_per_block(model, kv_dtype or dtype, 1),
        state_bytes_per_sequence=state_bytes,
        decode_weight_bytes=model.decode_weight_bytes(),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, Attention | LatentAttention)]


def _matmul_params(model: torch.nn.Module) -> int:
    """Multiply-adds per token of every linear layer but the LM head (MLA: W_UK, W_UV too)."""
    head = getattr(model, "lm_head", None)
    linears = sum(m.in_features * m.out_features for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and m is not head)
    return linears + sum(m.absorb_params for m in _attention_modules(model) if isinstance(m, LatentAttention))


def recompute_cost(model: torch.nn.Module) -> RecomputeCost:
    """The prefill FLOPs of L tokens less the LM head, as ``bench/summary.prefill_flops`` counts
    them: what a state checkpoint at L saves (``cache/checkpoint_policy.py``)."""
    attention = _attention_modules(model)
    width = attention[0].q_size if attention else 0
    return RecomputeCost(2.0 * _matmul_params(model), 4.0 * len(attention) * width)


def engine_stats(scheduler: Scheduler, cache: CacheCoordinator, runner: ModelRunner,
                 state_bytes: int) -> dict[str, int | float]:
    """Cumulative token counters and current pool usage (the disk tier adds its own)."""
    sched, spec, pools = scheduler, scheduler.spec_stats, cache.stats()
    # the main pool's: every attention layer, or the full-attention ones beside a window pool
    token_bytes = max(1, ModelRunner.kv_bytes_per_block(runner.model, runner.kv_dtype, 1,
                                                        "full" if runner.has_window_pool else "all"))
    return {
        "num_requests_running": sched.num_running,
        "num_requests_waiting": sched.num_waiting,
        "prefix_cache_queries": sched.prefix_cache_queries,
        "prefix_cache_hits": sched.prefix_cache_hits,
        "prefix_cache_hit_rate": sched.prefix_cache_hits / max(1, sched.prefix_cache_queries),
        "prefill_computed_tokens": sched.prefill_computed_tokens,
        "prefill_skipped_tokens": sched.prefill_skipped_tokens,
        "decode_tokens": sched.decode_tokens,
        **{f"decode_steps_{path}": count for path, count in runner.decode_steps.items()},
        "spec_decode_num_drafts": spec.num_drafts,
        "spec_decode_num_draft_tokens": spec.num_draft_tokens,
        "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
        **{f"spec_decode_num_accepted_tokens_pos{i}": count for i, count in enumerate(spec.accepted_per_pos)},
        "num_preemptions": sched.num_preemptions,
        "sibling_waits": sched.sibling_waits,
        "kv_blocks_total": pools["kv_blocks_total"],
        "kv_blocks_used": pools["kv_blocks_used"],
        "kv_blocks_cached": pools["kv_blocks_cached"],
        "kv_blocks_free": pools["kv_blocks_free"],
        "kv_tokens_per_gib": 2**30 / token_bytes,
        "kv_blocks_per_gib": 2**30 / (token_bytes * runner.block_size),
        "mamba_checkpoints_used": pools.get("state_checkpoints_used", 0),
        "mamba_checkpoints_capacity": pools.get("state_checkpoints_capacity", 0),
        "mamba_checkpoint_bytes": state_bytes,
        "hybrid_hit_tokens_lost": pools["hit_tokens_lost"],
        **{key: pools.get(key, 0) for key in ("swa_blocks_total", "swa_blocks_used", "swa_blocks_cached",
                                               "swa_blocks_released")},
        # cache/retention.py: finished requests' prefixes kept (SamplingParams.cache_ttl_s)
        "kv_retentions": pools["kv_retentions"],
        "kv_blocks_retained": pools["kv_blocks_retained"],
        "kv_retained_blocks_evicted": pools["kv_retained_blocks_evicted"],
        "mamba_checkpoints_retained": pools.get("state_checkpoints_retained", 0),
        "swa_blocks_retained": pools.get("swa_blocks_retained", 0),
    }


class StatsLogger:
    """One log line every ``interval`` seconds while steps run (0: never): throughput since the
    last line, hits and pool usage."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._tokens = (0, 0)  # (prefill computed, decode) at the last line

    def maybe_log(self, sched: Scheduler, cache: CacheCoordinator) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last < self.interval:
            return
        pools = cache.stats()
        dt = now - self._last
        p0, d0 = self._tokens
        computed, decode = sched.prefill_computed_tokens, sched.decode_tokens
        log.info(
            "running %d, waiting %d | prefill %.0f tok/s, decode %.0f tok/s | prefill tokens computed %d, "
            "skipped %d | prefix hit rate %.1f%% | KV blocks used %d, cached %d, free %d of %d",
            sched.num_running, sched.num_waiting, (computed - p0) / dt, (decode - d0) / dt, computed,
            sched.prefill_skipped_tokens, 100 * sched.prefix_cache_hits / max(1, sched.prefix_cache_queries),
            pools["kv_blocks_used"], pools["kv_blocks_cached"], pools["kv_blocks_free"], pools["kv_blocks_total"])
        self._last, self._tokens = now, (computed, decode)
