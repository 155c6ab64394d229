"""``torch.ops.hyprefix.bf16_linear``: bfloat16 weights in 16-row tiles times bfloat16
activations, the matmul of compiled bf16 decode steps (``bf16_linear.cpp`` has the layout,
the arithmetic and the measurements).

Built on first use (``build.load_kernel``) where ``hardware.DeviceCaps.bf16_tiles`` says the
CPU multiplies bf16 natively with AVX512-BF16; ``available()`` says whether it runs. Elsewhere
(or if the build fails, with one warning) compiled steps keep Inductor's reduction loop over
the plain weight (``models/quant.reduction_linear``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_kernel

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]
TILE = 16  # weight rows per tile

_available: bool | None = None


def available() -> bool:
    """Whether ``bf16_linear`` runs in this process (builds and loads it the first time).
    A plain global after that, so a compiled graph reads it as a constant."""
    global _available
    if _available is None:
        _available = device_caps("cpu").bf16_tiles and _build()
    return _available


def _build() -> bool:
    if not load_kernel("hyprefix_bf16_linear", SOURCE, FLAGS, "bf16 decode steps keep Inductor's matmul loops"):
        return False
    torch.library.register_fake("hyprefix::bf16_linear")(_fake)
    return True


def bf16_linear(x: torch.Tensor, tiles: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bfloat16) times the ``n``-row weight that ``pack`` tiled, plus ``bias``
    (bfloat16 [n]) before the one rounding: [..., n] in bfloat16. Call only where ``available()``."""
    return torch.ops.hyprefix.bf16_linear(x, tiles, n, bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] (K even) -> tiles [ceil(N/16), K/2, 16, 2], rows padded with zeros."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -n % TILE))
    return padded.view(-1, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``pack``: the [n, K] weight."""
    return tiles.permute(0, 2, 1, 3).reshape(-1, tiles.shape[1] * 2)[:n]


def rows(tiles: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``ids`` of the ``n``-row weight that ``pack`` tiled ([*ids.shape, K]): an embedding
    lookup from a tied LM head's tiles. Eager calls check the ids as ``nn.Embedding`` does."""
    flat = ids.reshape(-1)
    if not torch.compiler.is_compiling() and flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < n:
        raise IndexError(f"index out of range in self: ids must be in [0, {n})")
    return tiles[flat // TILE, :, flat % TILE].reshape(*ids.shape, tiles.shape[1] * 2)


def _fake(x: torch.Tensor, tiles: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The output's shape and dtype, for torch.compile."""
    return x.new_empty((*x.shape[:-1], n))
