"""Cascade decode attention: the grouping plan on plain data, and the attention it
drives against the plain gathered path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.config import EngineArgs
from hyprefix.runner.cascade import CascadeThresholds, FastPathCost, Segment
from hyprefix.runner.cascade import plan_segments as plan_any
from tests.support.compare import hf_greedy, random_prompts
from tests.support.models import TINY_CASCADE

PRODUCTION = CascadeThresholds(EngineArgs().cascade_min_saved_tokens, EngineArgs().cascade_min_solo_run_tokens,
                               EngineArgs().cascade_min_traffic_ratio)

def plan_segments(tables: list[list[int]], lens: list[int], block_size: int, min_saved_tokens: int):
    """The grouping alone: lone rows never become segments of their own."""
    return plan_any(tables, lens, block_size, CascadeThresholds(min_saved_tokens, min_solo_run_tokens=10**9))


def test_groups_rows_by_shared_leading_blocks():
    tables = [[5, 6, 7, 20], [5, 6, 7, 21], [9, 1], [5, 6, 8, 22], [9, 2]]
    lens = [60, 58, 20, 50, 30]
    groups, shared = plan_segments(tables, lens, block_size=16, min_saved_tokens=0)
    assert groups == [Segment(rows=[0, 1, 3], blocks=[5, 6]), Segment(rows=[2, 4], blocks=[9])]
    assert shared == [2, 2, 1, 2, 1]


def test_shared_blocks_stop_before_the_current_token():
    # Both rows hold block 3 as their last block; row 1's current token (position 32) is
    # in block 2, so only blocks 0-1 may be shared.
    tables = [[1, 2, 3], [1, 2, 3]]
    groups, shared = plan_segments(tables, [48, 33], block_size=16, min_saved_tokens=0)
    assert groups == [Segment(rows=[0, 1], blocks=[1, 2])]
    assert shared == [2, 2]
    # A row still inside its first block shares nothing.
    groups, shared = plan_segments([[1, 2], [1]], [20, 10], block_size=16, min_saved_tokens=0)
    assert groups == [] and shared == [0, 0]


def test_rows_split_like_a_trie_when_subsets_share_more():
    # A common first block (a chat-template header), then two system prompts of 3 blocks.
    head, sys_a, sys_b = [1], [10, 11, 12], [20, 21, 22]
    tables = [[*head, *sys_a, 30 + i] for i in range(3)] + [[*head, *sys_b, 40 + i] for i in range(3)]
    groups, shared = plan_segments(tables, [80] * 6, block_size=16, min_saved_tokens=0)
    assert groups == [Segment(rows=[0, 1, 2], blocks=[1, 10, 11, 12]),
                      Segment(rows=[3, 4, 5], blocks=[1, 20, 21, 22])]
    assert shared == [4] * 6


def test_a_short_row_does_not_cut_the_prefix_of_the_others():
    tables = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8], [1, 2, 3, 4, 7], [1, 6]]
    lens = [80, 80, 80, 20]  # row 3 may share one block only
    groups, shared = plan_segments(tables, lens, block_size=16, min_saved_tokens=0)
    assert groups == [Segment(rows=[0, 1, 2], blocks=[1, 2, 3, 4])]  # saves 2 x 4 blocks, not 3 x 1
    assert shared == [4, 4, 4, 0]


def test_small_savings_and_lone_rows_are_not_grouped():
    tables = [[1, 2, 3], [1, 2, 4], [7, 8, 9]]
    lens = [40, 40, 40]
    assert plan_segments(tables, lens, 16, min_saved_tokens=33)[0] == []
    groups, _ = plan_segments(tables, lens, 16, min_saved_tokens=32)
    assert groups == [Segment(rows=[0, 1], blocks=[1, 2])]


def test_long_private_parts_become_segments_of_their_own():
    # rows 0 and 1 share blocks 1-2; row 0 then has 3 private blocks before its current
    # token's block, row 1 only one; row 2 shares nothing and has 4 private blocks
    # (one range of ids, in any order).
    tables = [[1, 2, 7, 8, 9, 3], [1, 2, 5, 6], [20, 22, 21, 23, 4]]
    lens = [90, 60, 70]
    groups, covered = plan_any(tables, lens, 16, CascadeThresholds(min_saved_tokens=0, min_solo_run_tokens=48))
    assert groups == [Segment(rows=[0, 1], blocks=[1, 2]), Segment(rows=[0], blocks=[7, 8, 9]),
                      Segment(rows=[2], blocks=[20, 22, 21, 23])]
    assert covered == [5, 2, 4]  # row 1's one private block stays in the padded tail
    assert groups[2].contiguous and groups[1].contiguous
    assert plan_any(tables, lens, 16, CascadeThresholds(min_saved_tokens=0, min_solo_run_tokens=65))[1] == [2, 2, 0]


def test_production_thresholds_group_from_256_saved_tokens_and_read_256_private_tokens_alone():
    def pair(shared_blocks: int) -> tuple[list[list[int]], list[int]]:  # two rows, then their current blocks
        return [[*range(shared_blocks), 100], [*range(shared_blocks), 101]], [shared_blocks * 16 + 1] * 2

    assert plan_any(*pair(16), 16, PRODUCTION)[0] == [Segment(rows=[0, 1], blocks=list(range(16)))]
    assert plan_any(*pair(15), 16, PRODUCTION) == ([], [0, 0])  # saves 240 < 256
    lone = [*range(50, 66), 1]
    assert plan_any([lone], [16 * 16 + 1], 16, PRODUCTION)[0] == [Segment(rows=[0], blocks=lone[:16])]
    assert plan_any([lone[1:]], [15 * 16 + 1], 16, PRODUCTION)[0] == []


def test_contiguous_blocks_are_detected_in_any_order():
    assert Segment(rows=[0, 1], blocks=[4, 5, 6]).contiguous
    assert Segment(rows=[0, 1], blocks=[6, 4, 5]).contiguous
    assert not Segment(rows=[0, 1], blocks=[4, 6]).contiguous


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("in_place", [True, False])
def test_cascade_decode_matches_gathered_decode(dtype, tol, contiguous, in_place, monkeypatch):
    """The segment plan (its tails read in place by kernels/decode_attention.cpp, or gathered
    and padded) against plain gathered SDPA without a plan."""
    from hyprefix.kernels import decode_attention as decode_kernel
    from hyprefix.models.attention import paged_attention
    from hyprefix.outputs import ScheduledSeq
    from hyprefix.runner.batch import build_batch
    from hyprefix.sampling import SamplingParams

    gen = torch.Generator().manual_seed(0)
    bs, kvh, heads, dim, num_blocks = 4, 2, 6, 8, 64
    k_cache = torch.randn(num_blocks, bs, kvh, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, dim, generator=gen).to(dtype)
    shared_a = [11, 12, 10] if contiguous else [30, 3, 17]
    # rows 0-1 and 2-3 share prefixes; row 4 is alone with a run of 3 consecutive blocks
    tables = [[*shared_a, 40, 41], [*shared_a, 42], [20, 21, 43, 44, 45], [20, 21, 46], [52, 51, 50, 53]]
    lens = [19, 15, 18, 10, 14]
    seqs = [ScheduledSeq(request_id=str(i), token_ids=[1], start_pos=n - 1, block_table=t, sample=True,
                         params=SamplingParams())
            for i, (t, n) in enumerate(zip(tables, lens, strict=True))]
    batch = build_batch(seqs, bs, torch.device("cpu"), CascadeThresholds(*TINY_CASCADE.values()))
    plan = batch.decode_cascade
    assert plan is not None
    shared = [g for g in plan.segments if g.rows.numel() > 1]
    assert [g.rows.tolist() for g in shared] == [[0, 1], [2, 3]]
    assert (shared[0].first_block is not None) == contiguous
    # row 4's private blocks 52, 51, 50 are one range: read in place from block 50
    assert any(g.rows.tolist() == [4] and g.first_block == 50 for g in plan.segments)
    assert sum(0 in g.rows.tolist() for g in plan.segments) == 2  # row 0: its group's segment and its own
    assert (plan.segments[0].first_block is not None) == contiguous
    q = torch.randn(len(seqs), heads, dim, generator=gen).to(dtype)
    k = torch.randn(len(seqs), kvh, dim, generator=gen).to(dtype)
    v = torch.randn(len(seqs), kvh, dim, generator=gen).to(dtype)
    if in_place and not decode_kernel.available(dtype):
        pytest.skip("kernels/decode_attention.cpp does not run here")
    monkeypatch.setitem(decode_kernel._runs, dtype, in_place)
    out = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, dim**-0.5, None)
    batch.decode_cascade = None
    monkeypatch.setitem(decode_kernel._runs, dtype, False)
    ref = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), batch, dim**-0.5, None)
    assert (out.float() - ref.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_math_attention_with_lse_matches_the_fused_cpu_kernel(dtype, tol):
    """The device-agnostic fallback used off CPU, against torch's CPU flash kernel."""
    from hyprefix.models.attention import attention_with_lse, math_attention_with_lse

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 4, 16, generator=gen).to(dtype)
    k = torch.randn(3, 2, 40, 16, generator=gen).to(dtype)
    v = torch.randn(3, 2, 40, 16, generator=gen).to(dtype)
    mask = torch.zeros(3, 1, 1, 40, dtype=dtype)
    mask[0, ..., 30:] = float("-inf")
    out, lse = attention_with_lse(q, k, v, mask, 0.25)
    ref_out, ref_lse = math_attention_with_lse(q, k, v, mask, 0.25)
    assert ref_out.dtype == torch.float32 and lse.dtype == ref_lse.dtype == torch.float32
    assert (out.float() - ref_out).abs().max().item() < tol
    assert (lse - ref_lse).abs().max().item() < 1e-4


