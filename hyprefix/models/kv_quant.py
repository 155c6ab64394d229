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

Before quantizing, K rows are rotated by a fixed orthogonal R (``rotation``: a Walsh-Hadamard
matrix with seeded random signs for a power-of-two D, else a seeded random orthogonal one), and
the queries with them, so q . k is unchanged (``attention.paged_attention``). A few channels of K
(RoPE's low frequencies, say) often hold most of a row's magnitude and would set its scale;
rotated, every channel carries a share of them, the scale falls to near the row's typical value
and the codes keep more of every channel. On the real SmolLM2 file (weights as float) it cut
int8's mean next-token KL from 5.9e-4 to 1.5e-4 (docs/benchmarks.md). V is stored as it is:
rotating it too (and turning each output back by R^T) lowered the KL only from 1.64e-4 to
1.43e-4 (SmolLM2) and 5.45e-4 to 4.87e-4 (Gemma 3) and cost half the rotations' time, about 8 %
of a 1,024-token prefill. The latent (MLA) cache, whose rows are both K and V, rotates them whole
(``deepseek.LatentAttention.rotated``). ``FORMAT`` names this layout in the model identity, so
blocks written under another one are never read as these.

``quantize_rows`` / ``dequantize_rows`` are the reference arithmetic: the write op reproduces the
former bit for bit (``kernels/kv_write.cpp``), the SDPA paths that gather blocks run the latter;
the decode and flash prefill kernels read the rows in place, dequantizing as they load them
(``kernels/kv8_rows.h``), and are checked against these.
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
    return is_quantized_dtype(cache.dtype)


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """Whether K/V tensors of ``dtype`` hold packed 8-bit rows."""
    return dtype in LARGEST


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one (token, KV head) row: D codes and a scale, or D values of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype in LARGEST else head_dim * dtype.itemsize


def stored_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The cache tensor's last dimension for rows of ``head_dim`` values."""
    return head_dim + SCALE_BYTES if dtype in LARGEST else head_dim


ROTATION_SEED = 67  # fixed: the rotation is part of the format (a stored block's bytes depend on it)
# The layout's version in the model identity (``loading``: "|kv=int8/k-rotated"): bumped whenever
# what a stored block's bytes mean changes (here: K rotated, V not)
FORMAT = "k-rotated"


def _rotation(head_dim: int) -> torch.Tensor:
    """The fixed orthogonal [D, D] float64 matrix R (module docstring): a Walsh-Hadamard matrix
    with random signs on its rows, scaled to be orthonormal, for a power-of-two D; else the Q
    of a seeded Gaussian matrix."""
    gen = torch.Generator().manual_seed(ROTATION_SEED)
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=gen).double() * 2 - 1
        return signs[:, None] * h / head_dim ** 0.5
    q, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    return q


# (head dim, device, transposed) -> R (or R^T, contiguous) in float32 there: made eagerly
# (``rotation``) before any compiled step reads it, which then finds a constant tensor (making it
# there would put a generator in the graph)
_ROTATIONS: dict[tuple[int, str, bool], torch.Tensor] = {}


def rotation(head_dim: int, device: torch.device, transposed: bool = False) -> torch.Tensor:
    """R in float32 on ``device`` (``transposed``: R^T, contiguous): rows x [.., D] are stored as
    x @ R, queries meet them as q @ R (q . k unchanged), and an attention output o over rotated
    values is o @ R^T. The runner makes both at start for its head dims (``ModelRunner``), so a
    compiled step only looks them up."""
    key = (head_dim, str(device), transposed)
    if key not in _ROTATIONS:
        r = _rotation(head_dim)
        _ROTATIONS[key] = (r.T if transposed else r).contiguous().to(dtype=torch.float32, device=device)
    return _ROTATIONS[key]


def rotate(x: torch.Tensor, inverse: bool = False, invariant: bool = False) -> torch.Tensor:
    """x [..., D] (float32) @ R, or @ R^T when ``inverse``. ``invariant`` (the batch-invariant mode):
    through ``kernels/invariant_linear``, each row's bits independent of the other rows (a plain
    matmul's blocking follows the row count)."""
    d = x.shape[-1]
    if invariant:
        from hyprefix.kernels import invariant_linear

        # x @ M = linear(x, M^T): M^T is R^T to rotate, R to turn back
        return invariant_linear.invariant_linear(x.contiguous(), rotation(d, x.device, transposed=not inverse))
    return x @ rotation(d, x.device, transposed=inverse)


def rotations() -> list[torch.Tensor]:
    """Every R made so far: tensors a captured decode step reads, which outlive it."""
    return list(_ROTATIONS.values())


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) -> packed [..., D + 2] of ``dtype`` (module docstring)."""
    largest = LARGEST[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / largest).half()  # the stored scale, rounded as stored
    # times the reciprocal, not divided, as kernels/kv_write.cpp computes it: the codes are its bits
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


def as_stored(rows: torch.Tensor, storage: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] as a cache of ``storage`` holds them once written, read back as ``dtype``
    (what a prefill's attention over its own new rows reads: the same values as the cached ones)."""
    return dequantize_rows(quantize_rows(rows, storage), dtype)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``blocks`` of a cache [blocks, block_size, KVH, D(+2)] as values [n, block_size, KVH, D]:
    dequantized to ``dtype`` where the cache holds 8-bit rows, else as stored."""
    rows = cache.index_select(0, blocks)
    return dequantize_rows(rows, dtype) if is_quantized(cache) else rows
