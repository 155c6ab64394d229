"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.models import fused
from hyprefix.models.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    Rotary,
    mkldnn_packing_available,
    pack_weight,
    packed_linear,
    paged_attention,
)
from hyprefix.runner.batch import ForwardBatch


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's K (or V) cache per token, for pool sizing."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def rope_tables(hf_config, max_positions: int, dtype: torch.dtype, device: torch.device,
                head_dim: int) -> Rotary:
    """Rotary tables from the checkpoint's RoPE parameters via transformers' own init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' (length-dependent NTK scaling) is not supported")
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device=torch.device("cpu"))
    return Rotary(inv_freq, scaling, max_positions, dtype, device)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 qk_norm: bool, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.window = _layer_window(cfg, layer_idx)
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias,
                             dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias, dtype=dtype, device=device)
        # QK-norm (Qwen3): one weight row per q head then per k head, filled at load.
        self.qk_norm_eps = cfg.rms_norm_eps
        self.qk_norm_weight = nn.Parameter(torch.ones(
            self.num_heads + self.num_kv_heads, self.head_dim, dtype=dtype, device=device)) if qk_norm else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary: Rotary,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(x)
        # q and k are adjacent columns of qkv: normalise and rotate them in one pass.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        cos, sin = rotary.tables(batch)
        qk = batch.kernels.qk_norm_rope(qk, self.qk_norm_weight, cos, sin, self.qk_norm_eps, rotary.rotary_dim)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale, self.window)
        return self.o_proj(out.reshape(t, self.q_size))


def _layer_window(cfg, layer_idx: int) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device, **attn_kw) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.attn = Attention(cfg, layer_idx, dtype, device, **attn_kw)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False),
                            dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rotary: Rotary,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream); their sum is the hidden state."""
        if residual is None:
            h, residual = self.input_norm(x, batch), x
        else:
            h, residual = self.input_norm.add_forward(x, residual, batch)
        h = self.attn(h, batch, rotary, kv_cache)
        h, residual = self.post_norm.add_forward(h, residual, batch)
        return self.mlp(h), residual


# HF parameter suffix -> (our fused parameter, shard index)
_FUSED = {
    "self_attn.q_proj": ("attn.qkv", 0),
    "self_attn.k_proj": ("attn.qkv", 1),
    "self_attn.v_proj": ("attn.qkv", 2),
    "mlp.gate_proj": ("mlp.gate_up", 0),
    "mlp.up_proj": ("mlp.gate_up", 1),
}
_RENAMED = {
    "self_attn.o_proj": "attn.o_proj",
    "mlp.down_proj": "mlp.down",
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_norm",
}


class LlamaForCausalLM(nn.Module):
    """Covers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

    Differences are read from the config: QK-norm (Qwen3), q/k/v bias (Qwen2,
    ``attention_bias``), sliding windows (Mistral, ``layer_types``), RoPE scaling,
    tied embeddings.
    """

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config
        arch = (getattr(cfg, "architectures", None) or [""])[0]
        model_type = getattr(cfg, "model_type", "")
        qk_norm = model_type.startswith("qwen3") or arch.startswith("Qwen3")
        qwen2 = model_type == "qwen2" or arch.startswith("Qwen2")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        attn_kw = {"qk_norm": qk_norm, "qkv_bias": qwen2 or attention_bias, "o_bias": attention_bias}
        self.config = cfg
        self.dtype = dtype
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, device, **attn_kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie else Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        head_dim = self.layers[0].attn.head_dim
        self.max_positions = max_positions
        self.rotary = rope_tables(cfg, max_positions, dtype, device, head_dim)
        self.kv_layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
        self.requires_grad_(False)

    def materialize(self, device: torch.device) -> None:
        """After construction on the meta device: allocate parameters (uninitialised;
        ``load_weights`` fills every one) and compute the rotary tables."""
        self.to_empty(device=device)
        self.rotary = rope_tables(self.config, self.max_positions, self.dtype, device, self.kv_layout.head_dim)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x, residual = self.embed(batch.input_ids), None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, batch, self.rotary, kv)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head for the selected hidden states; float32 logits."""
        hidden = fused.rms_norm(hidden, self.norm.weight, self.norm.eps)
        if self._packed_head is not None:
            return packed_linear(hidden, self._packed_head, None).float()
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    _packed_head: torch.Tensor | None = None

    def pack_weights(self) -> None:
        """Switch linears to prepacked oneDNN weights where that is faster (CPU bf16).
        A tied LM head gets its own packed copy; the embedding keeps the plain one."""
        for module in list(self.modules()):  # pre-order: an MLP packs before its gate_up child
            if isinstance(module, Linear | GatedMLP):
                module.pack()
        if self.lm_head is None and mkldnn_packing_available(self.embed.weight):
            self._packed_head = pack_weight(self.embed.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard = self._map_name(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model ({target!r})")
            param = params[target]
            if shard is None:
                _copy(param.data, tensor, name)
            else:
                sizes = self._shard_sizes(target)
                offset = sum(sizes[:shard])
                _copy(param.data.narrow(0, offset, sizes[shard]), tensor, name)
            loaded.add(f"{target}#{shard}")
        missing = [n for n in params if not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {missing[:8]}")

    def _map_name(self, name: str) -> tuple[str | None, int | None]:
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "embed_tokens.weight":
            return "embed.weight", None
        if name == "norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return (None, None) if self.tie else ("lm_head.weight", None)
        if "rotary_emb" in name:
            return None, None
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            module, leaf = rest.rsplit(".", 1)
            if module in ("self_attn.q_norm", "self_attn.k_norm"):
                return f"layers.{idx}.attn.qk_norm_weight", int(module == "self_attn.k_norm")
            if module in _FUSED:
                fused, shard = _FUSED[module]
                return f"layers.{idx}.{fused}.{leaf}", shard
            if module in _RENAMED:
                return f"layers.{idx}.{_RENAMED[module]}.{leaf}", None
        return name, None

    def _shard_sizes(self, target: str) -> list[int]:
        attn = self.layers[0].attn
        if target.endswith("qk_norm_weight"):
            return [attn.num_heads, attn.num_kv_heads]
        if ".attn.qkv." in target:
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.dim() == 2 and src.dim() == 1 and dst.shape[1] == src.shape[0]:
        src = src.expand_as(dst)  # one per-head norm weight repeated for every head
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src.to(dtype=dst.dtype))
