"""The 8-bit K/V cache (``--kv-cache-dtype int8 | fp8_e4m3``): its row format, written and read.

A quantized cache is one tensor per K and V as the model-dtype cache is, [blocks, block_size,
KVH, D + 2] of the storage dtype (``torch.int8`` or ``torch.float8_e4m3fn``, which names the
format), so every path that moves blocks (the disk tier, the pool's page mapping) moves values and
scales together. Each (token, KV head) row holds its D codes, then its scale as float16 bits in the
last two bytes (little-endian): value = code * scale, scale = max |x| over the row / the format's
largest code (127; 448 for E4M3), 0 for a row of zeros. A scale per token and head keeps the
outlier channels of one token from costing the precision of others, and needs no rescaling of
earlier rows as a block fills (a scale per block would). The float16 scale costs 2 bytes a row: D
= 64 stores 66 bytes where bfloat16 stores 128 (1.94x), D = 128 130 against 256 (1.97x).

``quantize_rows`` / ``dequantize_rows`` are the reference arithmetic: the write path runs the
former, the gathering read paths (prefill over a cached prefix, the padded decode path, the
cascade's shared prefixes) the latter; the decode kernel reads the rows in place with the
dequantization fused (``kernels/decode_attention.h``) and is checked against these.
"""

from __future__ import annotations

import torch

STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
LARGEST = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 2


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The cache tensors' dtype for a quantized ``kv_cache_dtype``; None for "auto"."""
    return STORAGE.get(kv_cache_dtype)


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds packed 8-bit rows (its dtype is a storage dtype)."""
    return cache.dtype in LARGEST


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """Whether K/V tensors of ``dtype`` hold packed 8-bit rows."""
    return dtype in LARGEST


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one (token, KV head) row: D codes and a scale, or D values of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype in LARGEST else head_dim * dtype.itemsize


def stored_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The cache tensor's last dimension for rows of ``head_dim`` values."""
    return head_dim + SCALE_BYTES if dtype in LARGEST else head_dim


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) -> packed [..., D + 2] of ``dtype`` (module docstring)."""
    largest = LARGEST[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / largest).half()  # the stored scale, rounded as stored
    # times the reciprocal, not divided: Inductor rewrites a division so, and the codes a compiled
    # step writes must be the eager path's
    divisor = scale.float()
    scaled = xf * torch.where(divisor > 0, 1.0 / divisor.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    if dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.clamp(-largest, largest).to(dtype).view(torch.uint8)
    packed = torch.cat([codes, scale.view(torch.uint8)], dim=-1)
    return packed.view(dtype)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., D + 2] -> values [..., D] of ``dtype``."""
    raw = packed.view(torch.uint8)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    codes = raw[..., :-SCALE_BYTES].contiguous().view(packed.dtype).float()
    return (codes * scale).to(dtype)


def read_rows(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A cache's rows as values of ``dtype``: dequantized where the cache is packed, else as they are."""
    return dequantize_rows(rows, dtype) if is_quantized(cache) else rows
