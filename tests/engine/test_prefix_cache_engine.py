"""Prefix caching end to end on tiny dense models: identical greedy tokens with the
cache on and off, and a same-prompt burst computed once."""

from __future__ import annotations

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts
from tests.support.models import ARCHS, TINY_CASCADE

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def mixed_prompts(block_size: int) -> list[list[int]]:
    """Shared prefixes cut at block-aligned and unaligned points, exact duplicates
    (full hits), and unrelated prompts."""
    base = random_prompts([6 * block_size + 5], seed=11)[0]
    other = random_prompts([3 * block_size], seed=12)[0]
    tails = random_prompts([3, 9, 17, 1], seed=13)
    return [
        base,                                # computes the shared prefix
        base[: 2 * block_size] + tails[0],   # diverges block-aligned
        base[: 3 * block_size + 3] + tails[1],  # diverges inside a block
        list(base),                          # duplicate of a non-aligned prompt
        base[: 4 * block_size],              # block-aligned prefix: full hit
        other,                               # shares nothing
        list(other),                         # block-aligned duplicate: full hit
        base + tails[2],                     # extends the whole prompt
        tails[3],                            # one token
    ]


def run(path, prompts, waves: int, **kwargs) -> tuple[list[list[int]], dict]:
    """Generate in ``waves`` batches so later prompts can hit earlier ones' blocks."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, **TINY_CASCADE, **kwargs)
    size = -(-len(prompts) // waves)
    tokens = []
    for i in range(0, len(prompts), size):
        outs = llm.generate(prompts[i:i + size], GREEDY, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
        llm.check_invariants()
    return tokens, llm.get_stats()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_with_cache_on_and_off(tiny_models, arch):
    path, _ = tiny_models[arch]
    prompts = mixed_prompts(16)
    reference, ref_stats = run(path, prompts, waves=1, enable_prefix_caching=False)
    assert ref_stats["prefix_cache_hits"] == 0 and ref_stats["prefill_skipped_tokens"] == 0
    for waves, budget in ((1, 2048), (3, 24), (1, 7), (3, 2048)):  # unchunked and chunked prefill
        tokens, stats = run(path, prompts, waves=waves, max_num_batched_tokens=budget)
        assert tokens == reference, f"waves={waves} budget={budget}"
        assert stats["prefix_cache_hits"] > 0
        assert stats["prefill_computed_tokens"] < ref_stats["prefill_computed_tokens"]


@pytest.mark.parametrize("block_size", [7, 16])
def test_greedy_identical_with_odd_block_size(qwen3_dir, block_size):
    prompts = mixed_prompts(block_size)
    reference, _ = run(qwen3_dir, prompts, waves=1, enable_prefix_caching=False, block_size=block_size)
    tokens, stats = run(qwen3_dir, prompts, waves=2, block_size=block_size, max_num_batched_tokens=32)
    assert tokens == reference and stats["prefix_cache_hits"] > 0


@pytest.mark.parametrize("budget", [2048, 128])
def test_burst_of_eight_same_prompt_computes_it_once(qwen3_dir, budget):
    """8 requests with one 512-token prompt submitted together: the prompt is computed
    once (in one step, or in 4 chunks); each sibling waits for it and then computes
    only its last token."""
    prompt = random_prompts([512], seed=21)[0]
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=budget)
    outs = llm.generate([prompt] * 8, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    # Bound reached: the prompt once plus exactly one token per sibling.
    assert stats["prefill_computed_tokens"] == 512 + 7
    assert stats["prefill_skipped_tokens"] == 7 * 511
    # With room in the budget all 7 siblings would have started the prompt themselves.
    assert stats["sibling_waits"] == (7 if budget == 2048 else 0)
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [511] * 7
    assert sum(len(prompt) - o.num_cached_tokens for o in outs) == stats["prefill_computed_tokens"]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    llm.check_invariants()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] >= 512 // 16


def test_n_samples_share_the_prompt(qwen3_dir):
    prompt = random_prompts([100], seed=22)[0]
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256)
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=5), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    # 100 tokens = 6 full blocks + 4: each later sample hits the 96 cached tokens.
    assert llm.get_stats()["prefill_computed_tokens"] == 100 + 3 * 4


def test_next_chat_turn_hits_the_previous_answer(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256, **TINY_CASCADE)
    prompt = random_prompts([40], seed=23)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    history = prompt + first.outputs[0].token_ids  # 80 tokens; the last one was never computed
    follow_up = history + random_prompts([5], seed=24)[0]
    second = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    # Every full block of prompt + answer except the one holding the uncomputed last token.
    assert second.num_cached_tokens == (len(history) - 1) // 16 * 16 == 64


def test_cache_salt_separates_tenants(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256, **TINY_CASCADE)
    prompt = random_prompts([64], seed=25)[0]
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    a_again = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert (b.num_cached_tokens, plain.num_cached_tokens, a_again.num_cached_tokens) == (0, 0, 63)


def test_reset_prefix_cache_and_disabled_cache(qwen3_dir):
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256)
    prompt = random_prompts([64], seed=26)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.get_stats()["kv_blocks_cached"] == 4
    assert llm.reset_prefix_cache() == 4
    assert llm.get_stats()["kv_blocks_cached"] == 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0

    off = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    off.generate([prompt, prompt], GREEDY, use_tqdm=False)
    stats = off.get_stats()
    assert stats["prefix_cache_hits"] == 0 and stats["kv_blocks_cached"] == 0 and stats["sibling_waits"] == 0
    assert off.reset_prefix_cache() == 0


def test_mostly_cached_request_is_admitted_when_few_blocks_are_free(qwen3_dir):
    """Admission counts the hit: a 6-block prompt whose first 5 blocks are cached
    needs one new block, so it runs even though the pool could not hold it fresh
    next to the request already running."""
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=10, max_num_batched_tokens=512)
    engine = llm.engine
    shared = random_prompts([80], seed=27)[0]
    llm.generate([shared], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # 5 cached blocks
    engine.add_request("long", random_prompts([60], seed=28)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # "long" holds 4 blocks: 6 free, 5 of them cached
    engine.add_request("hit", shared + random_prompts([10], seed=29)[0], SamplingParams(max_tokens=2))
    engine.step()
    hit = engine.scheduler.requests["hit"]
    assert hit.num_cached_tokens == 80 and engine.scheduler.num_running == 2
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert llm.get_stats()["kv_blocks_used"] == 0
