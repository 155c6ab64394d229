"""Shared layers: RMSNorm, rotary embedding, linear layers and the gated MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyprefix.kernels import bf16_linear as bf16_kernel
from hyprefix.models.fused import Kernels
from hyprefix.models.linear_methods import ACTIVATIONS
from hyprefix.models.quant import Int8Weight, quantize_int8
from hyprefix.models.weights import MatrixForms


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


def drop_plain(weight: nn.Parameter) -> None:
    """Empty a matrix's plain tensor once another form replaces it (the parameter stays, with
    its dtype and device, for the weight loader and the accounting)."""
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


class Linear(nn.Linear):
    """nn.Linear whose matrix, after loading, may also (or instead) be held packed, as int8
    or as bf16 tiles (``weights.MatrixForms``, ``forms``), which picks the form each step
    multiplies. ``pack_halves``: pack the matrix as its two halves (a ``GatedMLP``'s gate_up,
    which multiplies them itself)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, pack_halves: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, device=device)
        self.forms = MatrixForms(out_features, in_features)
        self.pack_halves = pack_halves
        # False: ``--quantization`` leaves this matrix in float (a MoE router: a rounded logit can
        # change which experts a token reaches; vLLM and llama.cpp keep routers unquantized too).
        self.quantizable = True
        # True: the plain weight stays beside a packed form whatever the step paths (a MoE
        # router, which ``DecodeModel`` reads: ``kernels/decode_moe.h``).
        self.keeps_plain = False

    def pack(self, keep_plain: bool = False, eager_tiles: bool = False) -> None:
        """Add the packed form where the device allows it; ``keep_plain``: compiled decode steps
        read the matrix, so keep the plain weight (or bf16 tiles in its place); ``eager_tiles``:
        eager decode steps multiply its bf16 tiles (``MatrixForms.tiles_take``)."""
        if self.forms.pack(self.weight, keep_plain or self.keeps_plain, self.pack_halves, eager_tiles):
            drop_plain(self.weight)

    def quantize(self) -> None:
        """Switch to int8 weights quantized from the float weight."""
        self.use_int8(quantize_int8(self.weight))

    def use_int8(self, weight: Int8Weight) -> None:
        """Switch to these int8 weights [out_features, in_features]; the float one goes."""
        self.forms.use_int8(weight)
        drop_plain(self.weight)

    def use_batch_invariant(self) -> None:
        """The batch-invariant mode's matmul from now on (``MatrixForms.use_batch_invariant``);
        the plain weight goes where bf16 tiles replace it."""
        if self.forms.use_batch_invariant(self.weight):
            drop_plain(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forms.matmul(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding with the forms of its table as a tied LM head (``forms``: packed, int8,
    bf16 tiles, low-bit tiles). Where compiled decode steps read the head as bf16 tiles, the
    tiles also serve the lookups, gathered from them, instead of a second plain copy; so do a
    GGUF's quantized blocks (``forms.quant``), which replace the table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype, device=device)
        self.forms = MatrixForms(num_embeddings, embedding_dim)

    def pack_head(self, keep_plain: bool, eager_tiles: bool = False) -> None:
        """The table's packed form for a tied LM head (and, with ``keep_plain`` or ``eager_tiles``,
        its bf16 tiles, which then replace the table); the lookups keep the plain table otherwise."""
        if self.forms.pack(self.weight, keep_plain, eager_tiles=eager_tiles) and self.forms.bf16 is not None:
            drop_plain(self.weight)

    def use_batch_invariant_head(self) -> None:
        """A tied LM head in the batch-invariant mode (``MatrixForms.use_batch_invariant``); where
        bf16 tiles replace the table, they serve the lookups too."""
        if self.forms.use_batch_invariant(self.weight):
            drop_plain(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: hidden @ table^T, in the form ``forms`` picks."""
        return self.forms.matmul(hidden, self.weight, None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tiles = self.forms.bf16
        if tiles is not None:
            return bf16_kernel.rows(tiles.tiles, ids, tiles.rows)
        quant = self.forms.quant
        if quant is not None and not self.weight.numel():  # a GGUF's quantized table, no float copy
            return quant.lookup(ids).to(self.weight.dtype)
        return super().forward(ids)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), loaded with gate and up fused into one matrix;
    ``activation`` is a key of ``ACTIVATIONS`` (SiLU by default, Gemma's tanh-GELU).

    How gate_up, the activation and the product run is gate_up's method's ``apply_gated``
    (``linear_methods``): packed (CPU), two oneDNN matmuls with the activation and the product
    fused into their epilogues; in the batch-invariant mode, ``kernels/invariant_linear``'s own op.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype,
                 device: torch.device, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}; supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation][0]
        self.activation = activation
        self.intermediate = intermediate
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype, device=device, pack_halves=True)
        self.down = Linear(intermediate, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up
        return self.down(gate_up.forms.method.apply_gated(gate_up.forms, x, gate_up.weight, gate_up.bias,
                                                          self.activation, self.intermediate))
