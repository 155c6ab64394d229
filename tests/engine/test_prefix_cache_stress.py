"""Randomized engine stress of prefix caching: shared prefixes (block-aligned and
not), exact duplicates, n=2, multi-turn follow-ups, cache salts, aborts, a cache
reset and preemption in a small KV pool, with the invariants checked after every
step. The key check: greedy tokens are identical to a run with prefix caching off."""

from __future__ import annotations

import random

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts
from tests.support.models import TINY_CASCADE
from tests.support.stress_driver import drive, rng_tokens, verify

pytestmark = pytest.mark.slow  # randomized engine stress

NUM_REQUESTS = 60
MAX_STEPS = 5000


def make_prompt(rng: random.Random, prefixes: list[list[int]], block_size: int) -> list[int]:
    kind = rng.random()
    if kind < 0.15:  # unrelated
        return rng_tokens(rng, rng.randint(1, 3 * block_size))
    prefix = rng.choice(prefixes)
    if kind < 0.3:  # exactly a shared prefix (a full hit when it is block-aligned)
        return list(prefix)
    if kind < 0.4:  # a block-aligned piece of a shared prefix
        return prefix[: block_size * rng.randint(1, len(prefix) // block_size)]
    return prefix + rng_tokens(rng, rng.randint(1, 2 * block_size))


@pytest.mark.parametrize(("arch", "seed", "block_size", "num_kv_blocks", "budget", "max_num_seqs", "swa_ratio"),
                         [("qwen3", 0, 4, 40, 24, 8, None),
                          # this one through the compiled batched decode graph too
                          pytest.param("qwen3", 1, 16, 20, 40, 10, None, marks=pytest.mark.batched_graphs),
                          # every layer has a 24-token window, in a pool of its own that is too small
                          ("mistral", 2, 4, 60, 12, 8, 0.3)])
def test_prefix_cache_stress_matches_cache_off(tiny_models, arch, seed, block_size, num_kv_blocks, budget,
                                               max_num_seqs, swa_ratio):
    rng = random.Random(seed)
    model_dir = tiny_models[arch][0]
    swa = {"swa_full_tokens_ratio": swa_ratio} if swa_ratio else {}
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=num_kv_blocks, block_size=block_size,
              max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, seed=seed, log_stats_interval=0,
              enable_prefix_caching=True, **swa, **TINY_CASCADE)
    engine = llm.engine
    capacity = num_kv_blocks * block_size
    max_prompt = capacity // 2

    # Shared prefixes: block-aligned and not, short and long.
    lengths = [2 * block_size, 3 * block_size + 3, 5 * block_size + 1, 6 * block_size]
    lengths = [min(n, max_prompt - 2 * block_size) for n in lengths]
    prefixes = random_prompts(lengths, seed=200 + seed)

    todo: list[tuple[str, dict, SamplingParams]] = []
    for i in range(NUM_REQUESTS):
        prompt = make_prompt(rng, prefixes, block_size)
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), n=2 if rng.random() < 0.15 else 1,
                                ignore_eos=rng.random() < 0.7)
        item: dict = {"prompt_token_ids": prompt}
        if rng.random() < 0.15:
            item["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
        todo.append((f"r{i}", item, params))

    run = drive(llm, rng, todo, block_size=block_size, max_prompt=max_prompt, abort_p=0.05, reset_step=60,
                follow_p=0.35, follow_max_tokens=10, max_steps=MAX_STEPS)
    ref_llm = LLM(str(model_dir), dtype="float32", disable_hybrid_swa_memory=True,
                  num_kv_blocks=4 * num_kv_blocks, block_size=block_size,
                  max_num_batched_tokens=512, max_num_seqs=16, seed=seed, log_stats_interval=0,
                  enable_prefix_caching=False, **TINY_CASCADE)
    verify(llm, ref_llm, run, NUM_REQUESTS)
    stats = engine.get_stats()
    graphs = engine.runner.decode_graphs  # where the batched graph is on (one case), batched steps went through it
    assert graphs is not None and (not graphs.batched or 2 in graphs.compiled_sizes)

    # The traffic exercised what it was meant to.
    assert stats["prefix_cache_hits"] > 0 and stats["prefill_skipped_tokens"] > 0
    assert stats["sibling_waits"] > 0
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    assert run.num_followups > 5, run.num_followups
    assert run.aborted and run.reset_done
    assert any(out.num_cached_tokens > 0 for out in run.last.values())
    if swa_ratio:  # blocks left running requests' windows; some hits lost their evicted window
        assert stats["swa_blocks_released"] > 0 and stats["hybrid_hit_tokens_lost"] > 0
        assert any(out.num_cached_tokens > 24 for out in run.last.values())
