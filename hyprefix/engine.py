"""Engine: validates and admits requests, runs scheduler -> runner -> update steps,
and turns per-sequence progress into ``RequestOutput`` objects."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hyprefix.cache.events import EventLog
from hyprefix.cache.plan import build_cache, plan_pools
from hyprefix.catalog import DEFAULT_MODEL, default_quantization
from hyprefix.config import EngineArgs
from hyprefix.disk_cache import DiskCache
from hyprefix.errors import RequestError
from hyprefix.input_processor import InputProcessor, Prepared, PromptInput
from hyprefix.kv_events import KVEventsConfig, ZmqEventPublisher
from hyprefix.models.llama import Attention
from hyprefix.models.loader import (
    gguf_parsed_once,
    iter_gguf,
    iter_safetensors,
    load_config,
    load_model,
    load_tokenizer,
)
from hyprefix.openmp import release_workers
from hyprefix.output_processor import OutputProcessor
from hyprefix.outputs import RequestOutput
from hyprefix.request import Request
from hyprefix.runner.block_io import BlockIO
from hyprefix.runner.cascade import CascadeThresholds
from hyprefix.runner.model_runner import ModelRunner
from hyprefix.sampling import SamplingParams
from hyprefix.scheduler import Scheduler, SchedulerConfig
from hyprefix.speculative import SpeculativeConfig
from hyprefix.structured.grammar import GrammarCompiler
from hyprefix.text import ChatPrompt

log = logging.getLogger("hyprefix")

# Speculative decoding on models with recurrent layers: memory for the scratch states of the rows
# verifying drafts (k states a row); it bounds how many rows a step verifies.
SPEC_SCRATCH_BYTES = 1 << 30

# A step with nothing to run while disk reads are under way waits this long for one.
DISK_LOAD_POLL_S = 0.05

@dataclass(frozen=True)
class ModelFacts:
    """Sizes of the loaded model that a benchmark or a capacity plan needs, read from
    the model the engine runs (never re-derived from ``config.json``)."""

    dtype: str
    vocab_size: int
    matmul_params: int  # weights of every linear layer but the LM head: multiply-adds per token
    lm_head_params: int
    attention_layers: int
    attention_width: int  # query heads x head dim of one attention layer (0 without attention)
    kv_bytes_per_token: int  # K + V of every attention layer
    state_bytes_per_sequence: int  # state of every recurrent layer (Mamba2, Gated DeltaNet; 0 for dense models)
    decode_weight_bytes: int = 0  # weights one decode step reads (linears and LM head as stored, norms)
    quantization: str | None = None


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        model_path = args.model or DEFAULT_MODEL
        # a catalog model runs in the format measured to answer right unless one is asked for
        self.quantization = args.quantization or default_quantization(model_path)
        t0 = time.perf_counter()
        with gguf_parsed_once():
            loaded = load_model(model_path, args.dtype, self.device, args.max_model_len, args.revision,
                                quantization=self.quantization, compiled_decode=not args.enforce_eager,
                                lm_head_fp32=args.lm_head_fp32, batch_invariant=args.batch_invariant)
            self.tokenizer = load_tokenizer(args.tokenizer or loaded.path)
        self.model_path = loaded.path
        self.model_identity = loaded.identity  # of the weights loaded now: ``update_weights`` changes it
        self._loaded_identity = loaded.identity
        self.weight_version = args.weight_version
        self.num_weight_updates = 0
        self.hf_config = loaded.hf_config
        self.text_config = loaded.hf_config.get_text_config()  # the config itself but for multimodal ones
        self.dtype = loaded.dtype
        self.vocab_size = int(self.text_config.vocab_size)
        self.max_model_len = args.max_model_len or loaded.max_position_embeddings
        self.eos_token_ids = self._eos_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)

        layout = loaded.model.kv_layout
        state_dtype = torch.bfloat16 if args.mamba_ssm_cache_dtype == "bfloat16" else torch.float32
        state_bytes = ModelRunner.state_bytes_per_slot(loaded.model, self.dtype, state_dtype)

        def kv_bytes_per_block(which: str) -> int:
            return ModelRunner.kv_bytes_per_block(loaded.model, self.dtype, args.block_size, which)

        plan = plan_pools(args, [layout.window(i) for i in range(layout.num_layers)], self.max_model_len,
                          kv_bytes_per_block, state_bytes)
        window, num_blocks, num_window_blocks = plan.window, plan.num_blocks, plan.num_window_blocks
        num_ckpts = plan.num_checkpoints
        events_config = KVEventsConfig.parse(args.kv_events_config)
        self.cache_events = EventLog(enabled=events_config is not None)
        self.cache = build_cache(num_blocks, args.block_size, args.enable_prefix_caching, loaded.identity,
                                 self.cache_events, args.max_num_seqs, attention=bool(layout.num_layers),
                                 window=window, window_blocks=num_window_blocks,
                                 checkpoints=num_ckpts if loaded.model.state_layout is not None else None)
        self.state_bytes_per_slot = state_bytes
        self.speculative = SpeculativeConfig.parse(args.speculative_config)
        k = self.speculative.k if self.speculative is not None else 0
        # Hybrids verify drafts in as many rows a step as their scratch states fit in its budget.
        draft_rows = min(args.max_num_seqs, max(1, SPEC_SCRATCH_BYTES // (k * state_bytes))) if k and state_bytes \
            else None
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs,
                                                   speculative=self.speculative, max_draft_rows=draft_rows,
                                                   drafts_within_block=bool(state_bytes)), self.cache)
        self.runner = self._make_runner(loaded.model, num_blocks, num_ckpts, num_window_blocks, state_dtype, k,
                                        draft_rows or 0, live_slots=args.max_num_seqs if state_bytes else 0)
        self.disk = self._make_disk(layout, num_window_blocks, loaded.identity) if args.disk_cache_dir else None
        num_live = args.max_num_seqs if state_bytes else 0
        self.memory_bytes = {"weights": loaded.weight_bytes, "kv_pool": num_blocks * plan.bytes_per_block,
                             "swa_pool": num_window_blocks * plan.bytes_per_window_block,
                             "live_states": num_live * state_bytes, "checkpoint_pool": num_ckpts * state_bytes,
                             "draft_scratch_states": (draft_rows or 0) * k * state_bytes}
        log.info("loaded %s (%s, %s) in %.1fs", loaded.path, type(loaded.model).__name__,
                 str(self.dtype).replace("torch.", ""), time.perf_counter() - t0)
        self._log_memory(window, num_blocks, num_window_blocks, num_live, num_ckpts)
        self.event_publisher = ZmqEventPublisher(events_config) if events_config is not None else None
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, args.max_logprobs,
                                     self.grammars, lambda: (self.cache.kv.num_blocks, self.max_pool_tokens))
        self.outputs = OutputProcessor(self.tokenizer, self.vocab_size, self.scheduler)
        self._last_log = time.monotonic()
        self._logged_tokens = (0, 0)
        freeze_startup_heap()
        # Loading ran parallel work on this thread; the thread that steps the engine may be
        # another, and two OpenMP pools would slow every step (``openmp.py``).
        release_workers()

    def _make_runner(self, model, num_blocks: int, num_ckpts: int, num_window_blocks: int, state_dtype: torch.dtype,
                     k: int, draft_rows: int, live_slots: int) -> ModelRunner:
        args = self.args
        return ModelRunner(model, self.dtype, self.device, num_blocks, args.block_size, args.seed,
                           compile_enabled=not args.enforce_eager, num_live_slots=live_slots,
                           num_checkpoint_slots=num_ckpts, num_window_blocks=num_window_blocks,
                           cascade_thresholds=CascadeThresholds(args.cascade_min_saved_tokens,
                                                                args.cascade_min_solo_run_tokens,
                                                                args.cascade_min_traffic_ratio),
                           eos_token_ids=self.eos_token_ids, logprobs_mode=args.logprobs_mode,
                           batch_invariant=args.batch_invariant, state_dtype=state_dtype,
                           num_speculative_tokens=k, num_draft_rows=draft_rows)

    def _make_disk(self, layout, num_window_blocks: int, identity: str) -> DiskCache:
        """The disk tier over the runner's K/V and state tensors (``--disk-cache-dir``)."""
        args = self.args
        in_window_pool = [bool(num_window_blocks) and layout.window(i) is not None for i in range(layout.num_layers)]
        io = BlockIO(self.runner.kv_caches, [i for i, w in enumerate(in_window_pool) if not w],
                     self.runner.recurrent_states, args.block_size,
                     window_pool_layers=[i for i, w in enumerate(in_window_pool) if w])
        return DiskCache(args.disk_cache_dir, args.disk_cache_gb, args.disk_cache_write_through, identity,
                         self.cache, io)

    def _log_memory(self, window: int | None, num_blocks: int, num_window_blocks: int, num_live: int,
                    num_ckpts: int) -> None:
        mib, memory, state_bytes = 2**20, self.memory_bytes, self.state_bytes_per_slot
        if window is not None:
            log.info("sliding-window layers (window %d) keep their K/V in a pool of their own: %d blocks = %.1f MiB",
                     window, num_window_blocks, memory["swa_pool"] / mib)
        log.info("memory: weights %.1f MiB | KV pool %d blocks x %d tokens = %.1f MiB | live recurrent states "
                 "%d x %.2f MiB = %.1f MiB | state checkpoints %d x %.2f MiB = %.1f MiB",
                 memory["weights"] / mib, num_blocks, self.args.block_size, memory["kv_pool"] / mib,
                 num_live, state_bytes / mib, memory["live_states"] / mib, num_ckpts, state_bytes / mib,
                 memory["checkpoint_pool"] / mib)

    @property
    def model_facts(self) -> ModelFacts:
        model = self.runner.model
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        head = getattr(model, "lm_head", None)
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        return ModelFacts(
            dtype=str(self.dtype).replace("torch.", ""),
            vocab_size=self.vocab_size,
            matmul_params=sum(m.in_features * m.out_features for m in linears if m is not head),
            lm_head_params=int(self.text_config.hidden_size) * self.vocab_size,
            attention_layers=len(attention),
            attention_width=attention[0].q_size if attention else 0,
            kv_bytes_per_token=ModelRunner.kv_bytes_per_block(model, self.dtype, 1),
            state_bytes_per_sequence=self.state_bytes_per_slot,
            decode_weight_bytes=model.decode_weight_bytes(),
            quantization=self.quantization,
        )

    def warmup(self) -> None:
        """Compile the kernels of large steps now (the server calls it before serving)."""
        t0 = time.perf_counter()
        if self.runner.warmup():
            log.info("warmed up the compiled kernels in %.1fs", time.perf_counter() - t0)
            freeze_startup_heap()
        release_workers()  # as after loading

    # --------------------------------------------------------- weight updates
    def update_weights(self, weights: str | os.PathLike | Iterable[tuple[str, torch.Tensor]],
                       weight_version: str | None = None) -> dict[str, object]:
        """Load new weights into the running model, in place: a checkpoint directory or GGUF
        file of the same architecture and shapes, or (name, tensor) pairs with the
        checkpoint's names (a trainer's state dict). Everything is read and checked before
        anything changes: a mismatch raises ``RequestError`` and leaves the model as it was.

        The weight version (``weight_version``, else the update's number) becomes part of
        the model identity at the root of every block hash: no block or state checkpoint
        computed by the old weights can be hit again; they age out of the LRU. Requests in
        flight keep what they computed and go on with the new weights (callers that want
        otherwise finish or abort them first: ``AsyncEngine.update_weights``)."""
        t0 = time.perf_counter()
        if isinstance(weights, str | os.PathLike):
            weights = self._checkpoint_tensors(Path(weights))
        try:
            count = self.runner.model.update_weights(weights)
        except ValueError as exc:
            raise RequestError(f"the new weights do not fit this model: {exc}", param="model_path") from exc
        self.num_weight_updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self.num_weight_updates)
        self.model_identity = f"{self._loaded_identity}|weights={self.weight_version}#{self.num_weight_updates}"
        self.cache.kv.set_model_identity(self.model_identity)
        self.scheduler.forget_unstarted_hashes()
        seconds = time.perf_counter() - t0
        log.info("updated %d weight tensors to version %r in %.2fs", count, self.weight_version, seconds)
        return {"weight_version": self.weight_version, "num_parameters": count, "seconds": seconds}

    def _checkpoint_tensors(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's tensors, after checking it is one of this model's architecture."""
        if not path.exists():
            raise RequestError(f"no checkpoint at {path}", param="model_path")
        try:
            config = load_config(path)
        except (OSError, ValueError) as exc:
            raise RequestError(f"{path} is not a checkpoint this server reads: {exc}", param="model_path") from exc
        for key in ("model_type", "architectures"):
            theirs, mine = getattr(config, key, None), getattr(self.hf_config, key, None)
            if theirs != mine and (key == "model_type" or (theirs and mine)):  # a GGUF may name no architectures
                raise RequestError(f"the checkpoint at {path} is another architecture ({key} {theirs!r}, this "
                                   f"model's {mine!r})", param="model_path")
        return iter_gguf(path, config) if path.suffix == ".gguf" else iter_safetensors(path)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.hf_config, self.text_config, self._generation_config()):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def _generation_config(self):
        try:
            from transformers import GenerationConfig

            return GenerationConfig.from_pretrained(str(self.model_path))
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ intake
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of one prompt; raises RequestError on bad input."""
        return self.inputs.tokenize_prompt(prompt)

    def encode_chat(self, messages: list[dict] | ChatPrompt, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation (or a ``ChatPrompt``) under the tokenizer's chat template."""
        return self.inputs.encode_chat(messages, add_generation_prompt)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``RequestError`` unless the prompt ``ids`` with ``params`` can ever run here."""
        self.inputs.validate(ids, params)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, group: str | None = None) -> None:
        """Validate and queue one request (``add_requests`` with one item)."""
        self.add_requests([(request_id, prompt, params)], arrival_time, group)

    def add_requests(self, requests: Sequence[tuple[str, PromptInput, SamplingParams | None]],
                     arrival_time: float | None = None, group: str | None = None,
                     max_total_tokens: int | None = None) -> list[tuple[str | None, list[int]]]:
        """Validate every request, then queue them all: a bad one (``RequestError``)
        queues none and allocates nothing. ``group``: the client call they belong to
        (the scheduler shares slots fairly between groups); by default each is its own.
        ``max_total_tokens``: the most tokens they may ask for together, n x (prompt +
        max_tokens) summed (a server's per-call limit). Returns each prompt's (text or
        None, token ids)."""
        checked = []
        taken: set[str] = set()
        for request_id, prompt, params in requests:
            params = params or SamplingParams()
            if not isinstance(params, SamplingParams):
                raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
            child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
            if self.outputs.knows(request_id) or request_id in taken:
                raise RequestError(f"request id {request_id!r} is already in use")
            for child_id in child_ids:  # e.g. "a#1" given by the user, then "a" with n=2
                if self.outputs.knows(child_id) or child_id in self.scheduler.requests or child_id in taken:
                    raise RequestError(f"request id {request_id!r} clashes with request {child_id!r} in use")
            taken.update([request_id, *child_ids])
            checked.append((request_id, child_ids, self.inputs.prepare(prompt, params)))
        total = sum(p.params.n * (len(p.ids) + p.params.max_tokens) for _, _, p in checked)
        if max_total_tokens is not None and total > max_total_tokens:
            raise RequestError(f"this request asks for up to {total} tokens (n x (prompt tokens + max_tokens) over "
                               f"its prompts), more than the limit of {max_total_tokens} per request: lower n or "
                               "max_tokens", param="max_tokens", code="request_too_large")
        arrival = time.time() if arrival_time is None else arrival_time
        for request_id, child_ids, prepared in checked:
            samples = [self._sequence(child_id, i, prepared, arrival, group or request_id)
                       for i, child_id in enumerate(child_ids)]
            self.outputs.add(request_id, prepared.text, prepared.ids, prepared.params, samples, arrival)
            for request in samples:
                self.scheduler.add_request(request)
        return [(p.text, p.ids) for _, _, p in checked]

    def _sequence(self, request_id: str, index: int, prepared: Prepared, arrival: float, group: str) -> Request:
        """Sample ``index`` of a prepared request as a scheduler ``Request``, with its grammar
        (processed logprobs of a grammar row read its mask: such rows mask first, ``runner/sampler.py``)."""
        params = prepared.params
        request = Request(request_id, prepared.ids, params.for_sample(index) if params.n > 1 else params,
                          eos_token_ids=self.eos_token_ids, cache_salt=prepared.salt, arrival_time=arrival,
                          group=group)
        if params.structured_outputs is not None:
            processed_logprobs = self.args.logprobs_mode.startswith("processed")
            request.grammar = self.grammars.grammar(
                params.structured_outputs,
                masks_first=params.top_k != -1 or params.top_p < 1.0 or params.min_p > 0
                or (processed_logprobs and params.logprobs is not None))
        return request

    @property
    def max_pool_tokens(self) -> int:
        """Tokens the whole KV pool holds: no request may need more."""
        return self.cache.kv.num_blocks * self.cache.block_size

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its samples); its blocks are freed at once. Returns
        whether it was known and unfinished."""
        return self.outputs.abort(request_id)

    # -------------------------------------------------------------------- step
    def take_outputs(self) -> list[RequestOutput]:
        """The outputs made between steps (aborted requests') that ``step`` would return
        first: for a caller that does not step now (a paused server)."""
        return self.outputs.take_pending()

    @property
    def request_ids(self) -> list[str]:
        """Every user request not finished (or whose last output is still to be returned)."""
        return self.outputs.request_ids

    def has_unfinished(self) -> bool:
        """Requests not finished, or outputs not yet returned by ``step``."""
        return self.outputs.has_unfinished()

    def has_unfinished_sequences(self) -> bool:
        """Sequences waiting or running: whether another ``step`` can make progress."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that progressed."""
        outputs = self.outputs.take_pending()
        disk = self.disk
        if disk is not None:
            disk.import_ready(self.scheduler.requests)
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_ids:
            if disk is not None:
                disk.wait_for_loads(DISK_LOAD_POLL_S)
            return outputs
        if disk is not None:
            disk.save_noted()  # blocks this step's allocations evicted, before the forward rewrites them
        result = self.runner.execute(sched)
        advanced = self.scheduler.update(sched, result.sampled)
        if disk is not None and disk.tier.write_through:
            disk.save_noted()  # what the step published
        self._publish_cache_events()
        outputs += self.outputs.process(advanced, result.logprobs, result.prompt_logprobs)
        self._maybe_log()
        return outputs

    # ------------------------------------------------------------------- stats
    def get_stats(self) -> dict[str, int | float]:
        """Cumulative token counters and current pool usage (docs/architecture.md, "Stats")."""
        sched = self.scheduler
        cache = self.cache.stats()
        return {
            "num_requests_running": sched.num_running,
            "num_requests_waiting": sched.num_waiting,
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "prefix_cache_hit_rate": sched.prefix_cache_hits / max(1, sched.prefix_cache_queries),
            "prefill_computed_tokens": sched.prefill_computed_tokens,
            "prefill_skipped_tokens": sched.prefill_skipped_tokens,
            "decode_tokens": sched.decode_tokens,
            **{f"decode_steps_{path}": count for path, count in self.runner.decode_steps.items()},
            "spec_decode_num_drafts": sched.spec_stats.num_drafts,
            "spec_decode_num_draft_tokens": sched.spec_stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens": sched.spec_stats.num_accepted_tokens,
            **{f"spec_decode_num_accepted_tokens_pos{i}": count
               for i, count in enumerate(sched.spec_stats.accepted_per_pos)},
            "num_preemptions": sched.num_preemptions,
            "sibling_waits": sched.sibling_waits,
            "kv_blocks_total": cache["kv_blocks_total"],
            "kv_blocks_used": cache["kv_blocks_used"],
            "kv_blocks_cached": cache["kv_blocks_cached"],
            "kv_blocks_free": cache["kv_blocks_free"],
            "mamba_checkpoints_used": cache.get("state_checkpoints_used", 0),
            "mamba_checkpoints_capacity": cache.get("state_checkpoints_capacity", 0),
            "mamba_checkpoint_bytes": self.state_bytes_per_slot,
            "hybrid_hit_tokens_lost": cache["hit_tokens_lost"],
            **{key: cache.get(key, 0) for key in ("swa_blocks_total", "swa_blocks_used", "swa_blocks_cached",
                                                   "swa_blocks_released")},
            **(self.disk.stats() if self.disk is not None else {}),
        }

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no running request holds; returns how many."""
        dropped = self.cache.reset_cache()
        self._publish_cache_events()
        log.info("reset the prefix cache: dropped %d cached blocks", dropped)
        return dropped

    def _publish_cache_events(self) -> None:
        if self.event_publisher is not None:
            events = self.cache_events.drain()
            if events:
                self.event_publisher.publish(events)

    def close(self) -> None:
        """Write the disk cache out (what memory holds) and stop its threads; stop the KV event
        publisher (its sockets)."""
        if self.disk is not None:
            self.disk.close()
        if self.event_publisher is not None:
            self.event_publisher.close()
            self.event_publisher = None

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.args.log_stats_interval <= 0 or now - self._last_log < self.args.log_stats_interval:
            return
        sched, cache = self.scheduler, self.cache.stats()
        dt = now - self._last_log
        p0, d0 = self._logged_tokens
        computed, decode = sched.prefill_computed_tokens, sched.decode_tokens
        log.info(
            "running %d, waiting %d | prefill %.0f tok/s, decode %.0f tok/s | prefill tokens computed %d, "
            "skipped %d | prefix hit rate %.1f%% | KV blocks used %d, cached %d, free %d of %d",
            sched.num_running, sched.num_waiting, (computed - p0) / dt, (decode - d0) / dt, computed,
            sched.prefill_skipped_tokens, 100 * sched.prefix_cache_hits / max(1, sched.prefix_cache_queries),
            cache["kv_blocks_used"], cache["kv_blocks_cached"], cache["kv_blocks_free"], cache["kv_blocks_total"])
        self._last_log, self._logged_tokens = now, (computed, decode)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (the imports, the model, its config and
    tokenizer: hundreds of thousands of objects) out of the cyclic collector's reach, as vLLM's
    engine does after start-up. Each full collection otherwise walks them all, a pause of many
    decode steps at moments set by allocation counts. Objects frozen
    here that die later are still freed by their reference counts; only a cycle among them
    stays until the process ends."""
    gc.collect()
    gc.freeze()

