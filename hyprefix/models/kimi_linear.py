"""Kimi-Linear (``KimiLinearForCausalLM``, transformers model type ``kimi_linear``): a hybrid of
Kimi Delta Attention layers (``linear_attention``, ``kimi_delta.py``) and multi-head latent
attention layers (``full_attention``), with dense or MoE feed-forward parts.

Each layer is ``norm -> mixer -> norm -> MLP`` with residuals. The MLA layers are DeepSeek's
(``deepseek.LatentAttention``: absorbed attention over a latent cache, one latent a token and
layer) without rotary embeddings: the shared key part is used unrotated (``rope=None``), and the
softmax scale is (nope + rope head dims)^-0.5; their ``q_a`` / ``kv_a`` norms use transformers'
default epsilon, 1e-6, as its Kimi attention does. The KDA layers keep a conv window and a
[heads, dim, dim] state per sequence, checkpointed at block boundaries like Gated DeltaNet's, so
the prefix cache hits on Kimi-Linear as on a dense model. The MLP is a gated SiLU MLP
(``mlp_layer_types`` "dense") or a sparse MoE block ("sparse": sigmoid scores with a correction
bias, chosen within the best expert groups, renormalised, times ``routed_scaling_factor``, plus
shared experts of ``moe_intermediate_size * num_shared_experts``).

Checkpoints come as the hub writes them (``block_sparse_moe``, per-expert ``w1``/``w2``/``w3``,
``q_conv1d``/``k_conv1d``/``v_conv1d``, ``A_log`` [1, 1, heads, 1]; transformers 5 saves this
form too) or under transformers' own module names (``mlp``, fused expert stacks, ``conv1d``,
``forget_gate.*``); ``converted`` takes both. Variants this module does not implement (another
activation, softmax routing, rotary MLA) are refused at load with the field named.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.models.base import CausalLM, KVLayout, Target, last_layer_rows, select_rows
from hyprefix.models.deepseek import LatentAttention, absorb_stacks, map_latent_attention, map_shared_moe
from hyprefix.models.fused import Kernels
from hyprefix.models.kimi_delta import KdaDims, KimiDeltaAttention
from hyprefix.models.layers import GatedMLP, RMSNorm
from hyprefix.models.moe import Routing, SparseMoE, map_gated_mlp
from hyprefix.models.recurrent_state import RecurrentLayerState, StateLayout

LINEAR, FULL = "linear_attention", "full_attention"
MLA_NORM_EPS = 1e-6  # transformers' KimiLinearRMSNorm default, which its q_a / kv_a norms keep
# HF names inside a KDA layer's ``self_attn`` -> (our parameter, shard of it or None)
_KDA_PARTS = {"q_proj.weight": ("in_proj.weight", 0), "k_proj.weight": ("in_proj.weight", 1),
              "v_proj.weight": ("in_proj.weight", 2), "f_a_proj.weight": ("in_proj.weight", 3),
              "g_a_proj.weight": ("in_proj.weight", 4), "b_proj.weight": ("in_proj.weight", 5),
              "q_conv1d.weight": ("conv1d_weight", 0), "k_conv1d.weight": ("conv1d_weight", 1),
              "v_conv1d.weight": ("conv1d_weight", 2), "conv1d.weight": ("conv1d_weight", None),
              "f_b_proj.weight": ("f_b.weight", None), "g_b_proj.weight": ("g_b.weight", None),
              "A_log": ("A_log", None), "dt_bias": ("dt_bias", None), "o_norm.weight": ("norm_weight", None),
              "o_proj.weight": ("o_proj.weight", None)}
_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def check_config(cfg) -> None:
    """Refuse what this module does not implement, naming the config field."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Kimi-Linear config sets hidden_act={act!r}: only silu is supported")
    scoring = getattr(cfg, "moe_router_activation_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"Kimi-Linear config sets moe_router_activation_func={scoring!r}: only sigmoid routing "
                         "is supported (transformers' Kimi-Linear router)")
    if not getattr(cfg, "mla_use_nope", True):
        raise ValueError("Kimi-Linear config sets mla_use_nope=false (rotary MLA): only NoPE MLA is supported")
    kinds = set(cfg.layer_types) - {LINEAR, FULL}
    if kinds:
        raise ValueError(f"Kimi-Linear layer_types holds {sorted(kinds)}: supported are {LINEAR!r}, {FULL!r}")
    mlps = set(cfg.mlp_layer_types) - {"dense", "sparse"}
    if mlps:
        raise ValueError(f"Kimi-Linear mlp_layer_types holds {sorted(mlps)}: supported are 'dense', 'sparse'")
    if FULL not in cfg.layer_types:
        raise ValueError("a Kimi-Linear config needs at least one full_attention (MLA) layer")


def kimi_mla(cfg, dtype: torch.dtype, device: torch.device) -> LatentAttention:
    """DeepSeek's latent attention with Kimi's scale and norm epsilon (module docstring)."""
    attn = LatentAttention(cfg, dtype, device)
    attn.scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    attn.kv_a_norm.eps = MLA_NORM_EPS
    if attn.q_lora:
        attn.q_a_norm.eps = MLA_NORM_EPS
    return attn


