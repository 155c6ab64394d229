"""Exact tests of the state-checkpoint eviction policies (``cache/checkpoint_policy.py``) on plain
data (no torch): the cost model, Marconi's utility, the ``StatePool``'s victims under lru and
cost-aware (retained ones last under both, reservations never evicted), the admission rule, and
the positions the callers of ``reserve`` pass."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyprefix.cache.checkpoint_policy import CheckpointPolicy, RecomputeCost, utilities
from hyprefix.cache.events import EventLog, SaveLog, StateRemoved
from hyprefix.cache.state_pool import StatePool, before_last_token, checkpoint_position
from tests.support.plain_scheduling import make_scheduler, run_to_end, state_kind, toks
from tests.support.plain_scheduling import req as _req

COST = RecomputeCost(linear_flops_per_token=10.0, attention_flops_coeff=2.0)
COST_AWARE = CheckpointPolicy("cost-aware", COST)


def h(i: int) -> bytes:
    return b"key-%d" % i


def committed(pool: StatePool, key: bytes, position: int) -> int:
    slot = pool.reserve(key, position)
    assert slot is not None and pool.commit(slot) == key
    return slot


def test_flops_saved_is_linear_plus_half_the_attention_square():
    assert COST.flops_saved(0) == 0.0
    assert COST.flops_saved(4) == 10.0 * 4 + 2.0 * 16 / 2
    assert COST.flops_saved(100) == 1000.0 + 10000.0
    assert RecomputeCost().flops_saved(123) == 0.0  # no model sizes: every checkpoint worth the same


def test_utility_is_min_max_normalised_recency_plus_alpha_flops():
    assert utilities([1, 2, 3], [0.0, 10.0, 5.0], alpha=1.0) == [0.0, 1.5, 1.5]
    assert utilities([1, 2, 3], [0.0, 10.0, 5.0], alpha=2.0) == [0.0, 2.5, 2.0]
    assert utilities([4, 4], [7.0, 7.0], alpha=1.0) == [0.0, 0.0]  # no spread: each term 0
    assert utilities([5], [1.0], alpha=1.0) == [0.0]


def test_policy_refuses_unknown_names_and_negative_alpha():
    with pytest.raises(ValueError, match="one of"):
        CheckpointPolicy("lfu")
    with pytest.raises(ValueError, match="alpha"):
        CheckpointPolicy("cost-aware", alpha=-1.0)


def test_cost_aware_evicts_a_short_checkpoint_before_an_older_long_one():
    lru, cost = StatePool(1, 3), StatePool(1, 3, policy=COST_AWARE)
    for pool in (lru, cost):
        committed(pool, h(0), 400)  # the long conversation's, the oldest
        committed(pool, h(1), 40)
        committed(pool, h(2), 48)
    assert lru.reserve(h(3), 40) == 0 and lru.lookup(h(0)) is None  # LRU: the oldest goes
    # cost-aware: utilities 0 + 1, 0.5 + 0, 1 + 0.0005...: the short h(1) goes
    assert cost.reserve(h(3), 40) == 1 and cost.lookup(h(1)) is None and cost.lookup(h(0)) == 0
    cost.commit(1)
    assert cost.reserve(h(4), 40) == 2  # then the other short one; the long one stays
    assert cost.lookup(h(0)) == 0
    cost.check_invariants(lambda _: 0)


def test_cost_aware_with_equal_positions_evicts_in_lru_order():
    pool = StatePool(1, 3, policy=COST_AWARE)
    for i in range(3):
        committed(pool, h(i), 64)
    pool.touch(0)  # h(0) used last: h(1), then h(2), then h(0)
    assert pool.reserve(h(3), 64) == 1
    pool.commit(1)
    assert pool.reserve(h(4), 64) == 2
    pool.commit(2)
    assert pool.reserve(h(5), 64) == 0
    assert [pool.lookup(h(i)) for i in range(6)] == [None, None, None, 1, 2, None]


def test_recency_outweighs_a_small_cost_difference():
    pool = StatePool(1, 3, policy=COST_AWARE)
    committed(pool, h(0), 100)  # old and a little longer
    committed(pool, h(1), 96)
    committed(pool, h(2), 16)  # recent and short: the least FLOPs
    # normalised FLOPs 1, ~0.96, 0; recency 0, 0.5, 1: h(0) = 1, h(1) = ~1.46, h(2) = 1: a tie goes
    # to the least recent
    assert pool.reserve(h(3), 16) == 0


def test_retained_checkpoints_go_last_under_cost_aware():
    pool = StatePool(1, 3, policy=COST_AWARE)
    committed(pool, h(0), 16)  # short, old, retained
    committed(pool, h(1), 800)
    committed(pool, h(2), 900)
    pool.mark_retained([0])
    assert pool.reserve(h(3), 900) == 1  # the least utility among the plain ones, not the retained h(0)
    assert pool.lookup(h(0)) == 0 and pool.take_retention_lost() == []
    assert pool.reserve(h(4), 900) == 2  # h(3) is reserved, never evicted: the last plain one
    assert pool.reserve(h(5), 900) == 0  # only the retained one is left: it goes, its retention with it
    assert pool.take_retention_lost() == [0] and pool.retained_ids() == set()
    assert pool.reserve(h(6), 900) is None  # only reservations left
    pool.check_invariants(lambda _: 0)


def test_admission_refuses_a_checkpoint_worth_less_than_its_victim():
    policy = CheckpointPolicy("cost-aware", COST, alpha=2.0, admission=True)
    pool = StatePool(1, 2, EventLog(enabled=True), policy=policy)
    pool.save_log = SaveLog()
    committed(pool, h(0), 400)
    committed(pool, h(1), 400)
    pool.events.drain()
    # as the newest: 1 + 2 * 0 < the victim h(0)'s 0 + 2 * 1: refused, and nothing changes
    assert pool.reserve(h(2), 16) is None
    assert pool.lookup(h(0)) == 0 and pool.lookup(h(1)) == 1 and not pool.has(h(2))
    assert pool.save_log.take() == [] and pool.events.drain() == []
    # worth as much (1 + 2 * 1 >= 2): admitted, h(0) evicted
    assert pool.reserve(h(3), 400) == 0 and pool.lookup(h(0)) is None
    assert pool.save_log.take() == [(h(0), 0)] and pool.events.drain() == [StateRemoved([h(0)])]
    # without the rule the short one is admitted
    pool.policy = CheckpointPolicy("cost-aware", COST, alpha=2.0)
    assert pool.reserve(h(2), 16) == 1
    pool.check_invariants(lambda _: 0)


def test_lru_ignores_positions():
    pool = StatePool(1, 2)
    committed(pool, h(0), 4000)
    committed(pool, h(1), 4)
    assert pool.reserve(h(2), 4) == 0  # the oldest, however long


def test_checkpoint_position_of_a_key():
    hashes = [h(0), h(1), h(2)]
    assert checkpoint_position(hashes, h(1), 16) == 32
    assert checkpoint_position(hashes, before_last_token(h(2)), 16) == 47
    assert checkpoint_position(hashes, h(9), 16) == 0


def test_plan_step_reserves_at_the_tap_position():
    s = make_scheduler(32, 4, 64, 4, model_identity="hybrid-test", checkpoints=8)
    pool = state_kind(s).pool
    pool.policy = CheckpointPolicy("cost-aware", RecomputeCost(1.0, 0.0))
    a = _req("a", toks(100, 12), 2)  # block-aligned: taps at 8 and 11 (before its last token)
    s.add_request(a)
    run_to_end(s, check=lambda s: s.check_invariants())
    assert {pool.lookup(a.block_hashes[1]): 8.0, pool.lookup(before_last_token(a.block_hashes[2])): 11.0}.items() \
        <= pool._flops.items()


_ops = st.lists(st.tuples(st.sampled_from(["reserve", "commit", "cancel", "touch", "drop", "retain", "unretain"]),
                          st.integers(0, 7), st.integers(0, 64)), max_size=60)


@settings(max_examples=40, deadline=None)
@given(ops=_ops, policy=st.sampled_from(["lru", "cost-aware", "admit"]))
def test_invariants_hold_under_random_operations(ops, policy):
    """Reservations are never evicted, a retained checkpoint goes only when no plain one is left,
    and ``check_invariants`` holds after every operation."""
    chosen = CheckpointPolicy("cost-aware" if policy != "lru" else "lru", COST, admission=policy == "admit")
    pool = StatePool(1, 4, policy=chosen)
    for op, i, pos in ops:
        key = h(i) if pos % 5 else before_last_token(h(i))
        if op == "reserve":
            reserved, plain = dict(pool._reserved), set(pool._lru)
            slot = pool.reserve(key, pos * 16)
            assert reserved.items() <= pool._reserved.items(), "a reservation was evicted"
            lost = pool.take_retention_lost()
            assert not lost or not plain, "a retained checkpoint went before a plain one"
            assert slot is None or pool._reserved[slot] == key
        elif op == "commit":
            pool.commit(i % 4)
        elif op == "cancel":
            pool.cancel(i % 4)
        elif op == "touch":
            pool.touch(i % 4)
        elif op == "drop":
            pool.drop(h(i))
        elif op == "retain":
            pool.mark_retained([i % 4])
        else:
            pool.unmark_retained([i % 4])
        pool.check_invariants(lambda _: 0)
