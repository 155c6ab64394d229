"""Hybrid Transformer-Mamba2 models: NemotronH, Bamba, Granite 4.0-H and pure Mamba2.

All are a stack of pre-norm residual sub-layers whose mixer is a Mamba2
mixer, an attention layer (paged KV cache) or an MLP:

- NemotronH: one mixer per layer, chosen by ``layers_block_type`` (mamba,
  attention without positional encoding, ReLU^2 MLP, and in Nemotron 3 a MoE block:
  sigmoid routing with a correction bias over expert groups, ungated ReLU^2 experts,
  optionally in a smaller latent width, plus a shared ReLU^2 expert).
- Bamba: every layer is (Mamba2 or attention with partial rotary) then a gated
  SiLU MLP.
- GraniteMoeHybrid (Granite 4.0-H): Bamba's layer with a sparse MoE block (top-k
  logits, softmax over them) plus a shared gated MLP as its feed-forward part (the
  shared MLP alone where ``num_local_experts`` is 0); attention without positional
  encoding (``position_embedding_type`` "nope") or with RoPE; Granite's multipliers
  (embeddings, attention scale, each block's output before the residual add, logits).
- Mamba2: every layer is a Mamba2 mixer; the residual stream stays in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.models.base import CausalLM, KVLayout, Target, strip_prefix
from hyprefix.models.fused_moe import ExpertActivation
from hyprefix.models.layers import GatedMLP, Linear, RMSNorm
from hyprefix.models.llama import Attention, map_attention_or_mlp
from hyprefix.models.mamba2 import Mamba2Mixer, MambaDims
from hyprefix.models.moe import Routing, SparseMoE, map_expert
from hyprefix.models.recurrent_state import RecurrentLayerState, StateLayout


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.up = Linear(hidden, intermediate, bias=bias, dtype=dtype, device=device)
        self.down = Linear(intermediate, hidden, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.square(F.relu(self.up(x))))


class HybridBlock(nn.Module):
    """One HF layer: ``norm -> mixer`` and, for Bamba, ``ff_norm -> ff``."""

    def __init__(self, kind: str, norm: RMSNorm, mixer: nn.Module, ff_norm: RMSNorm | None = None,
                 ff: nn.Module | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.norm, self.mixer = norm, mixer
        self.ff_norm, self.ff = ff_norm, ff


GRANITE = "granitemoehybrid"


def _flavour(cfg) -> str:
    model_type = getattr(cfg, "model_type", "")
    if model_type in ("nemotron_h", "bamba", "mamba2", GRANITE):
        return model_type
    raise ValueError(f"not a supported hybrid model type: {model_type!r}")


def _nemotron_moe(cfg, dtype: torch.dtype, device: torch.device) -> SparseMoE:
    """A Nemotron 3 MoE layer (transformers' ``NemotronHMoE``). Refuses an expert activation
    other than ReLU^2 and a shared-expert count other than one."""
    if cfg.mlp_hidden_act != "relu2" or getattr(cfg, "n_shared_experts", 1) != 1:
        raise ValueError(f"NemotronH MoE with mlp_hidden_act={cfg.mlp_hidden_act!r} and n_shared_experts="
                         f"{getattr(cfg, 'n_shared_experts', 1)}: only relu2 and one shared expert are supported")
    routing = Routing(cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), scoring="sigmoid", groups=cfg.n_group,
                      groups_kept=cfg.topk_group, scale=float(cfg.routed_scaling_factor))
    shared = ReluSquaredMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias, dtype, device)
    return SparseMoE(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, routing, shared, False, dtype,
                     device, activation=ExpertActivation("relu2"), latent=cfg.moe_latent_size, correction_bias=True,
                     latent_bias=cfg.mlp_bias)


def _granite_ff(cfg, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Granite 4.0-H's feed-forward part: experts plus the shared gated MLP, or the shared MLP
    alone in a dense model."""
    if cfg.hidden_act != "silu":
        raise ValueError(f"GraniteMoeHybrid config sets hidden_act={cfg.hidden_act!r}: only silu is supported")
    if not cfg.num_local_experts:
        return GatedMLP(cfg.hidden_size, cfg.shared_intermediate_size, False, dtype, device)
    routing = Routing(cfg.num_experts_per_tok, softmax_after_topk=True)
    shared = GatedMLP(cfg.hidden_size, cfg.shared_intermediate_size, False, dtype, device)
    return SparseMoE(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, routing, shared, False, dtype,
                     device)


def _mamba_dims(cfg, flavour: str) -> MambaDims:
    if flavour == "nemotron_h":
        return MambaDims(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size,
                         cfg.conv_kernel, cfg.chunk_size, cfg.layer_norm_epsilon, cfg.time_step_min, float("inf"),
                         cfg.use_bias, cfg.use_conv_bias)
    if flavour in ("bamba", GRANITE):
        lo, hi = cfg.time_step_limit
        return MambaDims(cfg.hidden_size, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state,
                         cfg.mamba_d_conv, cfg.mamba_chunk_size, cfg.rms_norm_eps, lo, hi, cfg.mamba_proj_bias,
                         cfg.mamba_conv_bias)
    lo, hi = cfg.time_step_limit
    return MambaDims(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size, cfg.conv_kernel,
                     cfg.chunk_size, cfg.layer_norm_epsilon, lo, hi, cfg.use_bias, cfg.use_conv_bias)


class HybridForCausalLM(CausalLM):
    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config
        self.flavour = _flavour(cfg)
        kinds = list(getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
                     or ["linear_attention"] * cfg.num_hidden_layers)
        eps = cfg.rms_norm_eps if self.flavour in ("bamba", GRANITE) else cfg.layer_norm_epsilon
        dims = _mamba_dims(cfg, self.flavour)
        self.residual_in_fp32 = bool(getattr(cfg, "residual_in_fp32", False)) and self.flavour == "mamba2"
        blocks = []
        attn_kw = {"qk_norm": False, "qkv_bias": bool(getattr(cfg, "attention_bias", False)),
                   "o_bias": bool(getattr(cfg, "attention_bias", False))}
        for i, kind in enumerate(kinds):
            norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
            if kind == "linear_attention":
                mixer: nn.Module = Mamba2Mixer(dims, dtype, device)
            elif kind == "full_attention":
                mixer = Attention(cfg, i, dtype, device, **attn_kw)
                if self.flavour == GRANITE:
                    mixer.scale = float(cfg.attention_multiplier)
            elif kind == "mlp":
                mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)
            elif kind == "moe" and self.flavour == "nemotron_h":
                mixer = _nemotron_moe(cfg, dtype, device)
            else:
                raise ValueError(f"unsupported hybrid layer type {kind!r} (layer {i})")
            ff_norm = ff = None
            if self.flavour == "bamba":
                ff_norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
                ff = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False), dtype, device)
            elif self.flavour == GRANITE:
                ff_norm, ff = RMSNorm(cfg.hidden_size, eps, dtype, device), _granite_ff(cfg, dtype, device)
            blocks.append(HybridBlock(kind, norm, mixer, ff_norm, ff))
        self.blocks = nn.ModuleList(blocks)
        attns = [b.mixer for b in blocks if b.kind == "full_attention"]
        mambas = [b.mixer for b in blocks if b.kind == "linear_attention"]
        head_dim = attns[0].head_dim if attns else 1
        self.kv_layout = KVLayout(len(attns), attns[0].num_kv_heads if attns else 1, head_dim)
        self.state_layout = StateLayout(tuple(dims.state_shape for _ in mambas)) if mambas else None
        rotary = self.flavour == "bamba" or (self.flavour == GRANITE and cfg.position_embedding_type == "rope")
        self._init_head(cfg, dtype, device, max_positions, eps, head_dim if attns and rotary else None,
                        can_tie=self.flavour != "nemotron_h")
        granite = self.flavour == GRANITE
        self.embedding_multiplier = float(cfg.embedding_multiplier) if granite else 1.0
        self.residual_multiplier = float(cfg.residual_multiplier) if granite else 1.0
        self.logits_scaling = float(cfg.logits_scaling) if granite else 1.0

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states: list[RecurrentLayerState] | None = None) -> torch.Tensor:
        kernels = self.kernels
        rope = self.rotary.tables(batch.positions) if self.rotary is not None else None
        residual = self.embed(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            residual = residual * self.embedding_multiplier
        if self.residual_in_fp32:
            residual = residual.float()
        scale = self.residual_multiplier
        kv_iter, state_iter = iter(kv_caches), iter(states or [])
        for block in self.blocks:
            h = block.norm(residual.to(self.dtype), kernels)
            if block.kind == "linear_attention":
                h = block.mixer(h, batch, next(state_iter))
            elif block.kind == "full_attention":
                h = block.mixer(h, batch, rope, next(kv_iter), kernels)
            else:
                h = block.mixer(h)
            residual = residual + (h if scale == 1.0 else h * scale).to(residual.dtype)
            if block.ff is not None:
                h = block.ff(block.ff_norm(residual, kernels))
                residual = residual + (h if scale == 1.0 else h * scale).to(residual.dtype)
        return residual

    def map_name(self, name: str) -> Target | None:
        name = strip_prefix(name)
        embed = "embed_tokens.weight" if self.flavour in ("bamba", GRANITE) else "embeddings.weight"
        final = {"bamba": "final_layernorm.weight", GRANITE: "norm.weight"}.get(self.flavour, "norm_f.weight")
        head = self.map_head(name, embed, final)
        if head is not None or name in ("lm_head.weight", embed, final):
            return head
        if not name.startswith("layers."):
            return name, None, None
        _, idx, rest = name.split(".", 2)
        prefix = f"blocks.{idx}"
        block = self.blocks[int(idx)]
        module, leaf = rest.rsplit(".", 1)
        if module in ("norm", "input_layernorm"):
            return f"{prefix}.norm.{leaf}", None, None
        if module in ("pre_ff_layernorm", "post_attention_layernorm"):
            return f"{prefix}.ff_norm.{leaf}", None, None
        if module.startswith(("block_sparse_moe.", "shared_mlp.")):
            return _map_granite_ff(f"{prefix}.ff", block.ff, module, leaf)
        if module.startswith("feed_forward."):
            return map_attention_or_mlp(prefix, "mlp." + rest[len("feed_forward."):], None,
                                        self.config.intermediate_size, mlp_module="ff")
        _, _, sub = module.partition(".")  # mixer / mamba / self_attn
        if block.kind == "full_attention":
            return map_attention_or_mlp(prefix, f"self_attn.{sub}.{leaf}", block.mixer,
                                        self.config.intermediate_size, attn_module="mixer")
        if block.kind == "mlp":
            return f"{prefix}.mixer.{ {'up_proj': 'up', 'down_proj': 'down'}[sub]}.{leaf}", None, None
        if block.kind == "moe":
            return _map_nemotron_moe(f"{prefix}.mixer", block.mixer, rest.split(".", 1)[1])
        renamed = {"conv1d.weight": "conv1d_weight", "conv1d.bias": "conv1d_bias", "norm.weight": "norm_weight"}
        key = f"{sub}.{leaf}" if sub else leaf
        return f"{prefix}.mixer.{renamed.get(key, key)}", None, None


def _map_granite_ff(prefix: str, ff: nn.Module, module: str, leaf: str) -> Target:
    """Granite's MoE block (``block_sparse_moe``: router, experts' stacked ``input_linear``
    [E, 2I, H] gate rows first, ``output_linear``; transformers 5's ``experts.gate_up_proj`` /
    ``down_proj`` too) and shared MLP (``shared_mlp``: ``input_linear`` [2I, H], gate rows first,
    then ``output_linear``) onto ``ff`` (a ``SparseMoE``, or the shared ``GatedMLP`` alone)."""
    owner, _, sub = module.partition(".")
    if owner == "shared_mlp":
        path = f"{prefix}.shared" if isinstance(ff, SparseMoE) else prefix
        return f"{path}.{'gate_up' if sub == 'input_linear' else 'down'}.{leaf}", None, None
    if sub.startswith("router"):
        return f"{prefix}.router.weight", None, None
    gate_up = sub == "input_linear" or leaf == "gate_up_proj"
    return f"{prefix}.experts_{'gate_up' if gate_up else 'down'}.weight", None, None


def _map_nemotron_moe(prefix: str, moe: SparseMoE, rest: str) -> Target:
    """transformers' names inside a NemotronH MoE mixer (``rest`` after ``mixer.``): ``gate.weight``
    and ``gate.e_score_correction_bias``, the experts' ``up_proj`` / ``down_proj`` stacks (or one
    expert's ``experts.{e}.*``), ``shared_experts.*``, ``fc1_latent_proj`` / ``fc2_latent_proj``."""
    module, leaf = rest.rsplit(".", 1)
    if module == "gate":
        return f"{prefix}.{'router.weight' if leaf == 'weight' else 'correction_bias'}", None, None
    if module == "experts":
        return f"{prefix}.experts_{'gate_up' if leaf == 'up_proj' else 'down'}.weight", None, None
    if module.startswith("experts."):
        return map_expert(prefix, moe, rest)
    if module.startswith("shared_experts."):
        return f"{prefix}.shared.{ {'up_proj': 'up', 'down_proj': 'down'}[module.split('.')[1]]}.{leaf}", None, None
    latent = {"fc1_latent_proj": "latent_in", "fc2_latent_proj": "latent_out"}
    return f"{prefix}.{latent.get(module, module)}.{leaf}", None, None
