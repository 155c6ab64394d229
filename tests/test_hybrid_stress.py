"""Randomized engine stress of prefix caching on hybrid (Mamba) models: shared
prefixes, exact duplicates, n=2, multi-turn follow-ups, aborts, a cache reset,
preemption and KV eviction in a small KV pool, and a Mamba checkpoint budget of a
handful of slots (so checkpoints are evicted LRU). Invariants (KV blocks,
checkpoints on cached blocks, live state slots) are checked after every step. The
key check: greedy tokens are identical to a run with prefix caching off."""

from __future__ import annotations

import random

import pytest
from conftest import random_prompts

from hyprefix import LLM, SamplingParams

NUM_REQUESTS = 50
MAX_STEPS = 4000


def rng_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(n)]


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
        sc = engine.state_policy.states
        reserve = sc.reserve

        def counting_reserve(block_hash):
            evicting = not sc._free_ckpt and bool(sc._lru) and not sc.has(block_hash)
            slot = reserve(block_hash)
            self.evictions += evicting and slot is not None
            return slot

        sc.reserve = counting_reserve
        execute = engine.runner.execute

        def counting_execute(out):
            self.restores += sum(src is not None for src, _ in out.state_ops)
            self.taps += sum(len(q.state_taps) for q in out.seqs)
            return execute(out)

        engine.runner.execute = counting_execute


def check_states(engine) -> None:
    """Live slots and reservations belong exactly to running requests; the checkpoint
    pool stays in budget."""
    sc = engine.state_policy.states
    running = {r.request_id for r in engine.scheduler.running}
    assert set(sc._live) == running, "live Mamba slot leaked or missing"
    if not running:
        assert not sc._reserved, "a checkpoint reservation outlived its request"
    engine.state_policy.check_invariants(running, engine.kv.pool.lookup)
    assert sc.num_used <= sc.capacity


@pytest.mark.parametrize(("arch", "seed", "block_size", "num_kv_blocks", "num_ckpts", "budget", "max_num_seqs"),
                         [("nemotron_h", 0, 16, 24, 5, 48, 6), ("mamba2", 1, 8, 24, 4, 32, 6)])
def test_hybrid_prefix_cache_stress_matches_cache_off(hybrid_models, arch, seed, block_size, num_kv_blocks,
                                                      num_ckpts, budget, max_num_seqs):
    path, _ = hybrid_models[arch]
    rng = random.Random(seed)
    common = dict(dtype="float32", block_size=block_size, seed=seed, log_stats_interval=0, enforce_eager=True)
    # The reference (caching off) is built first: it tells the size of one state checkpoint.
    ref_llm = LLM(str(path), num_kv_blocks=4 * num_kv_blocks, max_num_batched_tokens=512, max_num_seqs=16,
                  enable_prefix_caching=False, **common)
    state_bytes = ref_llm.engine.state_bytes_per_slot
    assert state_bytes > 0
    llm = LLM(str(path), num_kv_blocks=num_kv_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
              mamba_cache_memory_gb=(num_ckpts + 0.5) * state_bytes / 2**30, enable_prefix_caching=True, **common)
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
        if added and rng.random() < 0.08:
            rid = rng.choice(sorted(added))
            was_live = rid not in last or not last[rid].finished
            assert engine.abort(rid) is was_live
            if was_live:
                aborted.add(rid)
            engine.check_invariants()
            check_states(engine)
        if not reset_done and step_no == 40:
            cached = engine.get_stats()["kv_blocks_cached"]
            assert llm.reset_prefix_cache() == cached
            engine.check_invariants()  # checkpoints on the dropped blocks are gone too
            reset_done = True
        for out in engine.step():
            prev = last.get(out.request_id)
            assert prev is None or not prev.finished, f"{out.request_id} reported after it finished"
            last[out.request_id] = out
            # Multi-turn: a finished conversation continues with its own output.
            if out.finished and out.request_id not in aborted and out.request_id not in followed \
                    and rng.random() < 0.4:
                followed.add(out.request_id)
                item, _ = added[out.request_id]
                follow = item["prompt_token_ids"] + list(out.outputs[0].token_ids) + rng_tokens(
                    rng, rng.randint(1, block_size + 2))
                if len(follow) <= max_prompt:
                    new_params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True)
                    todo.insert(rng.randint(0, min(3, len(todo))),
                                (f"{out.request_id}.t{num_followups}", {"prompt_token_ids": follow}, new_params))
                    num_followups += 1
        engine.check_invariants()
        check_states(engine)
        assert engine.get_stats()["kv_blocks_used"] <= num_kv_blocks
        if not todo and not engine.has_unfinished():
            break
    else:
        raise AssertionError(f"not done after {MAX_STEPS} steps: {engine.get_stats()}")

    stats = engine.get_stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked"
    assert not engine.state_policy.states._live, "live Mamba slots leaked"
    assert not engine.state_policy._plans, "state plans leaked"
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert engine.scheduler.requests == {}
    assert set(last) == set(added)  # every request finished or was aborted
    assert len(added) == NUM_REQUESTS + num_followups
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
    refs = ref_llm.generate([added[rid][0] for rid in done], [added[rid][1] for rid in done], use_tqdm=False)
    assert ref_llm.get_stats()["prefix_cache_hits"] == 0
    mismatches = []
    for rid, ref in zip(done, refs, strict=True):
        got = [c.token_ids for c in last[rid].outputs]
        want = [c.token_ids for c in ref.outputs]
        if got != want:
            mismatches.append((rid, last[rid].num_cached_tokens, got, want))
    assert not mismatches, f"{len(mismatches)} of {len(done)} requests differ, e.g. {mismatches[:3]}"

    # The traffic exercised what it was meant to.
    assert stats["prefix_cache_hits"] > 0 and stats["prefill_skipped_tokens"] > 0
    assert probe.restores > 0 and probe.taps > 0, "no Mamba checkpoint was used"
    assert probe.evictions > 0, "the checkpoint budget was meant to be too small"
    assert stats["num_preemptions"] > 0, "the KV pool was meant to be too small"
    assert stats["hybrid_hit_tokens_lost"] > 0
    assert num_followups > 5, num_followups
    assert aborted and reset_done
    assert any(last[rid].num_cached_tokens > 0 for rid in done)
