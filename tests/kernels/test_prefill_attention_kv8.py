"""Prefill attention over 8-bit packed K/V caches (``--kv-cache-dtype int8 | fp8_e4m3``), read in
place through a block table: ``kernels/prefill_attention.cpp`` dequantizes each row as it packs K
and V (``kernels/kv8_rows.h``) and must give what the same kernel gives over the gathered blocks
made values by ``kv_quant.dequantize_rows`` in q's dtype (no table), which is what
``models/attention.py`` ran before: int8 and E4M3, q float32 and bfloat16, head dims 64, 128, 72
(a partial vector per row) and, float32 only (bfloat16 needs an even one), 65; GQA groups 1 and 4,
a chunk after cached keys in scattered blocks, a last block partly filled, sliding windows and
sinks. Also every code of both formats decoded through the kernel, and the op's refusals."""

from __future__ import annotations

import pytest
import torch

from hyprefix.kernels import prefill_attention as kernel
from hyprefix.models import kv_quant

pytestmark = pytest.mark.skipif(not kernel.available(torch.float32),
                                reason="no flash prefill kernel here: prefill attention runs torch's SDPA")

BLOCK = 16
FORMATS = [torch.int8, torch.float8_e4m3fn]

# (tokens, heads, kv heads, head dim, first query position, first key position, window, sinks)
CASES = [
    (40, 4, 4, 64, 0, 0, 0, False),  # a whole prompt, group 1, keys not a multiple of the block
    (70, 16, 4, 128, 200, 0, 0, False),  # group 4, a chunk after 200 cached keys: 270 over 3 key blocks
    (33, 8, 2, 72, 150, 0, 0, True),  # a row of 72 values, sinks
    (50, 4, 1, 64, 300, 170, 96, False),  # a window pool's keys from position 170, a window of 96
    (25, 8, 8, 128, 104, 0, 40, True),  # a window and sinks; one key past a key block
    (20, 4, 4, 65, 61, 0, 0, False),  # an odd head dim (float32)
]


def _packed_inputs(case, fmt, q_dtype, seed=0):
    """q, packed K/V caches (random rows through kv_quant.quantize_rows) with spare blocks, the
    keys' scattered block table, the key count and the call's other arguments."""
    tokens, heads, kv_heads, dim, q_pos0, k_pos0, window, with_sinks = case
    gen = torch.Generator().manual_seed(seed)
    keys = q_pos0 + tokens - k_pos0
    used = -(-keys // BLOCK)
    blocks = 2 * used + 3
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen) * torch.rand(blocks, BLOCK, kv_heads, 1, generator=gen)
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen)
    q = torch.randn(tokens, heads, dim, generator=gen).to(q_dtype)
    table = torch.randperm(blocks, generator=gen)[:used]
    sinks = torch.linspace(-1.0, 2.0, heads) if with_sinks else None
    args = (dim ** -0.5, q_pos0, k_pos0, window or None)
    return q, kv_quant.quantize_rows(k, fmt), kv_quant.quantize_rows(v, fmt), table, keys, args, sinks


def _dequantized(cache, table, keys, dtype):
    """The keys' rows gathered through the table and made values of ``dtype`` (the old path)."""
    rows = cache.index_select(0, table).flatten(0, 1)[:keys]
    return kv_quant.dequantize_rows(rows, dtype)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_packed_cache_through_a_table_matches_the_dequantized_gather(case, fmt, q_dtype):
    if q_dtype == torch.bfloat16 and (case[3] % 2 or not kernel.available(q_dtype)):
        pytest.skip("bfloat16 needs an even head dim and the kernel in bfloat16 here")
    q, k_cache, v_cache, table, keys, args, sinks = _packed_inputs(case, fmt, q_dtype)
    assert k_cache.dtype == fmt and k_cache.shape[-1] == q.shape[-1] + kv_quant.SCALE_BYTES
    got = kernel.prefill_attention(q, k_cache, v_cache, *args, block_table=table, keys=keys, sinks=sinks)
    ks, vs = (_dequantized(cache, table, keys, q_dtype) for cache in (k_cache, v_cache))
    ref = kernel.prefill_attention(q, ks, vs, *args, sinks=sinks)
    assert got.dtype == q_dtype and got.shape == q.shape
    assert torch.equal(got, ref)  # the same packed operands, so the same bits
    assert got.isfinite().all() and got.abs().max() > 0.01


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [128, 72])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_every_code_decodes_exactly(fmt, dim, q_dtype):
    """V rows holding all 256 codes (E4M3's subnormals, -0 and its NaNs 0x7f / 0xff included) at
    random float16 scales, each the one key of a call (weight 1; one call a row, since P x V would
    spread a NaN row over the block's other queries): out is that row as kv_quant.dequantize_rows
    makes it in q's dtype, bit for bit."""
    if not kernel.available(q_dtype):
        pytest.skip("the kernel does not run bfloat16 here")
    rows = -(-256 // dim)
    codes = torch.arange(rows * dim) % 256
    gen = torch.Generator().manual_seed(3)
    scales = (torch.rand(rows, 1, generator=gen) + 0.5).half() / kv_quant.LARGEST[fmt]
    raw = torch.cat([codes.view(rows, dim).to(torch.uint8), scales.view(torch.uint8)], dim=1)
    v_cache = torch.zeros(rows + 2, BLOCK, 1, dim + kv_quant.SCALE_BYTES, dtype=torch.uint8)
    v_cache[2:, 0, 0] = raw  # row r the first key of block r + 2
    v_cache = v_cache.view(fmt)
    k_cache = torch.zeros_like(v_cache)  # codes 0, scale 0: every score 0
    q = torch.randn(rows, 2, dim, generator=gen).to(q_dtype)
    out = torch.cat([kernel.prefill_attention(q[r:r + 1], k_cache, v_cache, 0.1, 0, 0, None,
                                              block_table=torch.tensor([r + 2]), keys=1) for r in range(rows)])
    want = kv_quant.dequantize_rows(raw.view(fmt), q_dtype)[:, None].expand_as(out)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert out.isnan().sum().item() == (2 * 2 if fmt == torch.float8_e4m3fn else 0)  # 0x7f, 0xff; 2 heads


def test_bad_packed_inputs_raise_not_crash():
    q, k_cache, v_cache, table, keys, args, _ = _packed_inputs(CASES[1], torch.int8, torch.float32)
    with pytest.raises(RuntimeError, match="head dim \\+ 2"):  # rows of D, not D + 2
        kernel.prefill_attention(q, k_cache[..., :-2], v_cache[..., :-2], *args, block_table=table, keys=keys)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        kernel.prefill_attention(q, k_cache, v_cache.view(torch.float8_e4m3fn), *args, block_table=table, keys=keys)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        kernel.prefill_attention(q.half(), k_cache, v_cache, *args, block_table=table, keys=keys)
