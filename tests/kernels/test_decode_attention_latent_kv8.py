"""Decode attention over a latent cache (MLA: ``v_cache`` is ``k_cache``, one KV head) of 8-bit
packed rows (``--kv-cache-dtype int8 | fp8_e4m3``): the latent path (``kernels/latent_attention.h``)
dequantizes each chunk of rows it reads into its float32 scratch (``kernels/kv8_rows.h``: code *
scale, exact in float32) and then runs its own arithmetic, so its result must be, bit for bit,
the same kernel's over the float32 latent cache ``kv_quant.dequantize_rows`` makes of the same rows
(q in float32, the output rounded to q's dtype). int8 and E4M3, q float32, bfloat16 and float16,
DeepSeek's widths (576 = 512 + 64, values 512) and widths that leave tails (a head dim not a
whole vector, 5 heads), one row and several of different lengths with an empty one, a first
position (a cascade's tails), blocks of 8, every value (``v_dim`` 0), runs split over two
threads, and the batch-invariant mode's fixed runs; against float64 attention too."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import decode_attention as kernel
from hyprefix.models import kv_quant
from tests.kernels.test_decode_attention import _reference
from tests.kernels.test_decode_attention_latent import assert_rows_keep_their_bits
from tests.support.compare import with_threads

pytestmark = pytest.mark.skipif(not device_caps("cpu").paged_decode(torch.float32),
                                reason="no x86 AVX2/AVX-512 CPU: the model gathers for SDPA (test_decode_attention)")

FORMATS = [torch.int8, torch.float8_e4m3fn]

# (heads, latent dim D, value width (0: all D), context lengths, first positions or None, block
# size, run_blocks)
CASES = [
    (16, 576, 512, [130], None, 16, 0),  # DeepSeek-V2-Lite: one row, 8 blocks and 2 keys
    (16, 576, 512, [1, 47, 300, 0], None, 16, 0),  # rows of different lengths, one empty
    (12, 576, 512, [700, 33], None, 16, 0),  # 700 keys: several runs on two threads
    (5, 44, 20, [70, 3], None, 16, 0),  # tails: 5 heads, rows of 44 (a partial vector), values 20
    (16, 576, 512, [300, 45], [37, 0], 16, 0),  # cascade tails: the tables start at positions 37 / 0
    (16, 72, 64, [45, 200], None, 8, 0),  # blocks of 8 keys
    (8, 48, 0, [90, 17], None, 16, 0),  # every value (a cascade's tails ask for all D)
    (16, 576, 512, [300, 5, 520, 0], None, 16, 4),  # the batch-invariant mode: fixed runs of 4 blocks
]


def _packed_latent(case, fmt, q_dtype, seed=0):
    """q and a packed latent cache: random rows whose last eighth (the rope part) is larger than
    the rest, through kv_quant.quantize_rows; the call's tables and lengths."""
    heads, dim, _, lens, first, block, _ = case
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-(n - (first[i] if first else 0)) // block) for i, n in enumerate(lens)) + 1)
    blocks = len(lens) * width + 3
    rows = torch.randn(blocks, block, 1, dim, generator=gen) * torch.rand(blocks, block, 1, 1, generator=gen)
    rows[..., dim - dim // 8:] *= 3
    q = torch.randn(len(lens), heads, dim, generator=gen).to(q_dtype)
    tables = torch.randperm(blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    return q, kv_quant.quantize_rows(rows, fmt), tables, torch.tensor(lens), torch.tensor(first) if first else None


def _both(case, fmt, q_dtype, threads, seed=0):
    """(out, lse) over the packed cache and over its float32 dequantization (q in float32, the
    output rounded to q's dtype), and the inputs."""
    q, cache, tables, lens, first_pos = _packed_latent(case, fmt, q_dtype, seed)
    deq = kv_quant.dequantize_rows(cache, torch.float32)
    v_dim, run_blocks, scale = case[2] or None, case[6], case[1] ** -0.5

    def calls():
        got = kernel.decode_attention(q, cache, cache, tables, lens, scale, first_pos=first_pos,
                                      run_blocks=run_blocks, v_dim=v_dim)
        ref = kernel.decode_attention(q.float(), deq, deq, tables, lens, scale, first_pos=first_pos,
                                      run_blocks=run_blocks, v_dim=v_dim)
        return got, ref

    (out, lse), (ref, ref_lse) = with_threads(threads, calls)
    return out, lse, ref.to(q_dtype), ref_lse, (q, deq, tables, lens, first_pos, scale)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_packed_latent_rows_equal_the_dequantized_cache(case, fmt, q_dtype, threads):
    """The packed cache's result is the dequantized cache's, bit for bit (the same runs, each
    row's values exact in float32); an empty row gets zeros and -inf."""
    assert kernel.available(q_dtype)
    out, lse, ref, ref_lse, (q, *_) = _both(case, fmt, q_dtype, threads)
    v_dim = case[2] or case[1]
    assert out.dtype == q_dtype and out.shape == (*q.shape[:2], v_dim) and out.is_contiguous()
    assert torch.equal(out, ref)
    assert torch.equal(lse, ref_lse)
    empty = torch.isinf(lse)
    assert empty[:, 0].tolist() == [n == 0 for n in case[3]]
    assert not out[empty[:, 0]].any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[7]])
def test_packed_latent_rows_match_float64(case, fmt):
    """Against float64 attention over the dequantized rows (the first v_dim values of every head)."""
    out, lse, _, _, (q, deq, tables, lens, first_pos, scale) = _both(case, fmt, torch.float32, 1)
    ref, ref_lse = _reference(q, deq, deq, tables, lens, first_pos, scale, 0)
    empty = torch.isinf(ref_lse)
    assert (out.double() - ref[..., :out.shape[-1]]).abs().max().item() < 2e-6
    assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_long_packed_latent_context_splits_into_runs_that_merge_exactly(fmt):
    """Two threads split 2,000 keys of 16 heads into runs merged by their log-sum-exp: one
    thread's single pass, to float32 rounding."""
    case = (16, 576, 512, [2000], None, 16, 0)
    q, cache, tables, lens, _ = _packed_latent(case, fmt, torch.float32, seed=1)
    call = lambda: kernel.decode_attention(q, cache, cache, tables, lens, 0.05, v_dim=512)  # noqa: E731
    one, split = with_threads(1, call), with_threads(2, call)
    assert (one[0] - split[0]).abs().max().item() < 2e-6
    assert (one[1] - split[1]).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_invariant_packed_latent_rows_keep_their_bits(fmt):
    """Fixed runs (the batch-invariant mode): each row alone on one thread and all rows together
    on two give the same bits."""
    q, cache, tables, lens, _ = _packed_latent(CASES[7], fmt, torch.bfloat16, seed=3)
    assert_rows_keep_their_bits(q, cache, tables, lens)
