"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's layers and weight names, with NoPE layers.

``no_rope_layers[i]`` 0 marks a layer whose attention has no rotary embedding (transformers
builds it, when absent, with a NoPE layer every ``no_rope_layer_interval``: every fourth by
default). Those layers run attention with ``rope=None`` (``DecoderLayer.uses_rope``, which the
one-call decode kernel reads too).

A GGUF file (llama.cpp's ``smollm3``) states no NoPE pattern: llama.cpp runs every fourth layer
without RoPE, and ``config_from_gguf`` says the same.
"""

from __future__ import annotations

import torch

from hyprefix.models.gguf_config import GGUFMetadata, llama_like
from hyprefix.models.llama import DecoderLayer, LlamaForCausalLM

LLAMA_CPP_NOPE_STEP = 4  # llama.cpp's ``n_no_rope_layer_step`` for smollm3 (src/models/smollm3.cpp)


class SmolLM3DecoderLayer(DecoderLayer):
    """A Llama layer whose attention rotates q and k only where ``no_rope_layers`` says so."""

    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device, **attn_kw) -> None:
        super().__init__(cfg, layer_idx, dtype, device, **attn_kw)
        self.uses_rope = bool(cfg.no_rope_layers[layer_idx])


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: GQA, tied or untied head, NoPE layers, sliding windows by ``layer_types``.
    Refuses an activation other than SiLU, a ``no_rope_layers`` shorter than the layers, and
    sliding layers in ``layer_types`` with ``use_sliding_window`` off (transformers then applies
    the window or not depending on the attention kernel)."""

    layer_class = SmolLM3DecoderLayer

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        _check_supported(hf_config)
        super().__init__(hf_config, dtype, device, max_positions)


def _check_supported(cfg) -> None:
    if cfg.hidden_act != "silu":
        raise ValueError(f"SmolLM3 config sets hidden_act={cfg.hidden_act!r}: only silu is supported")
    if len(cfg.no_rope_layers) < cfg.num_hidden_layers:
        raise ValueError(f"SmolLM3 config's no_rope_layers has {len(cfg.no_rope_layers)} entries for "
                         f"{cfg.num_hidden_layers} layers")
    if "sliding_attention" in (cfg.layer_types or []) and not cfg.use_sliding_window:
        raise ValueError("SmolLM3 config marks sliding_attention layers in layer_types with use_sliding_window "
                         "false: transformers applies the window or not depending on the attention kernel, so it "
                         "is refused")


def config_from_gguf(meta: GGUFMetadata):
    """The ``SmolLM3Config`` of a ``smollm3`` GGUF file: the Llama-style keys, and NoPE on every
    fourth layer, as llama.cpp runs such a file (the converter writes no pattern)."""
    from transformers import SmolLM3Config

    if meta.get("attention.sliding_window", 0):
        raise meta.error("smollm3.attention.sliding_window is not supported (llama.cpp's smollm3 has none)")
    config = llama_like(meta)
    layers = config["num_hidden_layers"]
    return SmolLM3Config(**config, architectures=["SmolLM3ForCausalLM"], no_rope_layer_interval=LLAMA_CPP_NOPE_STEP,
                         no_rope_layers=[int((i + 1) % LLAMA_CPP_NOPE_STEP != 0) for i in range(layers)])
