"""A fixed pool of KV blocks with ref counts, a hash index and an O(1) LRU free list.

Invariants (see ``check_invariants``):
- a block is in the free list iff its ref count is 0;
- every hash in the index names a block that carries that hash;
- free blocks that carry a hash stay findable until they are reused; reuse takes
  the least recently freed block first;
- retained blocks (``mark_retained``: a finished request's prefix kept for a while,
  ``retention.py``) are reused only when no other free block is left: free ones wait
  in a list of their own, in the order they were freed.

Which unretained free block is reused is the eviction policy's (``kv_eviction.py``): ``lru``
(the default, no policy object) pops the least recently freed; ``cost-aware`` keeps chains
whole and weighs recency against recompute FLOPs (a ``ChainBook`` the pool keeps informed).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from hyprefix.cache.events import BlockRemoved, EventLog, SaveLog
from hyprefix.cache.kv_eviction import ChainBook, KVEvictionPolicy


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(frozen=True)
class ImportHold:
    """What ``BlockPool.reserve_import`` holds until ``end_import``: fresh blocks for a lower
    tier's bytes, and cached blocks they extend (so steps that run while the bytes are copied
    cannot evict them)."""

    blocks: list[int]
    prefix: list[int]


class BlockPool:
    def __init__(self, num_blocks: int, events: EventLog | None = None,
                 eviction: KVEvictionPolicy | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first key is reused next.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._retained: set[int] = set()  # blocks a retention keeps (``mark_retained``), free or not
        self._free_retained: OrderedDict[int, None] = OrderedDict()  # free and retained: reused last
        self._retention_lost: list[int] = []  # retained blocks reused since ``take_retention_lost``
        self._hash_index: dict[bytes, int] = {}
        self._num_cached_free = 0  # free blocks that still carry a hash
        self._forgotten: list[bytes] = []  # hashes forgotten since the last take_forgotten()
        self.events = events if events is not None else EventLog()  # BlockRemoved as hashes go
        # What a lower tier saves (evicted and, write-through, published blocks); None: no lower tier.
        self.save_log: SaveLog | None = None
        self._import_refs: Counter[int] = Counter()  # references ImportHolds keep (``reserve_import``)
        self._chains: ChainBook | None = None  # LRU: the O(1) pop, nothing tracked
        if eviction is not None and eviction.cost_aware:  # chains (``publish``'s parents) and free leaves
            self._chains = ChainBook(eviction, num_blocks, self._free)

    @property
    def tracks_chains(self) -> bool:
        """Whether ``publish`` wants each block's parent and chain index (cost-aware eviction)."""
        return self._chains is not None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks no request references (some may still be findable by hash; retained ones too)."""
        return len(self._free) + len(self._free_retained)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that are still findable by hash (evictable cache)."""
        return self._num_cached_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, referenced or not."""
        return len(self._hash_index)

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks off the free list (ref count 1), or None and no change."""
        if n > self.num_free:
            return None
        ids = []
        for _ in range(n):
            if self._free:
                if self._chains is None:  # LRU
                    block_id, _ = self._free.popitem(last=False)
                else:
                    block_id = self._chains.victim()
                    del self._free[block_id]
            else:  # only retained blocks are left: the least recently freed goes, its retention with it
                block_id, _ = self._free_retained.popitem(last=False)
                self._retained.discard(block_id)
                self._retention_lost.append(block_id)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evicted from the cache
                self._num_cached_free -= 1
                if self.save_log is not None and self._hash_index.get(block.block_hash) == block_id:
                    self.save_log.entries.append((block.block_hash, block_id))
                self._drop_hash(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def acquire(self, block_ids: list[int]) -> None:
        """Add a reference to blocks found in the cache (taking free ones off the list)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del (self._free_retained if block_id in self._retained else self._free)[block_id]
                if self._chains is not None:
                    self._chains.taken(block_id)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference; blocks reaching 0 join the free list in the order given
        (pass a chain tail first so tails are evicted before heads)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} released with ref count 0"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block_id in self._retained:
                    self._free_retained[block_id] = None
                else:
                    self._free[block_id] = None
                    if self._chains is not None:
                        self._chains.freed(block_id, block.block_hash is not None)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def lookup(self, block_hash: bytes) -> int | None:
        return self._hash_index.get(block_hash)

    def indexed(self) -> list[tuple[bytes, int]]:
        """Every (hash, block id) the index holds."""
        return list(self._hash_index.items())

    def publish(self, block_id: int, block_hash: bytes, parent: int | None = None, chain_index: int = 0) -> bool:
        """Make a block findable under ``block_hash``. A hash already in the index
        keeps its block; the new one stays private. Returns whether it was added.
        ``parent`` (the block indexed under the chain's previous hash; None for the first,
        ``chain_index`` 0) and ``chain_index`` matter only when ``tracks_chains``."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"publishing free block {block_id}"
        if block.block_hash is not None or block_hash in self._hash_index:
            if self._chains is not None and block.block_hash is None:
                self._chains.adopt(self._hash_index[block_hash], parent)
            return False
        block.block_hash = block_hash
        self._hash_index[block_hash] = block_id
        if self._chains is not None:
            self._chains.published(block_id, parent, chain_index)
        if self.save_log is not None and self.save_log.on_publish:
            self.save_log.entries.append((block_hash, block_id))
        return True

    def reset_cache(self) -> int:
        """Forget the hash of every free block, retained ones too (their retention ends:
        ``take_retention_lost``); returns how many were dropped."""
        for block_id in self._free_retained:
            self._retained.discard(block_id)
            self._retention_lost.append(block_id)
            self._free[block_id] = None
        self._free_retained.clear()
        dropped = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._drop_hash(block)
                dropped += 1
        self._num_cached_free = 0
        if self._chains is not None:
            self._chains.reset()
        return dropped

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._hash_index.get(block.block_hash) == block.block_id:
                del self._hash_index[block.block_hash]
                self._forgotten.append(block.block_hash)
                self.events.add(BlockRemoved([block.block_hash]))
                if self._chains is not None:
                    self._chains.dropped(block.block_id)
            block.block_hash = None

    # -------------------------------------------------------------- retention
    def mark_retained(self, block_ids: list[int]) -> None:
        """Keep these blocks (cached, findable) until ``unmark_retained``: while free they are
        reused only after every other free block, and then one that is reused is reported by
        ``take_retention_lost``."""
        for block_id in block_ids:
            if block_id in self._retained:
                continue
            self._retained.add(block_id)
            if self.blocks[block_id].ref_cnt == 0:
                del self._free[block_id]
                self._free_retained[block_id] = None
                if self._chains is not None:
                    self._chains.taken(block_id)

    def unmark_retained(self, block_ids: list[int]) -> None:
        """End the retention of these blocks (pass a chain head first): free ones join the free list
        as if freed now, tail first."""
        for block_id in reversed(block_ids):
            if block_id not in self._retained:
                continue
            self._retained.discard(block_id)
            if block_id in self._free_retained:
                del self._free_retained[block_id]
                self._free[block_id] = None
                if self._chains is not None:
                    self._chains.freed(block_id, self.blocks[block_id].block_hash is not None)

    def retained_ids(self) -> set[int]:
        return set(self._retained)

    def take_retention_lost(self) -> list[int]:
        """Retained blocks reused (their hash dropped) since the last call: no longer retained."""
        lost, self._retention_lost = self._retention_lost, []
        return lost

    def take_forgotten(self) -> list[bytes]:
        """Hashes the pool stopped indexing (eviction, reset) since the last call: what
        depends on those blocks (state checkpoints) must go too."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten

    def reserve_import(self, prefix: list[int], count: int) -> ImportHold | None:
        """``count`` fresh blocks for a lower tier's bytes (held, unindexed), holding the cached
        ``prefix`` blocks too, so the room never comes from them; None (and no change) when
        that does not fit. The caller publishes what it wants, then ``end_import``."""
        if count > self.num_free - sum(1 for b in prefix if self.is_free(b)):
            return None
        self.acquire(prefix)
        ids = self.allocate(count)
        assert ids is not None
        self._import_refs.update(prefix + ids)
        return ImportHold(ids, prefix)

    def end_import(self, hold: ImportHold) -> None:
        """Let every block of ``hold`` go (tail first); fresh blocks left unpublished return
        to the free list unindexed."""
        self._import_refs.subtract(hold.prefix + hold.blocks)
        self._import_refs = +self._import_refs
        self.release(list(reversed(hold.prefix + hold.blocks)))

    @property
    def num_import_held(self) -> int:
        """Blocks import holds keep referenced."""
        return len(self._import_refs)

    def check_invariants(self, expected_refs: dict[int, int]) -> None:
        """``expected_refs`` maps block id -> number of block tables holding it (import holds
        are counted here)."""
        expected_refs = dict(expected_refs)
        for block_id, refs in self._import_refs.items():
            expected_refs[block_id] = expected_refs.get(block_id, 0) + refs
        assert not self._free.keys() & self._free_retained.keys(), "a block on both free lists"
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == want, (
                f"block {block.block_id}: ref count {block.ref_cnt}, held by {want} tables")
            retained = block.block_id in self._retained
            on_list = block.block_id in (self._free_retained if retained else self._free)
            assert (block.ref_cnt == 0) == on_list, (
                f"block {block.block_id}: ref count {block.ref_cnt} but on its free list={on_list}")
        for block_hash, block_id in self._hash_index.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale hash for block {block_id}"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self._hash_index), "a block carries a hash the index does not know"
        cached_free = sum(1 for i in [*self._free, *self._free_retained] if self.blocks[i].block_hash is not None)
        assert cached_free == self._num_cached_free, "cached-free counter out of sync"
        if self._chains is not None:
            self._chains.check([b.block_hash for b in self.blocks])
