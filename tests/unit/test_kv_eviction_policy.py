"""The KV pool's eviction policies (``cache/kv_eviction.py``, ``--kv-cache-eviction-policy``) on
plain data: ``lru`` keeps today's order and builds nothing; ``cost-aware`` keeps chains whole,
reuses blocks without a hash first, weighs recency against recompute FLOPs among leaves, and
still reuses retained blocks last; its bookkeeping matches the hash index through every
operation (``check_invariants``)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyprefix.cache.block_pool import BlockPool
from hyprefix.cache.checkpoint_policy import RecomputeCost, utilities
from hyprefix.cache.events import BlockRemoved, EventLog, SaveLog
from hyprefix.cache.kv import KVCacheManager
from hyprefix.cache.kv_eviction import KVEvictionPolicy
from hyprefix.request import Request
from hyprefix.sampling import SamplingParams

COST = RecomputeCost(linear_flops_per_token=1.0, attention_flops_coeff=1.0)
COST_AWARE = KVEvictionPolicy("cost-aware", COST, block_size=16)


def chain(pool: BlockPool, length: int, tag: str, parent: int | None = None, first: int = 0) -> list[int]:
    """Allocate and publish a chain of ``length`` blocks (hashes ``tag0``, ``tag1``, ...) under
    ``parent``, block ``first`` of its request onwards, as ``KVCacheManager.publish`` does."""
    ids = pool.allocate(length)
    assert ids is not None
    for i, block_id in enumerate(ids):
        assert pool.publish(block_id, f"{tag}{first + i}".encode(), parent, first + i)
        parent = block_id
    return ids


def evictions(pool: BlockPool, n: int) -> list[int]:
    ids = pool.allocate(n)
    assert ids is not None
    return ids


def test_policy_validation_and_block_flops():
    with pytest.raises(ValueError):
        KVEvictionPolicy("lfu")
    with pytest.raises(ValueError):
        KVEvictionPolicy("cost-aware", alpha=-1.0)
    with pytest.raises(ValueError):
        KVEvictionPolicy("cost-aware", window=0)
    policy = KVEvictionPolicy("cost-aware", RecomputeCost(3.0, 2.0), block_size=4)
    # linear * B + attention * B * (i * B + B / 2)
    assert [policy.block_flops(i) for i in range(3)] == [3 * 4 + 2 * 4 * 2, 3 * 4 + 2 * 4 * 6, 3 * 4 + 2 * 4 * 10]


def test_chain_indices_score_as_their_block_flops():
    """``ChainBook.victim`` scores chain indices: min-max normalisation makes them equal to the
    ``block_flops`` they stand for (affine in the index), whatever the model's sizes."""
    rng = random.Random(0)
    for cost in (COST, RecomputeCost(7.0, 0.001), RecomputeCost(0.0, 3.0)):
        policy = KVEvictionPolicy("cost-aware", cost, block_size=16)
        for _ in range(20):
            stamps = sorted(rng.sample(range(1000), 12))
            indices = [rng.randrange(40) for _ in stamps]
            exact = utilities(stamps, [policy.block_flops(i) for i in indices], policy.alpha)
            assert utilities(stamps, indices, policy.alpha) == pytest.approx(exact)


def test_without_attention_every_block_costs_the_same_so_leaves_go_in_lru_order():
    pool = BlockPool(5, eviction=KVEvictionPolicy("cost-aware", RecomputeCost(1.0, 0.0), block_size=16))
    deep = chain(pool, 3, "c")  # 0 -> 1 -> 2
    shallow = chain(pool, 2, "o")  # 3 -> 4
    pool.release(list(reversed(deep)))
    pool.release(list(reversed(shallow)))
    assert evictions(pool, 5) == [2, 1, 0, 4, 3]


