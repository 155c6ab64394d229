"""Retention of a finished request's prefix (``cache/retention.py``) on plain data: retained blocks
are evicted last, within a budget and a tenant's share, capped to ``max_s``, expire by the
scheduler's clock (an injected one here) into plain cached blocks; the same for recurrent-state
checkpoints and sliding-window blocks. ``check_invariants`` runs before, between and after
every step (``step``), so no retention leaks a block or a count."""

from __future__ import annotations

import random

import pytest

from hyprefix.cache.block_pool import BlockPool
from hyprefix.cache.events import SaveLog
from hyprefix.cache.retention import RetentionConfig
from hyprefix.cache.state_pool import StatePool
from hyprefix.outputs import RetentionGrant
from hyprefix.request import Request
from hyprefix.scheduler import Scheduler
from tests.support.plain_scheduling import kv, make_scheduler, req, run_to_end, state_kind, toks, window_kind

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 12, clock: Clock | None = None, **retention) -> Scheduler:
    extra = {k: retention.pop(k) for k in ("checkpoints", "window", "window_blocks") if k in retention}
    return make_scheduler(num_blocks, BS, 64, 4, clock=clock or Clock(), retention=RetentionConfig(**retention),
                          **extra)


def finish(s: Scheduler, *requests: Request) -> None:
    for r in requests:
        s.add_request(r)
    run_to_end(s)


def chain(s: Scheduler, r: Request) -> list[int | None]:
    """Where each of the request's full blocks is findable (None: not cached)."""
    return [kv(s).pool.lookup(h) for h in kv(s).update_hashes(r)]


def retained(s: Scheduler) -> set[int]:
    return kv(s).pool.retained_ids()


# ------------------------------------------------------------------------------ pools
def test_block_pool_reuses_retained_free_blocks_last_and_reports_them_lost():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.publish(b, bytes([i]))
    pool.mark_retained([0, 1])
    pool.release([1, 0, 3, 2])
    assert list(pool._free) == [3, 2] and list(pool._free_retained) == [1, 0]
    assert pool.num_free == 4 and pool.num_cached_free == 4
    assert pool.allocate(3) == [3, 2, 1]  # every plain block first, then the least recently freed retained one
    assert pool.take_retention_lost() == [1] and pool.retained_ids() == {0}
    pool.unmark_retained([0])  # joins the plain list as if freed now
    assert list(pool._free) == [0] and pool.lookup(bytes([0])) == 0
    pool.check_invariants({b: 1 for b in (1, 2, 3)})


def test_state_pool_evicts_retained_checkpoints_last():
    pool = StatePool(1, 2)
    for key in (b"a", b"b"):
        pool.commit(pool.reserve(key))
    pool.mark_retained([pool.lookup(b"a")])
    assert pool.reserve(b"c") == 1  # the plain "b" goes though "a" is older
    assert pool.lookup(b"b") is None and pool.lookup(b"a") == 0 and pool.take_retention_lost() == []
    assert pool.reserve(b"d") == 0  # "c" is reserved (never evicted): only the retained "a" is left
    assert pool.lookup(b"a") is None and pool.take_retention_lost() == [0] and pool.retained_ids() == set()
    pool.check_invariants(lambda h: 0)


# -------------------------------------------------------------------------- the rules
def test_a_retained_prefix_is_evicted_after_every_plain_cached_block():
    s = make()
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=10)  # 13 tokens: 3 full blocks computed
    b = req("b", toks(100, 8), max_tokens=5)
    finish(s, a, b)
    assert a.retention == RetentionGrant(10.0, 12) and b.retention is None
    kept = chain(s, a)[:3]
    assert None not in kept and retained(s) == set(kept)
    kv(s).pool.save_log = SaveLog()  # a lower tier under the pool (the disk tier's log)
    finish(s, req("c", toks(200, 36), max_tokens=1))  # takes the 9 plain free blocks
    assert chain(s, a)[:3] == kept and chain(s, b) == [None, None, None]
    finish(s, req("d", toks(300, 40), max_tokens=1))  # 10 blocks: one must come from the retention
    assert chain(s, a)[:3] == [kept[0], kept[1], None]  # its tail went first
    assert (a.block_hashes[2], kept[2]) in kv(s).pool.save_log.entries  # saved below, as any evicted block
    stats = s.cache.stats()
    assert stats["kv_blocks_retained"] == 2 and stats["kv_retained_blocks_evicted"] == 1
    assert stats["kv_retentions"] == 1


