"""The experts of a mixture-of-experts block as one op, ``hyprefix::moe_experts``: given each
token's chosen experts and their routing weights, every (token, expert) pair's MLP, weighted and
summed per token. ``activation`` "silu": a gated-SiLU MLP (gate and up rows stacked per expert,
silu(gate) * up, then down); "relu2": an MLP without a gate (NemotronH's experts: up, relu^2, down);
"swiglu_oai": gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
with g = min(gate, limit). Each projection may have a bias per expert (gpt-oss's), added before
the activation and before the routing weight.

One op, opaque to ``torch.compile``: how many tokens each expert gets is data, which a compiled
graph cannot hold as a shape, so the grouping happens inside the op and a decode graph calls it
as one extern call between its matmuls (``runner/decode_graph.py``). Only the chosen experts'
weights are read:

- on a CPU, every (token, slot) pair sorted by expert and each projection one grouped matmul over
  the experts' row runs (``torch._grouped_mm``; an expert nobody chose is an empty group);
- elsewhere one matmul pair per chosen expert (CUDA's grouped matmul takes fewer dtypes than the
  models use).

A GGUF file's expert tensors stay in their blocks (``gguf_blocks``: each expert's rows are whole
16-row tiles of the stack, ``Experts``): then ``hyprefix::quant_moe`` (``kernels/quant_linear.cpp``)
multiplies each chosen expert's slice of the tiles, every expert's tiles the tasks of one parallel
loop per projection.

The routing itself (softmax or sigmoid, top-k, renormalising) is the family's: it varies by
family, and it is a few small ops a graph compiles well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models.layers import drop_plain
from hyprefix.models.quant import int8_part, quantize_int8, quantize_low_bit
from hyprefix.models.weights import MatrixForms


class Experts(nn.Module):
    """One projection of every expert, stacked: ``weight`` [E * rows, cols] (expert e's rows
    ``e * rows`` to ``(e + 1) * rows``), and its ``forms``, where a GGUF file's blocks replace the
    plain tensor (``MatrixForms.use_quant``)."""

    def __init__(self, num_experts: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                 bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.rows, self.cols = num_experts, rows, cols
        self.weight = nn.Parameter(torch.empty(num_experts * rows, cols, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(num_experts, rows, dtype=dtype, device=device)) if bias else None
        self.forms = MatrixForms(num_experts * rows, cols)

    @property
    def tiles_split_by_expert(self) -> bool:
        """Whether each expert's rows are whole 16-row tiles (so its blocks can be sliced out)."""
        return self.rows % 16 == 0

    def quantize(self, bits: int) -> bool:
        """``--quantization int8`` (8 bits, one scale per 32 columns, as GGUF's Q8_0) or ``int4``
        (``quant.quantize_low_bit``) for a float stack, into the tiles ``quant_moe`` multiplies;
        the plain tensor goes. Returns False, changing nothing, where the tiles cannot hold it
        (an expert's rows not whole 16-row tiles, columns not groups of 32, or no quant kernel
        here): it then stays float."""
        if (self.forms.quantized is not None or not self.tiles_split_by_expert or self.cols % 32
                or not quant_kernel.available()):
            return False
        weight = self.weight.detach()
        self.forms.use_quant(int8_part(quantize_int8(weight, group=32)) if bits == 8 else quantize_low_bit(weight))
        drop_plain(self.weight)
        return True

    def stacked(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as [E, rows, cols]: the plain tensor, or the blocks dequantized where only this
        projection of a block kept them (a file whose other projection is of a type the kernels do not
        take; rare, and slow: every call dequantizes)."""
        quant = self.forms.quant
        plain = self.weight if quant is None else quant.dequantize(dtype)
        return plain.view(self.num_experts, self.rows, self.cols)


def flat_experts(name: str, t: torch.Tensor) -> torch.Tensor:
    """Expert stacks [E, rows, cols] (transformers 5's fused ``experts.gate_up_proj`` /
    ``down_proj``, NemotronH's ungated ``experts.up_proj``, Granite's ``input_linear`` /
    ``output_linear``) as our [E * rows, cols]; any other tensor as it is (a row move only:
    ``CausalLM.converted``'s contract)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.up_proj")) or (
            t.dim() == 3 and name.endswith(("input_linear.weight", "output_linear.weight"))):
        return t.reshape(-1, t.shape[-1])
    return t


@dataclass(frozen=True)
class ExpertActivation:
    """What each expert computes between its projections (module docstring): ``name`` "silu",
    "relu2" or "swiglu_oai", the last with gpt-oss's ``alpha`` and ``limit``."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


SILU = ExpertActivation()


def moe_forward(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: Experts,
                down: Experts, activation: ExpertActivation = SILU) -> torch.Tensor:
    """The experts' sum for each token: the quant op where both projections hold blocks, else the
    float op (over the blocks dequantized where only one projection kept them)."""
    quant_up, quant_down = gate_up.forms.quant, down.forms.quant
    act = (activation.name, gate_up.bias, down.bias, activation.alpha, activation.limit)
    if quant_up is not None and quant_down is not None:
        return quant_kernel.quant_moe(x, chosen, weights, quant_up.tensors, gate_up.rows, quant_down.tensors, down.rows,
                                      *act)
    return moe_experts(x, chosen, weights, gate_up.stacked(x.dtype), down.stacked(x.dtype), *act)


@torch.library.custom_op("hyprefix::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: str, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """x [T, H]; chosen [T, k] expert ids; weights [T, k] in x's dtype; gate_up [E, 2I, H] (each
    expert's gate rows, then its up rows; [E, I, H], up alone, for "relu2"); down [E, H, I];
    biases [E, 2I] and [E, H] or None. Returns [T, H]."""
    act = ExpertActivation(activation, alpha, limit)
    if x.device.type == "cpu":
        return grouped_experts(x, chosen, weights, gate_up, down, act, gate_up_bias, down_bias)
    return looped_experts(x, chosen, weights, gate_up, down, act, gate_up_bias, down_bias)


@moe_experts.register_fake
def _(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
      down: torch.Tensor, activation: str, gate_up_bias: torch.Tensor | None = None,
      down_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    return torch.empty_like(x)


def activate(h: torch.Tensor, activation: ExpertActivation) -> torch.Tensor:
    """The experts' activation on their gate_up outputs (``moe_experts``)."""
    if activation.name == "relu2":
        return torch.square(F.relu(h))
    gate, up = h.chunk(2, dim=-1)
    if activation.name == "swiglu_oai":
        gate, up = gate.clamp(max=activation.limit), up.clamp(-activation.limit, activation.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))
    return F.silu(gate) * up


def grouped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, activation: ExpertActivation, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: pairs sorted by expert, one grouped matmul per projection, no Python loop."""
    num_experts, top_k = gate_up.shape[0], chosen.shape[1]
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    tokens, expert = order // top_k, flat[order]
    h = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends)
    h = activate(h if gate_up_bias is None else h + gate_up_bias[expert], activation)
    h = torch._grouped_mm(h, down.transpose(1, 2), offs=ends)
    h = h if down_bias is None else h + down_bias[expert]
    return torch.zeros_like(x).index_add_(0, tokens, h * weights.flatten()[order, None])


def looped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: ExpertActivation, gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One matmul pair per chosen expert (devices other than a CPU)."""
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        h = activate(F.linear(x[rows], gate_up[e], None if gate_up_bias is None else gate_up_bias[e]), activation)
        h = F.linear(h, down[e], None if down_bias is None else down_bias[e]) * weights[rows, slot, None]
        out.index_add_(0, rows, h)
    return out