def test_engine_takes_the_cascade_path_with_production_thresholds(tiny_models):
    """Prompts long enough for the production thresholds (the engine's default) on the eager
    path (no fast decode path to weigh the plan against): two requests for one 300-token
    prompt share its 18 full blocks (saving 288 >= 256 K/V rows), and a 290-token prompt
    reads its 18 private blocks (288 >= 256 tokens) as a segment of its own; greedy tokens
    equal transformers'."""
    path, hf = tiny_models["qwen3"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, enforce_eager=True)
    assert llm.engine.runner.cascade_thresholds == PRODUCTION
    model = llm.engine.runner.model
    forward, plans = model.forward, []
    model.forward = lambda batch, *rest: plans.append(batch.decode_cascade) or forward(batch, *rest)
    shared, alone = random_prompts((300, 290), seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([shared, shared, alone], params, use_tqdm=False)
    segments = [g for plan in plans if plan is not None for g in plan.segments]
    assert any(g.rows.numel() == 2 and g.blocks.numel() == 18 for g in segments)
    assert any(g.rows.numel() == 1 and g.blocks.numel() == 18 for g in segments)
    for prompt, out in zip([shared, shared, alone], outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, params.max_tokens)
    llm.check_invariants()


def _decode_seqs(tables: list[list[int]], lens: list[int]) -> list:
    from hyprefix.outputs import ScheduledSeq
    from hyprefix.sampling import SamplingParams

    return [ScheduledSeq(request_id=str(i), token_ids=[1], start_pos=n - 1, block_table=t, sample=True,
                         params=SamplingParams()) for i, (t, n) in enumerate(zip(tables, lens, strict=True))]


def test_fast_path_weighs_the_bytes_a_shared_plan_saves():
    """``FastPathCost.worth_sharing``: reading every row whole must move at least
    ``min_traffic_ratio`` times the bytes of the shared plan (weights included)."""
    shared = [Segment(rows=[0, 1, 2, 3], blocks=[1, 2, 3, 4]), Segment(rows=[3], blocks=[9])]
    lens = [80, 80, 80, 80]  # 320 tokens whole; the plan saves 3 x 64 = 192 of them
    cost = FastPathCost(weight_bytes=0, kv_bytes_per_token=10, min_traffic_ratio=2.5, max_rows=None)
    assert cost.worth_sharing(shared, lens, 16)  # 3200 bytes whole >= 2.5 x 1280
    assert not FastPathCost(0, 10, 2.6, None).worth_sharing(shared, lens, 16)
    assert not FastPathCost(1000, 10, 2.5, None).worth_sharing(shared, lens, 16)  # the weights dilute it
    assert FastPathCost(1000, 10, 2.5, 3).worth_sharing(shared, lens, 16)  # 4 rows: eager anyway
    assert FastPathCost(10**9, 10, 0.0, None).worth_sharing(shared, lens, 16)  # 0: always share


def test_build_batch_drops_a_shared_plan_the_fast_path_beats():
    """Four rows on a 4-block shared prefix: kept without a fast path, dropped for a plan
    without groups (but with the rows' own long runs) when the fast path moves too few
    bytes more, kept when it moves enough more; a step with a prefill keeps it (no fast path
    takes it)."""
    from hyprefix.runner.batch import build_batch

    tables = [[1, 2, 3, 4, 10 + r, 20 + r, 30 + r] for r in range(4)]
    lens = [100] * 4
    seqs = _decode_seqs(tables, lens)
    thresholds = CascadeThresholds(min_saved_tokens=0, min_solo_run_tokens=32, min_traffic_ratio=0.0)

    def groups(batch) -> list[list[int]]:
        plan = batch.decode_cascade
        return [] if plan is None else [g.rows.tolist() for g in plan.segments]

    cpu = torch.device("cpu")
    assert groups(build_batch(seqs, 16, cpu, thresholds)) == [[0, 1, 2, 3], [0], [1], [2], [3]]
    slow = FastPathCost(weight_bytes=100, kv_bytes_per_token=1, min_traffic_ratio=4.0, max_rows=None)
    kept = groups(build_batch(seqs, 16, cpu, thresholds, slow))  # 500 bytes whole, 308 shared: 1.6x < 4
    assert kept == [[0], [1], [2], [3]]  # every row reads its whole table: its own run of 6 blocks
    cheap = FastPathCost(weight_bytes=0, kv_bytes_per_token=1, min_traffic_ratio=1.5, max_rows=None)
    assert groups(build_batch(seqs, 16, cpu, thresholds, cheap))[0] == [0, 1, 2, 3]  # 400 / 208 >= 1.5
    prefill = dataclasses.replace(_decode_seqs([[40, 41]], [20])[0], token_ids=[1] * 20, start_pos=0)
    assert groups(build_batch([*seqs, prefill], 16, cpu, thresholds, slow))[0] == [0, 1, 2, 3]


def test_multi_turn_decodes_stay_on_the_fast_path(tiny_models):
    """Conversations that share a system prompt decode in the one-call int8 kernel (the cascade
    plan would save too few bytes to pay for the eager path), and equal an eager engine that
    reads the shared prefix once."""
    from hyprefix.kernels import decode_layers

    if not decode_layers.available():
        pytest.skip("the decode_layers kernel does not run here")
    path, _ = tiny_models["llama"]
    system = random_prompts((64,), seed=3)[0]
    prompts = [system + tail for tail in random_prompts((9, 12, 7, 15), seed=4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fast = LLM(str(path), dtype="float32", num_kv_blocks=128, quantization="int8", enforce_eager=True,
               cascade_min_saved_tokens=0)
    shared = LLM(str(path), dtype="float32", num_kv_blocks=128, quantization="int8", enforce_eager=True,
                 cascade_min_saved_tokens=0, cascade_min_traffic_ratio=0.0)
    shared.engine.runner.model.decode_kernel = False  # the eager path, which takes the shared plan
    for llm in (fast, shared):
        llm.generate(prompts[:1], params, use_tqdm=False)  # the system prompt cached
    outs = [llm.generate(prompts[1:], params, use_tqdm=False) for llm in (fast, shared)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    stats = fast.get_stats()
    assert stats["decode_steps_kernel"] == 2 * (params.max_tokens - 1) and stats["decode_steps_eager"] == 0
    fast.check_invariants()