def test_plain_lru_evicts_the_same_prefix():
    s = make()
    a = req("a", toks(0, 8), max_tokens=5)
    finish(s, a, req("b", toks(100, 8), max_tokens=5))
    finish(s, req("c", toks(200, 36), max_tokens=1))
    assert chain(s, a)[:2] == [None, None]  # the oldest cached blocks went first


def test_expiry_turns_a_retention_into_plain_cached_blocks():
    clock = Clock()
    s = make(clock=clock)
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=10)
    finish(s, a, req("b", toks(100, 8), max_tokens=5))
    kept = chain(s, a)[:3]
    clock.now += 9.9
    s.schedule()
    assert retained(s) == set(kept)
    clock.now += 0.2
    s.schedule()
    assert retained(s) == set() and s.cache.stats()["kv_retentions"] == 0
    assert list(kv(s).pool._free)[-3:] == kept[::-1]  # as if freed at expiry: tail first, after the rest
    assert chain(s, a)[:3] == kept  # still cached and findable
    s.check_invariants()


def test_a_budget_caps_retentions_to_the_head_that_fits():
    s = make(budget_fraction=0.25, tenant_fraction=1.0)  # 3 of 12 blocks
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=60)
    finish(s, a)
    assert a.retention == RetentionGrant(60.0, 12)
    b = req("b", toks(100, 8), max_tokens=5, cache_ttl_s=60)
    finish(s, b)
    assert b.retention == RetentionGrant(0.0, 0)  # the budget is full: nothing kept
    longer = req("a2", a.all_token_ids[:12] + toks(500, 8), max_tokens=5, cache_ttl_s=60)
    finish(s, longer)
    assert longer.num_cached_tokens == 12
    assert longer.retention == RetentionGrant(60.0, 12)  # the shared head costs nothing more; the rest does not fit
    assert len(retained(s)) == 3


def test_a_tenant_holds_at_most_its_share():
    s = make(num_blocks=16, budget_fraction=1.0, tenant_fraction=0.25)  # 4 blocks a tenant
    x1 = req("x1", toks(0, 8), max_tokens=5, salt="x", cache_ttl_s=30)
    x2 = req("x2", toks(100, 8), max_tokens=5, salt="x|other", cache_ttl_s=30)  # the same tenant "x"
    y1 = req("y1", toks(200, 8), max_tokens=5, salt="y", cache_ttl_s=30)
    anon = req("n1", toks(300, 8), max_tokens=5, cache_ttl_s=30)
    finish(s, x1)
    finish(s, x2)
    finish(s, y1)
    finish(s, anon)
    assert x1.retention == RetentionGrant(30.0, 12)
    assert x2.retention == RetentionGrant(30.0, 4)  # capped to the one block left of "x"'s share
    assert y1.retention == RetentionGrant(30.0, 12) and anon.retention == RetentionGrant(30.0, 12)
    assert len(retained(s)) == 3 + 1 + 3 + 3


def test_a_retention_longer_than_the_maximum_is_capped_and_zero_asks_nothing():
    clock = Clock()
    s = make(clock=clock, max_s=5.0)
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=1e9)
    zero = req("z", toks(100, 8), max_tokens=5, cache_ttl_s=0)
    finish(s, a, zero)
    assert a.retention == RetentionGrant(5.0, 12) and zero.retention == RetentionGrant(0.0, 0)
    clock.now += 5
    s.schedule()
    assert retained(s) == set()


def test_aborted_requests_keep_nothing_and_release_ends_a_retention_early():
    s = make()
    a = req("a", toks(0, 8), max_tokens=50, cache_ttl_s=30)
    s.add_request(a)
    for _ in range(3):
        s.update(out := s.schedule(), {q.request_id: 7 for q in out.seqs if q.sample})
    s.finish("a", "abort")
    assert a.retention is None and retained(s) == set()
    b = req("b", toks(100, 8), max_tokens=5, cache_ttl_s=30)
    finish(s, b)
    assert retained(s) and s.release_retention(["b", "nobody"]) == 1
    assert retained(s) == set() and s.release_retention(["b"]) == 0
    s.check_invariants()


def test_a_retained_block_reused_then_expiring_while_referenced():
    clock = Clock()
    s = make(clock=clock)
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=10)
    finish(s, a)
    kept = chain(s, a)[:3]
    assert s.cache.cached_tokens(req("q", [*a.all_token_ids[:12], 1, 2])) == 12  # cache-aware counts them
    b = req("b", a.all_token_ids[:12] + toks(700, 3), max_tokens=8)
    s.add_request(b)
    s.update(out := s.schedule(), {q.request_id: 9 for q in out.seqs if q.sample})
    assert b.num_cached_tokens == 12 and all(kv(s).pool.blocks[i].ref_cnt == 1 for i in kept)
    clock.now += 11  # expires while b holds the blocks
    s.update(out := s.schedule(), {q.request_id: 9 for q in out.seqs if q.sample})
    s.check_invariants()
    assert retained(s) == set() and kv(s).pool.num_free == 12 - len(kv(s).block_table("b"))
    run_to_end(s)
    assert kv(s).pool.num_used == 0 and set(kept) <= set(kv(s).pool._free)


