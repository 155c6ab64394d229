"""LFM2 (Liquid AI, ``Lfm2ForCausalLM``): a hybrid of gated short convolutions and attention.

Each layer is ``operator_norm -> mixer`` then ``ffn_norm -> SwiGLU MLP``, the mixer a short
convolution block or grouped-query attention with QK-norm and RoPE, chosen by ``layer_types``
("conv" / "full_attention"); the final norm is ``embedding_norm``; the LM head is tied.

The short convolution: ``B, C, x = in_proj(h)`` (thirds of its output), a causal depthwise conv
of ``B * x`` over the last ``conv_L_cache`` tokens, times ``C``, then ``out_proj``. Its recurrent
state is that conv window alone (the last ``conv_L_cache - 1`` inputs, ``LayerStateShape`` with
an empty matrix state), so a prompt's state is checkpointed and restored as Mamba's is and the
prefix cache hits on it like on a dense model's.
"""

from __future__ import annotations

import torch
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.models.base import CausalLM, KVLayout, Target, select_rows
from hyprefix.models.fused import Kernels
from hyprefix.models.layers import GatedMLP, Linear, RMSNorm, RopeTables
from hyprefix.models.llama import Attention, map_attention_or_mlp
from hyprefix.models.recurrent_state import (
    LayerStateShape,
    RecurrentLayerState,
    StateLayout,
    conv_decode,
    conv_prefill,
)

CONV, FULL = "conv", "full_attention"
# HF names of a layer's modules -> ours (``map_layer``); the rest are mapped as Llama's.
_RENAMED = {"operator_norm": "input_norm", "ffn_norm": "post_norm", "conv.conv": "mixer.conv",
            "conv.in_proj": "mixer.in_proj", "conv.out_proj": "mixer.out_proj"}
_MLP = {"feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}


class ShortConv(nn.Module):
    """LFM2's gated short convolution over one conv window of state per sequence (module doc)."""

    def __init__(self, hidden: int, kernel: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.hidden, self.kernel = hidden, kernel
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias, dtype=dtype, device=device)
        self.conv = nn.Module()  # HF's ``conv.conv`` (an nn.Conv1d): its weight [hidden, 1, kernel], bias
        self.conv.weight = nn.Parameter(torch.empty(hidden, 1, kernel, dtype=dtype, device=device))
        self.conv.bias = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device)) if bias else None
        self.out_proj = Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)

    @property
    def state_shape(self) -> LayerStateShape:
        return LayerStateShape(self.hidden, self.kernel - 1, (0,))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        bx = b * v
        out = torch.empty_like(bx)
        weight, bias = self.conv.weight, self.conv.bias
        n_dec = batch.num_decode
        if n_dec:
            slots = batch.decode_state_slots
            assert slots is not None
            out[:n_dec], windows = conv_decode(state, slots, bx[:n_dec], weight, bias)
            for row, ckpt in batch.decode_state_taps:
                state.tap(ckpt, windows[row], state.matrix[int(slots[row])])
        k1 = self.kernel - 1
        for span in batch.prefills:
            sl = span.token_slice
            out[sl], inputs = conv_prefill(state, span.state_slot, bx[sl], weight, bias)
            for offset, ckpt in span.state_taps:
                state.tap(ckpt, inputs[:, offset:offset + k1], state.matrix[span.state_slot])
        return self.out_proj(c * out)


class Lfm2Layer(nn.Module):
    def __init__(self, cfg, idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.norm_eps
        self.kind = cfg.layer_types[idx]
        self.input_norm = RMSNorm(hidden, eps, dtype, device)
        if self.kind == CONV:
            self.mixer: nn.Module = ShortConv(hidden, cfg.conv_L_cache, bool(cfg.conv_bias), dtype, device)
        elif self.kind == FULL:
            self.mixer = Attention(cfg, idx, dtype, device, qk_norm=True, qkv_bias=False, o_bias=False)
            self.mixer.qk_norm_eps = eps
        else:
            raise ValueError(f"LFM2 layer {idx} has the type {self.kind!r}; supported: {CONV!r}, {FULL!r}")
        self.post_norm = RMSNorm(hidden, eps, dtype, device)
        self.mlp = GatedMLP(hidden, mlp_size(cfg), False, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rope: RopeTables,
                cache, kernels: Kernels, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache``: the layer's recurrent state (conv) or its (K, V) cache (attention)."""
        h, residual = self.input_norm.add_forward(x, residual, kernels)
        h = self.mixer(h, batch, cache) if self.kind == CONV else self.mixer(h, batch, rope, cache, kernels)
        h, residual = self.post_norm.add_forward(*select_rows(h, residual, rows), kernels)
        return self.mlp(h), residual


def mlp_size(cfg) -> int:
    """The MLP's width as transformers computes it (``block_auto_adjust_ff_dim``: two thirds,
    times ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``)."""
    size = cfg.intermediate_size
    if getattr(cfg, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            size = int(cfg.block_ffn_dim_multiplier * size)
            size = cfg.block_multiple_of * ((size + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    return size


class Lfm2ForCausalLM(CausalLM):
    selects_output_rows = True

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config
        self.layers = nn.ModuleList(Lfm2Layer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        attns = [layer.mixer for layer in self.layers if layer.kind == FULL]
        convs = [layer.mixer for layer in self.layers if layer.kind == CONV]
        if not attns:
            raise ValueError("LFM2 config has no full_attention layer")
        self.kv_layout = KVLayout(len(attns), attns[0].num_kv_heads, attns[0].head_dim)
        self.state_layout = StateLayout(tuple(conv.state_shape for conv in convs)) if convs else None
        self._init_head(cfg, dtype, device, max_positions, cfg.norm_eps, attns[0].head_dim)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states: list[RecurrentLayerState] | None = None) -> torch.Tensor:
        return self._mixed_layers(batch, kv_caches, states, CONV)

    def map_name(self, name: str) -> Target | None:
        head = self.map_head(self.relative_name(name), "embed_tokens.weight", "embedding_norm.weight")
        return head if head is not None or name.endswith("lm_head.weight") else super().map_name(name)

    def map_layer(self, idx: int, rest: str) -> Target:
        module, leaf = rest.rsplit(".", 1)
        prefix, layer = f"layers.{idx}", self.layers[idx]
        if module in _RENAMED:
            return f"{prefix}.{_RENAMED[module]}.{leaf}", None, None
        if module in _MLP:
            return map_attention_or_mlp(prefix, f"{_MLP[module]}.{leaf}", None, layer.mlp.intermediate)
        if module == "self_attn.out_proj":
            return f"{prefix}.mixer.o_proj.{leaf}", None, None
        if module in ("self_attn.q_layernorm", "self_attn.k_layernorm"):
            attn = layer.mixer
            return (f"{prefix}.mixer.qk_norm_weight", int(module == "self_attn.k_layernorm"),
                    [attn.num_heads, attn.num_kv_heads])
        return map_attention_or_mlp(prefix, rest, layer.mixer, layer.mlp.intermediate, attn_module="mixer")
