"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B):
Qwen3's attention (QK-norm, GQA) with a sparse MoE block in place of the MLP on every
``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` (``moe.SparseMoE``: softmax
router, top-k, weights renormalised where ``norm_topk_prob``; no shared expert).

Everything else is Llama's (``LlamaForCausalLM``): the layers differ only in the MLP they build.
A GGUF file (llama.cpp's ``qwen3moe``) is read by ``gguf_hybrid``, whose expert stacks stay in
their blocks (``fused_moe``'s ``quant_moe``); transformers' own GGUF reader misnames the stacks.
"""

from __future__ import annotations

import torch
from torch import nn

from hyprefix.models.base import Target
from hyprefix.models.llama import DecoderLayer, LlamaForCausalLM
from hyprefix.models.moe import SparseMoE, is_moe_layer, map_sparse_moe


class Qwen3MoeDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if is_moe_layer(cfg, layer_idx):
            return SparseMoE.from_config(cfg, dtype, device)
        return super().build_mlp(cfg, layer_idx, dtype, device)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM (an activation other than SiLU is refused, as for every family of
    Llama's layout)."""

    layer_class = Qwen3MoeDecoderLayer

    def map_layer(self, idx: int, rest: str) -> Target:
        mlp = self.layers[idx].mlp
        if rest.startswith("mlp.") and isinstance(mlp, SparseMoE):
            return map_sparse_moe(f"layers.{idx}.mlp", mlp, rest.split(".", 1)[1])
        return super().map_layer(idx, rest)

