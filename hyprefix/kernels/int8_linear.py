"""``torch.ops.hyprefix.int8_linear``: int8 weights in 16-row tiles times activations
quantized to int8 per 32, on AVX512-VNNI (``int8_linear.cpp`` has the arithmetic and the
layout).

Built on first use (``build.load_kernel``). ``available()`` says whether it runs here: the
CPU has AVX512-VNNI and ATen may use AVX-512 (``hardware.DeviceCaps.int8_vnni``) and the
build worked; a failed build logs one warning and int8 weights take the portable path
(``models/quant.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_kernel

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
TILE = 16  # weight rows per tile

_available: bool | None = None


def available() -> bool:
    """Whether ``int8_linear`` runs in this process (builds and loads it the first time).
    A plain global after that, so a compiled graph reads it as a constant."""
    global _available
    if _available is None:
        _available = device_caps("cpu").int8_vnni and _build()
    return _available


def _build() -> bool:
    if not load_kernel("hyprefix_int8_linear", SOURCE, FLAGS, "int8 weights take the portable path"):
        return False
    torch.library.register_fake("hyprefix::int8_linear")(_fake)
    return True


def int8_linear(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., K] (float32 / bfloat16) times the ``n``-row weight that ``pack`` tiled, in x's
    dtype. Call only where ``available()``."""
    return torch.ops.hyprefix.int8_linear(x, tiles, scales, n)


def pack(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and scales [N] or [N, K / 32] -> the kernel's tiles (uint8 [N/16, K/4, 16, 4]
    holding w + 128; rows padded to a whole tile) and scales (float32 [N/16 * 16], or float16
    [N/16, K/32, 16]: GGUF Q8_0's scales are float16, so they stay exact)."""
    n, k = qweight.shape
    pad = -n % TILE
    biased = torch.nn.functional.pad((qweight.to(torch.int16) + 128).to(torch.uint8), (0, 0, 0, pad), value=128)
    tiles = biased.view(-1, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    if scales.dim() == 1:
        return tiles, torch.nn.functional.pad(scales.float(), (0, pad)).contiguous()
    grouped = torch.nn.functional.pad(scales.half(), (0, 0, 0, pad)).view(-1, TILE, scales.shape[1])
    return tiles, grouped.permute(0, 2, 1).contiguous()


def unpack(tiles: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack``: int8 [n, K] and scales [n] or [n, K / 32]."""
    k = tiles.shape[1] * 4
    qweight = (tiles.permute(0, 2, 1, 3).reshape(-1, k).to(torch.int16) - 128).to(torch.int8)[:n]
    if scales.dim() == 1:
        return qweight, scales[:n]
    return qweight, scales.permute(0, 2, 1).reshape(-1, scales.shape[1])[:n].float()


def _fake(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile."""
    return x.new_empty((*x.shape[:-1], n))
