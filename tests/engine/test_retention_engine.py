"""Retention on a tiny model (``cache/retention.py``): an agent's conversation asks to keep its
prefix (``SamplingParams.cache_ttl_s``) while a tool runs; other requests then fill the KV pool.
Under plain LRU the conversation's blocks (and, for a hybrid, its state checkpoints, which die
with them) are evicted and the next turn computes its whole context again; retained, the next
turn hits the whole prefix, and its greedy tokens are those computed without any hit."""

from __future__ import annotations

import pytest

from hyprefix import LLM, SamplingParams
from tests.support.compare import random_prompts

BS = 16  # the default block size
TURN, *OTHERS = random_prompts([200, 300, 300, 300, 300], seed=11)
TOOL_RESULT = random_prompts([24], seed=12)[0]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def second_turn(model: str, ttl: float | None) -> tuple[int, list[int], LLM]:
    """(cached tokens, greedy tokens) of a conversation's second turn after a pause under memory
    pressure, and the engine."""
    llm = LLM(model, dtype="float32", enforce_eager=True, log_stats_interval=0, num_kv_blocks=64,
              retention_tenant_fraction=0.5)
    (first,) = llm.generate([TURN], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, cache_ttl_s=ttl),
                            use_tqdm=False)
    if ttl:
        assert first.retention is not None and first.retention.ttl_s == ttl
        assert first.retention.num_tokens == (len(TURN) + 8 - 1) // BS * BS  # every full block it computed
    else:
        assert first.retention is None
    for other in OTHERS:  # the tool runs; other sessions' turns fill the pool with their blocks
        llm.generate([other], GREEDY, use_tqdm=False)
    llm.check_invariants()
    (turn,) = llm.generate([TURN + first.outputs[0].token_ids + TOOL_RESULT], GREEDY, use_tqdm=False)
    llm.check_invariants()
    return turn.num_cached_tokens, turn.outputs[0].token_ids, llm


@pytest.mark.parametrize("model", ["demo-dense-tiny", "demo-hybrid-tiny"])
def test_a_retained_conversation_survives_memory_pressure_that_evicts_it_under_lru(model):
    plain_hit, plain_tokens, _ = second_turn(model, None)
    kept_hit, kept_tokens, llm = second_turn(model, 60.0)
    stats = llm.get_stats()
    assert plain_hit == 0  # LRU evicted the conversation (and a hybrid's checkpoints with it)
    assert kept_hit == (len(TURN) + 8 - 1) // BS * BS  # the whole retained prefix
    assert kept_tokens == plain_tokens
    assert stats["kv_retentions"] == 1 and stats["kv_blocks_retained"] == kept_hit // BS
    assert stats["kv_retained_blocks_evicted"] == 0
    if model == "demo-hybrid-tiny":
        assert stats["mamba_checkpoints_retained"] == 1
    llm.engine.core.set_model_identity("new weights")  # what a weight update does: nothing old is kept
    assert llm.get_stats()["kv_retentions"] == 0 and llm.get_stats()["kv_blocks_retained"] == 0
    llm.check_invariants()
