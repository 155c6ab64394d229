"""SchedulerOutput -> tensors -> forward -> sampled token ids. Owns the KV and
recurrent state tensors and performs every state copy the scheduler asks for; gives
the model its elementwise kernels (compiled or not) once, at construction."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hyprefix.kernels import decode_attention
from hyprefix.models import kv_quant
from hyprefix.models.fused import COMPILE_MIN_TOKENS, Kernels
from hyprefix.models.recurrent_state import RecurrentLayerState
from hyprefix.outputs import DECODE_PATHS, PositionLogprobs, ScheduledSeq, SchedulerOutput, StepResult
from hyprefix.runner.batch import build_batch
from hyprefix.runner.cascade import CascadeThresholds, FastPathCost
from hyprefix.runner.decode_graph import DecodeGraphs
from hyprefix.runner.huge_pages import PageMapper, lazy_zeros, move_weights
from hyprefix.runner.logits import logprobs_of
from hyprefix.runner.sampler import Sampler
from hyprefix.runner.verify import accept, sample_rows
from hyprefix.sampling import SamplingParams
from hyprefix.structured.step_masks import GrammarMasks

if TYPE_CHECKING:  # (a plain dataclass; importing it would import the scheduler and the catalog)
    from hyprefix.engine_config import RunnerConfig

log = logging.getLogger("hyprefix.runner")

# Prompt logprobs are computed this many positions at a time (a [rows, vocab] float32 block each).
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True)
class PoolSizes:
    """The cache tensors the runner allocates, as the engine's pool plan sized them.

    ``num_window_blocks`` > 0: sliding-window layers get a pool of that many blocks of their
    own (``cache/sliding.py``); 0: they share the main pool. ``num_live_slots``,
    ``num_checkpoint_slots``: recurrent-state slots (models with recurrent layers), kept in
    ``state_dtype``. ``num_speculative_tokens``, ``num_draft_rows``: speculative decoding's k
    and, for models with recurrent layers, how many rows a step may verify drafts in (each gets
    k scratch state slots: the state after each of its drafts)."""

    dtype: torch.dtype  # the model's
    num_blocks: int
    block_size: int
    num_window_blocks: int = 0
    num_live_slots: int = 0
    num_checkpoint_slots: int = 0
    state_dtype: torch.dtype = torch.float32
    num_speculative_tokens: int = 0
    num_draft_rows: int = 0
    kv_dtype: torch.dtype | None = None  # the K/V tensors' (``kv_quant``'s storage dtypes), None: ``dtype``


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pools: PoolSizes, config: RunnerConfig,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        """``config``: device, compilation, seed, logprobs mode and cascade thresholds
        (``engine_config.RunnerConfig``); ``eos_token_ids``: what ``min_tokens`` holds back.
        Sampled tokens' logprobs hold what ``config.logprobs_mode`` says (``Sampler``; prompt
        logprobs are always raw logprobs, as vLLM's). ``config.batch_invariant``: the
        batch-invariant mode (the model is already switched, ``CausalLM.use_batch_invariant``):
        every step eager, with no compiled kernels (a large step's fused loops are not a small
        one's arithmetic), no decode graphs, no one-call decode kernel and no cascade plans."""
        dtype, device = pools.dtype, torch.device(config.device)
        kv_dtype = pools.kv_dtype or dtype
        num_blocks, block_size, num_window_blocks = pools.num_blocks, pools.block_size, pools.num_window_blocks
        batch_invariant = config.batch_invariant
        compile_enabled = config.compile
        cascade_thresholds = CascadeThresholds(config.cascade_min_saved_tokens, config.cascade_min_solo_run_tokens,
                                               config.cascade_min_traffic_ratio)
        self.batch_invariant = batch_invariant
        self.kv_dtype = kv_dtype
        compile_enabled = compile_enabled and not batch_invariant
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cascade_thresholds = cascade_thresholds
        layout = model.kv_layout

        if device.type == "cpu" and layout.num_layers:
            decode_attention.available(dtype)  # built (or found) now, before any step is compiled
            if not batch_invariant and not kv_quant.is_quantized_dtype(kv_dtype):  # its own K/V reads: model-dtype rows
                model.use_decode_kernel()
        if kv_quant.is_quantized_dtype(kv_dtype):
            for dim in layout.rotation_blocks or (layout.head_dim,):
                for transposed in (False, True):  # made now, found as constants by compiled steps
                    kv_quant.rotation(dim, device, transposed)
        self.has_window_pool = num_window_blocks > 0
        shapes = [(num_window_blocks if self.has_window_pool and layout.window(i) is not None else num_blocks,
                   block_size, layout.num_kv_heads, kv_quant.stored_head_dim(layout.head_dim, kv_dtype))
                  for i in range(layout.num_layers)]
        # On a CPU, the weights in transparent huge pages where the OS gives them; the K/V
        # mapped as blocks are first written (``huge_pages``: huge-page faults are slow).
        per_layer = layout.tensors_per_layer
        kv = lazy_zeros([s for shape in shapes for s in (shape,) * per_layer], kv_dtype, device)
        self.huge_page_bytes = move_weights(model)
        if self.huge_page_bytes:
            log.info("transparent huge pages: weights %.1f MiB", self.huge_page_bytes / 2**20)
        # (K, V) a layer; a latent layer's V is its K (``KVLayout.latent``)
        self.kv_caches = list(zip(kv[::per_layer], kv[per_layer - 1::per_layer], strict=True))
        self.kv_pages = PageMapper(kv)  # an idle server maps the pool ahead of use (``map_kv_pages``)
        # One per recurrent layer (Mamba2, Gated DeltaNet): live and checkpoint slots.
        state_layout = model.state_layout
        # Checkpoint slots past ``num_checkpoint_slots``: speculative decoding's scratch, k a row
        # verifying drafts: its state after each of its first k tokens (``_verify_layout``).
        self.num_speculative_tokens = pools.num_speculative_tokens
        self.scratch_base = pools.num_checkpoint_slots
        num_scratch = pools.num_draft_rows * pools.num_speculative_tokens if state_layout is not None else 0
        self.recurrent_states: list[RecurrentLayerState] = [
            RecurrentLayerState.allocate(shape, pools.num_live_slots, pools.num_checkpoint_slots + num_scratch, dtype,
                                         device, pools.state_dtype)
            for shape in (state_layout.layers if state_layout is not None else ())]
        self.sampler = Sampler(config.seed, device, eos_token_ids, logprobs_mode=config.logprobs_mode)
        model.kernels = Kernels(compile_enabled)
        # Compiled decode steps (``CausalLM.decode_graph_capable``), unless the model runs its
        # decode steps in one kernel call of its own (``decode_logits``).
        self.decode_graphs = DecodeGraphs(model) \
            if compile_enabled and model.decode_graph_capable and not model.decode_kernel else None
        # One context entered each step: the decorator form builds a new one every call.
        self._inference_mode = torch.inference_mode()
        # Decode-only steps by the path that ran them (``DECODE_PATHS``).
        self.decode_steps = dict.fromkeys(DECODE_PATHS, 0)
        self._step_bytes = (model.decode_weight_bytes() if layout.num_layers else 0,
                            self.kv_bytes_per_block(model, kv_dtype, 1))

    def map_kv_pages(self) -> bool:
        """Map the next few MiB of the K/V caches' pages ahead of their first write (an idle
        server's work: ``PageMapper``); False once all are mapped."""
        return self.kv_pages.map_next()

    @property
    def kernels(self) -> Kernels:
        """The model's elementwise kernels (set here at construction)."""
        return self.model.kernels

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, dtype: torch.dtype, block_size: int,
                           layers: str = "all") -> int:
        """K + V bytes of one block over ``layers``: "all" attention layers, the
        "full"-attention ones, or the sliding-"window" ones; ``dtype``: the K/V tensors' (a
        ``kv_quant`` storage dtype: codes and a scale a row)."""
        layout = model.kv_layout
        windowed = sum(layout.window(i) is not None for i in range(layout.num_layers))
        count = {"all": layout.num_layers, "full": layout.num_layers - windowed, "window": windowed}[layers]
        return layout.tensors_per_layer * count * block_size * layout.num_kv_heads * kv_quant.row_bytes(layout.head_dim,
                                                                                                   dtype)

    @staticmethod
    def state_bytes_per_slot(model: torch.nn.Module, dtype: torch.dtype,
                             state_dtype: torch.dtype = torch.float32) -> int:
        """Conv (``dtype``) + matrix (``state_dtype``) state of every recurrent layer (0 for
        models without any)."""
        layout = model.state_layout
        return layout.bytes_per_slot(dtype, state_dtype) if layout is not None else 0

    def _apply_state_ops(self, ops: list[tuple[int | None, int]]) -> None:
        """Initialise live slots: copy a checkpoint in (never alias it) or zero it."""
        for src, dst in ops:
            for layer in self.recurrent_states:
                layer.restore(src, dst)

    def warmup(self) -> bool:
        """Run one throwaway step big enough for the compiled kernels, then a decode step of
        one row and one of two (the compiled decode graphs), so they compile now rather than
        inside the first requests (which would hold every client).
        It writes K/V into the first blocks (twice as many for the batched graph) and live
        state slots 0 and 1, which nothing reads before their owners write them. Returns whether it ran."""
        tokens = COMPILE_MIN_TOKENS
        num_blocks = -(-(tokens + 1) // self.block_size)  # room for one decode token after the prompt
        if not self.kernels.compile_enabled or any(k.shape[0] < num_blocks for k, _ in self.kv_caches):
            return False
        live = bool(self.recurrent_states) and self.recurrent_states[0].conv.shape[0] > 0
        if self.recurrent_states and not live:
            return False
        seq = ScheduledSeq("warmup", [0] * tokens, 0, list(range(num_blocks)), sample=True,
                           params=SamplingParams(temperature=0, max_tokens=1), state_slot=0 if live else -1,
                           window_blocks=list(range(num_blocks)) if self.has_window_pool else None)
        self.execute(SchedulerOutput([seq], tokens, state_ops=[(None, 0)] if live else []))
        names = ["warmup"]
        if self.decode_graphs is not None and (self.decode_graphs.window_pools or not self.has_window_pool):
            # and the compiled decode steps, which the first requests' decodes would compile: batch
            # 1, then the batched graph with two rows on blocks of their own (rows on the same
            # blocks would share a prefix, which a cascade plan reads eagerly) and, with recurrent
            # layers, live state slots of their own
            room = min(k.shape[0] for k, _ in self.kv_caches) // num_blocks
            if live:
                room = min(room, self.recurrent_states[0].conv.shape[0])
            for rows in (1, 2) if self.decode_graphs.batched and room >= 2 else (1,):
                names = [f"warmup{i}" if i else "warmup" for i in range(rows)]
                blocks = [list(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(rows)]
                steps = [ScheduledSeq(name, [0], tokens, blocks[i], sample=True, params=seq.params,
                                      state_slot=i if live else -1,
                                      window_blocks=blocks[i] if self.has_window_pool else None)
                         for i, name in enumerate(names)]
                self.execute(SchedulerOutput(steps, rows))
        self.sampler.forget(names)
        return True

    def _fast_path(self) -> FastPathCost | None:
        """The fast decode path's cost model while one exists (``runner/cascade.py``)."""
        if self.model.decode_kernel:
            max_rows = None
        elif self.decode_graphs is not None and self.decode_graphs.enabled:
            max_rows = self.decode_graphs.max_batch
        else:
            return None
        return FastPathCost(*self._step_bytes, self.cascade_thresholds.min_traffic_ratio, max_rows)

    def execute(self, output: SchedulerOutput, masks: GrammarMasks | None = None) -> StepResult:
        """Run one step. ``masks``: the step's structured-output rows, started by the engine
        before this call (``structured/step_masks.py``) so their bitmask is computed beside
        the forward; read only (the grammars advance in ``Scheduler.update``, after this
        returns, and by then the masks' worker is done with them)."""
        self.sampler.forget(output.finished_ids)
        try:
            if output.is_empty:
                return StepResult()
            with self._inference_mode:
                return self._execute(output, masks)
        finally:
            if masks is not None:
                masks.wait()

    def _execute(self, output: SchedulerOutput, masks: GrammarMasks | None) -> StepResult:
        self._apply_state_ops(output.state_ops)
        seqs, scratch = output.seqs, {}
        if any(seq.num_drafts for seq in seqs):
            seqs, scratch = self._verify_layout(seqs)
        batch = build_batch(seqs, self.block_size, self.device, self.cascade_thresholds, self._fast_path(),
                            self.batch_invariant)
        whole = self.model.decode_logits(batch, self.kv_caches)
        path = "kernel" if self.model.takes_decode_kernel(batch) else "eager"  # decode_logits' own condition
        if whole is None and self.decode_graphs is not None and self.decode_graphs.eligible(batch):
            whole = self.decode_graphs.logits(batch, self.kv_caches, self.recurrent_states)
            path = "graph" if whole is not None else path
        if not batch.prefills and batch.num_decode:
            self.decode_steps[path] += 1
        result = StepResult()
        if whole is not None:
            logits, greedy = whole
        else:
            # Only the sampled rows leave the model unless prompt logprobs read every row.
            selected = self.model.selects_output_rows and batch.num_tokens > len(batch.sample_seqs) \
                and not any(seq.params.prompt_logprobs is not None for seq in batch.seqs)
            if selected:
                batch.output_rows = batch.logits_indices
            hidden = self.model(batch, self.kv_caches, self.recurrent_states)
            result.prompt_logprobs = {} if selected else self._prompt_logprobs(batch.seqs, hidden)
            if not batch.sample_seqs:
                return result
            logits = self.model.compute_logits(hidden if selected else hidden[batch.logits_indices])
            greedy = None
        tokens, logprobs = self.sampler.sample(logits, batch.sample_seqs, greedy, masks)
        # Rows of one request are consecutive (a row verifying drafts samples k + 1 times).
        for row, (seq, token) in enumerate(zip(batch.sample_seqs, tokens, strict=True)):
            result.sampled.setdefault(seq.request_id, []).append(token)
            if row in logprobs:
                result.logprobs.setdefault(seq.request_id, []).append(logprobs[row])
        for seq in output.seqs:
            if seq.num_drafts:
                self._accept(seq, result, scratch.get(seq.request_id))
        return result

    def _verify_layout(self, seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], dict[str, int]]:
        """The step's rows with drafts laid out for the forward. Without recurrent layers, every
        token of such a row becomes a decode row of its own (attention reads the K/V the step
        writes for the tokens before it: each layer writes every row's K/V before any row
        attends), so the fast decode paths verify drafts too. With recurrent layers the row stays
        one span and taps the state after each of its first k tokens into scratch slots (the
        second returned value: each request's first scratch slot) for ``_accept``."""
        if not self.recurrent_states:
            return [row for seq in seqs for row in (sample_rows(seq) if seq.num_drafts else (seq,))], {}
        k, out, scratch = self.num_speculative_tokens, [], {}
        for seq in seqs:
            if seq.num_drafts:
                first = self.scratch_base + len(scratch) * k
                assert first + seq.num_drafts <= self.recurrent_states[0].ckpt_conv.shape[0], \
                    "more rows verify drafts than have scratch state slots"
                scratch[seq.request_id] = first
                scratch_taps = [(seq.start_pos + i + 1, first + i) for i in range(seq.num_drafts)]
                seq = dataclasses.replace(seq, state_taps=tuple(sorted([*seq.state_taps, *scratch_taps])))
            out.append(seq)
        return out, scratch

    def _accept(self, seq: ScheduledSeq, result: StepResult, scratch: int | None) -> None:
        """Keep the drafts of ``seq`` that stand (``verify.accept``) and the token sampled after
        them; a model with recurrent layers takes the state after the last token kept from its
        scratch slot (the live slot holds the state after every draft)."""
        drafts = seq.token_ids[-seq.num_drafts:]
        sampled = result.sampled[seq.request_id]
        accepted = accept(sampled, drafts)
        del sampled[accepted + 1:]
        entries = result.logprobs.get(seq.request_id)
        if entries is not None:
            del entries[accepted + 1:]
        if scratch is not None and accepted < seq.num_drafts:
            for layer in self.recurrent_states:
                layer.restore(scratch + accepted, seq.state_slot)

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor
                         ) -> dict[str, tuple[int, list[PositionLogprobs]]]:
        """Logprobs of the prompt tokens after each chunk position of the requests that ask
        (``SamplingParams.prompt_logprobs``): position p's logits score prompt token p + 1.
        ``seqs`` in the batch's token order (``ForwardBatch.seqs``)."""
        out: dict[str, tuple[int, list[PositionLogprobs]]] = {}
        offset = 0
        for seq in seqs:
            start, offset = offset, offset + seq.num_tokens
            num_top = seq.params.prompt_logprobs
            last = min(seq.context_len, len(seq.prompt_token_ids) - 1)  # positions scoring a prompt token
            if num_top is None or seq.start_pos >= last:
                continue
            entries: list[PositionLogprobs] = []
            for first in range(seq.start_pos, last, PROMPT_LOGPROBS_ROWS):
                end = min(first + PROMPT_LOGPROBS_ROWS, last)
                logits = self.model.compute_logits(hidden[start + first - seq.start_pos:start + end - seq.start_pos])
                targets = torch.tensor(seq.prompt_token_ids[first + 1:end + 1], device=logits.device)
                entries.extend(logprobs_of(logits, targets, [num_top] * (end - first)))
            out[seq.request_id] = (seq.start_pos + 1, entries)
        return out
