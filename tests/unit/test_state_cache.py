"""Exact unit tests of recurrent-state caching on plain data (no torch): the
``StatePool`` (live slots, budgeted checkpoints, reserve / commit / cancel /
drop, LRU) and the ``RecurrentStatePool`` kind driven through the ``Scheduler``
and its ``CacheCoordinator`` with fake tokens, wired as ``engine.py`` wires them.

The block size is 4 everywhere, so a checkpoint "at position p" is keyed by the
hash of the request's block ``p // 4 - 1`` and holds the state after ``p`` tokens.
Invariants (KV, checkpoints, live slots) are checked before and after every step.
"""

from __future__ import annotations

import pytest

from hyprefix.cache.recurrent import RecurrentStateCache
from hyprefix.cache.state_pool import StatePool, before_last_token, block_of
from hyprefix.outputs import SchedulerOutput
from hyprefix.request import Request, Status
from hyprefix.scheduler import Scheduler
from tests.support.plain_scheduling import expected_output, kv, make_scheduler, seq_of, state_kind, toks
from tests.support.plain_scheduling import req as _req
from tests.support.plain_scheduling import run_to_end as _run_to_end
from tests.support.plain_scheduling import step as _step

BS = 4


def h(i: int) -> bytes:
    return b"hash-%d" % i


# =============================================================== StatePool alone
def committed(sc: StatePool, block_hash: bytes) -> int:
    slot = sc.reserve(block_hash)
    assert slot is not None
    assert sc.commit(slot) == block_hash
    return slot


def test_checkpoint_slots_are_handed_out_in_order():
    sc = StatePool(num_live_slots=2, num_checkpoint_slots=3)
    assert [sc.reserve(h(i)) for i in range(3)] == [0, 1, 2]
    assert sc.num_used == 3 and sc.capacity == 3
    assert [sc.lookup(h(i)) for i in range(3)] == [None] * 3  # reserved is not findable
    assert sc.reserve(h(3)) is None  # full of reservations: nothing to evict
    assert [sc.commit(s) for s in (2, 0, 1)] == [h(2), h(0), h(1)]
    assert [sc.lookup(h(i)) for i in range(3)] == [0, 1, 2]
    sc.check_invariants({h(i): i for i in range(3)}.get)


def test_reserve_refuses_a_hash_already_committed_or_reserved():
    sc = StatePool(1, 4)
    slot = sc.reserve(h(0))
    assert slot == 0 and sc.has(h(0))
    assert sc.reserve(h(0)) is None  # being written this step
    sc.commit(slot)
    assert sc.reserve(h(0)) is None  # already present
    assert sc.num_used == 1
    assert sc.reserve(h(1)) == 1


def test_zero_capacity_never_reserves():
    sc = StatePool(2, 0)
    assert sc.reserve(h(0)) is None
    assert sc.num_used == 0 and sc.lookup(h(0)) is None and not sc.has(h(0))
    sc.check_invariants(lambda _: None)
    assert sc.assign_live("a") == 0  # live slots do not depend on the checkpoint budget


def test_lru_evicts_the_least_recently_committed_checkpoint():
    sc = StatePool(1, 2)
    assert committed(sc, h(0)) == 0
    assert committed(sc, h(1)) == 1
    assert sc.reserve(h(2)) == 0  # h(0) is the least recently used: evicted, its slot reused
    assert sc.lookup(h(0)) is None and sc.lookup(h(1)) == 1 and not sc.has(h(0))
    sc.commit(0)
    assert sc.lookup(h(2)) == 0
    assert sc.reserve(h(3)) == 1  # now h(1) is the oldest
    assert sc.lookup(h(1)) is None and sc.lookup(h(2)) == 0


def test_forgetting_a_block_drops_both_of_its_checkpoints():
    sc = StatePool(num_live_slots=1, num_checkpoint_slots=3)
    slots = [committed(sc, key) for key in (h(1), before_last_token(h(1)), h(2))]
    assert block_of(before_last_token(h(1))) == h(1) and block_of(h(1)) == h(1)
    assert sc.drop(h(1))
    assert sc.lookup(h(1)) is None and sc.lookup(before_last_token(h(1))) is None
    assert sc.lookup(h(2)) == slots[2] and sc.num_used == 1
    assert not sc.drop(h(1))
    sc.check_invariants(lambda block_hash: 0)


