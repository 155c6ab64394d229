"""Shared layers: RMSNorm, rotary embedding, linear layers and the gated MLP."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.hardware import device_caps
from hyprefix.kernels import bf16_linear as bf16_kernel
from hyprefix.models.fused import Kernels
from hyprefix.models.quant import (
    Bf16Tiles,
    Int8Tiles,
    Int8Weight,
    bf16_tiles,
    int8_buffers,
    quantize_int8,
    reduction_linear,
    set_bf16_tiles,
    set_int8_buffers,
)


class RMSNorm(nn.Module):
    """Holds the weight; the arithmetic lives in ``fused.py``."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                    kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the first layer has no residual yet: (norm(x), x)."""
        if residual is None:
            return self(x, kernels), x
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True)
class RopeTables:
    """One step's half-width cos/sin [T, 1, rotary_dim/2], gathered once per forward
    by the model (``Rotary.tables``) and shared by its attention layers."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int


class Rotary(nn.Module):
    """cos/sin tables for every position up to ``max_positions`` (HF rotate-half layout).

    ``inv_freq`` and ``scaling`` come from transformers' own RoPE init functions, so
    default, linear, llama3, yarn and longrope scaling follow the checkpoint config.
    Only the first ``rotary_dim`` channels of each head rotate (partial rotary).
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = int(emb.shape[-1])
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """Half-width cos/sin for the tokens at ``positions`` (long [T])."""
        half = self.rotary_dim // 2
        return RopeTables(self.cos[positions, :half][:, None, :], self.sin[positions, :half][:, None, :],
                          self.rotary_dim)


