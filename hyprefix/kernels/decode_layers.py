"""``torch.classes.hyprefix.DecodeModel``: a Llama-style decoder with int8 weights and its K/V
caches, held once, and its decode step in one call and one parallel region:
``torch.ops.hyprefix.decode_model_hidden`` (the hidden states) and ``decode_model_logits``
(logits and their argmax). ``decode_layers.cpp`` has the arithmetic and why; ``models/llama.py``
calls it for the decode-only steps it fits.

Built on first use, one build per pair of the int8 kernel's ISA (``int8_linear.FLAGS``) and
ATen's vector ISA (``build.VECTOR_FLAGS``, for the attention's loops). ``available()`` says
whether it runs: both kernels run here and this build worked.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import decode_attention, int8_linear
from hyprefix.kernels.build import VECTOR_FLAGS, load_kernel
from hyprefix.models.quant import Int8Tiles

SOURCE = Path(__file__).with_suffix(".cpp")

_available: bool | None = None


def available() -> bool:
    """Whether ``DecodeModel`` runs in this process (builds and loads it the first time)."""
    global _available
    if _available is None:
        _available = (int8_linear.available() and decode_attention.available(torch.float32)
                      and _build(device_caps("cpu").int8_isa))
    return _available


def _build(int8_isa: str) -> bool:
    vector_isa = "AVX512" if device_caps("cpu").isa.startswith("AVX512") else "AVX2"
    name = f"hyprefix_decode_layers_{int8_isa.lower()}_{vector_isa.lower()}"
    flags = [*dict.fromkeys([*int8_linear.FLAGS[int8_isa], *VECTOR_FLAGS[vector_isa]])]
    return load_kernel(name, SOURCE, flags, "decode layers run op by op")


def build(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
          ) -> tuple[torch.ScriptObject, bool]:
    """The ``DecodeModel`` of a ``LlamaForCausalLM`` whose layers fit it (``use_decode_kernel``)
    over these caches, one (K, V) a layer, and whether it has the LM head (int8 tiles), so
    ``decode_model_logits`` runs. It holds the weights as they are now."""
    head = model.lm_head.int8 if model.lm_head is not None else model._int8_head
    tiled = isinstance(head, Int8Tiles)
    first = model.layers[0].attn
    out = torch.classes.hyprefix.DecodeModel(
        model.embed.weight, model.norm.weight, head.tiles if tiled else None, head.scales if tiled else None,
        model.rotary.cos, model.rotary.sin, first.num_heads, model.norm.eps, first.qk_norm_eps, first.scale)
    for layer, (k, v) in zip(model.layers, kv_caches, strict=True):
        attn, mlp = layer.attn, layer.mlp
        out.add_layer(layer.input_norm.weight, *_weight(attn.qkv), attn.qk_norm_weight, *_weight(attn.o_proj),
                      layer.post_norm.weight, *_weight(mlp.gate_up), *_weight(mlp.down), k, v, attn.window or 0)
    return out, tiled


def _weight(linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return linear.int8.tiles, linear.int8.scales, linear.bias
