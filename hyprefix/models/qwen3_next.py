"""Gated-DeltaNet hybrids: Qwen3.5 (dense and MoE; text models and the language model
of their ``ForConditionalGeneration`` checkpoints) and Qwen3-Next.

Each layer is ``norm -> mixer -> norm -> MLP`` with residuals; the mixer is a Gated
DeltaNet (``linear_attention``, ``gated_deltanet.py``) or gated attention
(``full_attention``: output gate, partial rotary, QK-norm) by ``layer_types``; the
MLP is a gated SiLU MLP or a sparse MoE block (router, experts, shared expert with a
sigmoid gate). Norms scale by ``1 + w`` (stored so at load, so the shared kernels
apply), except the DeltaNet's gated output norm. For text, Qwen3.5's multimodal
RoPE (``mrope_section``) reduces to plain RoPE: every section sees the same position.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.models.base import CausalLM, KVLayout, Target, language_model_name, select_rows
from hyprefix.models.fused import Kernels
from hyprefix.models.fused_moe import flat_experts
from hyprefix.models.gated_deltanet import DeltaNetDims, GatedDeltaNet
from hyprefix.models.layers import GatedMLP, RMSNorm, RopeTables
from hyprefix.models.llama import Attention
from hyprefix.models.moe import SparseMoE, is_moe_layer, map_gated_mlp, map_sparse_moe
from hyprefix.models.recurrent_state import RecurrentLayerState, StateLayout

LINEAR, FULL = "linear_attention", "full_attention"


class Qwen3NextLayer(nn.Module):
    def __init__(self, cfg, i: int, dims: DeltaNetDims, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if self.kind == LINEAR:
            self.mixer: nn.Module = GatedDeltaNet(dims, dtype, device)
        elif self.kind == FULL:
            bias = bool(getattr(cfg, "attention_bias", False))
            self.mixer = Attention(cfg, i, dtype, device, qk_norm=True, qkv_bias=bias, o_bias=bias, output_gate=True)
        else:
            raise ValueError(f"unsupported layer type {self.kind!r} (layer {i})")
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp: nn.Module = (SparseMoE.from_config(cfg, dtype, device) if is_moe_layer(cfg, i)
                               else GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, rope: RopeTables,
                cache, kernels: Kernels, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cache``: the layer's (K, V) pool or its recurrent state. Returns (this
        layer's output, residual stream); their sum is the hidden state."""
        h, residual = self.input_norm.add_forward(x, residual, kernels)
        h = self.mixer(h, batch, cache) if self.kind == LINEAR else self.mixer(h, batch, rope, cache, kernels)
        h, residual = self.post_norm.add_forward(*select_rows(h, residual, rows), kernels)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and the language
    model of Qwen3_5(Moe)ForConditionalGeneration (``hf_config.text_config``)."""

    selects_output_rows = True

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config.get_text_config()
        dims = self._dims = DeltaNetDims.from_config(cfg)
        self.layers = nn.ModuleList(Qwen3NextLayer(cfg, i, dims, dtype, device) for i in range(cfg.num_hidden_layers))
        attns = [layer.mixer for layer in self.layers if layer.kind == FULL]
        deltas = [layer for layer in self.layers if layer.kind == LINEAR]
        if not attns:
            raise ValueError("a Qwen3.5 / Qwen3-Next config needs at least one full_attention layer")
        self.kv_layout = KVLayout(len(attns), attns[0].num_kv_heads, attns[0].head_dim)
        self.state_layout = StateLayout(tuple(dims.state_shape for _ in deltas)) if deltas else None
        self._q_shape = (attns[0].num_heads, attns[0].head_dim)  # to split q_proj into query and gate rows
        self._init_head(cfg, dtype, device, max_positions, cfg.rms_norm_eps, attns[0].head_dim)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states: list[RecurrentLayerState] | None = None) -> torch.Tensor:
        return self._mixed_layers(batch, kv_caches, states, LINEAR)

    # ------------------------------------------------------------------ loading
    def converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors -> ours: ``1 + w`` norms; the attention q_proj split into query and
        gate rows; Qwen3-Next's interleaved DeltaNet projections and fused expert tensors
        split into the per-part tensors the names map to."""
        for name, t in weights:
            name = language_model_name(name)
            if name is None:
                continue
            if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
                yield name, t.float() + 1
            elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                heads, head_dim = self._q_shape
                q, gate = t.reshape(heads, 2, head_dim, *t.shape[1:]).unbind(1)
                yield name, q.reshape(heads * head_dim, *t.shape[1:])
                yield name.replace("q_proj", "gate_proj"), gate.reshape(heads * head_dim, *t.shape[1:])
            elif name.endswith("linear_attn.in_proj_qkvz.weight"):
                yield from self._split_qkvz(name, t)
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                d = self._dims
                b, a = t.view(d.k_heads, 2, d.v_heads // d.k_heads, -1).unbind(1)
                yield name.replace("in_proj_ba", "in_proj_b"), b.reshape(d.v_heads, -1)
                yield name.replace("in_proj_ba", "in_proj_a"), a.reshape(d.v_heads, -1)
            else:
                yield name, flat_experts(name, t)

    def _split_qkvz(self, name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3-Next groups in_proj_qkvz by key head: [q, k, v (r heads), z (r heads)]
        per key head; ours is [q | k | v | z] over all heads."""
        d = self._dims
        r = d.v_heads // d.k_heads
        q, k, v, z = t.view(d.k_heads, -1, t.shape[-1]).split([d.k_dim, d.k_dim, r * d.v_dim, r * d.v_dim], dim=1)
        qkv = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
        yield name.replace("in_proj_qkvz", "in_proj_qkv"), qkv
        yield name.replace("in_proj_qkvz", "in_proj_z"), z.reshape(-1, t.shape[-1])

    def relative_name(self, name: str) -> str | None:
        return name  # ``converted`` made it relative already

    def map_layer(self, idx: int, rest: str) -> Target:
        prefix, layer = f"layers.{idx}", self.layers[idx]
        module, leaf = rest.rsplit(".", 1)
        if module in ("input_layernorm", "post_attention_layernorm"):
            return f"{prefix}.{'input_norm' if module == 'input_layernorm' else 'post_norm'}.{leaf}", None, None
        if rest.startswith("linear_attn."):
            return self._map_deltanet(prefix, rest.split(".", 1)[1])
        if rest.startswith("self_attn."):
            return self._map_attention(prefix, layer.mixer, module.split(".", 1)[1], leaf)
        if rest.startswith("mlp."):
            return self._map_mlp(prefix, layer.mlp, rest.split(".", 1)[1])
        return f"{prefix}.{rest}", None, None

    def _map_deltanet(self, prefix: str, rest: str) -> Target:
        d = self._dims
        sizes = [d.conv_dim, d.value_dim, d.v_heads, d.v_heads]
        parts = {"in_proj_qkv.weight": 0, "in_proj_z.weight": 1, "in_proj_b.weight": 2, "in_proj_a.weight": 3}
        if rest in parts:
            return f"{prefix}.mixer.in_proj.weight", parts[rest], sizes
        renamed = {"conv1d.weight": "conv1d_weight", "norm.weight": "norm_weight"}
        return f"{prefix}.mixer.{renamed.get(rest, rest)}", None, None

    def _map_attention(self, prefix: str, attn: Attention, module: str, leaf: str) -> Target:
        sizes = [attn.q_size, attn.kv_size, attn.kv_size, attn.q_size]
        parts = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 3}
        if module in parts:
            return f"{prefix}.mixer.qkv.{leaf}", parts[module], sizes
        if module in ("q_norm", "k_norm"):
            return (f"{prefix}.mixer.qk_norm_weight", int(module == "k_norm"), [attn.num_heads, attn.num_kv_heads])
        return f"{prefix}.mixer.{module}.{leaf}", None, None

    def _map_mlp(self, prefix: str, mlp: nn.Module, rest: str) -> Target:
        if isinstance(mlp, GatedMLP):
            return map_gated_mlp(f"{prefix}.mlp", mlp, rest)
        assert isinstance(mlp, SparseMoE)
        return map_sparse_moe(f"{prefix}.mlp", mlp, rest)