def test_reset_ends_every_retention():
    s = make()
    finish(s, req("a", toks(0, 8), max_tokens=5, cache_ttl_s=30))
    assert s.cache.reset_cache() == 3
    assert retained(s) == set() and s.cache.stats()["kv_retentions"] == 0
    s.check_invariants()


def test_hybrid_retention_keeps_the_checkpoint_at_the_prefix_end():
    def second_turn(ttl: float | None) -> int:
        s = make(num_blocks=32, checkpoints=3, tenant_fraction=0.34)  # one slot of three retained
        a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=ttl)
        finish(s, a)
        if ttl:
            assert a.retention == RetentionGrant(ttl, 12)
            assert state_kind(s).pool.retained_ids() == {state_kind(s).pool.lookup(a.block_hashes[2])}
        finish(s, req("b", toks(100, 8), max_tokens=5))  # its three checkpoints take every slot under LRU
        turn = req("a2", a.all_token_ids[:12] + toks(900, 6), max_tokens=2)
        finish(s, turn)
        return turn.num_cached_tokens

    assert second_turn(None) == 0  # plain LRU evicted every checkpoint of a
    assert second_turn(20.0) == 12  # the retained one stayed: the next turn resumes at the prefix end


def test_hybrid_checkpoint_budget_caps_the_grant():
    s = make(num_blocks=32, checkpoints=4, budget_fraction=0.25, tenant_fraction=1.0)  # one retained checkpoint
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=20)
    b = req("b", toks(100, 8), max_tokens=5, cache_ttl_s=20)
    finish(s, a)
    finish(s, b)
    assert a.retention == RetentionGrant(20.0, 12)
    assert b.retention == RetentionGrant(0.0, 0)  # its checkpoint does not fit: a KV prefix alone is no hybrid hit
    assert s.cache.stats()["state_checkpoints_retained"] == 1


def test_sliding_window_retention_keeps_the_window_before_the_prefix_end():
    s = make(num_blocks=32, window=4, window_blocks=12)
    a = req("a", toks(0, 8), max_tokens=5, cache_ttl_s=20)
    finish(s, a)
    pool = window_kind(s).pool
    assert a.retention == RetentionGrant(20.0, 12)
    assert pool.retained_ids() == {pool.lookup(a.block_hashes[2])}  # the window of a hit at 12 is block 2
    finish(s, req("b", toks(100, 44), max_tokens=1))  # 11 window blocks: all but the retained one turn over
    turn = req("a2", a.all_token_ids[:12] + toks(900, 6), max_tokens=2)
    finish(s, turn)
    assert turn.num_cached_tokens == 12


@pytest.mark.parametrize("seed", range(4))
def test_random_retentions_never_leak(seed):
    rng = random.Random(seed)
    clock = Clock()
    s = make(num_blocks=24, clock=clock, checkpoints=8 if seed % 2 else None, budget_fraction=0.5,
             tenant_fraction=0.3, max_s=8.0)
    bases = [toks(1000 * i, 12) for i in range(4)]
    for i in range(40):
        base = rng.choice(bases)
        r = req(f"r{i}", base[: rng.randrange(4, 13)] + toks(50_000 + 10 * i, rng.randrange(0, 9)),
                max_tokens=rng.randrange(1, 7), salt=rng.choice([None, "t1", "t2"]),
                cache_ttl_s=rng.choice([None, 0, 3, 20]))
        s.add_request(r)
        for _ in range(rng.randrange(0, 4)):
            if s.has_unfinished():
                s.check_invariants()
                s.update(out := s.schedule(), {q.request_id: 5 for q in out.seqs if q.sample})
        if rng.random() < 0.2:
            s.release_retention([f"r{rng.randrange(i + 1)}"])
        clock.now += rng.random() * 2
    run_to_end(s)
    assert s.cache.stats()["kv_blocks_retained"] <= 12  # never beyond the budget
    clock.now += 10
    s.schedule()
    s.check_invariants()
    assert retained(s) == set() and kv(s).pool.num_used == 0 and s.cache.stats()["kv_retentions"] == 0
