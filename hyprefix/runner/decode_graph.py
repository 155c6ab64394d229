"""Compiled decode steps: the whole forward of a decode-only step (embedding, every
layer with its paged attention and K/V write, final norm, LM head) as one
``torch.compile``d graph, as vLLM captures a CUDA graph per batch size.

Eager, a decode step of a small model is mostly per-op overhead: ~30 layers x a few
dozen small ops. Compiled, Inductor fuses the elementwise chains into the matmuls'
loops (``quant.reduction_linear``) and the step runs as a handful of C++ kernels. (With
int8 weights and float32 on CPU, a Llama-family model needs no graph: its whole decode step
is one kernel call, ``kernels/decode_layers.cpp``, and the runner makes no ``DecodeGraphs``.)

Two graphs, each compiled on first use, with the context length (block-table width) a
symbolic size so a growing context never recompiles:
- batch 1 (the one-stream, most latency-bound case): every matmul streams its weight once
  (Inductor's loop, or the int8 / bf16 tile kernels);
- every larger batch, one graph with a symbolic batch size (``batched``), where the model's
  matmuls are oneDNN's prepacked GEMMs (or the int8 tile kernel) as extern calls
  (``kernels/packed_linear.cpp``) and Inductor fuses what lies between them. It exists where
  every matmul of the model has such a kernel (a CPU with prepacked weights or int8 tiles)
  and the paged decode-attention kernel runs; elsewhere batched steps run eagerly.
  Inductor's own loops with a symbolic batch size ran far slower than eager, and a static
  graph per batch size would cost a cold compile each (``docs/perf-log.md``).
Each is traced by ``torch.compile`` once and then called straight into Inductor's code with
its flat inputs, without Dynamo (``runner/graph_capture.py``: public APIs only).
A step qualifies when it is decode only and reads no prefix shared by several rows through a
cascade plan (those stay eager, ``runner/cascade.py``; a long context's single-row segment is
ignored); any other step runs eagerly. Sliding-window layers with a pool of their own (gpt-oss,
Gemma 3) read it through the window tables, slots and first positions, inputs of the graph as
the main tables are; the window tables are padded to the main tables' width, so one symbolic
width serves both (a window table is never the wider: it is a suffix of the same context).

Models with recurrent layers (Mamba2, Gated DeltaNet, KDA) compile where their fused decode ops run
(``CausalLM.decode_graph_capable``): the graph takes the live states and each row's slot, and
calls the ops, which advance the states in place, as extern kernels between the matmuls.
Checkpoint taps are copies of a live state after the step, so they are made after the graph
(``tap_decode_rows``). Compiling runs the step once, as the step itself.

If compiling fails (no C++ compiler, an unsupported op) that graph is switched off with a
warning: after a batch-1 failure every decode step runs eagerly, after a batched failure only
the batched steps do.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from hyprefix.forward import ForwardBatch, WindowKV
from hyprefix.kernels import decode_attention, packed_linear
from hyprefix.models import kv_quant
from hyprefix.models.layers import Linear
from hyprefix.models.quant import uses_tile_kernels
from hyprefix.models.recurrent_state import RecurrentLayerState, tap_decode_rows
from hyprefix.models.weights import MatrixForms
from hyprefix.runner.graph_capture import CapturedStep, backend_for, capture

log = logging.getLogger("hyprefix.runner")


KERNELS_DIR = Path(__file__).parent.parent / "kernels"


class DecodeGraphs:
    # Whether engines compile the batched graph where they can (a seam for the test suite, where
    # each engine shape would cost a cold compile of its own; only the tests of the graph turn it on).
    batched_by_default = True
    # Whether steps with a sliding-window pool take the graphs (a seam for the test suite, where
    # each windowed engine shape would cost a cold compile; only the tests of it turn it on).
    window_pools = True

    def __init__(self, model: torch.nn.Module, batched: bool | None = None) -> None:
        """``batched``: compile the graph of batches of two or more rows too, where the model
        allows it (``batched_graph_capable``); None: ``batched_by_default``."""
        self.model = model
        batched = self.batched_by_default if batched is None else batched
        self.batched = batched and batched_graph_capable(model)
        self.enabled = True
        # Dynamo keeps the compiled steps of every engine in this process on one code
        # object (two per model and cache shape: batch 1 and batched); past its limit compiling
        # would fail.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        # With the int8 or bf16 tile kernels each matmul is an extern call (four per layer): a C++ wrapper
        # calls them for less than Inductor's Python one, for a longer cold compile.
        # No size/stride asserts on the graph's inputs: the step is called without Dynamo's
        # guards anyway (``_compile``), and asserting its 300+ inputs every step costs time.
        # The kernel sources' hash in Inductor's cache key: a step it compiled against another
        # build of our extern kernels (another op schema) would crash if loaded from its cache.
        # Inductor's own loops split across threads only past 8192 elements a thread. Its default,
        # 512, made a fork-join of each norm and add over one hidden row, each costing more than
        # the loop (a Qwen3-MoE layer's step: 5 fork-joins, now 1, the router's). Batch-1 TPOT
        # changed no more than two identical engines differ (docs/perf-log.md, 2026-12-07).
        self._options = {"size_asserts": False, "post_grad_custom_post_pass": _KERNEL_SOURCES_KEY,
                         "cpp.min_chunk_size": 8192,
                         **({"cpp_wrapper": True} if uses_tile_kernels(model) else {})}
        # The batched graph calls many extern kernels: the C++ wrapper calls them for less.
        self._batched_options = {**self._options, "cpp_wrapper": True}
        self._steps: dict[int, CapturedStep] = {}  # 1 or BATCHED -> its step

    @property
    def max_batch(self) -> int | None:
        """The most rows a compiled step takes: 1, or None (any) with the batched graph."""
        return None if self.batched else 1

    @property
    def compiled_sizes(self) -> set[int]:
        """1 for the batch-1 graph, ``BATCHED`` (2) for the graph of every larger batch."""
        return set(self._steps)

    def eligible(self, batch: ForwardBatch) -> bool:
        """A decode-only step of at most ``max_batch`` rows (None: any) that reads no prefix shared by
        several rows once (a cascade plan of only single-row segments, a long context's own
        run, may be ignored: the graph reads every row's whole block table, no more bytes)."""
        return (self.enabled and batch.reads_tables_whole(window_pool=self.window_pools)
                and (self.max_batch is None or batch.num_decode <= self.max_batch))

    def logits(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               states: list[RecurrentLayerState] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Float32 logits [D, vocab] of a qualifying step and their argmax [D] (the greedy
        tokens, from Inductor's argmax loop, cheaper than ``Tensor.argmax`` after the step),
        or None when the graphs are off (compiling failed): the caller runs the step eagerly.
        ``states``: the model's recurrent layers' states (live slots advanced in place, the
        step's checkpoint taps copied after it)."""
        tables = batch.decode_block_tables
        assert tables is not None and batch.decode_context_lens is not None
        if tables.shape[1] < 2:  # a width of 1 would be specialised: pad (the mask hides it)
            tables = torch.nn.functional.pad(tables, (0, 2 - tables.shape[1]))
        states = states or []
        assert (batch.decode_state_slots is not None) == bool(states), "state slots and states go together"
        window = batch.window_kv
        window_tables = None
        if window is not None:
            assert window.decode_block_tables is not None and window.decode_first_pos is not None
            window_tables = torch.nn.functional.pad(window.decode_block_tables,
                                                    (0, tables.shape[1] - window.decode_block_tables.shape[1]))
        args = (batch.input_ids, batch.positions, batch.slot_mapping, tables, batch.decode_context_lens,
                batch.decode_state_slots, window.slot_mapping if window is not None else None, window_tables,
                window.decode_first_pos if window is not None else None, kv_caches, states, batch.block_size)
        out = self._run(args, min(batch.num_decode, BATCHED))
        if out is not None and batch.decode_state_taps:
            for layer in states:
                tap_decode_rows(layer, batch.decode_state_slots, batch.decode_state_taps)
        return out

    def _run(self, args: tuple, key: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        step = self._steps.get(key)
        if step is not None:
            with torch.inference_mode():  # as when compiled: no guard would catch a grad-mode call
                return step(args[:_STEP_INPUTS])
        t0 = time.perf_counter()
        try:
            step, out = self._compile(args, batched=key == BATCHED)
        except Exception as exc:
            which = "batched compiled decode steps are" if key == BATCHED else "compiled decode steps are"
            if key == BATCHED:  # the batch-1 graph stays
                self.batched = False
            else:
                self.enabled = False
            log.warning("%s off (compiling failed: %s: %s); they run eagerly", which,
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        self._steps[key] = step
        log.info("compiled the decode step for %s in %.1fs", "batch 1" if key == 1 else "batches of 2 or more",
                 time.perf_counter() - t0)
        return out

    def _compile(self, args: tuple, batched: bool) -> tuple[CapturedStep, tuple[torch.Tensor, torch.Tensor]]:
        """Compile the step for these arguments' shapes (the table width symbolic; with
        ``batched`` the row count too), run it once and capture it (``graph_capture``): from
        then on it is called with the step's first ``_STEP_INPUTS`` arguments straight into Inductor's code, without
        Dynamo. A batched graph that specialised its row count is refused (``CaptureError``)
        rather than compiled per size."""
        torch._dynamo.mark_dynamic(args[3], 1)  # the block tables' width
        if batched:
            for t in args[:_STEP_INPUTS]:
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        options = self._batched_options if batched else self._options
        compiled = torch.compile(DecodeGraphs._step, fullgraph=True, dynamic=False, backend=backend_for(options))
        model = self.model
        lasting = [*model.parameters(), *model.buffers(), *(t for pair in args[9] for t in pair),
                   *(t for m in model.modules() if isinstance(m, MatrixForms) for t in m.attribute_tensors()),
                   *(t for layer in args[10] for t in (layer.conv, layer.matrix, layer.ckpt_conv, layer.ckpt_matrix)),
                   *kv_quant.rotations()]
        symbolic = [(3, 1), *([(0, 0)] if batched else [])]
        return capture(lambda: compiled(self, *args), args[:_STEP_INPUTS], lasting, symbolic)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              tables: torch.Tensor, context_lens: torch.Tensor, state_slots: torch.Tensor | None,
              window_slots: torch.Tensor | None, window_tables: torch.Tensor | None,
              window_first_pos: torch.Tensor | None, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              states: list[RecurrentLayerState], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = input_ids.shape[0]
        window = None if window_slots is None else WindowKV(window_slots, window_tables, window_first_pos, [], [])
        batch = ForwardBatch(
            seqs=[], input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, write_index=None,
            block_size=block_size, num_decode=n, decode_block_tables=tables, decode_context_lens=context_lens,
            decode_cascade=None, decode_state_slots=state_slots, decode_state_taps=[], prefills=[],
            logits_indices=torch.arange(n, device=input_ids.device), sample_seqs=[], window_kv=window)
        logits = self.model.compute_logits(self.model(batch, kv_caches, states))
        return logits, logits.argmax(dim=-1)


BATCHED = 2  # the key of the graph of every batch of two or more rows


def batched_graph_capable(model: torch.nn.Module) -> bool:
    """Whether every matmul of ``model`` has an extern kernel for a symbolic batch size (a
    prepacked oneDNN weight, ``kernels/packed_linear.cpp``, which must build, or int8 tiles)
    and each row's K/V is read in place (``kernels/decode_attention.cpp``): without that
    kernel the graph would gather every row's blocks padded to the longest table, where the
    eager cascade path reads a long row on its own. A float32 LM head (``--lm-head-fp32``) is
    multiplied by aten's matmul, an extern call of its own (``CausalLM.compute_logits``)."""
    fp32_head = model.head_forms.fp32 is not None
    linears = [m for m in model.modules() if isinstance(m, Linear) and not (fp32_head and m is model.lm_head)]
    dtype = getattr(model, "dtype", None)
    if not linears or dtype is None or not decode_attention.available(dtype):
        return False
    kernels = {linear.forms.batched_kernel for linear in linears} | (
        set() if fp32_head else {model.head_forms.batched_kernel})
    return None not in kernels and ("packed" not in kernels or packed_linear.available())


class KernelSourcesKey(CustomGraphPass):
    """A post-grad pass that changes nothing; its ``uuid``, which Inductor's on-disk cache keys
    compiled graphs by, is the hash of ``hyprefix/kernels``' C++ sources."""

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        return None

    def uuid(self) -> bytes:
        return get_hash_for_files(tuple(str(p) for p in sorted(KERNELS_DIR.glob("*.[ch]*"))))


# One instance for every engine: Dynamo reuses a step compiled with equal options, which this keeps equal.
_KERNEL_SOURCES_KEY = KernelSourcesKey()


# input_ids, positions, slot_mapping, tables, context_lens, state slots (None without recurrent
# layers), the window pool's slots, tables and first positions (None without one): new tensors
# every step
_STEP_INPUTS = 9