def mkldnn_packing_available(weight: torch.Tensor) -> bool:
    """Whether this weight's dtype is prepacked on its device (``hardware.DeviceCaps.prepack``)."""
    return device_caps(weight.device).prepack(weight.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, which oneDNN's prepacked matmul reads faster
    than the plain layout on CPU, at decode and prefill sizes (``docs/perf-log.md``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def one_row(x: torch.Tensor) -> bool:
    """Whether ``x`` has exactly one row for certain (a batch-1 graph's static size; a
    batched graph's row count is symbolic)."""
    rows = x.shape[0]
    return isinstance(rows, int) and rows == 1


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a batched decode graph: an extern call (``kernels/packed_linear.cpp``)
        return torch.ops.hyprefix.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
                   up_bias: torch.Tensor | None, epilogue: tuple) -> torch.Tensor:
    """act(x @ gate^T + gate_bias) * (x @ up^T + up_bias), the activation (``epilogue``: oneDNN's
    attr, scalars, algorithm) and the product fused into the two prepacked matmuls."""
    if torch.compiler.is_compiling():
        assert not epilogue[1], "the compiled gate/up op passes no activation scalars"
        return torch.ops.hyprefix.packed_gate_up(x, gate, up, gate_bias, up_bias, epilogue[0], epilogue[2])
    h = torch.ops.mkldnn._linear_pointwise(x, gate, gate_bias, *epilogue)
    return torch.ops.mkldnn._linear_pointwise.binary(x, h, up, up_bias, "mul")


class Linear(nn.Linear):
    """nn.Linear that, after loading, can switch to a prepacked oneDNN weight on CPU
    (for the dtypes ``hardware.DeviceCaps.prepack`` allows; other devices keep the plain
    path) or to int8 weights (``quant.py``). Inside a compiled decode step it reads the
    plain (or int8) weight through ``quant.reduction_linear``; ``pack(keep_plain=True)``
    keeps the plain weight for that beside the packed copy, or its ``Bf16Tiles`` in its
    place where the bf16 kernel takes it (``graph_weight``)."""

    _packed: torch.Tensor | None = None
    owner_packs = False  # a GatedMLP's gate_up: the MLP packs it (as gate and up), ``pack`` leaves it

    @property
    def int8(self) -> Int8Weight | Int8Tiles | None:
        """The int8 weights (module buffers, ``quant.set_int8_buffers``); None if float."""
        return int8_buffers(self)

    @property
    def graph_weight(self) -> torch.Tensor | Int8Weight | Int8Tiles | Bf16Tiles:
        """What a compiled decode step multiplies: the int8 weights, the bf16 tiles, or the plain weight."""
        int8 = self.int8
        if int8 is not None:
            return int8
        tiles = bf16_tiles(self)
        return tiles if tiles is not None else self.weight

    def pack(self, keep_plain: bool = False) -> None:
        if self._packed is None and not self.owner_packs and self.weight.numel() \
                and mkldnn_packing_available(self.weight):
            self._packed = pack_weight(self.weight)
            if not keep_plain or set_bf16_tiles(self, self.weight):
                self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # the packed copy replaces it

    def quantize(self) -> None:
        """Switch to int8 weights quantized from the float weight."""
        self.use_int8(quantize_int8(self.weight))

    def use_int8(self, weight: Int8Weight) -> None:
        """Switch to these int8 weights [out_features, in_features]; the float one goes."""
        if tuple(weight.qweight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"int8 weight of shape {tuple(weight.qweight.shape)} for a linear layer of "
                             f"{self.out_features} x {self.in_features}")
        set_int8_buffers(self, weight)
        self._packed = None
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self._packed is not None and not one_row(x):  # a batched graph: oneDNN's GEMM
                return packed_linear(x, self._packed, self.bias)
            return reduction_linear(x, self.graph_weight, self.bias)
        int8 = self.int8
        if int8 is not None:
            return int8.matmul(x, self.bias)
        if self._packed is not None:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose table can move into ``Bf16Tiles`` (``use_tiles``): a tied LM head's
    copy for compiled decode steps then also serves the lookups, gathered from the tiles,
    instead of a second plain copy."""

    def use_tiles(self) -> bool:
        """Keep the table only as bf16 tiles where the kernel takes it; returns whether it does."""
        if not set_bf16_tiles(self, self.weight):
            return False
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tiles = bf16_tiles(self)
        return super().forward(ids) if tiles is None else bf16_kernel.rows(tiles.tiles, ids, tiles.rows)


# Gate activations: the eager function, and the oneDNN epilogue (attr, scalars, algorithm)
# that computes it fused into the gate matmul (checked equal to the eager one to ~1 ulp).
ACTIVATIONS: dict[str, tuple] = {
    "silu": (F.silu, ("swish", [], "")),
    "gelu_pytorch_tanh": (partial(F.gelu, approximate="tanh"), ("gelu", [], "tanh")),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), loaded with gate and up fused into one matrix;
    ``activation`` is a key of ``ACTIVATIONS`` (SiLU by default, Gemma's tanh-GELU).

    Packed (CPU), gate and up become two oneDNN matmuls with the activation and the
    product fused into their epilogues: no elementwise passes over the
    intermediate activations.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}; supported: {sorted(ACTIVATIONS)}")
        self.act, self._epilogue = ACTIVATIONS[activation]
        self.intermediate = intermediate
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype, device=device)
        self.gate_up.owner_packs = True
        self.down = Linear(intermediate, hidden, bias=bias, dtype=dtype, device=device)
        self._packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None

    def pack(self, keep_plain: bool = False) -> None:
        self.down.pack(keep_plain)
        weight, bias = self.gate_up.weight, self.gate_up.bias
        if self._packed is not None or not weight.numel() or not mkldnn_packing_available(weight):
            return
        gate_w, up_w = weight.split(self.intermediate)
        gate_b, up_b = bias.split(self.intermediate) if bias is not None else (None, None)
        self._packed = (pack_weight(gate_w), pack_weight(up_w), gate_b, up_b)
        if not keep_plain or set_bf16_tiles(self.gate_up, weight):
            weight.data = torch.empty(0, dtype=weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and not (torch.compiler.is_compiling() and one_row(x)):
            return self.down(packed_gate_up(x, *self._packed, self._epilogue))
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.act(gate) * up)
