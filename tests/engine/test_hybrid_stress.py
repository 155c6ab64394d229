"""Randomized engine stress of prefix caching on hybrid (Mamba) models: shared
prefixes, exact duplicates, n=2, multi-turn follow-ups, aborts, a cache reset,
preemption and KV eviction in a small KV pool, and a Mamba checkpoint budget of a
handful of slots (so checkpoints are evicted LRU). Invariants (KV blocks,
checkpoints on cached blocks, live state slots) are checked after every step. The
key check: greedy tokens are identical to a run with prefix caching off."""

from __future__ import annotations

import random

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts
from tests.support.models import TINY_CASCADE
from tests.support.plain_scheduling import kv, state_kind
from tests.support.stress_driver import drive, rng_tokens, verify

pytestmark = pytest.mark.slow  # randomized engine stress

NUM_REQUESTS = 50
MAX_STEPS = 4000


def make_prompt(rng: random.Random, prefixes: list[list[int]], block_size: int) -> list[int]:
    kind = rng.random()
    if kind < 0.1:  # unrelated
        return rng_tokens(rng, rng.randint(1, 3 * block_size))
    prefix = rng.choice(prefixes)
    if kind < 0.25:  # exactly a shared prefix
        return list(prefix)
    if kind < 0.4:  # branches off a shared prefix at a block boundary (a divergence point)
        return prefix[: block_size * rng.randint(1, len(prefix) // block_size)] + rng_tokens(
            rng, rng.randint(1, block_size + 3))
    if kind < 0.5:  # branches off mid-block
        return prefix[: rng.randint(1, len(prefix))] + rng_tokens(rng, rng.randint(1, block_size))
    return prefix + rng_tokens(rng, rng.randint(1, 2 * block_size))


class Probe:
    """Counts what the state cache did: restores, checkpoint taps and LRU evictions."""

    def __init__(self, engine) -> None:
        self.restores = self.taps = self.evictions = 0
        sc = state_kind(engine.scheduler).pool
        reserve = sc.reserve

        def counting_reserve(block_hash, *args, **kwargs):
            evicting = not sc._free_ckpt and bool(sc._lru) and not sc.has(block_hash)
            slot = reserve(block_hash, *args, **kwargs)
            self.evictions += evicting and slot is not None
            return slot

        sc.reserve = counting_reserve
        execute = engine.runner.execute

        def counting_execute(out, masks=None):
            self.restores += sum(src is not None for src, _ in out.state_ops)
            self.taps += sum(len(q.state_taps) for q in out.seqs)
            return execute(out, masks)

        engine.runner.execute = counting_execute


def check_states(engine) -> None:
    """Live slots and reservations belong exactly to running requests; the checkpoint
    pool stays in budget."""
    sc = state_kind(engine.scheduler).pool
    running = {r.request_id for r in engine.scheduler.running}
    assert set(sc._live) == running, "live Mamba slot leaked or missing"
    if not running:
        assert not sc._reserved, "a checkpoint reservation outlived its request"
    state_kind(engine.scheduler).check_invariants(running, kv(engine.scheduler).pool.lookup)
    assert sc.num_used <= sc.capacity


@pytest.mark.parametrize(("arch", "seed", "block_size", "num_kv_blocks", "num_ckpts", "budget", "max_num_seqs"),
                         [("nemotron_h", 0, 16, 24, 5, 48, 6), ("mamba2", 1, 8, 24, 4, 32, 6),
                          ("qwen3_next", 2, 16, 24, 5, 48, 6), ("qwen3_5", 3, 7, 40, 4, 29, 5)])
def test_hybrid_prefix_cache_stress_matches_cache_off(hybrid_models, arch, seed, block_size, num_kv_blocks,
                                                      num_ckpts, budget, max_num_seqs):
    path, _ = hybrid_models[arch]
    rng = random.Random(seed)
    common = dict(dtype="float32", block_size=block_size, seed=seed, log_stats_interval=0, enforce_eager=True,
                  **TINY_CASCADE)
    # The reference (caching off) is built first: it tells the size of one state checkpoint.
    ref_llm = LLM(str(path), num_kv_blocks=4 * num_kv_blocks, max_num_batched_tokens=512, max_num_seqs=16,
                  enable_prefix_caching=False, **common)
    state_bytes = ref_llm.engine.state_bytes_per_slot
    assert state_bytes > 0
    llm = LLM(str(path), num_kv_blocks=num_kv_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
              state_cache_memory_gb=(num_ckpts + 0.5) * state_bytes / 2**30, enable_prefix_caching=True, **common)
    engine = llm.engine
    assert engine.get_stats()["mamba_checkpoints_capacity"] == num_ckpts
    probe = Probe(engine)
    max_prompt = num_kv_blocks * block_size // 2

    lengths = [2 * block_size + 3, 3 * block_size, 4 * block_size + 5, 5 * block_size + 1]
    lengths = [min(n, max_prompt - 2 * block_size) for n in lengths]
    prefixes = random_prompts(lengths, seed=300 + seed)

    todo: list[tuple[str, dict, SamplingParams]] = []
    for i in range(NUM_REQUESTS):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), n=2 if rng.random() < 0.15 else 1,
                                ignore_eos=rng.random() < 0.7)
        todo.append((f"r{i}", {"prompt_token_ids": make_prompt(rng, prefixes, block_size)}, params))

    run = drive(llm, rng, todo, block_size=block_size, max_prompt=max_prompt, abort_p=0.08, reset_step=40,
                follow_p=0.4, follow_max_tokens=12, max_steps=MAX_STEPS, check=lambda: check_states(engine))
    assert not state_kind(engine.scheduler).pool._live, "live Mamba slots leaked"
    assert not state_kind(engine.scheduler)._plans, "state plans leaked"
    done = verify(llm, ref_llm, run, NUM_REQUESTS)
    stats = engine.get_stats()

    # The traffic exercised what it was meant to.
    assert stats["prefix_cache_hits"] > 0 and stats["prefill_skipped_tokens"] > 0
    assert probe.restores > 0 and probe.taps > 0, "no Mamba checkpoint was used"
    assert probe.evictions > 0, "the checkpoint budget was meant to be too small"
    assert stats["num_preemptions"] > 0, "the KV pool was meant to be too small"
    assert stats["hybrid_hit_tokens_lost"] > 0
    assert run.num_followups > 5, run.num_followups
    assert run.aborted and run.reset_done
    assert any(run.last[rid].num_cached_tokens > 0 for rid in done)
