"""Compiled decode steps: the whole forward of a decode-only step (embedding, every
layer with its paged attention and K/V write, final norm, LM head) as one
``torch.compile``d graph, as vLLM captures a CUDA graph per batch size.

Eager, a decode step of a small model is mostly per-op overhead: ~30 layers x a few
dozen small ops. Compiled, Inductor fuses the elementwise chains into the matmuls'
loops (``quant.reduction_linear``) and the step runs as a handful of C++ kernels.

Two graphs cover every step that qualifies: one for batch 1 (its own: the most
latency-bound case) and one for batches 2 .. ``max_batch`` with the batch size
symbolic; both take the context length (block-table width) as a symbolic size, so a
growing context never recompiles. A step qualifies when it is decode only, has no
cascade plan (shared prefixes read once per group stay eager, ``runner/cascade.py``),
no sliding-window pool and no recurrent state (hybrids stay eager), and at most
``max_batch`` rows; any other step runs eagerly. If compiling fails (no C++ compiler,
an unsupported op) the graphs are switched off with a warning and every step runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from hyprefix.forward import ForwardBatch

log = logging.getLogger("hyprefix.runner")


def max_graph_batch(dtype: torch.dtype, quantized: bool) -> int:
    """Largest batch whose matmuls are faster as compiled reductions than as eager GEMMs.
    Zen 4, 24 weight matrices of 3072 x 576 (float32): batch 1, 2, 4, 8 took 5.6, 5.8,
    7.2, 8.4 ms as reductions vs 9.2 (M = 1) and ~14 ms (M = 16) prepacked; bf16
    reductions turn compute-bound from batch 4 (5.7 ms vs 2.4 at batch 1) where oneDNN's
    bf16 GEMM is not. int8 weights dequantize inside the loop like bf16 ones."""
    if dtype == torch.float32 and not quantized:
        return 8
    return 2


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int) -> None:
        self.model = model
        self.max_batch = max_batch
        self.enabled = max_batch > 0
        # Dynamo keeps the compiled steps of every engine in this process on one code
        # object (two per model shape); past its limit it would run them eagerly unsaid.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # A low realize threshold stores each norm's output once instead of recomputing it
        # inside every row of the next matmul (which made int8 rows compute-bound).
        self._compiled = torch.compile(self._step, fullgraph=True, dynamic=False,
                                       options={"realize_cpu_opcount_threshold": 4})
        self._seen: set[bool] = set()  # which graphs (batch 1, batch > 1) ran already

    def eligible(self, batch: ForwardBatch) -> bool:
        return (self.enabled and not batch.prefills and 0 < batch.num_decode <= self.max_batch
                and batch.decode_cascade is None and batch.window_kv is None and batch.decode_state_slots is None
                and batch.write_index is None and len(batch.sample_seqs) == batch.num_decode)

    def logits(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Float32 logits [D, vocab] of a qualifying step, or None when the graphs are
        off (compiling failed): the caller runs the step eagerly."""
        tables = batch.decode_block_tables
        assert tables is not None and batch.decode_context_lens is not None
        if tables.shape[1] < 2:  # a width of 1 would be specialised: pad (the mask hides it)
            tables = torch.nn.functional.pad(tables, (0, 2 - tables.shape[1]))
        args = [batch.input_ids, batch.positions, batch.slot_mapping, tables, batch.decode_context_lens]
        torch._dynamo.mark_dynamic(tables, 1)
        multi = batch.num_decode > 1
        if multi:
            for tensor in args:
                torch._dynamo.mark_dynamic(tensor, 0)
        first = multi not in self._seen
        t0 = time.perf_counter()
        try:
            if first:
                logits = self._compiled(*args, kv_caches, batch.block_size)
            else:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    logits = self._compiled(*args, kv_caches, batch.block_size)
        except Exception as exc:
            if not first:
                raise
            self.enabled = False
            log.warning("compiled decode steps are off (compiling failed: %s: %s); decode runs eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if first:
            self._seen.add(multi)
            log.info("compiled the decode step for %s in %.1fs", f"batches 2..{self.max_batch}" if multi
                     else "batch 1", time.perf_counter() - t0)
        return logits

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              tables: torch.Tensor, context_lens: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              block_size: int) -> torch.Tensor:
        n = input_ids.shape[0]
        batch = ForwardBatch(
            seqs=[], input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, write_index=None,
            block_size=block_size, num_decode=n, decode_block_tables=tables, decode_context_lens=context_lens,
            decode_cascade=None, decode_state_slots=None, decode_state_taps=[], prefills=[],
            logits_indices=torch.arange(n, device=input_ids.device), sample_seqs=[])
        return self.model.compute_logits(self.model(batch, kv_caches, None))
