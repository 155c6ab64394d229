"""The experts of a mixture-of-experts block as one op, ``hyprefix::moe_experts``: given each
token's chosen experts and their routing weights, every (token, expert) pair's gated-SiLU MLP
(gate and up rows stacked per expert, then down), weighted and summed per token.

One op, opaque to ``torch.compile``: how many tokens each expert gets is data, which a compiled
graph cannot hold as a shape, so the grouping happens inside the op and a decode graph calls it
as one extern call between its matmuls (``runner/decode_graph.py``). Only the chosen experts'
weights are read:

- on a CPU, every (token, slot) pair sorted by expert and each projection one grouped matmul over
  the experts' row runs (``torch._grouped_mm``; an expert nobody chose is an empty group);
- elsewhere one matmul pair per chosen expert (CUDA's grouped matmul takes fewer dtypes than the
  models use).

The routing itself (softmax or sigmoid, top-k, renormalising) is the family's: it varies by
family, and it is a few small ops a graph compiles well.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("hyprefix::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x [T, H]; chosen [T, k] expert ids; weights [T, k] in x's dtype; gate_up [E, 2I, H] (each
    expert's gate rows, then its up rows); down [E, H, I]. Returns [T, H]."""
    if x.device.type == "cpu":
        return grouped_experts(x, chosen, weights, gate_up, down)
    return looped_experts(x, chosen, weights, gate_up, down)


@moe_experts.register_fake
def _(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
      down: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def grouped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """The CPU path: pairs sorted by expert, one grouped matmul per projection, no Python loop."""
    num_experts, top_k = gate_up.shape[0], chosen.shape[1]
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).to(torch.int32)
    tokens = order // top_k
    gate, up = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    h = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    return torch.zeros_like(x).index_add_(0, tokens, h * weights.flatten()[order, None])


def looped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """One matmul pair per chosen expert (devices other than a CPU)."""
    out = torch.zeros_like(x)
    for e in chosen.unique().tolist():
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[e]) * weights[rows, slot, None]
        out.index_add_(0, rows, h)
    return out
