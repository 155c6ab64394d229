"""``torch.ops.hyprefix.int8_linear``: int8 weights in 16-row tiles times activations
quantized to int8 per 32, on AVX512-VNNI or AVX2 (``int8_linear.cpp`` has the arithmetic and
the layout: the same tiles for both, holding w + 128 for VNNI and w for AVX2).

Built on first use (``build.load_kernel``), one build per ISA. ``available()`` says whether
it runs here: ``hardware.DeviceCaps.int8_isa`` names a build for this CPU and ATen's ISA, and
the build worked; a failed build logs one warning and int8 weights take the portable path
(``models/quant.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_kernel

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = {"AVX512_VNNI": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"],
         "AVX2": ["-mavx2", "-mfma", "-mf16c"]}
TILE = 16  # weight rows per tile

_available: bool | None = None


def available() -> bool:
    """Whether ``int8_linear`` runs in this process (builds and loads it the first time).
    A plain global after that, so a compiled graph reads it as a constant."""
    global _available
    if _available is None:
        isa = device_caps("cpu").int8_isa
        _available = bool(isa) and _build(isa)
    return _available


def _build(isa: str) -> bool:
    name = f"hyprefix_int8_linear_{isa.lower()}"
    if not load_kernel(name, SOURCE, FLAGS[isa], "int8 weights take the portable path"):
        return False
    torch.library.register_fake("hyprefix::int8_linear")(_fake)
    return True


def int8_linear(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] (float32 / bfloat16) times the ``n``-row weight that ``pack`` tiled, in x's
    dtype. Call only where ``available()``."""
    return torch.ops.hyprefix.int8_linear(x, tiles, scales, n)


def signed_tiles() -> bool:
    """Whether this CPU's build takes tiles of signed weights (AVX2) rather than w + 128 (VNNI)."""
    return device_caps("cpu").int8_isa == "AVX2"


def pack(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and scales [N] or [N, K / 32] -> this CPU's build's tiles (uint8 [N/16, K/4,
    16, 4] holding w + 128, or w itself for the AVX2 build, where a -128 becomes -127; rows
    padded to a whole tile) and scales (float32 [N/16 * 16], or float16 [N/16, K/32, 16]:
    GGUF Q8_0's scales are float16, so they stay exact)."""
    n, k = qweight.shape
    pad = -n % TILE
    if signed_tiles():
        stored, zero = qweight.clamp(min=-127).view(torch.uint8), 0
    else:
        stored, zero = (qweight.to(torch.int16) + 128).to(torch.uint8), 128
    stored = torch.nn.functional.pad(stored, (0, 0, 0, pad), value=zero)
    tiles = stored.view(-1, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    if scales.dim() == 1:
        return tiles, torch.nn.functional.pad(scales.float(), (0, pad)).contiguous()
    grouped = torch.nn.functional.pad(scales.half(), (0, 0, 0, pad)).view(-1, TILE, scales.shape[1])
    return tiles, grouped.permute(0, 2, 1).contiguous()


def unpack(tiles: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack``: int8 [n, K] and scales [n] or [n, K / 32]."""
    k = tiles.shape[1] * 4
    stored = tiles.permute(0, 2, 1, 3).reshape(-1, k)[:n]
    qweight = stored.view(torch.int8) if signed_tiles() else (stored.to(torch.int16) - 128).to(torch.int8)
    if scales.dim() == 1:
        return qweight, scales[:n]
    return qweight, scales.permute(0, 2, 1).reshape(-1, scales.shape[1])[:n].float()


def _fake(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile."""
    return x.new_empty((*x.shape[:-1], n))
