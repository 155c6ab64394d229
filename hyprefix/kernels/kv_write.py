"""``kv_write_8bit``: a step's K or V rows quantized into an 8-bit paged cache in one op, and
``kv_write_8bit_stored``: the same, returning the rows as the cache holds them (``kv_write.cpp``;
``models/kv_quant.py`` has the format and the same arithmetic in torch ops, which these reproduce
bit for bit). Built once per machine and ISA on ATen's vector types (``build.load_vector_kernel``);
where it does not build, ``--kv-cache-dtype int8 | fp8_e4m3`` is refused at start
(``loading.kv_cache_storage``)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_vector_kernel

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def available() -> bool:
    """Whether the ops run in this process (builds and loads them the first time)."""
    if not device_caps("cpu").vector_kernels or not load_vector_kernel(SOURCE, "an 8-bit K/V cache is refused"):
        return False
    torch.library.register_fake("hyprefix::kv_write_8bit")(_fake)
    torch.library.register_fake("hyprefix::kv_write_8bit_stored")(_fake_stored)
    return True


def kv_write_8bit(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, KVH, D] into ``cache`` [blocks, block_size, KVH, D + 2] (int8 or float8_e4m3fn) at
    flat slots ``slots`` [T] (int64). Call only where ``available()``."""
    torch.ops.hyprefix.kv_write_8bit(rows, cache, slots)


def kv_write_8bit_stored(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                         index: torch.Tensor | None = None) -> torch.Tensor:
    """``kv_write_8bit`` of the rows ``index`` [W] picks (None: all, W == T) at ``slots`` [W];
    returns every row as stored, read back: float32 [T, KVH, D], ``kv_quant.as_stored``'s values."""
    return torch.ops.hyprefix.kv_write_8bit_stored(rows, cache, slots, index)


def _fake(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    return None


def _fake_stored(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                 index: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(rows.shape, dtype=torch.float32)
