"""Exact unit tests of the KV block pool and the per-request block tables (plain data, no torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hyprefix.cache.block_pool import BlockPool
from hyprefix.cache.kv import KVCacheManager


def free_order(pool: BlockPool) -> list[int]:
    """The free list in reuse order, observed through the public API: allocate
    everything, then give it back in the same order. This restores the order but
    drops the hashes of free blocks (allocation means reuse), so call it only
    when no free block carries a hash that the test still needs."""
    ids = pool.allocate(pool.num_free)
    assert ids is not None
    pool.release(ids)
    return ids


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


# ------------------------------------------------------------------ torch-free import
def test_cache_and_scheduler_import_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import hyprefix.cache
        import hyprefix.cache.block_pool
        import hyprefix.cache.kv
        import hyprefix.cache.plan
        import hyprefix.scheduler
        import hyprefix.request
        import hyprefix.outputs
        import hyprefix.sampling
        assert sys.modules["torch"] is None
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# ------------------------------------------------------------------------ BlockPool
def test_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocation_order_and_counts():
    pool = BlockPool(5)
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (5, 5, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.allocate(0) == []
    assert (pool.num_free, pool.num_used) == (2, 3)
    assert refs(pool) == [1, 1, 1, 0, 0]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free == 0
    pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1, 4: 1})


def test_failed_allocation_changes_nothing():
    pool = BlockPool(4)
    assert pool.allocate(1) == [0]
    pool.publish(0, b"h0")
    pool.release([0])  # free but cached, at the back of the free list
    assert pool.allocate(2) == [1, 2]
    before = (refs(pool), pool.num_free, pool.num_used, pool.num_cached_free)
    assert before == ([0, 1, 1, 0], 2, 2, 1)
    assert pool.allocate(3) is None
    assert (refs(pool), pool.num_free, pool.num_used, pool.num_cached_free) == before
    assert pool.lookup(b"h0") == 0  # the cached block survived the failed attempt
    assert pool.blocks[0].block_hash == b"h0"
    pool.check_invariants({1: 1, 2: 1})
    assert pool.allocate(2) == [3, 0]  # and the free list order is unchanged


def test_release_order_is_lru():
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.release([2, 0])  # freed in the order given, after the never-used blocks
    assert free_order(pool) == [4, 5, 2, 0]
    pool.release([3])
    pool.release([1])
    assert free_order(pool) == [4, 5, 2, 0, 3, 1]
    assert pool.allocate(3) == [4, 5, 2]
    assert pool.allocate(3) == [0, 3, 1]


def test_release_of_unreferenced_block_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.release([0])


def test_ref_counts_shared_blocks():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.acquire([0, 1])  # a second table shares both blocks
    assert refs(pool) == [2, 2, 0, 0]
    pool.check_invariants({0: 2, 1: 2})
    pool.release([1, 0])
    assert refs(pool) == [1, 1, 0, 0]
    assert pool.num_used == 2 and free_order(pool) == [2, 3]
    pool.release([1, 0])
    assert refs(pool) == [0, 0, 0, 0]
    assert free_order(pool) == [2, 3, 1, 0]
    pool.check_invariants({})


def test_acquire_takes_a_free_block_off_the_free_list():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.publish(1, b"h1")
    pool.release([1, 0])
    assert pool.lookup(b"h1") == 1 and pool.num_cached_free == 1
    pool.acquire([1])  # a prefix hit on a free cached block
    assert refs(pool) == [0, 1, 0, 0]
    assert pool.num_cached_free == 0 and pool.num_free == 3
    pool.check_invariants({1: 1})
    assert free_order(pool) == [2, 3, 0]
    assert pool.blocks[1].block_hash == b"h1" and pool.lookup(b"h1") == 1


def test_publish_lookup_and_duplicate_hash_stays_private():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.lookup(b"a") is None
    assert pool.publish(0, b"a") is True
    assert pool.lookup(b"a") == 0
    # The same content computed again elsewhere: the index keeps the first block.
    assert pool.publish(1, b"a") is False
    assert pool.lookup(b"a") == 0
    assert pool.blocks[1].block_hash is None
    # A block that already carries a hash is not re-published under another.
    assert pool.publish(0, b"b") is False
    assert pool.lookup(b"b") is None
    assert pool.blocks[0].block_hash == b"a"
    assert pool.publish(2, b"c") is True
    pool.check_invariants({0: 1, 1: 1, 2: 1})
    # Freeing the private duplicate never touches the index.
    pool.release([1])
    assert pool.lookup(b"a") == 0
    assert pool.num_cached_free == 0
    # Freed cached blocks stay findable.
    pool.release([2, 0])
    assert pool.lookup(b"a") == 0 and pool.lookup(b"c") == 2
    assert pool.num_cached_free == 2
    pool.check_invariants({})


def test_reuse_drops_the_old_hash():
    pool = BlockPool(3)
    assert pool.allocate(3) == [0, 1, 2]
    pool.publish(0, b"x")
    pool.publish(1, b"y")
    pool.release([1, 0, 2])
    assert pool.num_cached_free == 2
    assert pool.allocate(1) == [1]  # least recently freed first
    assert pool.lookup(b"y") is None and pool.blocks[1].block_hash is None
    assert pool.lookup(b"x") == 0
    assert pool.num_cached_free == 1
    # The hash can now be published again, on another block.
    assert pool.publish(1, b"x") is False  # still owned by block 0
    assert pool.allocate(1) == [0]
    assert pool.lookup(b"x") is None and pool.blocks[0].block_hash is None
    assert pool.publish(1, b"x") is True
    assert pool.lookup(b"x") == 1
    pool.check_invariants({0: 1, 1: 1})


def test_reset_cache_counts_only_free_cached_blocks():
    pool = BlockPool(5)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for i in range(4):
        assert pool.publish(i, bytes([i]))
    pool.release([3, 2, 1])  # block 0 stays referenced
    assert pool.num_cached_free == 3
    assert pool.reset_cache() == 3
    assert pool.num_cached_free == 0
    assert [pool.lookup(bytes([i])) for i in range(4)] == [0, None, None, None]
    assert pool.blocks[0].block_hash == bytes([0])
    assert pool.reset_cache() == 0
    assert free_order(pool) == [4, 3, 2, 1]  # order of the free list is kept
    pool.check_invariants({0: 1})


def test_check_invariants_detects_bad_ref_counts():
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    pool.check_invariants({0: 1, 1: 1})
    with pytest.raises(AssertionError):
        pool.check_invariants({0: 1})
    with pytest.raises(AssertionError):
        pool.check_invariants({0: 1, 1: 1, 2: 1})
    with pytest.raises(AssertionError):
        pool.check_invariants({0: 2, 1: 1})


# ----------------------------------------------------------------- KVCacheManager
def test_kv_manager_tables_grow_block_by_block():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.blocks_for(0) == 0 and kv.blocks_for(1) == 1 and kv.blocks_for(4) == 1 and kv.blocks_for(5) == 2
    assert kv.block_table("a") == [] and not kv.holds("a")
    assert kv.num_new_blocks_needed("a", 9) == 3
    assert kv.allocate_slots("a", 3)
    assert kv.block_table("a") == [0]
    assert kv.allocate_slots("a", 4)  # still fits in block 0
    assert kv.block_table("a") == [0]
    assert kv.allocate_slots("b", 8)
    assert kv.block_table("b") == [1, 2]
    assert kv.allocate_slots("a", 5)
    assert kv.block_table("a") == [0, 3]
    assert kv.num_new_blocks_needed("a", 5) == 0
    kv.check_invariants()
    assert kv.pool.num_used == 4


def test_kv_manager_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 8)
    assert kv.block_table("a") == [0, 1]
    assert not kv.allocate_slots("a", 17)  # needs 3 more, only 2 free
    assert kv.block_table("a") == [0, 1]
    assert not kv.allocate_slots("b", 12)
    assert kv.block_table("b") == [] and not kv.holds("b")
    assert kv.pool.num_free == 2
    kv.check_invariants()
    assert kv.allocate_slots("b", 5)
    assert kv.block_table("b") == [2, 3]


def test_kv_manager_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    assert kv.allocate_slots("a", 6)
    assert kv.allocate_slots("b", 2)
    assert kv.block_table("a") == [0, 1, 2] and kv.block_table("b") == [3]
    kv.free("a")
    assert not kv.holds("a")
    # never-used blocks first, then a's chain tail to head
    assert free_order(kv.pool) == [4, 5, 2, 1, 0]
    kv.free("b")
    kv.free("b")  # freeing twice (or an unknown id) is a no-op
    kv.free("nobody")
    assert free_order(kv.pool) == [4, 5, 2, 1, 0, 3]
    assert kv.pool.num_used == 0
    kv.check_invariants()
    assert kv.allocate_slots("c", 12)
    assert kv.block_table("c") == [4, 5, 2, 1, 0, 3]
