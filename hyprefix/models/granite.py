"""IBM Granite 3.x dense (``GraniteForCausalLM``): Llama's layers and weight names with four
multipliers from the config, applied where transformers applies them:

* ``embedding_multiplier``: the embeddings are scaled by it before the first layer;
* ``attention_multiplier``: the attention scale (in place of ``head_dim ** -0.5``);
* ``residual_multiplier``: each attention and MLP output is scaled by it before it is added to
  the residual stream;
* ``logits_scaling``: the logits are divided by it.

``DecoderLayer.residual_multiplier`` and ``LlamaForCausalLM``'s ``embedding_multiplier`` and
``logits_scaling`` carry them, so the one-call decode kernel runs Granite too.

A GGUF file (llama.cpp's ``granite``) states them as ``granite.embedding_scale``,
``attention.scale``, ``residual_scale`` and ``logit_scale``; a missing one means what it means
to llama.cpp (no scaling; for the attention scale ``head_dim ** -0.5``).
"""

from __future__ import annotations

import torch

from hyprefix.models.gguf_config import GGUFMetadata, llama_like
from hyprefix.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    """A Llama layer with the attention scale ``attention_multiplier`` and both block outputs
    scaled by ``residual_multiplier`` before they join the residual stream."""

    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device, **attn_kw) -> None:
        super().__init__(cfg, layer_idx, dtype, device, **attn_kw)
        self.attn.scale = float(cfg.attention_multiplier)
        self.residual_multiplier = float(cfg.residual_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x dense models (an activation other than SiLU is refused, as for every family of
    Llama's layout)."""

    layer_class = GraniteDecoderLayer

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__(hf_config, dtype, device, max_positions)
        self.embedding_multiplier = float(hf_config.embedding_multiplier)
        self.logits_scaling = float(hf_config.logits_scaling)


def config_from_gguf(meta: GGUFMetadata):
    """The ``GraniteConfig`` of a ``granite`` GGUF file: the Llama-style keys and the four
    multipliers, each missing one as llama.cpp reads it (0 or absent: no scaling; the attention
    scale then ``head_dim ** -0.5``). A file whose RoPE is switched off
    (``rope.scaling.finetuned`` false, Granite 4's NoPE layers) is refused."""
    from transformers import GraniteConfig

    if not meta.get("rope.scaling.finetuned", True):
        raise meta.error("granite.rope.scaling.finetuned is false (no RoPE): not supported")
    config = llama_like(meta)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return GraniteConfig(
        **config, architectures=["GraniteForCausalLM"],
        embedding_multiplier=meta.real("embedding_scale", 0.0) or 1.0,
        residual_multiplier=meta.real("residual_scale", 0.0) or 1.0,
        attention_multiplier=meta.real("attention.scale", 0.0) or head_dim ** -0.5,
        logits_scaling=meta.real("logit_scale"))