def test_lru_keeps_todays_order_and_tracks_nothing():
    """The same script on a pool without a policy and one with ``lru``: the same ids, and the
    least recently freed goes first even when it still has a cached child."""
    orders = []
    for eviction in (None, KVEvictionPolicy("lru", COST)):
        pool = BlockPool(6, eviction=eviction)
        assert not pool.tracks_chains
        head = chain(pool, 3, "c")  # blocks 0, 1, 2
        one_off = chain(pool, 1, "o")  # block 3
        pool.release(head)  # head first: block 0 (with a cached child) is the least recently freed
        pool.release(one_off)
        pool.mark_retained([1])
        orders.append(evictions(pool, 5))
        pool.check_invariants({b: 1 for b in (0, 2, 3, 4, 5)})
    assert orders[0] == orders[1] == [4, 5, 0, 2, 3]


def test_cost_aware_never_evicts_a_block_with_a_cached_child_while_a_free_leaf_exists():
    pool = BlockPool(6, eviction=COST_AWARE)
    assert pool.tracks_chains
    conversation = chain(pool, 3, "c")  # 0 -> 1 -> 2
    one_off = chain(pool, 1, "o")  # 3
    evictions(pool, 2)  # the last two blocks, never used: held from now on
    pool.release(conversation[:2])  # 0 and 1 free (LRU's next), 2 still held: neither is a leaf
    pool.release(one_off)
    assert evictions(pool, 1) == [3]  # the only leaf
    assert pool.lookup(b"c0") == 0 and pool.lookup(b"c1") == 1
    # no free leaf left: LRU order, and block 1 is stranded (its parent gone)
    assert evictions(pool, 1) == [0]
    assert pool.lookup(b"c0") is None and pool._chains.num_children(1) == 1
    pool.check_invariants({2: 1, 3: 1, 4: 1, 5: 1, 0: 1})


def test_cost_aware_reuses_blocks_without_a_hash_first_then_stranded_leaves():
    pool = BlockPool(6, eviction=COST_AWARE)
    old = chain(pool, 1, "old")  # 0: the least recently freed, a leaf
    head, tail = chain(pool, 2, "s")  # 1 -> 2
    plain = evictions(pool, 1)  # 3: never published
    pool.release(old)
    pool.release([head])  # 2 still holds: 1 is not a leaf, and goes by LRU below
    pool.release(plain)
    assert evictions(pool, 2) == [4, 5]  # never used: no hash
    assert evictions(pool, 1) == [3]  # freed last, but it carries nothing
    pool.release([4, 5])
    assert evictions(pool, 2) == [4, 5]
    pool.release([tail])  # now 1 -> 2 is whole again, 2 a leaf
    assert evictions(pool, 1) == [0]  # shallow and least recent
    assert evictions(pool, 1) == [2]  # the only leaf (1 has a child)
    pool.release([2])  # freed with no hash
    assert evictions(pool, 1) == [2]
    pool.check_invariants({b: 1 for b in (0, 2, 3, 4, 5)})

    # a stranded leaf holds nothing a hit reaches: it goes before an older, unstranded leaf
    pool = BlockPool(4, eviction=COST_AWARE)
    head, tail = chain(pool, 2, "s")  # 0 -> 1
    other = chain(pool, 1, "o")  # 2
    evictions(pool, 1)  # 3, held
    pool.release([head])
    assert evictions(pool, 1) == [0]  # not a leaf, but the only free block: 1 is stranded
    pool.release(other)
    pool.release([tail])
    assert pool.lookup(b"s1") == 1
    assert evictions(pool, 1) == [1]  # freed after block 2, but unreachable
    pool.check_invariants({0: 1, 1: 1, 3: 1})


def test_cost_aware_among_leaves_evicts_the_least_utility():
    """A deep leaf of a long conversation outlives shallow one-off leaves freed after it, as long
    as one of them is newer (min-max: the newest one-off scores 1, as the deep one does at worst);
    LRU would reuse it right after the older one-off."""
    pool = BlockPool(16, eviction=COST_AWARE)
    old_one_off = chain(pool, 1, "a")  # 0
    conversation = chain(pool, 10, "c")  # 1 .. 10, leaf 10 at chain index 9
    one_offs = [chain(pool, 1, tag) for tag in "xyz"]  # 11, 12, 13
    pool.release(old_one_off)
    pool.release(list(reversed(conversation)))  # tail first, as KVCacheManager.free does
    for ids in one_offs:
        pool.release(ids)
    evictions(pool, 2)  # 14, 15: never used
    assert evictions(pool, 3) == [0, 11, 12]  # never the conversation's leaf while an older one-off is there
    assert pool.lookup(b"c9") == 10
    assert evictions(pool, 1) == [10]  # 10 and 13 tie at 1: the least recently freed goes
    pool.check_invariants({b: 1 for b in (0, 10, 11, 12, 14, 15)})


