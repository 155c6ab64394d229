"""``torch.ops.hyprefix.decode_layers``: every layer of a Llama-style decoder over decode rows
with int8 weights, in one call and one parallel region (``decode_layers.cpp`` has the
arithmetic and why). ``models/llama.py`` calls it for the decode-only steps it fits.

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
    """Whether ``decode_layers`` runs in this process (builds and loads it the first time). A
    plain global after that, so a compiled graph reads it as a constant."""
    global _available
    if _available is None:
        _available = (int8_linear.available() and decode_attention.available(torch.float32)
                      and _build(device_caps("cpu").int8_isa))
    return _available


def _build(int8_isa: str) -> bool:
    vector_isa = "AVX512" if device_caps("cpu").isa.startswith("AVX512") else "AVX2"
    name = f"hyprefix_decode_layers_{int8_isa.lower()}_{vector_isa.lower()}"
    flags = [*dict.fromkeys([*int8_linear.FLAGS[int8_isa], *VECTOR_FLAGS[vector_isa]])]
    if not load_kernel(name, SOURCE, flags, "decode layers run op by op"):
        return False
    torch.library.register_fake("hyprefix::decode_layers")(_fake)
    return True


def _fake(x: torch.Tensor, *args) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile."""
    return x.new_empty(x.shape)
