"""Recurrent-state prefix caching on hybrid models (Mamba2 and Gated DeltaNet): equivalence with caching off and the
checkpoint placement rules (divergence point, last prompt boundary, finish)."""

from __future__ import annotations

import logging

import pytest

from hyprefix import LLM, SamplingParams
from tests.engine.test_prefix_cache_engine import mixed_prompts
from tests.support.compare import random_prompts
from tests.support.models import HYBRID_ARCHS, TINY_CASCADE
from tests.support.plain_scheduling import kv, state_kind

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def make(path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(str(path), dtype="float32", log_stats_interval=0, **TINY_CASCADE, **kwargs)


def greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.check_invariants()
    return [o.outputs[0].token_ids for o in outs]


def checkpoint_at(llm: LLM, prompt: list[int], position: int) -> bool:
    """Whether a Mamba checkpoint exists after ``position`` tokens of ``prompt``."""
    from hyprefix.request import Request

    probe = Request("probe", prompt, GREEDY)
    hashes = kv(llm.engine.scheduler).update_hashes(probe)
    return state_kind(llm.engine.scheduler).pool.lookup(hashes[position // 16 - 1]) is not None


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_identical_with_cache_on_off_and_chunked(hybrid_models, arch):
    path, _ = hybrid_models[arch]
    prompts = mixed_prompts(16)
    reference = greedy(make(path, enable_prefix_caching=False), prompts)
    for waves, budget in ((1, 2048), (3, 24), (1, 7), (3, 2048)):  # unchunked and chunked prefill
        llm = make(path, max_num_batched_tokens=budget)
        size = -(-len(prompts) // waves)
        tokens = [t for i in range(0, len(prompts), size) for t in greedy(llm, prompts[i:i + size])]
        assert tokens == reference, f"{arch} waves={waves} budget={budget}"
        stats = llm.get_stats()
        assert stats["prefix_cache_hits"] > 0 and stats["mamba_checkpoints_used"] > 0


def test_restored_prefills_share_a_step_with_a_fresh_one(hybrid_models):
    """Several prefills restored from checkpoints, next to a fresh prefill, in one step."""
    path, _ = hybrid_models["nemotron_h"]
    a, b, fresh = random_prompts([40, 57, 33], seed=31)
    followups = [a + random_prompts([9], seed=32)[0], b + random_prompts([20], seed=33)[0], fresh]
    reference = greedy(make(path, enable_prefix_caching=False), followups)

    llm = make(path)
    greedy(llm, [a, b])
    steps = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda out, *masks: steps.append(out) or execute(out, *masks)
    assert greedy(llm, followups) == reference
    first = steps[0]
    assert len([src for src, _ in first.state_ops if src is not None]) == 2  # a and b restored
    assert len([src for src, _ in first.state_ops if src is None]) == 1  # fresh starts from zeros
    assert sorted(s.start_pos for s in first.seqs) == [0, 32, 48]


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5"])
def test_divergence_point_checkpoint(hybrid_models, arch):
    path, _ = hybrid_models[arch]
    llm = make(path)
    shared = random_prompts([40], seed=41)[0]
    first = shared + random_prompts([30], seed=42)[0]  # checkpoints only at its own last boundary, 64
    greedy(llm, [first])
    assert checkpoint_at(llm, first, 64) and not checkpoint_at(llm, first, 32)
    branch = shared[:32] + random_prompts([12], seed=43)[0]  # leaves the cached KV path at 32
    out = llm.generate([branch], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # KV blocks below 32 were cached, but no state at 32
    assert llm.get_stats()["hybrid_hit_tokens_lost"] == 32
    assert checkpoint_at(llm, branch, 32)  # taken at the divergence point
    other = shared[:32] + random_prompts([20], seed=44)[0]
    assert llm.generate([other], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.get_stats()["hybrid_hit_tokens_lost"] == 32


def test_last_boundary_checkpoint_of_a_multi_chunk_prompt(hybrid_models):
    path, _ = hybrid_models["bamba"]
    llm = make(path, max_num_batched_tokens=30)  # chunks 0-30, 30-60, 60-90, 90-100: 96 is mid-chunk
    prompt = random_prompts([100], seed=51)[0]
    extended = [*prompt, 7, 8, 9]
    reference = greedy(make(path, enable_prefix_caching=False), [prompt, extended])
    assert greedy(llm, [prompt]) == reference[:1]
    assert checkpoint_at(llm, prompt, 96)
    outs = llm.generate([prompt, extended], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [96, 96]
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next"])
@pytest.mark.parametrize("budget", [2048, 21])
def test_identical_block_aligned_prompt_computes_only_its_last_token(hybrid_models, budget, arch):
    """The RL-burst case: a block-aligned prompt seen before is a full KV hit that
    resumes from the checkpoint one token before its end and computes one token, as on
    a dense model. With a 21-token budget the chunks end at 21, 42 and 63: the state
    after 63 tokens is written one step before its block completes and is published
    with it."""
    path, _ = hybrid_models[arch]
    prompt = random_prompts([64], seed=52)[0]
    reference = greedy(make(path, enable_prefix_caching=False), [prompt])
    llm = make(path, max_num_batched_tokens=budget)
    first = greedy(llm, [prompt])
    outs = llm.generate([prompt] * 3, GREEDY, use_tqdm=False)
    llm.check_invariants()
    assert [o.num_cached_tokens for o in outs] == [63, 63, 63]
    stats = llm.get_stats()
    assert stats["prefill_computed_tokens"] == 64 + 3 and stats["hybrid_hit_tokens_lost"] == 0
    assert first == reference and [o.outputs[0].token_ids for o in outs] == reference * 3


def test_identical_prompts_submitted_together_compute_the_prompt_once(hybrid_models):
    path, _ = hybrid_models["nemotron_h"]
    prompt = random_prompts([64], seed=53)[0]
    llm = make(path)
    outs = llm.generate([prompt] * 4, GREEDY, use_tqdm=False)
    assert sorted(o.num_cached_tokens for o in outs) == [0, 63, 63, 63]
    assert llm.get_stats()["prefill_computed_tokens"] == 64 + 3
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_next"])
def test_finish_checkpoint_is_reused_by_the_next_turn(hybrid_models, arch):
    path, _ = hybrid_models[arch]
    llm = make(path)
    prompt = random_prompts([40], seed=61)[0]
    answer = greedy(llm, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    history = prompt + answer  # 80 tokens; the last one was never computed
    assert checkpoint_at(llm, history, 64)
    assert not checkpoint_at(llm, history, 48)  # the earlier provisional decode checkpoint was dropped
    follow_up = history + random_prompts([5], seed=62)[0]
    reference = greedy(make(path, enable_prefix_caching=False), [follow_up])
    out = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and [out.outputs[0].token_ids] == reference


def test_checkpoint_dies_with_its_kv_block(hybrid_models):
    path, _ = hybrid_models["nemotron_h"]
    llm = make(path, num_kv_blocks=12)
    prompt = random_prompts([40], seed=71)[0]
    greedy(llm, [prompt])
    assert checkpoint_at(llm, prompt, 32)
    used = llm.get_stats()["mamba_checkpoints_used"]
    greedy(llm, random_prompts([170], seed=72))  # 170 + 10 tokens take all 12 blocks: evicts prompt's
    assert not checkpoint_at(llm, prompt, 32)
    assert llm.get_stats()["mamba_checkpoints_used"] <= used  # dropped, not leaked
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.parametrize("budget_gb", [0.0, 1e-9])
def test_no_checkpoint_budget_still_correct(hybrid_models, budget_gb, caplog):
    """0 disables hybrid hits; a budget below one checkpoint gives zero slots and a warning."""
    path, _ = hybrid_models["nemotron_h"]
    prompt = random_prompts([50], seed=81)[0]
    reference = greedy(make(path, enable_prefix_caching=False), [prompt, prompt])
    with caplog.at_level(logging.WARNING, logger="hyprefix"):
        llm = make(path, state_cache_memory_gb=budget_gb)
    assert ("smaller than one state checkpoint" in caplog.text) == (budget_gb > 0)
    assert greedy(llm, [prompt]) + greedy(llm, [prompt]) == reference
    stats = llm.get_stats()
    assert stats["mamba_checkpoints_capacity"] == 0 and stats["mamba_checkpoints_used"] == 0
    assert stats["prefix_cache_hits"] == 0 and stats["hybrid_hit_tokens_lost"] == 48


@pytest.mark.parametrize("policy", ["lru", "cost-aware"])
def test_cost_aware_eviction_keeps_a_conversation_through_one_off_prompts(hybrid_models, policy):
    """Three checkpoint slots: one-off prompts push the conversation's finish checkpoint out
    under lru; cost-aware keeps it (it saves the most FLOPs), and the next turn hits it. Outputs
    are those of caching off either way."""
    path, _ = hybrid_models["nemotron_h"]
    llm = make(path, max_state_checkpoints=3, max_num_seqs=1, state_cache_eviction_policy=policy)
    pool = state_kind(llm.engine.scheduler).pool
    assert pool.policy.name == policy
    assert pool.policy.cost.linear_flops_per_token == 2.0 * llm.engine.model_facts.matmul_params
    prompt, *one_offs = random_prompts([100, 30, 30, 30], seed=91)
    history = prompt + greedy(llm, [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert checkpoint_at(llm, history, 128)
    for one_off in one_offs:  # each takes two checkpoints: at 16 (its last boundary) and 32 (its finish)
        greedy(llm, [one_off])
    follow_up = history + random_prompts([5], seed=92)[0]
    reference = greedy(make(path, enable_prefix_caching=False), [follow_up])
    out = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == (128 if policy == "cost-aware" else 0)
    assert [out.outputs[0].token_ids] == reference
