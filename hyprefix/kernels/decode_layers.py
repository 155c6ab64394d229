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