def test_the_window_counts_leaves_not_free_blocks():
    """A conversation's inner blocks, freed before the one-offs, fill the least recently freed
    places: a window of three free blocks would see only its tail as a leaf (and evict it, as LRU
    does); three leaves are its tail and two one-offs, and the older one-off goes."""
    pool = BlockPool(10, eviction=KVEvictionPolicy("cost-aware", COST, block_size=16, window=3))
    conversation = chain(pool, 6, "c")  # 0 .. 5
    one_offs = [chain(pool, 1, tag) for tag in "xyz"]  # 6, 7, 8
    evictions(pool, 1)  # 9
    pool.release(list(reversed(conversation)))
    for ids in one_offs:
        pool.release(ids)
    assert evictions(pool, 2) == [6, 7]
    assert pool.lookup(b"c5") == 5
    pool.check_invariants({6: 1, 7: 1, 9: 1})


def test_cost_aware_still_reuses_retained_blocks_last():
    pool = BlockPool(5, eviction=COST_AWARE)
    kept = chain(pool, 2, "k")  # 0 -> 1
    other = chain(pool, 2, "o")  # 2 -> 3
    evictions(pool, 1)  # 4
    pool.mark_retained(kept)
    pool.release(list(reversed(kept)))
    pool.release(list(reversed(other)))
    assert evictions(pool, 2) == [3, 2]
    assert pool.take_retention_lost() == []
    assert evictions(pool, 1) == [1]  # only retained ones left: LRU order among them (tail first)
    assert pool.take_retention_lost() == [1]
    pool.check_invariants({1: 1, 2: 1, 3: 1, 4: 1})


def test_cost_aware_eviction_saves_and_announces_as_lru_does():
    events = EventLog(enabled=True)
    pool = BlockPool(2, events, COST_AWARE)
    pool.save_log = SaveLog()
    ids = chain(pool, 2, "c")
    pool.release(list(reversed(ids)))
    assert evictions(pool, 1) == [1]
    assert pool.save_log.entries == [(b"c1", 1)]
    assert events.drain() == [BlockRemoved([b"c1"])]
    assert pool.take_forgotten() == [b"c1"]


def test_a_stranded_block_is_adopted_when_its_parent_is_computed_again():
    pool = BlockPool(4, eviction=COST_AWARE)
    head, _ = chain(pool, 2, "s")  # 0 -> 1
    evictions(pool, 2)  # 2, 3
    pool.release([head])
    assert evictions(pool, 1) == [0]  # 1 stranded
    assert pool._chains.num_children(0) == 0
    pool.release([2])
    assert chain(pool, 1, "s") == [2]  # "s0" again, on another block
    pool.release([3])
    assert evictions(pool, 1) == [3]
    assert not pool.publish(3, b"s1", 2, 1)  # "s1" stays block 1's, now under block 2
    assert pool._chains.num_children(2) == 1
    pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1})


# ------------------------------------------------------------ random operations
BS = 2
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 6, 0, 0], [5, 5, 5, 5, 5, 5], [7, 1, 7]]

_ops = st.lists(st.tuples(st.sampled_from(["admit", "step", "free", "reset", "retain", "unretain"]),
                          st.integers(0, 2 * len(PROMPTS) - 1), st.integers(0, 4)), max_size=40)


def _checked_victims(pool: BlockPool) -> None:
    """Wrap the pool's ``victim``: a block with a cached child goes only when every free block
    (retained ones aside) has a cached child; a block without a hash goes before any cached one."""
    book = pool._chains
    victim = book.victim

    def checked():
        free = list(pool._free)
        plain = [b for b in free if pool.blocks[b].block_hash is None]
        leaf = any(book.num_children(b) == 0 for b in free)
        choice = victim()
        assert not (book.num_children(choice) and leaf), f"block {choice} with a cached child evicted"
        assert not plain or choice == plain[0], f"block {choice} evicted before block {plain[0]}, which has no hash"
        return choice

    book.victim = checked


