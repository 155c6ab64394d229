"""Decode attention over a latent cache (MLA: ``v_cache`` is ``k_cache``, one KV head), the
kernel's own path (``kernels/latent_attention.h``): every query head from one read of each key
row, each head's output the first ``v_dim`` values of the weighted rows. Against float64
attention over the same blocks: DeepSeek's widths (D 576, values 512) with 16 heads and 12,
widths and head counts that leave tails of every tile (heads 5, values 20 of 40; 128 heads),
context lengths that are not whole blocks, longer than one thread's run, a batch of rows of
different lengths with an empty one, a first position (a cascade's tails), blocks of 8, one
thread and two, float32, bfloat16 and float16. Also: the latent path equals the general one on
a copy of the cache, runs split over threads merge to one thread's result, the batch-invariant
mode keeps a row's bits whatever the batch and the threads, ``v_dim`` on other caches, and the
op's fake under torch.compile."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import decode_attention as kernel
from tests.kernels.test_decode_attention import _reference
from tests.support.compare import with_threads

pytestmark = pytest.mark.skipif(not device_caps("cpu").paged_decode(torch.float32),
                                reason="no x86 AVX2/AVX-512 CPU: the model gathers for SDPA (test_decode_attention)")

# (heads, latent dim D, value width, context lengths, first positions or None, block size)
CASES = [
    (16, 576, 512, [130], None, 16),  # DeepSeek-V2-Lite: 16 heads, 8 blocks and 2 keys
    (16, 576, 512, [1, 47, 300, 0], None, 16),  # a batch of rows of different lengths, one empty
    (12, 576, 512, [700, 33], None, 16),  # 12 heads (padded lanes); 700 keys: several runs on 2 threads
    (5, 40, 20, [70, 3], None, 16),  # tails: 5 heads, values 20 (a partial vector), keys 70
    (128, 48, 32, [40], None, 16),  # DeepSeek-V3's 128 heads: several vectors of heads
    (16, 576, 512, [300, 45], [37, 0], 16),  # cascade tails: the tables start at positions 37 / 0
    (16, 72, 64, [45, 200], None, 8),  # blocks of 8 keys
]


def _latent_inputs(case, dtype, seed=0):
    heads, dim, _, lens, first, block = case
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-(n - (first[i] if first else 0)) // block) for i, n in enumerate(lens)) + 1)
    blocks = len(lens) * width + 3
    cache = torch.randn(blocks, block, 1, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    return q, cache, tables, torch.tensor(lens), torch.tensor(first) if first else None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_latent_decode_matches_float64(case, dtype, threads):
    """out [B, H, v_dim] = the first v_dim values of float64 attention; the log-sum-exp too;
    an empty row gets zeros and -inf."""
    assert kernel.available(dtype)
    q, cache, tables, lens, first_pos = _latent_inputs(case, dtype)
    v_dim, scale = case[2], case[1] ** -0.5
    out, lse = with_threads(threads, lambda: kernel.decode_attention(q, cache, cache, tables, lens, scale,
                                                                      first_pos=first_pos, v_dim=v_dim))
    ref, ref_lse = _reference(q, cache, cache, tables, lens, first_pos, scale, 0)
    assert out.dtype == dtype and out.shape == (*q.shape[:2], v_dim) and out.is_contiguous()
    tol = 2e-6 if dtype == torch.float32 else 2e-2  # 16-bit inputs, float32 arithmetic, 16-bit output
    assert (out.double() - ref[..., :v_dim]).abs().max().item() < tol
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() < 1e-4
    assert not out[empty[:, 0]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_path_equals_the_general_path_on_a_copy(dtype):
    """The same cache as two tensors (K and V apart: the general path, over all D values) and as
    one (the latent path): the same first v_dim values, to float32 rounding."""
    q, cache, tables, lens, _ = _latent_inputs(CASES[1], dtype, seed=2)
    latent, lse = kernel.decode_attention(q, cache, cache, tables, lens, 0.05, v_dim=512)
    general, general_lse = kernel.decode_attention(q, cache, cache.clone(), tables, lens, 0.05)
    assert general.shape[-1] == 576
    tol = 2e-6 if dtype == torch.float32 else 3e-2  # bfloat16: one unit in the last place at |x| < 4
    assert (latent.float() - general[..., :512].float()).abs().max().item() < tol
    assert torch.allclose(lse, general_lse, atol=1e-5, rtol=0, equal_nan=True)
    full, _ = kernel.decode_attention(q, cache, cache, tables, lens, 0.05)  # v_dim None: every value
    assert full.shape[-1] == 576 and (full[..., :512].float() - latent.float()).abs().max().item() < tol


def test_a_long_latent_context_splits_into_runs_that_merge_exactly():
    """Two threads split 2,000 keys of 16 heads into runs merged by their log-sum-exp: one
    thread's single pass, to float32 rounding."""
    q, cache, tables, lens, _ = _latent_inputs((16, 576, 512, [2000], None, 16), torch.float32, seed=1)
    call = lambda: kernel.decode_attention(q, cache, cache, tables, lens, 0.05, v_dim=512)  # noqa: E731
    one, split = with_threads(1, call), with_threads(2, call)
    assert (one[0] - split[0]).abs().max().item() < 1e-6
    assert (one[1] - split[1]).abs().max().item() < 1e-5


