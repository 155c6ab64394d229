"""Randomized engine stress of prefix caching: shared prefixes (block-aligned and
not), exact duplicates, n=2, multi-turn follow-ups, cache salts, aborts, a cache
reset and preemption in a small KV pool, with the invariants checked after every
step. The key check: greedy tokens are identical to a run with prefix caching off."""

from __future__ import annotations

import random

import pytest
from conftest import random_prompts

from hyprefix import LLM, SamplingParams

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


def rng_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(n)]


@pytest.mark.parametrize(("seed", "block_size", "num_kv_blocks", "budget", "max_num_seqs"),
                         [(0, 4, 40, 24, 8), (1, 16, 20, 40, 10)])
def test_prefix_cache_stress_matches_cache_off(qwen3_dir, seed, block_size, num_kv_blocks, budget, max_num_seqs):
    rng = random.Random(seed)
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=num_kv_blocks, block_size=block_size,
              max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, seed=seed, log_stats_interval=0,
              enable_prefix_caching=True)
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

    added: dict[str, tuple[dict, SamplingParams]] = {}
    last: dict[str, object] = {}  # request id -> latest RequestOutput
    aborted: set[str] = set()
    followed: set[str] = set()
    num_followups = 0
    reset_done = False

    for step_no in range(MAX_STEPS):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            if not todo:
                break
            rid, item, params = todo.pop(0)
            engine.add_request(rid, item, params)
            added[rid] = (item, params)
        if added and rng.random() < 0.05:
            rid = rng.choice(sorted(added))
            was_live = rid not in last or not last[rid].finished
            assert engine.abort(rid) is was_live
            if was_live:
                aborted.add(rid)
            engine.check_invariants()
        if not reset_done and step_no == 60:
            cached = engine.get_stats()["kv_blocks_cached"]
            assert llm.reset_prefix_cache() == cached
            assert engine.get_stats()["kv_blocks_cached"] == 0
            engine.check_invariants()
            reset_done = True
        for out in engine.step():
            prev = last.get(out.request_id)
            assert prev is None or not prev.finished, f"{out.request_id} reported after it finished"
            last[out.request_id] = out
            # Multi-turn: a finished conversation continues with its own output.
            if out.finished and out.request_id not in aborted and out.request_id not in followed \
                    and rng.random() < 0.35:
                followed.add(out.request_id)
                item, _ = added[out.request_id]
                follow = item["prompt_token_ids"] + list(out.outputs[0].token_ids) + rng_tokens(
                    rng, rng.randint(1, block_size + 2))
                if len(follow) <= max_prompt:
                    new_item = dict(item, prompt_token_ids=follow)
                    new_params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 10), ignore_eos=True)
                    todo.insert(rng.randint(0, min(3, len(todo))),
                                (f"{out.request_id}.t{num_followups}", new_item, new_params))
                    num_followups += 1
        engine.check_invariants()
        assert engine.get_stats()["kv_blocks_used"] <= num_kv_blocks
        if not todo and not engine.has_unfinished():
            break
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps: {engine.get_stats()}")

    stats = engine.get_stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked"
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert engine.scheduler.requests == {}
    # Every request finished or was aborted.
    assert set(last) == set(added)
    assert len(added) == NUM_REQUESTS + num_followups  # nothing was rejected
    for rid, (_, params) in added.items():
        out = last[rid]
        assert out.finished and len(out.outputs) == params.n, rid
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length", "abort"), rid
            if c.finish_reason == "abort":
                assert rid in aborted

    # The key check: identical greedy tokens with prefix caching off.
    done = [rid for rid in added if rid not in aborted]
    assert len(done) > NUM_REQUESTS // 2
    ref_llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=4 * num_kv_blocks, block_size=block_size,
                  max_num_batched_tokens=512, max_num_seqs=16, seed=seed, log_stats_interval=0,
                  enable_prefix_caching=False)
    refs = ref_llm.generate([added[rid][0] for rid in done], [added[rid][1] for rid in done], use_tqdm=False)
    assert ref_llm.get_stats()["prefix_cache_hits"] == 0
    mismatches = []
    for rid, ref in zip(done, refs, strict=True):
        got = [c.token_ids for c in last[rid].outputs]
        want = [c.token_ids for c in ref.outputs]
        if got != want:
            mismatches.append((rid, got, want))
    assert not mismatches, f"{len(mismatches)} of {len(done)} requests differ, e.g. {mismatches[:3]}"

    # The traffic exercised what it was meant to.
    assert stats["prefix_cache_hits"] > 0 and stats["prefill_skipped_tokens"] > 0
    assert stats["sibling_waits"] > 0
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    assert num_followups > 5, num_followups
    assert aborted and reset_done
    assert any(last[rid].num_cached_tokens > 0 for rid in added)
