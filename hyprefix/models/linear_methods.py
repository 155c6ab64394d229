"""How one matrix is multiplied: a method chosen once, at load, for each ``weights.MatrixForms``
(the shape of vLLM's linear and quantization methods). The method holds no tensors: they stay
buffers of the ``MatrixForms`` (so they move with the model, and a compiled decode step reads
them as lasting inputs); ``apply`` multiplies with them.

- ``PLAIN``: the plain tensor (devices without prepacking, and before loading ends).
- ``PACKED``: oneDNN's prepacked copy (whole, or the halves a ``GatedMLP`` multiplies itself),
  with bf16 tiles beside it where decode steps multiply those.
- ``INT8``: int8 weights (per channel, or per 32 as a GGUF's Q8_0), the int8 kernel's tiles
  where it runs.
- ``QUANT``: a GGUF's low-bit blocks (``quant.QuantTiles``), inputs gathered into the file's
  column order where the converter reordered the columns.
- ``INVARIANT``: the batch-invariant mode's kernels.

A method's ``apply`` is traced into a compiled decode step as it runs eagerly; where a graph
multiplies differently (Inductor's loop over the weight for one row, oneDNN's GEMM as an
extern call for a batch), the method says so itself: that is a choice made once per trace, not
per step.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hyprefix.kernels import bf16_linear as bf16_kernel
from hyprefix.kernels import invariant_linear as invariant_kernel
from hyprefix.models.quant import reduction_linear

if TYPE_CHECKING:
    from hyprefix.models.weights import MatrixForms

# Gate activations of a gated MLP: the eager function, and the oneDNN epilogue (attr, scalars,
# algorithm) that computes it fused into the gate matmul (checked equal to the eager one to ~1 ulp).
ACTIVATIONS: dict[str, tuple] = {
    "silu": (F.silu, ("swish", [], "")),
    "gelu_pytorch_tanh": (partial(F.gelu, approximate="tanh"), ("gelu", [], "tanh")),
}

# Up to this many rows an eager matmul multiplies a matrix's bf16 tiles where it has them
# (``MatrixForms.tiles_take``): decode batches, which stream the matrix once.
EAGER_TILE_ROWS = 8


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x`` has exactly one row for certain (a batch-1 graph's static size; a
    batched graph's row count is symbolic)."""
    rows = x.shape[0]
    return isinstance(rows, int) and rows == 1


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  tiles: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's prepacked matmul; inside a batched decode graph the extern op of
    ``kernels/packed_linear.cpp``, which multiplies ``tiles`` (the matrix's bf16 tiles) instead
    for a batch of at most ``EAGER_TILE_ROWS`` rows."""
    if torch.compiler.is_compiling():
        return torch.ops.hyprefix.packed_linear(x, packed, bias, tiles, EAGER_TILE_ROWS if tiles is not None else 0)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
                   up_bias: torch.Tensor | None, epilogue: tuple, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ gate^T + gate_bias) * (x @ up^T + up_bias) for ``PACKED`` halves (a ``GatedMLP``'s
    gate and up), the activation (``epilogue``: oneDNN's attr, scalars, algorithm) and the product
    fused into the two prepacked matmuls. ``tiles``: as ``packed_linear``'s, of the fused [gate; up]
    matrix."""
    if torch.compiler.is_compiling():
        assert not epilogue[1], "the compiled gate/up op passes no activation scalars"
        return torch.ops.hyprefix.packed_gate_up(x, gate, up, gate_bias, up_bias, epilogue[0], epilogue[2], tiles,
                                                 EAGER_TILE_ROWS if tiles is not None else 0)
    h = torch.ops.mkldnn._linear_pointwise(x, gate, gate_bias, *epilogue)
    return torch.ops.mkldnn._linear_pointwise.binary(x, h, up, up_bias, "mul")


class LinearMethod:
    """Multiplies ``x`` by the matrix ``forms`` holds (``plain``: its owner's plain tensor)."""

    name = "plain"
    # The extern kernel a batched compiled decode step multiplies with
    # (``runner/decode_graph.batched_graph_capable``); None: no batched graph.
    batched_kernel: str | None = None

    def apply(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # Inductor's loop over the weight, fused with what feeds it
            return reduction_linear(x, plain, bias)
        return F.linear(x, plain, bias)

    def apply_gated(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None,
                    activation: str, intermediate: int) -> torch.Tensor:
        """act(gate) * up of a fused [gate; up] matrix (a ``GatedMLP``'s): the matmul, then the
        activation (a key of ``ACTIVATIONS``) and the product."""
        gate, up = self.apply(forms, x, plain, bias).split(intermediate, dim=-1)
        return ACTIVATIONS[activation][0](gate) * up


class PackedMethod(LinearMethod):
    name = "packed"
    batched_kernel = "packed"

    def apply(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if forms.packed is not None and not one_row(x):  # a batched graph: oneDNN's GEMM (or the tiles)
                return packed_linear(x, forms.packed, bias, forms.graph_tiles(x, bias))
            return reduction_linear(x, forms.graph_weight(plain), bias)
        if forms.tiles_take(x):
            return forms.bf16.matmul(x, bias)
        if forms.packed is not None:
            return packed_linear(x, forms.packed, bias)
        return F.linear(x, plain, bias)  # packed as halves (``apply_gated`` multiplies them)

    def apply_gated(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None,
                    activation: str, intermediate: int) -> torch.Tensor:
        """Packed as halves: gate and up as two oneDNN matmuls with the activation and the product
        in their epilogues (no elementwise pass over the intermediate activations); a one-row graph
        and eager decode-sized batches that take the bf16 tiles multiply the fused matrix instead."""
        halves = forms.packed_halves
        compiling = torch.compiler.is_compiling()
        if halves is None or (compiling and one_row(x)) or forms.tiles_take(x):
            return super().apply_gated(forms, x, plain, bias, activation, intermediate)
        gate_bias, up_bias = bias.split(intermediate) if bias is not None else (None, None)
        tiles = forms.graph_tiles(x, bias) if compiling else None
        return packed_gate_up(x, *halves, gate_bias, up_bias, ACTIVATIONS[activation][1], tiles)


class Int8Method(LinearMethod):
    name = "int8"

    def apply(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        weight = forms.int8
        if torch.compiler.is_compiling():
            return reduction_linear(x, weight, bias)
        return weight.matmul(x, bias)


class Int8TilesMethod(Int8Method):
    name = "int8_tiles"
    batched_kernel = "int8_tiles"

    def apply(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return forms.int8.matmul(x, bias)  # the int8 kernel, eager or as an extern call in a graph


class QuantMethod(LinearMethod):
    name = "quant"
    batched_kernel = "quant_tiles"

    def apply(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        order = forms.input_index
        if order is not None:  # the tiles keep the file's column order (``use_column_order``)
            x = x.index_select(-1, order)
        return forms.quant.matmul(x, bias)  # the kernel, eager or as an extern call in a graph


class InvariantMethod(LinearMethod):
    """The batch-invariant mode: ``bf16_linear`` over the bf16 tiles for bfloat16 inputs, else
    ``kernels/invariant_linear`` over the plain weight (or an LM head's float32 copy)."""

    name = "invariant"

    def apply(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        tiles = forms.bf16
        if tiles is not None and x.dtype == torch.bfloat16:
            return bf16_kernel.bf16_linear(x, tiles.tiles, forms.rows, bias)
        return invariant_kernel.invariant_linear(x, plain, bias)

    def apply_gated(self, forms: MatrixForms, x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None,
                    activation: str, intermediate: int) -> torch.Tensor:
        """The activation and product in ``kernels/invariant_linear``'s own op, whose result for an
        element does not depend on where it falls in torch's split of the tensor."""
        return invariant_kernel.invariant_gated_act(self.apply(forms, x, plain, bias), activation)


PLAIN, PACKED, INT8, INT8_TILES, QUANT, INVARIANT = (LinearMethod(), PackedMethod(), Int8Method(), Int8TilesMethod(),
                                                     QuantMethod(), InvariantMethod())
