"""Gemma 3 text decoder over a paged KV cache: ``Gemma3ForCausalLM``, and the language
model of a ``Gemma3ForConditionalGeneration`` checkpoint (its vision tower is skipped).

Against Llama: embeddings scaled by sqrt(hidden); Gemma RMSNorm ``norm(x) * (1 + w)``
(``1 + w`` is stored at load, so the shared kernels apply) with four norms per layer
(sandwiching attention and MLP); QK-norm; attention scaled by
``query_pre_attn_scalar ** -0.5``; sliding and full layers by ``layer_types``, each
type with its own RoPE; tanh-GELU gated MLP; tied LM head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.models.base import CausalLM, KVLayout, Target, language_model_name, rope_tables
from hyprefix.models.fused import Kernels
from hyprefix.models.layers import GatedMLP, RMSNorm, RopeTables
from hyprefix.models.llama import Attention, map_attention_or_mlp

FULL = "full_attention"
# HF layer names that ours do not share with Llama (map_attention_or_mlp renames the rest).
_RENAMED = {"pre_feedforward_layernorm": "pre_ff_norm", "post_feedforward_layernorm": "post_ff_norm"}


class _RopeView:
    """The config as one layer type's RoPE sees it: ``rope_parameters`` is that type's
    dict (transformers 5 nests Gemma 3's by layer type); the rest is the config's."""

    def __init__(self, cfg, params: dict) -> None:
        self._cfg = cfg
        self.rope_parameters = params

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)

    def standardize_rope_params(self) -> None:  # transformers' RoPE init calls it; ours is final
        pass


def _check_supported(cfg) -> None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            raise ValueError(f"Gemma 3 config sets {name}={getattr(cfg, name)}: softcapping is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 config sets use_bidirectional_attention: only causal attention is supported")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        bias = bool(getattr(cfg, "attention_bias", False))
        self.layer_type = cfg.layer_types[layer_idx]
        self.input_norm = RMSNorm(hidden, eps, dtype, device)
        self.attn = Attention(cfg, layer_idx, dtype, device, qk_norm=True, qkv_bias=bias, o_bias=bias)
        self.attn.scale = cfg.query_pre_attn_scalar ** -0.5
        self.post_norm = RMSNorm(hidden, eps, dtype, device)
        self.pre_ff_norm = RMSNorm(hidden, eps, dtype, device)
        activation = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, False, dtype, device, activation=activation)
        self.post_ff_norm = RMSNorm(hidden, eps, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rope: RopeTables,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream); their sum is the hidden state."""
        h, residual = self.input_norm.add_forward(x, residual, kernels)
        h = self.post_norm(self.attn(h, batch, rope, kv_cache, kernels), kernels)
        h, residual = self.pre_ff_norm.add_forward(h, residual, kernels)
        return self.post_ff_norm(self.mlp(h), kernels), residual


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text models; ``hf_config`` is a Gemma3TextConfig or a Gemma3Config (whose
    ``text_config`` is used). Softcapping and bidirectional attention are refused."""

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config.get_text_config()
        _check_supported(cfg)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        attn = self.layers[0].attn
        self.kv_layout = KVLayout(cfg.num_hidden_layers, attn.num_kv_heads, attn.head_dim,
                                  tuple(layer.attn.window for layer in self.layers))
        # HF multiplies by the scale cast to the weight dtype (sqrt(640) -> 25.25 in bf16).
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype))
        self._init_head(cfg, dtype, device, max_positions, cfg.rms_norm_eps, rotary_head_dim=None)
        self.rotaries = self._rotaries(device)

    def _rotaries(self, device: torch.device) -> nn.ModuleDict:
        """One RoPE table per layer type (sliding layers use a smaller base)."""
        cfg, params = self.config, self.config.rope_parameters
        head_dim = self.layers[0].attn.head_dim
        return nn.ModuleDict({
            t: rope_tables(_RopeView(cfg, params.get(t) or params.get(FULL) or params), self.max_positions,
                           self.dtype, device, head_dim)
            for t in sorted({layer.layer_type for layer in self.layers})})

    def materialize(self, device: torch.device) -> None:
        super().materialize(device)
        self.rotaries = self._rotaries(device)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states=None) -> torch.Tensor:
        x, residual = self.embed(batch.input_ids) * self.embed_scale, None
        ropes = {t: rotary.tables(batch.positions) for t, rotary in self.rotaries.items()}
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, batch, ropes[layer.layer_type], kv, self.kernels)
        return x + residual

    def converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Gemma norms scale by ``1 + w``: stored so (in float32, as HF adds it)."""
        return ((name, t.float() + 1 if name.endswith("norm.weight") else t) for name, t in weights)

    def relative_name(self, name: str) -> str | None:
        return language_model_name(name)

    def map_layer(self, idx: int, rest: str) -> Target:
        module, leaf = rest.rsplit(".", 1)
        if module in _RENAMED:
            return f"layers.{idx}.{_RENAMED[module]}.{leaf}", None, None
        return map_attention_or_mlp(f"layers.{idx}", rest, self.layers[0].attn, self.config.intermediate_size)