def assert_rows_keep_their_bits(q, cache, tables, lens):
    """Fixed runs of 4 blocks over a latent cache: each row alone on one thread gives the bits of
    all rows together on two. Returns (out, lse) of all rows together."""
    call = lambda idx: kernel.decode_attention(q[idx], cache, cache, tables[idx], lens[idx], 0.05,  # noqa: E731
                                               run_blocks=4, v_dim=512)
    together = with_threads(2, lambda: call(slice(None)))
    for b in range(q.shape[0]):
        alone = with_threads(1, lambda: call(slice(b, b + 1)))  # noqa: B023
        assert torch.equal(alone[0][0], together[0][b]) and torch.equal(alone[1][0], together[1][b])
    return together


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_latent_rows_keep_their_bits(dtype):
    """Fixed runs (``run_blocks``, the batch-invariant mode): each row alone on one thread and all
    rows together on two give the same bits, equal to float64 attention."""
    q, cache, tables, lens, _ = _latent_inputs((16, 576, 512, [300, 5, 520, 64, 129], None, 16), dtype, seed=3)
    together = assert_rows_keep_their_bits(q, cache, tables, lens)
    ref, _ = _reference(q, cache, cache, tables, lens, None, 0.05, 0)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (together[0].double() - ref[..., :512]).abs().max().item() < tol


def test_v_dim_on_other_caches_and_bad_values():
    """On K and V apart (GQA), ``v_dim`` keeps each head's first values of the full result;
    a v_dim past the head dim is refused."""
    from tests.kernels.test_decode_attention import CASES as PLAIN
    from tests.kernels.test_decode_attention import _inputs

    q, k_cache, v_cache, tables, lens, _, _ = _inputs(PLAIN[1], torch.float32)
    full, lse = kernel.decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    part, part_lse = kernel.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, v_dim=40)
    assert part.shape == (*q.shape[:2], 40) and part.is_contiguous()
    assert torch.equal(part, full[..., :40]) and torch.equal(lse, part_lse)
    with pytest.raises(RuntimeError, match="v_dim"):
        kernel.decode_attention(q, k_cache, v_cache, tables, lens, 0.1, v_dim=q.shape[-1] + 1)


def test_the_fake_gives_the_value_width_under_compile():
    """torch.compile traces the op through its fake: the output [B, H, v_dim], equal to eager."""
    q, cache, tables, lens, _ = _latent_inputs(CASES[3], torch.float32)

    def step(q, cache, tables, lens):
        out, lse = kernel.decode_attention(q, cache, cache, tables, lens, 0.1, v_dim=20)
        return out * 2, lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out, lse = compiled(q, cache, tables, lens)
    eager = step(q, cache, tables, lens)
    assert out.shape == (2, 5, 20) and torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