def kimi_moe(cfg, dtype: torch.dtype, device: torch.device) -> SparseMoE:
    routing = Routing(cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), scoring="sigmoid",
                      groups=cfg.n_group or 1, groups_kept=cfg.topk_group or 1, scale=cfg.routed_scaling_factor)
    width = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
    shared = GatedMLP(cfg.hidden_size, width, False, dtype, device) if width else None
    return SparseMoE(cfg.hidden_size, cfg.num_local_experts, cfg.moe_intermediate_size, routing, shared, False,
                     dtype, device, correction_bias=True)


class KimiLinearLayer(nn.Module):
    def __init__(self, cfg, i: int, dims: KdaDims, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mixer: nn.Module = (KimiDeltaAttention(dims, dtype, device) if self.kind == LINEAR
                                 else kimi_mla(cfg, dtype, device))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: nn.Module = (kimi_moe(cfg, dtype, device) if cfg.mlp_layer_types[i] == "sparse"
                               else GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache,
                kernels: Kernels, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache``: the layer's recurrent state (KDA) or its latent cache (MLA). Returns (this
        layer's output, residual stream) at ``rows`` (None: all); their sum is the hidden state."""
        h, residual = self.input_norm.add_forward(x, residual, kernels)
        if self.kind == LINEAR:
            h, residual = select_rows(self.mixer(h, batch, cache), residual, rows)
        else:
            h = self.mixer(h, batch, None, cache, kernels, rows)
            residual = residual if rows is None else residual[rows]
        h, residual = self.post_norm.add_forward(h, residual, kernels)
        return self.mlp(h), residual


class KimiLinearForCausalLM(CausalLM):
    """KimiLinearForCausalLM (module docstring)."""

    selects_output_rows = True

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config
        check_config(cfg)
        dims = self._dims = KdaDims.from_config(cfg)
        self.layers = nn.ModuleList(KimiLinearLayer(cfg, i, dims, dtype, device) for i in range(cfg.num_hidden_layers))
        mlas = [layer.mixer for layer in self.layers if layer.kind == FULL]
        kdas = [layer for layer in self.layers if layer.kind == LINEAR]
        self.kv_layout = KVLayout(len(mlas), 1, mlas[0].latent_dim, latent=True,
                                  rotation_blocks=(mlas[0].rank, mlas[0].rope_dim))
        self.state_layout = StateLayout(tuple(dims.state_shape for _ in kdas)) if kdas else None
        self._init_head(cfg, dtype, device, max_positions, cfg.rms_norm_eps, None)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states: list[RecurrentLayerState] | None = None) -> torch.Tensor:
        x, residual = self.embed(batch.input_ids), None
        kv_iter, state_iter = iter(kv_caches), iter(states or [])
        for layer, rows in zip(self.layers, last_layer_rows(batch, len(self.layers)), strict=True):
            cache = next(state_iter) if layer.kind == LINEAR else next(kv_iter)
            x, residual = layer(x, residual, batch, cache, self.kernels, rows)
        return x + residual

    # ------------------------------------------------------------------ loading
    def converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under one naming (module docstring): ``mlp.`` for ``block_sparse_moe.``,
        ``gate_proj`` / ``down_proj`` / ``up_proj`` for an expert's ``w1`` / ``w2`` / ``w3``, the
        forget gate's tensors directly under ``self_attn``, ``A_log`` flat, conv kernels 3-D, and
        ``kv_b_proj`` split into the per-head W_UK and W_UV the absorbed attention multiplies."""
        mla = next(layer.mixer for layer in self.layers if layer.kind == FULL)
        for name, t in super().converted(weights):
            name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
            if ".mlp.experts." in name:
                parts = name.split(".")
                if len(parts) > 2 and parts[-2] in _EXPERT_PROJ:
                    name = ".".join([*parts[:-2], _EXPERT_PROJ[parts[-2]], parts[-1]])
            if name.endswith("self_attn.A_log"):
                t = t.reshape(-1)
            elif name.endswith("conv1d.weight") and t.dim() == 2:  # [channels, kernel], as vLLM keeps it
                t = t.unsqueeze(1)
            yield from absorb_stacks(name, t, mla)

    def map_layer(self, idx: int, rest: str) -> Target:
        prefix, layer = f"layers.{idx}", self.layers[idx]
        if rest.startswith(("input_layernorm.", "post_attention_layernorm.")):
            norm = "input_norm" if rest.startswith("input_layernorm.") else "post_norm"
            return f"{prefix}.{norm}.{rest.rsplit('.', 1)[1]}", None, None
        if rest.startswith("self_attn."):
            inner = rest.removeprefix("self_attn.")
            if layer.kind == LINEAR:
                return self._map_kda(prefix, inner)
            return map_latent_attention(f"{prefix}.mixer", inner)
        if rest.startswith("mlp."):
            inner, mlp = rest.removeprefix("mlp."), layer.mlp
            if isinstance(mlp, GatedMLP):
                return map_gated_mlp(f"{prefix}.mlp", mlp, inner)
            return map_shared_moe(f"{prefix}.mlp", mlp, inner)
        return f"{prefix}.{rest}", None, None

    def _map_kda(self, prefix: str, inner: str) -> Target:
        if inner not in _KDA_PARTS:
            return f"{prefix}.mixer.{inner}", None, None  # no such parameter: load_weights names it
        ours, shard = _KDA_PARTS[inner]
        if shard is None:
            return f"{prefix}.mixer.{ours}", None, None
        d = self._dims
        sizes = d.proj_sizes if ours == "in_proj.weight" else [d.qkv_dim] * 3
        return f"{prefix}.mixer.{ours}", shard, sizes
