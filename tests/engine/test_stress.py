"""Randomized engine stress: many requests, aborts and preemption in a tiny KV pool,
with the invariants checked after every step."""

from __future__ import annotations

import random

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts
from tests.support.models import TINY_CASCADE
from tests.support.stress_driver import drive

pytestmark = pytest.mark.slow  # randomized engine stress

NUM_REQUESTS = 60
NUM_KV_BLOCKS = 24
MAX_STEPS = 4000


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 40)
    n = 2 if rng.random() < 0.15 else 1
    kind = rng.random()
    if kind < 0.45:
        return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=rng.random() < 0.5)
    if kind < 0.8:
        return SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.9]),
                              top_k=rng.choice([-1, 20]), seed=rng.randrange(1 << 30), max_tokens=max_tokens, n=n)
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n,
                          stop_token_ids=[rng.randrange(3, 4096) for _ in range(3)])


@pytest.mark.parametrize(("seed", "block_size", "budget", "max_num_seqs"), [(0, 4, 32, 8), (1, 16, 24, 6)])
def test_random_traffic_with_aborts_and_preemption(qwen3_dir, seed, block_size, budget, max_num_seqs):
    rng = random.Random(seed)
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, block_size=block_size,
              max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, seed=seed, log_stats_interval=0,
              **TINY_CASCADE)
    engine = llm.engine
    capacity = NUM_KV_BLOCKS * block_size

    lengths = [rng.randint(1, 80) for _ in range(NUM_REQUESTS)]
    prompts = random_prompts(lengths, seed=100 + seed)
    todo = [(f"r{i}", {"prompt_token_ids": prompts[i]}, random_params(rng)) for i in range(NUM_REQUESTS)]
    too_long = {rid for rid, item, params in todo
                if -(-(len(item["prompt_token_ids"]) + params.max_tokens) // block_size) > NUM_KV_BLOCKS}
    run = drive(llm, rng, todo, block_size=block_size, max_prompt=capacity, abort_p=0.04, reset_step=-1,
                follow_p=0, follow_max_tokens=0, max_steps=MAX_STEPS, arrivals=(0, 0, 1, 1, 2, 4))
    added = {rid: (item["prompt_token_ids"], params) for rid, (item, params) in run.added.items()}
    last, aborted, requests = run.last, run.aborted, run.samples

    # Everything ended, nothing leaked.
    stats = engine.get_stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert engine.scheduler.requests == {}
    assert stats["num_preemptions"] > 0, "the pool was meant to be too small"
    assert set(run.rejected) == too_long and all("can never fit" in m for m in run.rejected.values())
    assert len(added) + len(too_long) == NUM_REQUESTS and len(added) > NUM_REQUESTS // 2
    assert set(last) == set(added)
    for rid, (prompt, params) in added.items():
        out = last[rid]
        assert out.finished and out.prompt_token_ids == prompt and len(out.outputs) == params.n
        for c in out.outputs:
            assert len(c.token_ids) <= params.max_tokens
            assert all(0 <= t < 4096 for t in c.token_ids)
            if c.finish_reason == "abort":
                assert rid in aborted
            elif c.finish_reason == "length":
                assert len(c.token_ids) == params.max_tokens
            else:
                assert c.finish_reason == "stop"
                stops = set(params.stop_token_ids or []) | (set() if params.ignore_eos else engine.eos_token_ids)
                assert c.token_ids[-1] in stops
        m = out.metrics
        if m.first_token_time is not None:
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(prompt) + params.max_tokens <= capacity

    # Requests that were preempted and recomputed give the tokens they give alone.
    preempted = [rid for rid, (_, params) in added.items()
                 if params.n == 1 and rid not in aborted and requests[rid].num_preemptions > 0
                 and (params.greedy or params.seed is not None)]
    greedy_preempted = [rid for rid in preempted if added[rid][1].greedy]
    seeded_preempted = [rid for rid in preempted if not added[rid][1].greedy]
    assert greedy_preempted, "no greedy request was preempted"
    for rid in greedy_preempted[:3] + seeded_preempted[:1]:
        prompt, params = added[rid]
        (alone,) = llm.generate([prompt], params, use_tqdm=False)
        assert alone.outputs[0].token_ids == last[rid].outputs[0].token_ids, rid
        assert alone.outputs[0].text == last[rid].outputs[0].text, rid
    assert engine.get_stats()["kv_blocks_used"] == 0