@settings(max_examples=60, deadline=None)
@given(ops=_ops, window=st.sampled_from([2, 64]))
def test_chains_stay_consistent_under_random_operations(ops, window):
    """Requests (two copies of each prompt; prompts share prefixes) admitted on their prefix hit
    and computed a block at a time, each block published after the one before, as the engine
    does; freed; the cache reset; blocks retained and let go in either order. The same hash
    computed twice (one copy private), parents evicted under their children (LRU fallback,
    retention's order) and reset strand and adopt blocks."""
    kv = KVCacheManager(8, BS, eviction=KVEvictionPolicy("cost-aware", COST, BS, window=window))
    _checked_victims(kv.pool)
    live: dict[str, Request] = {}
    for op, i, k in ops:
        rid, prompt = f"r{i}", PROMPTS[i % len(PROMPTS)]
        if op == "admit" and rid not in live:
            request = Request(rid, list(prompt), SamplingParams(max_tokens=1))
            hits = kv.match_prefix(request)
            if kv.admit(request, hits, request.num_tokens):
                request.num_computed_tokens = max(len(hits) * BS, min(request.num_tokens, k * BS))
                kv.publish(request)
                live[rid] = request
        elif op == "step" and rid in live:
            request = live[rid]
            request.num_computed_tokens = min(request.num_tokens, request.num_computed_tokens + BS)
            kv.publish(request)
        elif op == "free" and rid in live:
            del live[rid]
            kv.free(rid)
        elif op == "reset":
            kv.reset_cache()
        elif op == "retain":
            kv.pool.mark_retained([b for _, b in kv.pool.indexed()][k:k + 2])
        elif op == "unretain":
            kv.pool.unmark_retained(sorted(kv.pool.retained_ids(), reverse=k % 2 == 1))
        kv.check_invariants()
        kv.pool.take_retention_lost()


_pool_ops = st.lists(st.tuples(st.sampled_from(["extend", "extend", "release", "acquire", "reset", "retain",
                                                "unretain"]), st.integers(0, 15), st.integers(0, 1)), max_size=50)


@settings(max_examples=60, deadline=None)
@given(ops=_pool_ops, window=st.sampled_from([2, 64]))
def test_pool_bookkeeping_survives_any_order(ops, window):
    """The pool alone, driven harder than the engine drives it: blocks released and hit in any
    order (parents freed before their children, so the LRU fallback strands them), hashes two
    tokens wide (the same hash computed again: adopted), parents looked up when a block is
    published (gone: stranded from birth)."""
    pool = BlockPool(6, eviction=KVEvictionPolicy("cost-aware", COST, BS, window=window))
    _checked_victims(pool)
    depth: dict[bytes, int] = {}  # every hash ever published -> its chain index
    held: list[int] = []
    for op, k, token in ops:
        if op == "extend":
            bases = [None, *sorted(depth)]
            base = bases[k % len(bases)]
            block_hash = (base or b"") + bytes([token])
            ids = pool.allocate(1)
            if ids is not None:
                index = depth[base] + 1 if base is not None else 0
                pool.publish(ids[0], block_hash, pool.lookup(base) if base is not None else None, index)
                depth.setdefault(block_hash, index)
                held += ids
        elif op == "release" and held:
            pool.release([held.pop(k % len(held))])
        elif op == "acquire":
            cached = [b for _, b in sorted(pool.indexed())]
            if cached:
                pool.acquire([cached[k % len(cached)]])
                held.append(cached[k % len(cached)])
        elif op == "reset":
            pool.reset_cache()
        elif op == "retain":
            pool.mark_retained([b for _, b in sorted(pool.indexed())][k % 3:k % 3 + 2])
        elif op == "unretain":
            pool.unmark_retained(sorted(pool.retained_ids(), reverse=token == 1))
        pool.check_invariants(Counter(held))
        pool.take_retention_lost()
