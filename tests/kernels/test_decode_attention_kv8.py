"""Decode attention over 8-bit packed K/V rows (``--kv-cache-dtype int8 | fp8_e4m3``): the kernel
reads each row's codes and scale in place (``kernels/kv8_rows.h``) and must give what it gives
over the float32 cache ``kv_quant.dequantize_rows`` makes of the same rows (the dequantization is
exact in float32, the rest the same arithmetic): int8 and E4M3, q float32 and bfloat16, head dims
with a register path (64, 128) and without (80; 76, whose rows end in a partial vector on AVX2
and AVX-512), GQA groups 1 and 4, rows of different lengths and an empty one, sliding windows, a
first position, the batch-invariant runs (run_blocks > 0), one thread and two. Also every code of
both formats (E4M3 subnormals, negative zero and NaN included) decoded through the kernel, and
the op's refusals."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import decode_attention as kernel
from hyprefix.models import kv_quant
from tests.kernels.test_decode_attention import _reference
from tests.support.compare import with_threads

pytestmark = pytest.mark.skipif(not device_caps("cpu").paged_decode(torch.float32),
                                reason="no x86 AVX2/AVX-512 CPU: the model gathers for SDPA (test_decode_attention)")

BLOCK = 16
FORMATS = [torch.int8, torch.float8_e4m3fn]

# (heads, kv heads, head dim, context lengths, first positions or None, window, run_blocks)
CASES = [
    (4, 4, 64, [1, 77, 300], None, 0, 0),  # group 1, rows of different lengths
    (16, 4, 128, [0, 33, 200], None, 0, 0),  # group 4, an empty row
    (8, 2, 80, [99, 5], None, 0, 0),  # a head dim without a register path
    (4, 1, 76, [140], None, 0, 0),  # ... whose rows end in a partial vector
    (4, 1, 64, [300, 18], None, 64, 0),  # a sliding window that cuts the first row
    (8, 2, 128, [300, 45], [37, 0], 0, 0),  # cascade tails: the tables start at positions 37 / 0
    (4, 1, 80, [400], [250], 100, 0),  # a window pool: the table at 250, the window at 300
    (8, 2, 128, [300, 45, 0], [37, 0, 0], 0, 2),  # batch-invariant runs of 2 blocks
    (4, 4, 76, [200, 64], None, 50, 1),  # ... of 1 block, with a window
]


def _packed_inputs(case, fmt, q_dtype, seed=0):
    """q, packed K/V caches (random rows through kv_quant.quantize_rows) and the call's tables."""
    heads, kv_heads, dim, lens, first, window, run_blocks = case
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-(n - (first[i] if first else 0)) // BLOCK) for i, n in enumerate(lens)) + 1)
    blocks = len(lens) * width + 3
    k = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen) * torch.rand(blocks, BLOCK, kv_heads, 1, generator=gen)
    v = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(q_dtype)
    tables = torch.randperm(blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    first_pos = torch.tensor(first) if first else None
    return (q, kv_quant.quantize_rows(k, fmt), kv_quant.quantize_rows(v, fmt), tables, torch.tensor(lens),
            first_pos, window, run_blocks)


def _against_dequantized(q, k_cache, v_cache, tables, lens, first_pos, window, run_blocks, threads):
    """The kernel over the packed caches and, as the reference, over their float32 dequantization
    with q in float32 (the packed path's arithmetic), its output rounded to q's dtype."""
    scale = q.shape[-1] ** -0.5
    k_ref = kv_quant.dequantize_rows(k_cache, torch.float32)
    v_ref = kv_quant.dequantize_rows(v_cache, torch.float32)

    def both():
        got = kernel.decode_attention(q, k_cache, v_cache, tables, lens, scale, window, first_pos, run_blocks)
        ref = kernel.decode_attention(q.float(), k_ref, v_ref, tables, lens, scale, window, first_pos, run_blocks)
        return got, ref

    (out, lse), (ref, ref_lse) = with_threads(threads, both)
    return out, lse, ref.to(q.dtype), ref_lse, k_ref, v_ref


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_packed_rows_match_the_dequantized_cache(case, fmt, q_dtype, threads):
    assert kernel.available(q_dtype)
    q, k_cache, v_cache, tables, lens, first_pos, window, run_blocks = _packed_inputs(case, fmt, q_dtype)
    assert k_cache.dtype == fmt and k_cache.shape[-1] == q.shape[-1] + kv_quant.SCALE_BYTES
    out, lse, ref, ref_lse, k_ref, v_ref = _against_dequantized(q, k_cache, v_cache, tables, lens, first_pos,
                                                                window, run_blocks, threads)
    assert out.dtype == q_dtype and out.shape == q.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-5, atol=1e-6)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-5, atol=1e-5)
    assert not out[empty[:, 0]].any()
    if q_dtype == torch.float32 and threads == 1:  # the reference itself: float64 attention
        f64, f64_lse = _reference(q, k_ref, v_ref, tables, lens, first_pos, q.shape[-1] ** -0.5, window)
        assert (out.double() - f64).abs().max().item() < 2e-6
        assert (lse.double()[~empty] - f64_lse[~empty]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dim", [128, 76])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_exactly(fmt, dim):
    """V rows holding all 256 codes (E4M3's subnormals, -0 and its NaNs 0x7f / 0xff included) at
    random float16 scales, each row the one key its query row sees: out is that row's values."""
    rows = -(-256 // dim)
    codes = torch.arange(rows * dim) % 256
    gen = torch.Generator().manual_seed(3)
    scales = (torch.rand(rows, 1, generator=gen) + 0.5).half() / kv_quant.LARGEST[fmt]
    raw = torch.cat([codes.view(rows, dim).to(torch.uint8), scales.view(torch.uint8)], dim=1)
    v_cache = torch.zeros(rows, BLOCK, 1, dim + kv_quant.SCALE_BYTES, dtype=torch.uint8)
    v_cache[:, 0, 0] = raw
    v_cache = v_cache.view(fmt)
    k_cache = torch.zeros_like(v_cache)  # codes 0, scale 0: every score 0
    q = torch.randn(rows, 2, dim, generator=gen)
    tables, lens = torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.long)
    out, lse, ref, ref_lse, _, v_ref = _against_dequantized(q, k_cache, v_cache, tables, lens, None, 0, 0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0.0, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse)
    want = v_ref[:, 0, 0].unsqueeze(1).expand_as(out)  # softmax over one key: weight 1
    torch.testing.assert_close(out, want, rtol=1e-6, atol=0.0, equal_nan=True)
    assert out.isnan().sum().item() == (2 * 2 if fmt == torch.float8_e4m3fn else 0)  # 0x7f, 0xff; 2 heads


def test_bad_packed_inputs_raise_not_crash():
    q, k_cache, v_cache, tables, lens, _, _, _ = _packed_inputs(CASES[0], torch.int8, torch.float32)
    with pytest.raises(RuntimeError, match="head dim"):  # rows of D, not D + 2
        kernel.decode_attention(q, k_cache[..., :-2].contiguous(), v_cache[..., :-2].contiguous(), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must share a dtype"):
        kernel.decode_attention(q, k_cache, v_cache.view(torch.float8_e4m3fn), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="q must be float32"):
        kernel.decode_attention(q.double(), k_cache, v_cache, tables, lens, 0.1)
