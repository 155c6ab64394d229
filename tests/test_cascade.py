"""Cascade decode attention: the grouping plan on plain data, and the attention it
drives against the plain gathered path."""

from __future__ import annotations

import pytest
import torch

from hyprefix.runner.cascade import SharedPrefix, plan_shared_prefixes


def test_groups_rows_by_shared_leading_blocks():
    tables = [[5, 6, 7, 20], [5, 6, 7, 21], [9, 1], [5, 6, 8, 22], [9, 2]]
    lens = [60, 58, 20, 50, 30]
    groups, shared = plan_shared_prefixes(tables, lens, block_size=16, min_saved_tokens=0)
    assert groups == [SharedPrefix(rows=[0, 1, 3], blocks=[5, 6]), SharedPrefix(rows=[2, 4], blocks=[9])]
    assert shared == [2, 2, 1, 2, 1]


def test_shared_blocks_stop_before_the_current_token():
    # Both rows hold block 3 as their last block; row 1's current token (position 32) is
    # in block 2, so only blocks 0-1 may be shared.
    tables = [[1, 2, 3], [1, 2, 3]]
    groups, shared = plan_shared_prefixes(tables, [48, 33], block_size=16, min_saved_tokens=0)
    assert groups == [SharedPrefix(rows=[0, 1], blocks=[1, 2])]
    assert shared == [2, 2]
    # A row still inside its first block shares nothing.
    groups, shared = plan_shared_prefixes([[1, 2], [1]], [20, 10], block_size=16, min_saved_tokens=0)
    assert groups == [] and shared == [0, 0]


def test_small_savings_and_lone_rows_are_not_grouped():
    tables = [[1, 2, 3], [1, 2, 4], [7, 8, 9]]
    lens = [40, 40, 40]
    assert plan_shared_prefixes(tables, lens, 16, min_saved_tokens=33)[0] == []
    groups, _ = plan_shared_prefixes(tables, lens, 16, min_saved_tokens=32)
    assert groups == [SharedPrefix(rows=[0, 1], blocks=[1, 2])]


def test_contiguous_blocks_are_detected():
    assert SharedPrefix(rows=[0, 1], blocks=[4, 5, 6]).contiguous
    assert not SharedPrefix(rows=[0, 1], blocks=[4, 6]).contiguous


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_cascade_decode_matches_gathered_decode(dtype, tol, contiguous):
    from hyprefix.models.attention import paged_attention
    from hyprefix.models.fused import Kernels
    from hyprefix.outputs import ScheduledSeq
    from hyprefix.runner.batch import build_batch
    from hyprefix.sampling import SamplingParams

    gen = torch.Generator().manual_seed(0)
    bs, kvh, heads, dim, num_blocks = 4, 2, 6, 8, 64
    k_cache = torch.randn(num_blocks, bs, kvh, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, dim, generator=gen).to(dtype)
    shared_a = [10, 11, 12] if contiguous else [30, 3, 17]
    tables = [[*shared_a, 40, 41], [*shared_a, 42], [20, 21, 43, 44, 45], [20, 21, 46], [50, 51]]
    lens = [19, 15, 18, 10, 6]
    seqs = [ScheduledSeq(request_id=str(i), token_ids=[1], start_pos=n - 1, block_table=t, sample=True,
                         params=SamplingParams())
            for i, (t, n) in enumerate(zip(tables, lens, strict=True))]
    batch = build_batch(seqs, bs, torch.device("cpu"), Kernels(compile_enabled=False))
    plan = batch.decode_cascade
    assert plan is not None and len(plan.groups) == 2
    assert (plan.groups[0].first_block is not None) == contiguous
    q = torch.randn(len(seqs), heads, dim, generator=gen).to(dtype)
    k = torch.randn(len(seqs), kvh, dim, generator=gen).to(dtype)
    v = torch.randn(len(seqs), kvh, dim, generator=gen).to(dtype)
    out = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, dim**-0.5, None)
    batch.decode_cascade = None
    ref = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, dim**-0.5, None)
    assert (out.float() - ref.float()).abs().max().item() < tol
