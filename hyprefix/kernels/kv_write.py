"""``kv_write_8bit``: a step's K or V rows quantized into an 8-bit paged cache in one op
(``kv_write.cpp``; ``models/kv_quant.py`` has the format and the same arithmetic in torch ops,
which this reproduces bit for bit). Plain C++, built once per machine; where it does not build,
``--kv-cache-dtype int8 | fp8_e4m3`` is refused at start (``loading.kv_cache_storage``)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hyprefix.kernels.build import load_kernel

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def available() -> bool:
    """Whether the op runs in this process (builds and loads it the first time)."""
    if not load_kernel("hyprefix_kv_write", SOURCE, [], "an 8-bit K/V cache is refused"):
        return False
    torch.library.register_fake("hyprefix::kv_write_8bit")(_fake)
    return True


def kv_write_8bit(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, KVH, D] into ``cache`` [blocks, block_size, KVH, D + 2] (int8 or float8_e4m3fn) at
    flat slots ``slots`` [T] (int64). Call only where ``available()``."""
    torch.ops.hyprefix.kv_write_8bit(rows, cache, slots)


def _fake(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    return None
