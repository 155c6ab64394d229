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
  (Inductor's loop, or the int8 / bf16 tile kernels), and the step is called without Dynamo
  (``DecodeGraphs._compile``);
- every larger batch, one graph with a symbolic batch size (``batched``), where the model's
  matmuls are oneDNN's prepacked GEMMs (or the int8 tile kernel) as extern calls
  (``kernels/packed_linear.cpp``) and Inductor fuses what lies between them. It exists where
  every matmul of the model has such a kernel (a CPU with prepacked weights or int8 tiles)
  and the paged decode-attention kernel runs; elsewhere batched steps run eagerly.
  Inductor's own loops with a symbolic batch size ran far slower than eager, and a static
  graph per batch size would cost a cold compile each (``docs/perf-log.md``).
A step qualifies when it is decode only, reads no prefix shared by several rows through a
cascade plan (those stay eager, ``runner/cascade.py``; a long context's single-row segment is
ignored) and no sliding-window pool; any other step runs eagerly.

Models with recurrent layers (Mamba2, Gated DeltaNet) compile where their fused decode ops run
(``CausalLM.decode_graph_capable``): the graph takes the live states and each row's slot, and
calls the ops, which advance the states in place, as extern kernels between the matmuls.
Checkpoint taps are copies of a live state after the step, so they are made after the graph
(``tap_decode_rows``). Compiling runs a step more than once (``_compile``): every run starts from
the rows' states before the step (a run from advanced states would advance them twice, and its
attention layers would write other K/V over the step's).

If compiling fails (no C++ compiler, an unsupported op) that graph is switched off with a
warning: after a batch-1 failure every decode step runs eagerly, after a batched failure only
the batched steps do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FunctionType

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from hyprefix.forward import ForwardBatch
from hyprefix.kernels import decode_attention, packed_linear
from hyprefix.models.layers import Linear
from hyprefix.models.quant import uses_tile_kernels
from hyprefix.models.recurrent_state import RecurrentLayerState, tap_decode_rows

log = logging.getLogger("hyprefix.runner")


KERNELS_DIR = Path(__file__).parent.parent / "kernels"


class DecodeGraphs:
    # Whether engines compile the batched graph where they can (a seam for the test suite, where
    # each engine shape would cost a cold compile of its own; only the tests of the graph turn it on).
    batched_by_default = True

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
        self._options = {"size_asserts": False, "post_grad_custom_post_pass": _KERNEL_SOURCES_KEY,
                         **({"cpp_wrapper": True} if uses_tile_kernels(model) else {})}
        # The batched graph calls many extern kernels: the C++ wrapper calls them for less.
        self._batched_options = {**self._options, "cpp_wrapper": True}
        self._steps: dict[int, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}  # 1 or BATCHED -> its step

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
        return (self.enabled and batch.reads_tables_whole()
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
        args = (batch.input_ids, batch.positions, batch.slot_mapping, tables, batch.decode_context_lens,
                batch.decode_state_slots, kv_caches, states, batch.block_size)
        out = self._run(args, min(batch.num_decode, BATCHED))
        if out is not None and batch.decode_state_taps:
            for layer in states:
                tap_decode_rows(layer, batch.decode_state_slots, batch.decode_state_taps)
        return out

    def _run(self, args: tuple, key: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        step = self._steps.get(key)
        if step is not None:
            with torch.inference_mode():  # as when compiled: no guard would catch a grad-mode call
                return step(self, *args)
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

    def _compile(self, args: tuple, batched: bool) -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                                             tuple[torch.Tensor, torch.Tensor]]:
        """Compile the step for these arguments' shapes (the table width symbolic; with
        ``batched`` the row count too) and run it once. Returns the step to call as
        ``step(self, *args)`` from then on.

        Batch 1: the bytecode Dynamo made for it, called directly, as vLLM dispatches to its
        compiled code, which skips Dynamo's frame evaluation and guards. That is sound
        because nothing a guard checks changes between this engine's calls: the model, its
        K/V tensors and every shape but the table width are fixed. Where no bytecode was made
        in this call (another engine of the same shapes compiled it earlier in this process),
        the step goes through Dynamo.

        Batched: always through Dynamo, whose guards check each call's row count against
        what the graph was compiled for (a small part of a batched step). It runs a second time with
        one more row before it is kept: had Dynamo specialised the row count anyway, that
        would compile again, and the batched graph is refused rather than compiled per size."""
        captured: list[CodeType] = []
        thread = threading.get_ident()

        def keep(code: CodeType, new_code: CodeType) -> None:
            if code is _STEP_CODE and threading.get_ident() == thread:
                captured.append(new_code)

        def mark(step_args: tuple) -> None:
            torch._dynamo.mark_dynamic(step_args[3], 1)  # the block tables' width
            if batched:
                for t in step_args[:_STEP_INPUTS]:
                    if t is not None:
                        torch._dynamo.maybe_mark_dynamic(t, 0)

        compiled = torch.compile(DecodeGraphs._step, fullgraph=True, dynamic=False,
                                 options=self._batched_options if batched else self._options)
        hook = torch._dynamo.convert_frame.register_bytecode_hook(keep)
        rewind = _state_rewinder(args)
        try:
            mark(args)
            out = compiled(self, *args)
            if batched:  # row 0 again: its K/V written again to its slot (equal up to rounding)
                with torch.inference_mode(args[0].is_inference()):  # tensors of the same kind (a guard)
                    more = tuple(None if t is None else torch.cat([t, t[:1]]) for t in args[:_STEP_INPUTS])
                made = len(captured)
                mark(more)
                rewind()
                compiled(self, *more, *args[_STEP_INPUTS:])
                if len(captured) > made:
                    raise RuntimeError("the batched graph specialised its batch size")
                if args[5] is not None:  # row 0's twin advanced its state twice and wrote K/V from it
                    rewind()
                    out = compiled(self, *args)
        finally:
            hook.remove()
        if captured and not batched:
            step = FunctionType(captured[-1], DecodeGraphs._step.__globals__, "_step")
            return _direct_call(step, self, args, rewind) or step, out

        def through_dynamo(graphs: DecodeGraphs, *step_args) -> tuple[torch.Tensor, torch.Tensor]:
            mark(step_args)
            return compiled(graphs, *step_args)
        return through_dynamo, out

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              tables: torch.Tensor, context_lens: torch.Tensor, state_slots: torch.Tensor | None,
              kv_caches: list[tuple[torch.Tensor, torch.Tensor]], states: list[RecurrentLayerState],
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = input_ids.shape[0]
        batch = ForwardBatch(
            seqs=[], input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, write_index=None,
            block_size=block_size, num_decode=n, decode_block_tables=tables, decode_context_lens=context_lens,
            decode_cascade=None, decode_state_slots=state_slots, decode_state_taps=[], prefills=[],
            logits_indices=torch.arange(n, device=input_ids.device), sample_seqs=[])
        logits = self.model.compute_logits(self.model(batch, kv_caches, states))
        return logits, logits.argmax(dim=-1)


_STEP_CODE = DecodeGraphs._step.__code__
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
# layers): new tensors every step
_STEP_INPUTS = 6


def _state_rewinder(args: tuple) -> Callable[[], None]:
    """A function that puts the live recurrent states of a step's rows back to what they are
    now, before the step, so the step can run again as the same step: a K/V write run twice
    writes the same values, but a run from advanced states would advance them twice and feed
    the attention layers other inputs. A no-op without recurrent layers."""
    slots, states = args[5], args[7]
    if slots is None:
        return lambda: None
    saved = [(layer.conv.index_select(0, slots), layer.matrix.index_select(0, slots)) for layer in states]

    def rewind() -> None:
        for layer, (conv, matrix) in zip(states, saved, strict=True):
            layer.conv.index_copy_(0, slots, conv)
            layer.matrix.index_copy_(0, slots, matrix)
    return rewind


def _direct_call(step: Callable[..., tuple[torch.Tensor, torch.Tensor]], graphs: DecodeGraphs, args: tuple,
                 rewind: Callable[[], None]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The compiled step called straight with its flat inputs, without the bytecode Dynamo
    made to gather them (reading every weight through module attributes, every step). One
    recorded run of ``step`` (a decode step run twice writes the same K/V twice) gives the
    flat inputs: each must be one of this step's input tensors, the block tables' width (the
    one symbolic size), or a tensor that lives as long as the engine (the model's parameters
    and buffers, the K/V caches, the recurrent states); the outputs must be the compiled
    function's own. Anything
    else (another torch's bytecode, a graph that takes other values) returns None and
    ``step`` stays."""
    names = [n for n in step.__code__.co_names if n.startswith("__compiled_fn")]
    if len(names) != 1 or not callable(compiled_fn := step.__globals__.get(names[0])):
        return None
    recorded: list[tuple[tuple, object]] = []

    def record(*flat):
        out = compiled_fn(*flat)
        recorded.append((flat, out))
        return out

    rewind()  # the recorded run is the same step again (``_state_rewinder``)
    with torch.inference_mode():
        result = FunctionType(step.__code__, {**step.__globals__, names[0]: record}, "_step")(graphs, *args)
    if len(recorded) != 1 or not isinstance(result, tuple) or not isinstance(recorded[0][1], list | tuple):
        return None
    flat, outputs = recorded[0]
    inputs, width = args[:_STEP_INPUTS], args[3].shape[1]
    lasting = {id(t) for t in (*graphs.model.parameters(), *graphs.model.buffers())}
    lasting.update(id(t) for pair in args[6] for t in pair)
    lasting.update(id(t) for layer in args[7] for t in (layer.conv, layer.matrix, layer.ckpt_conv, layer.ckpt_matrix))
    slots: list[tuple[int, int]] = []  # (position in flat, index in inputs; -1: the tables' width)
    for i, value in enumerate(flat):
        which = next((j for j, t in enumerate(inputs) if value is t), None)
        if which is not None:
            slots.append((i, which))
        elif isinstance(value, int) and value == width:
            slots.append((i, -1))
        elif not (isinstance(value, torch.Tensor) and id(value) in lasting):
            return None
    picks = [next((j for j, o in enumerate(outputs) if o is r), None) for r in result]
    if None in picks:
        return None
    template = list(flat)
    for i, _ in slots:
        template[i] = None  # this run's inputs: not kept alive

    def direct(graphs: DecodeGraphs, *step_args) -> tuple[torch.Tensor, torch.Tensor]:
        call = template.copy()
        for i, which in slots:
            call[i] = step_args[which] if which >= 0 else step_args[3].shape[1]
        out = compiled_fn(*call)
        return tuple(out[j] for j in picks)

    return direct