def test_touch_refreshes_a_checkpoint():
    sc = StatePool(1, 2)
    committed(sc, h(0))
    committed(sc, h(1))
    sc.touch(0)  # a hit on h(0)
    assert sc.reserve(h(2)) == 1  # h(1) goes instead
    assert sc.lookup(h(0)) == 0 and sc.lookup(h(1)) is None
    sc.touch(1)  # touching a reserved (uncommitted) slot is a no-op
    sc.commit(1)
    assert sc.reserve(h(3)) == 0  # h(0) (touched before h(2) was committed) is the oldest now


def test_reservations_are_never_evicted():
    sc = StatePool(1, 2)
    committed(sc, h(0))
    assert sc.reserve(h(1)) == 1  # free slot
    assert sc.reserve(h(2)) == 0  # evicts the committed h(0)
    assert sc.reserve(h(3)) is None  # both slots are reservations: nothing evictable
    assert sc.num_used == 2
    assert sc.lookup(h(0)) is None
    assert sc.commit(1) == h(1) and sc.commit(0) == h(2)


def test_commit_and_cancel():
    sc = StatePool(1, 2)
    slot = sc.reserve(h(0))
    assert sc.commit(slot) == h(0)
    assert sc.commit(slot) is None  # not reserved any more
    assert sc.commit(1) is None  # never reserved
    other = sc.reserve(h(1))
    assert other == 1
    sc.cancel(other)
    assert not sc.has(h(1)) and sc.lookup(h(1)) is None and sc.num_used == 1
    sc.cancel(other)  # twice: no-op (the slot must not be freed twice)
    sc.cancel(slot)  # a committed slot is not cancelled
    assert sc.lookup(h(0)) == 0
    sc.check_invariants({h(0): 7}.get)
    assert sc.reserve(h(2)) == 1  # the cancelled slot is free again
    assert sc.reserve(h(3)) == 0  # and h(0) is evicted for the next one


def test_drop_frees_the_slot():
    sc = StatePool(1, 2)
    committed(sc, h(0))
    committed(sc, h(1))
    assert sc.drop(h(0)) is True
    assert sc.drop(h(0)) is False  # already gone
    assert sc.lookup(h(0)) is None and sc.num_used == 1
    sc.check_invariants({h(1): 3}.get)
    assert sc.reserve(h(2)) == 0  # the dropped slot, without evicting h(1)
    assert sc.lookup(h(1)) == 1
    assert sc.drop(h(2)) is False  # a reservation is not dropped by hash
    assert sc.has(h(2)) and sc.commit(0) == h(2)


def test_live_slots():
    sc = StatePool(num_live_slots=2, num_checkpoint_slots=1)
    assert sc.assign_live("a") == 0
    assert sc.assign_live("a") == 0  # idempotent
    assert sc.assign_live("b") == 1
    with pytest.raises(RuntimeError):
        sc.assign_live("c")
    assert sc.live_slot("a") == 0 and sc.live_slot("c") is None
    sc.release_live("a")
    sc.release_live("a")  # twice: no-op
    sc.release_live("never")
    assert sc.live_slot("a") is None
    assert sc.assign_live("c") == 0
    sc.check_invariants(lambda _: None)


def test_check_invariants_catches_a_checkpoint_whose_block_is_gone():
    sc = StatePool(1, 2)
    committed(sc, h(0))
    committed(sc, h(1))
    kv_index = {h(0): 5, h(1): 6}
    sc.check_invariants(kv_index.get)
    del kv_index[h(1)]  # the KV block was evicted but nobody told the state cache
    with pytest.raises(AssertionError, match="no longer cached"):
        sc.check_invariants(kv_index.get)
    sc.drop(h(1))  # what the coordinator does with a forgotten hash
    sc.check_invariants(kv_index.get)


# ============================================ RecurrentStateCache via the Scheduler
def make(num_blocks: int = 32, budget: int = 64, max_seqs: int = 4, ckpts: int = 8,
         attention: bool = True) -> Scheduler:
    """Wired as engine.py does: attention KV plus a recurrent state."""
    return make_scheduler(num_blocks, BS, budget, max_seqs, model_identity="hybrid-test", checkpoints=ckpts,
                          attention=attention)


