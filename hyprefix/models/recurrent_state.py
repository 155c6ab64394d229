"""What every recurrent mixer (Mamba2, Gated DeltaNet) shares: where its state lives
and its causal depthwise conv over a conv state.

A recurrent layer's state is a conv window (the last K-1 conv inputs, in the model
dtype) and a matrix state (float32 whatever the model dtype, or bfloat16 by choice:
``--mamba-ssm-cache-dtype``): Mamba2's SSM state [heads, head_dim, state], Gated
DeltaNet's [value heads, key dim, value dim]. The mixers compute in float32 whatever
the stored dtype: a bfloat16 state is widened when read and rounded when stored. The
state lives outside the modules, in ``RecurrentLayerState`` tensors indexed by slot.
Before a forward the runner has put each scheduled request's initial state in its
live slot (zeros or a restored checkpoint, copied never aliased); the mixer reads
it, advances it, writes it back, and copies the state at requested positions
("taps") into checkpoint slots.

A checkpoint slot holds the state of every recurrent layer of the model; the layers
may differ in shape (``StateLayout`` lists them), so one byte budget serves models
that mix kinds of recurrent layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerStateShape:
    """One recurrent layer's state: conv window [conv_dim, conv_width] (model dtype) and
    a matrix state of shape ``matrix`` (float32 or bfloat16)."""

    conv_dim: int
    conv_width: int  # kernel - 1
    matrix: tuple[int, ...]

    def bytes(self, dtype: torch.dtype, matrix_dtype: torch.dtype = torch.float32) -> int:
        return self.conv_dim * self.conv_width * dtype.itemsize + math.prod(self.matrix) * matrix_dtype.itemsize


@dataclass(frozen=True)
class StateLayout:
    """The state shapes of a model's recurrent layers, in layer order."""

    layers: tuple[LayerStateShape, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_slot(self, dtype: torch.dtype, matrix_dtype: torch.dtype = torch.float32) -> int:
        return sum(layer.bytes(dtype, matrix_dtype) for layer in self.layers)


@dataclass
class RecurrentLayerState:
    conv: torch.Tensor  # [live slots, conv_dim, K-1]
    matrix: torch.Tensor  # [live slots, *matrix], float32 or bfloat16
    ckpt_conv: torch.Tensor  # [checkpoint slots, conv_dim, K-1]
    ckpt_matrix: torch.Tensor  # [checkpoint slots, *matrix], the live matrix's dtype

    @classmethod
    def allocate(cls, shape: LayerStateShape, live: int, checkpoints: int, dtype: torch.dtype,
                 device: torch.device, matrix_dtype: torch.dtype = torch.float32) -> RecurrentLayerState:
        def conv(n: int) -> torch.Tensor:
            return torch.zeros(n, shape.conv_dim, shape.conv_width, dtype=dtype, device=device)

        def matrix(n: int) -> torch.Tensor:
            return torch.zeros(n, *shape.matrix, dtype=matrix_dtype, device=device)

        return cls(conv(live), matrix(live), conv(checkpoints), matrix(checkpoints))

    def tap(self, ckpt_slot: int, conv: torch.Tensor, matrix: torch.Tensor) -> None:
        self.ckpt_conv[ckpt_slot].copy_(conv)
        self.ckpt_matrix[ckpt_slot].copy_(matrix)

    def decode_matrices(self, slots: torch.Tensor, slot_range: tuple[int, int] | None) -> torch.Tensor:
        """The decode rows' matrix states in float32, to update in place: a view of the live
        tensor when it is float32 and the slots are one ascending range
        (``ForwardBatch.decode_state_range``), else a copy that ``store_decode_matrices``
        writes back."""
        if slot_range is not None:
            view = self.matrix[slot_range[0]:slot_range[1]]
            return view if view.dtype == torch.float32 else view.float()
        return self.matrix.index_select(0, slots).float()

    def store_decode_matrices(self, matrices: torch.Tensor, slots: torch.Tensor,
                              slot_range: tuple[int, int] | None) -> None:
        if slot_range is None:
            self.matrix.index_copy_(0, slots, matrices.to(self.matrix.dtype))
        elif self.matrix.dtype != torch.float32:
            self.matrix[slot_range[0]:slot_range[1]].copy_(matrices)

    def prefill_matrix(self, slot: int) -> torch.Tensor:
        """A prefill's initial matrix state in float32 (the scan's input, never written)."""
        return self.matrix[slot].float()

    def restore(self, ckpt_slot: int | None, live_slot: int) -> None:
        """Initialise a live slot from a checkpoint (a copy) or with zeros (None)."""
        if ckpt_slot is None:
            self.conv[live_slot].zero_()
            self.matrix[live_slot].zero_()
        else:
            self.conv[live_slot].copy_(self.ckpt_conv[ckpt_slot])
            self.matrix[live_slot].copy_(self.ckpt_matrix[ckpt_slot])


def tap_decode_rows(state: RecurrentLayerState, slots: torch.Tensor, taps: list[tuple[int, int]]) -> None:
    """After a decode step advanced the live states in place: copy decode row ``row``'s state
    (live slot ``slots[row]``) into checkpoint slot ``ckpt`` for each tap."""
    for row, ckpt in taps:
        slot = int(slots[row])
        state.tap(ckpt, state.conv[slot], state.matrix[slot])


def conv_prefill(state: RecurrentLayerState, slot: int, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of one prefill ``x`` [n, C] after the slot's conv state;
    advances the state. Returns (conv output [n, C] before the activation, the conv
    inputs [C, K-1+n] old state first: the conv state after ``j`` tokens is
    ``inputs[:, j:j + K-1]``). Also right for prompts shorter than the kernel."""
    n = x.shape[0]
    inputs = torch.cat((state.conv[slot], x.t().to(state.conv.dtype)), dim=-1)
    out = F.conv1d(inputs[None], weight, bias, groups=weight.shape[0])[0]
    state.conv[slot].copy_(inputs[:, n:])
    return out.t(), inputs


def silu_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """SiLU of ``x`` [n, heads * dim] (any strides) as a new head-major float32 [heads, n, dim]
    tensor: the layout the chunked scans read, made in one pass from a prefill's channel-major
    conv output, so later reductions over ``dim`` read contiguous memory."""
    n = x.shape[0]
    out = torch.empty(heads, n, x.shape[1] // heads, dtype=torch.float32, device=x.device)
    out.copy_(x.view(n, heads, -1).transpose(0, 1))
    return F.silu(out, inplace=True)


def conv_decode(state: RecurrentLayerState, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``x`` [m, C] for the live ``slots``; advances their conv
    states. Returns (conv output [m, C] before the activation, each row's new conv
    state [m, C, K-1])."""
    window = torch.cat((state.conv.index_select(0, slots), x.unsqueeze(-1).to(state.conv.dtype)), dim=-1)
    new_state = window[:, :, 1:]
    state.conv.index_copy_(0, slots, new_state)
    out = (window * weight[:, 0, :]).sum(-1)
    if bias is not None:
        out = out + bias
    return out, new_state
