"""Hybrid Transformer-Mamba2 models: NemotronH, Bamba and pure Mamba2.

All three are a stack of pre-norm residual sub-layers whose mixer is a Mamba2
mixer, an attention layer (paged KV cache) or an MLP:

- NemotronH: one mixer per layer, chosen by ``layers_block_type`` (mamba,
  attention without positional encoding, ReLU^2 MLP).
- Bamba: every layer is (Mamba2 or attention with partial rotary) then a gated
  SiLU MLP.
- Mamba2: every layer is a Mamba2 mixer; the residual stream stays in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.models.base import CausalLM, KVLayout, Target, strip_prefix
from hyprefix.models.layers import GatedMLP, Linear, RMSNorm
from hyprefix.models.llama import Attention, map_attention_or_mlp
from hyprefix.models.mamba2 import Mamba2Mixer, MambaDims
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


def _flavour(cfg) -> str:
    model_type = getattr(cfg, "model_type", "")
    if model_type in ("nemotron_h", "bamba", "mamba2"):
        return model_type
    raise ValueError(f"not a supported hybrid model type: {model_type!r}")


def _mamba_dims(cfg, flavour: str) -> MambaDims:
    if flavour == "nemotron_h":
        return MambaDims(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size,
                         cfg.conv_kernel, cfg.chunk_size, cfg.layer_norm_epsilon, cfg.time_step_min, float("inf"),
                         cfg.use_bias, cfg.use_conv_bias)
    if flavour == "bamba":
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
        eps = cfg.rms_norm_eps if self.flavour == "bamba" else cfg.layer_norm_epsilon
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
            elif kind == "mlp":
                mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)
            else:
                raise ValueError(f"unsupported hybrid layer type {kind!r} (layer {i})")
            ff_norm = ff = None
            if self.flavour == "bamba":
                ff_norm = RMSNorm(cfg.hidden_size, eps, dtype, device)
                ff = GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False), dtype, device)
            blocks.append(HybridBlock(kind, norm, mixer, ff_norm, ff))
        self.blocks = nn.ModuleList(blocks)
        attns = [b.mixer for b in blocks if b.kind == "full_attention"]
        mambas = [b.mixer for b in blocks if b.kind == "linear_attention"]
        head_dim = attns[0].head_dim if attns else 1
        self.kv_layout = KVLayout(len(attns), attns[0].num_kv_heads if attns else 1, head_dim)
        self.state_layout = StateLayout(tuple(dims.state_shape for _ in mambas)) if mambas else None
        self._init_head(cfg, dtype, device, max_positions, eps,
                        head_dim if attns and self.flavour == "bamba" else None,
                        can_tie=self.flavour != "nemotron_h")

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states: list[RecurrentLayerState] | None = None) -> torch.Tensor:
        kernels = self.kernels
        rope = self.rotary.tables(batch.positions) if self.rotary is not None else None
        residual = self.embed(batch.input_ids)
        if self.residual_in_fp32:
            residual = residual.float()
        kv_iter, state_iter = iter(kv_caches), iter(states or [])
        for block in self.blocks:
            h = block.norm(residual.to(self.dtype), kernels)
            if block.kind == "linear_attention":
                h = block.mixer(h, batch, next(state_iter))
            elif block.kind == "full_attention":
                h = block.mixer(h, batch, rope, next(kv_iter), kernels)
            else:
                h = block.mixer(h)
            residual = residual + h.to(residual.dtype)
            if block.ff is not None:
                residual = residual + block.ff(block.ff_norm(residual, kernels)).to(residual.dtype)
        return residual

    def map_name(self, name: str) -> Target | None:
        name = strip_prefix(name)
        embed = "embed_tokens.weight" if self.flavour == "bamba" else "embeddings.weight"
        final = "final_layernorm.weight" if self.flavour == "bamba" else "norm_f.weight"
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
        if module == "pre_ff_layernorm":
            return f"{prefix}.ff_norm.{leaf}", None, None
        if module.startswith("feed_forward."):
            return map_attention_or_mlp(prefix, "mlp." + rest[len("feed_forward."):], None,
                                        self.config.intermediate_size, mlp_module="ff")
        _, _, sub = module.partition(".")  # mixer / mamba / self_attn
        if block.kind == "full_attention":
            return map_attention_or_mlp(prefix, f"self_attn.{sub}.{leaf}", block.mixer,
                                        self.config.intermediate_size, attn_module="mixer")
        if block.kind == "mlp":
            return f"{prefix}.mixer.{ {'up_proj': 'up', 'down_proj': 'down'}[sub]}.{leaf}", None, None
        renamed = {"conv1d.weight": "conv1d_weight", "conv1d.bias": "conv1d_bias", "norm.weight": "norm_weight"}
        key = f"{sub}.{leaf}" if sub else leaf
        return f"{prefix}.mixer.{renamed.get(key, key)}", None, None
