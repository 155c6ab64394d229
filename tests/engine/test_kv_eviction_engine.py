"""``--kv-cache-eviction-policy`` through the engine on a tiny dense model: one-off prompts after a
conversation's first turn fill a small KV pool. ``lru`` reuses the conversation's blocks first
(they were freed first), ``cost-aware`` the one-offs' shallow leaves, so the next turn hits more
of its prefix; the greedy tokens of every request are the same under both."""

from __future__ import annotations

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TURN, *ONE_OFFS = random_prompts([200, 60, 60, 60, 60], seed=21)
FOLLOW_UP = random_prompts([20], seed=22)[0]


def conversation(policy: str) -> tuple[int, list[list[int]]]:
    """(tokens the second turn hit, every request's greedy tokens) on a 20-block pool."""
    llm = LLM("demo-dense-tiny", dtype="float32", enforce_eager=True, log_stats_interval=0, num_kv_blocks=20,
              kv_cache_eviction_policy=policy)
    assert llm.engine.scheduler.cache.kv.pool.tracks_chains == (policy == "cost-aware")
    (first,) = llm.generate([TURN], GREEDY, use_tqdm=False)
    outs = [first] + [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in ONE_OFFS]  # one at a time
    llm.check_invariants()
    (second,) = llm.generate([TURN + first.outputs[0].token_ids + FOLLOW_UP], GREEDY, use_tqdm=False)
    llm.check_invariants()
    return second.num_cached_tokens, [list(o.outputs[0].token_ids) for o in [*outs, second]]


def test_cost_aware_keeps_more_of_a_conversation_with_the_same_tokens_as_lru():
    lru_hit, lru_tokens = conversation("lru")
    cost_hit, cost_tokens = conversation("cost-aware")
    assert cost_tokens == lru_tokens
    assert cost_hit > lru_hit
