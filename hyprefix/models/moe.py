"""A sparse mixture-of-experts MLP block as the families build it: a router, the routed experts
(``fused_moe``: one op, tokens grouped by expert inside it, only the chosen experts' weights
read) and, where the family has one, a shared expert (optionally scaled by a sigmoid gate).

The routing function is the family's (``Routing``); ``map_sparse_moe`` maps transformers'
names of such a block onto ours, for every family that names it as Qwen does (``mlp.gate``,
``mlp.experts.*``, ``mlp.shared_expert*``), per-expert tensors and transformers 5's fused
``[E, rows, cols]`` stacks alike (``flat_experts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyprefix.models.base import Target
from hyprefix.models.fused_moe import Experts, moe_forward
from hyprefix.models.layers import GatedMLP, Linear


@dataclass(frozen=True)
class Routing:
    """How a router's logits choose experts: softmax over every expert, then the ``top_k``
    largest (Qwen, Mixtral), their weights renormalised to sum to one where ``renormalize``."""

    top_k: int
    renormalize: bool

    def __call__(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in ``dtype``, chosen expert ids [T, k]) for router logits [T, E]."""
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(dtype), chosen


class SparseMoE(nn.Module):
    """Router -> ``top_k`` of ``num_experts`` gated SiLU experts, plus an optional shared expert
    (a gated SiLU MLP), scaled by sigmoid(shared_gate(x)) where ``shared_gate``. Expert weights
    are stacked: gate_up [E * 2I, hidden] (each expert's gate rows, then its up rows), down
    [E * hidden, I]."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, routing: Routing, shared: int,
                 shared_gate: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden, self.num_experts, self.inter, self.routing = hidden, num_experts, intermediate, routing
        self.router = Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        self.experts_gate_up = Experts(num_experts, 2 * intermediate, hidden, dtype, device)
        self.experts_down = Experts(num_experts, hidden, intermediate, dtype, device)
        self.shared = GatedMLP(hidden, shared, False, dtype, device) if shared else None
        self.shared_gate = Linear(hidden, 1, bias=False, dtype=dtype, device=device) if shared and shared_gate else None

    @classmethod
    def from_config(cls, cfg, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        """Qwen's config fields (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): ``num_experts``,
        ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, and a gated
        shared expert of ``shared_expert_intermediate_size`` where that is set."""
        routing = Routing(cfg.num_experts_per_tok, bool(getattr(cfg, "norm_topk_prob", True)))
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        return cls(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, routing, shared, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.routing(self.router(x), x.dtype)
        out = moe_forward(x, chosen, weights, self.experts_gate_up, self.experts_down)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        return out


def is_moe_layer(cfg, i: int) -> bool:
    """Whether Qwen's config makes layer ``i``'s MLP sparse: experts configured, the layer not in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer."""
    if not getattr(cfg, "num_experts", 0):
        return False
    if i in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    return (i + 1) % (getattr(cfg, "decoder_sparse_step", 1) or 1) == 0


def flat_experts(name: str, t: torch.Tensor) -> torch.Tensor:
    """transformers 5's fused expert stacks [E, rows, cols] as our [E * rows, cols]; any other
    tensor as it is (a row move only: ``CausalLM.converted``'s contract)."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return t.reshape(-1, t.shape[-1])
    return t


def map_gated_mlp(prefix: str, mlp: GatedMLP, rest: str) -> Target:
    """``{gate,up,down}_proj.{weight,bias}`` of a gated MLP onto its fused gate_up and down."""
    module, leaf = rest.rsplit(".", 1)
    if module in ("gate_proj", "up_proj"):
        return f"{prefix}.gate_up.{leaf}", int(module == "up_proj"), [mlp.intermediate] * 2
    return f"{prefix}.down.{leaf}", None, None


def map_sparse_moe(prefix: str, moe: SparseMoE, rest: str) -> Target:
    """transformers' names inside a Qwen-style sparse MoE block (``rest`` after ``mlp.``) onto
    ``moe``'s parameters (``prefix``: the block's own name)."""
    if rest == "gate.weight":
        return f"{prefix}.router.weight", None, None
    if rest == "shared_expert_gate.weight":
        return f"{prefix}.shared_gate.weight", None, None
    if rest.startswith("shared_expert.") and moe.shared is not None:
        return map_gated_mlp(f"{prefix}.shared", moe.shared, rest.split(".", 1)[1])
    if rest == "experts.gate_up_proj":
        return f"{prefix}.experts_gate_up.weight", None, None
    if rest == "experts.down_proj":
        return f"{prefix}.experts_down.weight", None, None
    _, e, proj, _ = rest.split(".")  # experts.{e}.{gate,up,down}_proj.weight
    e, n = int(e), moe.num_experts
    if proj == "down_proj":
        return f"{prefix}.experts_down.weight", e, [moe.hidden] * n
    return f"{prefix}.experts_gate_up.weight", 2 * e + (proj == "up_proj"), [moe.inter] * (2 * n)
