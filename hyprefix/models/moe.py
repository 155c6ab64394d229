"""A sparse mixture-of-experts MLP block as the families build it: a router, the routed experts
(``fused_moe``: one op, tokens grouped by expert inside it, only the chosen experts' weights
read) and, where the family has one, a shared expert (optionally scaled by a sigmoid gate).

The routing function is the family's (``Routing``); ``map_sparse_moe`` maps transformers'
names of such a block onto ours, for every family that names it as Qwen does (``mlp.gate``,
``mlp.experts.*``, ``mlp.shared_expert*``), per-expert tensors and transformers 5's fused
``[E, rows, cols]`` stacks alike (``fused_moe.flat_experts``, which ``CausalLM.converted`` applies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyprefix.models.base import Target
from hyprefix.models.fused_moe import SILU, ExpertActivation, Experts, moe_forward
from hyprefix.models.layers import GatedMLP, Linear


@dataclass(frozen=True)
class Routing:
    """How a router's logits choose experts.

    - ``scoring`` "softmax": softmax over every expert, then the ``top_k`` largest (Qwen,
      Mixtral; with ``groups``, DeepSeek-V2's group-limited greedy: within the ``groups_kept``
      groups whose best score is highest), their weights renormalised to sum to one where
      ``renormalize``; or, with
      ``softmax_after_topk``, the ``top_k`` largest logits and a softmax over those alone
      (Granite MoE, gpt-oss).
    - ``scoring`` "sigmoid" (DeepSeek-V3, Nemotron 3): sigmoid scores; the choice ranks them plus
      the router's correction bias, within the ``groups_kept`` of ``groups`` expert groups whose
      two best sum highest; the weights are the chosen scores (without the bias), renormalised
      where ``renormalize``.

    The weights are then multiplied by ``scale`` (``routed_scaling_factor``)."""

    top_k: int
    renormalize: bool = False
    softmax_after_topk: bool = False
    scoring: str = "softmax"
    groups: int = 1
    groups_kept: int = 1
    scale: float = 1.0

    def __call__(self, logits: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in ``dtype``, chosen expert ids [T, k]) for router logits [T, E]
        (``bias``: the correction bias of sigmoid scoring)."""
        if self.scoring == "sigmoid":
            weights, chosen = self._sigmoid(logits.float(), bias)
        elif self.softmax_after_topk:
            top, chosen = torch.topk(logits.float(), self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            scores = torch.softmax(logits.float(), dim=-1)
            choice = scores
            if self.groups > 1:  # DeepSeek-V2's groups, ranked by their best score
                best = scores.unflatten(-1, (self.groups, -1)).amax(-1)
                choice = _within_groups(scores, best, self.groups, self.groups_kept)
            chosen = torch.topk(choice, self.top_k, dim=-1)[1]
            weights = scores.gather(-1, chosen)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
        return (weights if self.scale == 1.0 else weights * self.scale).to(dtype), chosen

    def _sigmoid(self, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias.float()
        if self.groups > 1:
            group_scores = choice.unflatten(-1, (self.groups, -1)).topk(2, dim=-1)[0].sum(-1)
            choice = _within_groups(choice, group_scores, self.groups, self.groups_kept)
        chosen = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(-1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights, chosen


def _within_groups(choice: torch.Tensor, group_scores: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    """``choice`` [T, E] with every expert outside the ``kept`` best-scoring of ``groups`` equal
    groups set to -inf (so top-k picks within the kept groups)."""
    best = torch.topk(group_scores, kept, dim=-1)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
    return choice.unflatten(-1, (groups, -1)).masked_fill(~mask[..., None], float("-inf")).flatten(-2)


class SparseMoE(nn.Module):
    """Router -> ``top_k`` of ``num_experts`` experts (``activation``, ``fused_moe``: gated SiLU
    MLPs, ungated ReLU^2 ones, gpt-oss's clamped SwiGLU), plus an optional ``shared`` expert (any
    MLP module), scaled by sigmoid(shared_gate(x)) where ``shared_gate``. ``latent``: the experts
    work in a smaller width, between a projection down from the hidden size and one back up
    (NemotronH's latent MoE). ``correction_bias``: the bias sigmoid routing adds to the scores to
    choose (not to weigh). ``biases`` (gpt-oss): the router's logits and each expert's
    projections have biases.
    Expert weights are stacked: gate_up [E * 2I, width] (each expert's gate rows, then its up rows;
    [E * I, width], up alone, for "relu2"), down [E * width, I]."""

    def __init__(self, hidden: int, num_experts: int, intermediate: int, routing: Routing, shared: nn.Module | None,
                 shared_gate: bool, dtype: torch.dtype, device: torch.device,
                 activation: ExpertActivation = SILU, latent: int | None = None,
                 correction_bias: bool = False, latent_bias: bool = False, biases: bool = False) -> None:
        super().__init__()
        width = latent or hidden
        self.hidden, self.width, self.num_experts, self.inter = hidden, width, num_experts, intermediate
        self.routing, self.activation = routing, activation
        self.router = Linear(hidden, num_experts, bias=biases, dtype=dtype, device=device)
        self.router.quantizable = False
        self.router.keeps_plain = True  # DecodeModel's MoE blocks read it (``fits_decode_kernel``)
        self.correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device)) \
            if correction_bias else None
        self.latent_in = Linear(hidden, width, bias=latent_bias, dtype=dtype, device=device) if latent else None
        self.latent_out = Linear(width, hidden, bias=latent_bias, dtype=dtype, device=device) if latent else None
        self.experts_gate_up = Experts(num_experts, (1 if self.ungated else 2) * intermediate, width, dtype, device,
                                       biases)
        self.experts_down = Experts(num_experts, width, intermediate, dtype, device, biases)
        self.shared = shared
        self.shared_gate = Linear(hidden, 1, bias=False, dtype=dtype, device=device) if shared and shared_gate else None

    @classmethod
    def from_config(cls, cfg, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        """Qwen's config fields (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): ``num_experts``,
        ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, and a gated
        shared expert of ``shared_expert_intermediate_size`` where that is set."""
        routing = Routing(cfg.num_experts_per_tok, bool(getattr(cfg, "norm_topk_prob", True)))
        width = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        shared = GatedMLP(cfg.hidden_size, width, False, dtype, device) if width else None
        return cls(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, routing, shared, True, dtype, device)

    @property
    def ungated(self) -> bool:
        """Whether the experts have no gate projection (ReLU^2: gate_up holds the up rows alone)."""
        return self.activation.name == "relu2"

    def fits_decode_kernel(self) -> bool:
        """Whether ``hyprefix::DecodeModel`` can run this block (``kernels/decode_moe.h``): softmax
        over every expert, top-k, renormalised or not, unscaled; a float32 router without a bias;
        SiLU experts without biases, both stacks in tiles of one part with whole tiles an expert;
        no shared expert, latent projections or correction bias."""
        routing, up, down = self.routing, self.experts_gate_up, self.experts_down
        quant = [stack.forms.quant for stack in (up, down)]
        return (routing.scoring == "softmax" and not routing.softmax_after_topk and routing.groups == 1
                and routing.scale == 1.0 and self.activation.name == "silu" and self.shared is None
                and self.latent_in is None and self.correction_bias is None and self.router.bias is None
                and self.router.weight.dtype == torch.float32
                and self.router.weight.shape == (self.num_experts, self.hidden)
                and up.bias is None and down.bias is None and up.rows % 32 == 0 and down.rows % 16 == 0
                and all(q is not None and len(q.tensors) == 3 for q in quant))

    def active_expert_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of expert weights one token reads (``CausalLM.decode_weight_bytes``): top-k of
        the stacks, as stored; the router, shared expert and latent projections are linears,
        counted as such."""
        stacks = self.experts_gate_up.forms.decode_bytes(dtype) + self.experts_down.forms.decode_bytes(dtype)
        return stacks * min(self.routing.top_k, self.num_experts) // self.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.routing(self.router(x), x.dtype, self.correction_bias)
        h = x if self.latent_in is None else self.latent_in(x)
        out = moe_forward(h, chosen, weights, self.experts_gate_up, self.experts_down, self.activation)
        if self.latent_out is not None:
            out = self.latent_out(out)
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
    return map_expert(prefix, moe, rest)


def map_expert(prefix: str, moe: SparseMoE, rest: str) -> Target:
    """One expert's projection, ``experts.{e}.{gate,up,down}_proj.weight``, onto its rows of the
    stacks (``up_proj`` alone fills an ungated expert's gate_up rows)."""
    _, e, proj, _ = rest.split(".")
    e, n = int(e), moe.num_experts
    if proj == "down_proj":
        return f"{prefix}.experts_down.weight", e, [moe.width] * n
    if moe.ungated:
        return f"{prefix}.experts_gate_up.weight", e, [moe.inter] * n
    return f"{prefix}.experts_gate_up.weight", 2 * e + (proj == "up_proj"), [moe.inter] * (2 * n)