def req(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    return _req(rid, prompt, max_tokens)


def cache(s: Scheduler) -> StatePool:
    return state_kind(s).pool


def check(s: Scheduler) -> None:
    s.check_invariants()
    sc = cache(s)
    assert set(sc._live) == {r.request_id for r in s.running}, "live slots != running requests"
    assert set(state_kind(s)._plans) == {r.request_id for r in s.running}, "plans != running requests"


def _every_seq_has_its_live_slot(s: Scheduler, out: SchedulerOutput) -> None:
    for q in out.seqs:
        assert q.state_slot == cache(s).live_slot(q.request_id)


def step(s: Scheduler) -> SchedulerOutput:
    out = _step(s, check=check, on_plan=lambda out: _every_seq_has_its_live_slot(s, out))
    assert not cache(s)._reserved, "a reservation outlived its step"
    return out


def run_to_end(s: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = _run_to_end(s, max_steps, check=check, on_plan=lambda out: _every_seq_has_its_live_slot(s, out))
    check(s)
    assert not cache(s)._live
    return outs


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, tuple]]:
    """(request id, start, number of tokens, state taps) of every scheduled seq."""
    return [(q.request_id, q.start_pos, q.num_tokens, q.state_taps) for q in out.seqs]


def ckpt(s: Scheduler, tokens: list[int], position: int) -> int | None:
    """The checkpoint slot holding the state after ``position`` tokens of ``tokens``."""
    assert position % BS == 0 and position > 0
    probe = req("probe", tokens)
    return cache(s).lookup(kv(s).update_hashes(probe)[position // BS - 1])


def ckpts(s: Scheduler, tokens: list[int]) -> dict[int, int]:
    """position -> checkpoint slot, for every checkpointed boundary of ``tokens``."""
    found = {p: ckpt(s, tokens, p) for p in range(BS, len(tokens) // BS * BS + 1, BS)}
    return {p: slot for p, slot in found.items() if slot is not None}


def test_fresh_request_gets_a_zero_state_and_a_tap_at_its_last_boundary():
    s = make()
    a = req("a", toks(100, 10))
    s.add_request(a)
    out = step(s)
    assert out.state_ops == [(None, 0)]  # fresh: zeros into live slot 0
    assert plan(out) == [("a", 0, 10, ((8, 0),))]  # floor((10 - 1) / 4) * 4 = 8
    assert ckpts(s, a.prompt_token_ids) == {8: 0}
    out = step(s)  # decode: no state op, no tap
    assert out.state_ops == [] and plan(out) == [("a", 10, 1, ())]
    assert a.is_finished and a.output_token_ids == expected_output(a)
    assert cache(s).live_slot("a") is None and ckpts(s, a.prompt_token_ids) == {8: 0}


def test_block_aligned_prompt_checkpoints_before_its_last_token_and_an_identical_prompt_resumes_there():
    s = make()
    prompt = toks(100, 12)
    a = req("a", prompt)
    s.add_request(a)
    # last boundary floor(11 / 4) * 4 = 8, and the state after 11 tokens (before the last one)
    assert plan(step(s)) == [("a", 0, 12, ((8, 0), (11, 1)))]
    run_to_end(s)
    before_last = before_last_token(a.block_hashes[2])
    assert cache(s).lookup(before_last) == 1
    b = req("b", prompt)
    s.add_request(b)
    out = step(s)
    # a full KV hit of 3 blocks: resume from the before-last checkpoint and compute only
    # the final token, whose K/V already sits in the shared block (as on a dense model)
    assert out.state_ops == [(1, 0)]
    assert plan(out) == [("b", 11, 1, ())] and not seq_of(out, "b").write_kv
    assert b.num_cached_tokens == 11 and s.cache.hit_tokens_lost == 0
    assert s.prefix_cache_hits == 11
    run_to_end(s)
    assert b.output_token_ids == expected_output(b)


def test_block_aligned_prompt_without_before_last_checkpoint_resumes_a_block_earlier():
    s = make()
    prompt = toks(100, 12)
    a = req("a", prompt)
    s.add_request(a)
    step(s)
    run_to_end(s)
    assert cache(s).drop_key(before_last_token(a.block_hashes[2]))
    b = req("b", prompt)
    s.add_request(b)
    out = step(s)
    assert out.state_ops == [(0, 0)]
    assert plan(out) == [("b", 8, 4, ((11, 1),))] and seq_of(out, "b").write_kv
    # a dense model would have hit 11 tokens
    assert b.num_cached_tokens == 8 and s.cache.hit_tokens_lost == 3


def test_hybrid_hit_rule_restore_and_lost_tokens_counted_once_per_admission():
    s = make(num_blocks=24)
    P = toks(100, 30)
    a = req("a", P)
    s.add_request(a)
    assert plan(step(s)) == [("a", 0, 30, ((28, 0),))]
    run_to_end(s)
    assert ckpts(s, P) == {28: 0}
    assert kv(s).block_table("a") == [] and kv(s).pool.lookup(a.block_hashes[6]) == 6

    # b shares P's first 3 blocks but there is no state at 12: a KV hit of 12, usable 0.
    b = req("b", P[:12] + toks(900, 6))
    s.add_request(b)
    out = step(s)
    assert out.state_ops == [(None, 0)]
    assert plan(out) == [("b", 0, 18, ((12, 1), (16, 2)))]  # divergence point 12, last boundary 16
    assert b.num_cached_tokens == 0 and s.cache.hit_tokens_lost == 12
    run_to_end(s)
    assert ckpts(s, P) == {12: 1, 28: 0}

    # d holds most of the pool; c cannot be admitted until d finishes.
    d = req("d", toks(2000, 48), max_tokens=4)
    s.add_request(d)
    out = step(s)
    assert plan(out) == [("d", 0, 48, ((44, 3), (47, 4)))]  # 48 is block-aligned: also before its last token
    assert len(kv(s).block_table("d")) == 12
    c = req("c", P[:24] + toks(3000, 26))  # 50 tokens: KV hit 24, checkpoints at 12 and 28
    s.add_request(c)
    attempts = []
    find_hit = s.cache.find_hit
    s.cache.find_hit = lambda r: attempts.append((r.request_id, (hit := find_hit(r)).num_tokens)) or hit
    lost_before = s.cache.hit_tokens_lost
    out = step(s)  # d's first decode takes a 13th block: the LRU free block 6 (P's block 6)
    assert plan(out) == [("d", 48, 1, ())]
    assert c.status == Status.WAITING
    # P's block 6 was evicted, and with it the checkpoint at 28 (slot 0 is free again)
    assert ckpts(s, P) == {12: 1}
    while c.status == Status.WAITING:
        out = step(s)
    assert d.is_finished
    assert attempts == [("c", 12)] * len(attempts) and len(attempts) >= 3  # blocked attempts...
    assert s.cache.hit_tokens_lost - lost_before == 12  # ...but the 12 lost tokens counted once
    assert c.num_cached_tokens == 12  # usable hit: the last checkpoint at or below the KV hit
    assert out.state_ops == [(1, 0)]  # restore the checkpoint at 12 into live slot 0
    # c's 10 new blocks come off the LRU free list: P's blocks 3..5 (c's own KV hit beyond
    # the usable part) and blocks 8..12, which evicts b's block 3 with its checkpoint at 16
    # (slot 2) and d's last full block 12 with its before-last-token checkpoint (slot 4).
    # c then computes 12..50 in one chunk with taps at its divergence point 24 and its last
    # boundary 48, in the slots freed last-in first-out: 4, then 2.
    assert seq_of(out, "c").block_table == [0, 1, 2, 5, 4, 3, 12, 11, 10, 9, 8, 6, 7]
    assert ckpts(s, b.all_token_ids) == {12: 1}
    assert cache(s).lookup(d.block_hashes[10]) == 3 and kv(s).pool.lookup(d.block_hashes[11]) is None
    assert plan(out) == [("c", 12, 38, ((24, 4), (48, 2)))]
    run_to_end(s)
    assert c.output_token_ids == expected_output(c)
    assert ckpts(s, c.prompt_token_ids) == {12: 1, 24: 4, 48: 2}


def test_taps_land_in_the_right_chunk_of_a_chunked_prefill():
    s = make(budget=10)
    P = toks(100, 39)
    a = req("a", P)
    s.add_request(a)
    run_to_end(s)  # tap at 36, finish checkpoint at 40
    b = req("b", P[:20] + toks(700, 15))  # 35 tokens; KV hit 20 with no state there
    s.add_request(b)
    outs = [step(s) for _ in range(4)]
    assert [plan(o) for o in outs] == [
        [("b", 0, 10, ())],
        [("b", 10, 10, ((20, 2),))],  # the divergence point at the very end of a chunk
        [("b", 20, 10, ())],  # 20 belongs to the previous chunk, not this one
        [("b", 30, 5, ((32, 3),))],  # floor(34 / 4) * 4 = 32, inside the last chunk
    ]
    assert [o.state_ops for o in outs] == [[(None, 0)], [], [], []]
    assert [seq_of(o, "b").sample for o in outs] == [False, False, False, True]
    assert ckpts(s, b.prompt_token_ids) == {20: 2, 32: 3}


def test_provisional_decode_checkpoint_replaced_every_block_and_kept_at_finish():
    s = make()
    a = req("a", toks(100, 10), max_tokens=12)
    s.add_request(a)
    outs = run_to_end(s)
    taps = [(q.start_pos, q.num_tokens, q.state_taps) for o in outs for q in o.seqs if q.state_taps]
    assert taps == [(0, 10, ((8, 0),)), (11, 1, ((12, 1),)), (15, 1, ((16, 2),)), (19, 1, ((20, 1),))]
    history = a.all_token_ids  # 22 tokens, 21 computed
    assert a.output_token_ids == expected_output(a)
    # the prompt's checkpoint stays; only the latest decode checkpoint (20) does
    assert ckpts(s, history) == {8: 0, 20: 1}
    assert cache(s).num_used == 2

    follow = req("follow", [*history, 1, 2, 3])  # the next chat turn resumes at 20
    s.add_request(follow)
    out = step(s)
    assert out.state_ops == [(1, 0)]
    assert plan(out) == [("follow", 20, 5, ((24, 2),))]
    assert follow.num_cached_tokens == 20


def test_waiting_request_asks_a_running_prefill_for_a_checkpoint_where_it_branches():
    s = make(budget=12)
    P = toks(100, 30)
    o = req("o", P)
    w = req("w", P[:20] + toks(800, 6))  # leaves o's path at 20
    s.add_request(o)
    s.add_request(w)
    out = step(s)  # o takes the whole budget; w would wait on o's blocks anyway
    assert plan(out) == [("o", 0, 12, ())]
    assert state_kind(s)._plans["o"].taps == [20, 28]  # 20 asked for by w
    out = step(s)
    assert plan(out) == [("o", 12, 12, ((20, 0),))]  # inside the chunk 12..24
    assert w.status == Status.WAITING
    out = step(s)
    # o's last chunk; w hits the 5 blocks o published and the state at 20
    assert plan(out) == [("o", 24, 6, ((28, 1),)), ("w", 20, 6, ((24, 2),))]
    assert out.state_ops == [(0, 1)]
    assert w.num_cached_tokens == 20 and s.cache.hit_tokens_lost == 0
    assert kv(s).block_table("w")[:5] == kv(s).block_table("o")[:5]
    run_to_end(s)
    assert o.output_token_ids == expected_output(o) and w.output_token_ids == expected_output(w)


def test_sibling_of_a_running_prefill_resumes_at_the_shared_last_boundary():
    """n=2 style: two identical prompts; the second waits for the first's blocks and
    resumes from its last-boundary checkpoint."""
    s = make(budget=64)
    P = toks(100, 18)
    a, b = req("a", P, max_tokens=3), req("b", P, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert plan(out) == [("a", 0, 18, ((16, 0),))]
    assert s.sibling_waits == 1
    out = step(s)
    assert plan(out) == [("a", 18, 1, ()), ("b", 16, 2, ())]
    assert out.state_ops == [(0, 1)]
    run_to_end(s)
    assert b.num_cached_tokens == 16 and b.output_token_ids == expected_output(b)
    assert s.cache.hit_tokens_lost == 0


def test_checkpoint_dropped_when_its_block_is_evicted():
    s = make(num_blocks=6)
    P = toks(100, 10)
    a = req("a", P, max_tokens=1)
    s.add_request(a)
    run_to_end(s)
    assert ckpts(s, P) == {8: 0}
    assert list(kv(s).pool._free) == [3, 4, 5, 2, 1, 0]
    big = req("big", toks(500, 19), max_tokens=2)  # 5 blocks: 3, 4, 5, then evicts 2 and 1
    s.add_request(big)
    step(s)
    assert kv(s).block_table("big") == [3, 4, 5, 2, 1]
    assert kv(s).pool.lookup(a.block_hashes[1]) is None  # P's block 1 (tokens 4..8) is gone...
    assert ckpts(s, P) == {}  # ...and the checkpoint on it died with it
    assert cache(s).num_used == 1  # only big's own checkpoint at 16, in the freed slot 0
    assert ckpts(s, big.prompt_token_ids) == {16: 0}
    run_to_end(s)
    again = req("again", P)
    s.add_request(again)
    out = step(s)
    assert out.state_ops == [(None, 0)] and again.num_cached_tokens == 0
    assert s.cache.hit_tokens_lost == 4  # block 0 still hits in KV, no state at 4


def test_reset_prefix_cache_drops_checkpoints_of_dropped_blocks_only():
    s = make()
    P, Q = toks(100, 10), toks(300, 14)
    a = req("a", P, max_tokens=1)
    s.add_request(a)
    run_to_end(s)
    q = req("q", Q, max_tokens=4)
    s.add_request(q)
    step(s)  # q is running and holds its blocks
    assert ckpts(s, P) == {8: 0} and ckpts(s, Q) == {12: 1}
    assert s.cache.reset_cache() == 2  # P's 2 free cached blocks
    check(s)
    assert ckpts(s, P) == {}  # dropped with the hashes
    assert ckpts(s, Q) == {12: 1}  # q's blocks are held: still findable, checkpoint kept
    assert cache(s).num_used == 1
    run_to_end(s)
    b = req("b", P)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 0


def test_zero_checkpoint_capacity_takes_no_taps_and_never_restores():
    s = make(ckpts=0, budget=8)
    P = toks(100, 18)
    outs = []
    for rid in ("a", "b"):
        r = req(rid, P, max_tokens=10)
        s.add_request(r)
        outs += run_to_end(s)
    seqs = [q for o in outs for q in o.seqs]
    assert all(q.state_taps == () for q in seqs)
    assert all(src is None for o in outs for src, _ in o.state_ops)
    assert [src for o in outs for src, _ in o.state_ops] == [None, None]
    assert s.prefix_cache_hits == 0 and cache(s).num_used == 0
    assert s.cache.hit_tokens_lost == 16  # b's whole KV hit (4 blocks) lost, once


def test_preemption_releases_the_live_slot_and_resumes_from_a_checkpoint():
    s = make(num_blocks=8)
    r1 = req("r1", toks(100, 10), max_tokens=14)  # 24 tokens: 6 blocks
    r2 = req("r2", toks(300, 10), max_tokens=10)  # 20 tokens: 5 blocks
    s.add_request(r1)
    s.add_request(r2)
    out = step(s)
    assert out.state_ops == [(None, 0), (None, 1)]
    assert plan(out) == [("r1", 0, 10, ((8, 0),)), ("r2", 0, 10, ((8, 1),))]
    preempted_at = None
    for _ in range(10):
        out = step(s)
        if out.preempted_ids:
            preempted_at = out
            break
    assert preempted_at is not None and preempted_at.preempted_ids == ["r2"]
    assert [q.request_id for q in out.seqs] == ["r1"] and out.state_ops == []
    assert r2.status == Status.PREEMPTED and r2.num_computed_tokens == 0
    assert cache(s).live_slot("r2") is None and "r2" not in state_kind(s)._plans
    # r2 had decoded to 16: its provisional checkpoint at 16 sat on the block r1 just took
    assert ckpts(s, r2.all_token_ids) == {8: 1}
    readmitted = None
    while readmitted is None:
        out = step(s)
        if any(q.request_id == "r2" for q in out.seqs):
            readmitted = out
    assert r1.is_finished
    q2 = seq_of(readmitted, "r2")
    assert readmitted.state_ops == [(1, 0)]  # its own prompt checkpoint, into a fresh live slot
    assert q2.start_pos == 8 and q2.state_slot == 0
    run_to_end(s)
    assert r1.output_token_ids == expected_output(r1)
    assert r2.output_token_ids == expected_output(r2)
    assert kv(s).pool.num_used == 0 and not cache(s)._live and not cache(s)._reserved


def test_abort_between_schedule_and_update_cancels_the_reservation():
    s = make(ckpts=2)
    a = req("a", toks(100, 10))
    s.add_request(a)
    check(s)
    out = s.schedule()
    assert plan(out) == [("a", 0, 10, ((8, 0),))]
    assert cache(s).num_used == 1 and cache(s).live_slot("a") == 0
    s.finish("a", "abort")
    check(s)
    assert cache(s).num_used == 0 and cache(s).live_slot("a") is None
    s.update(out, {"a": 1})  # the finished request's step result is ignored
    check(s)
    assert ckpts(s, a.prompt_token_ids) == {}  # never committed
    assert [cache(s).reserve(h(i)) for i in range(3)] == [0, 1, None]  # both slots free again


def test_checkpoint_pool_is_lru_and_a_hit_refreshes_it():
    s = make(ckpts=2)
    P, Q, R = toks(100, 10), toks(300, 10), toks(500, 10)
    for rid, prompt in (("p", P), ("q", Q)):
        s.add_request(req(rid, prompt, max_tokens=1))
        run_to_end(s)
    assert ckpts(s, P) == {8: 0} and ckpts(s, Q) == {8: 1}
    again = req("again", P, max_tokens=1)  # a hit on P's checkpoint makes it the most recently used
    s.add_request(again)
    out = step(s)
    assert out.state_ops == [(0, 0)] and plan(out) == [("again", 8, 2, ())]
    s.add_request(req("r", R, max_tokens=1))
    out = step(s)
    assert plan(out) == [("r", 0, 10, ((8, 1),))]  # Q's checkpoint was the LRU one
    assert ckpts(s, P) == {8: 0} and ckpts(s, Q) == {} and ckpts(s, R) == {8: 1}
    # Q's KV blocks are still cached, but without a state the hybrid hit is 0.
    q2 = req("q2", Q, max_tokens=1)
    s.add_request(q2)
    out = step(s)
    assert out.state_ops == [(None, 0)] and q2.num_cached_tokens == 0
    assert s.cache.hit_tokens_lost == 8


def test_scheduler_invariants_catch_a_checkpoint_left_on_an_evicted_block():
    """If the coordinator did not pass forgotten hashes on, evicting a block would leave
    its checkpoint behind: check_invariants must notice."""
    s = make(num_blocks=4)
    kv(s).pool.take_forgotten = lambda: []
    s.add_request(req("a", toks(100, 10), max_tokens=1))
    run_to_end(s)
    assert ckpts(s, toks(100, 10)) == {8: 0}
    s.add_request(req("b", toks(300, 14), max_tokens=1))  # 4 blocks: evicts a's blocks
    s.schedule()
    assert kv(s).block_table("b") == [3, 2, 1, 0]
    with pytest.raises(AssertionError, match="no longer cached"):
        s.check_invariants()
    s.finish("b", "abort")


# ======================================================== the coordinator's contract
def random_traffic(s: Scheduler, seed: int) -> list[tuple]:
    """Shared prefixes, retries and branches; returns every step's plan and state ops."""
    import random

    rng = random.Random(seed)
    prefixes = [toks(100 * (i + 1), n) for i, n in enumerate((8, 13, 20))]
    log = []
    for i in range(30):
        prefix = rng.choice(prefixes)
        prompt = prefix[: rng.randint(1, len(prefix))] if rng.random() < 0.3 else prefix + toks(5000 + i * 10, i % 7)
        s.add_request(req(f"r{i}", prompt, max_tokens=rng.randint(1, 6)))
        if rng.random() < 0.5:
            out = step(s)
            log.append((plan(out), out.state_ops))
    for out in run_to_end(s):
        log.append((plan(out), out.state_ops))
    return log


@pytest.mark.parametrize("seed", [0, 1])
def test_a_model_without_attention_layers_caches_exactly_like_a_hybrid(seed):
    """The attention kind never shortens a hit: a pure recurrent model (blocks only
    index the cache) plans every step exactly as a hybrid with the same budget."""
    hybrid, pure = make(num_blocks=24, ckpts=6), make(num_blocks=24, ckpts=6, attention=False)
    assert [k.name for k in hybrid.cache.kinds] == ["attention", "recurrent"]
    assert [k.name for k in pure.cache.kinds] == ["recurrent"]
    log = random_traffic(hybrid, seed)
    assert log == random_traffic(pure, seed)
    assert any(ops and ops[0][0] is not None for _, ops in log), "no step restored a checkpoint"
    assert hybrid.cache.stats() == pure.cache.stats()


def test_a_model_needs_one_kind_and_at_most_one_recurrent_state():
    from hyprefix.cache.coordinator import CacheCoordinator
    from hyprefix.cache.kv import KVCacheManager

    with pytest.raises(ValueError, match="at least one kind"):
        CacheCoordinator(KVCacheManager(4, BS), [])
    two = [RecurrentStateCache(StatePool(1, 1), BS), RecurrentStateCache(StatePool(1, 1), BS)]
    with pytest.raises(ValueError, match="at most one kind of recurrent state"):
        CacheCoordinator(KVCacheManager(4, BS), two)
