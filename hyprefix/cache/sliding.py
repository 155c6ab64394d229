"""The sliding-window kind of cache (no torch): K/V of the sliding-window attention
layers in a block pool of their own, so a running request gives back the blocks
that left its window while the full-attention layers keep theirs.

A token at position p of a layer with window W attends to positions p-W+1 .. p.
A request that computes from position s on never reads a block that ends before
s-W+1, so before each step (``shrink``) such blocks leave the request's table.
Published ones stay findable by hash until the pool reuses them, like a finished
request's blocks: the prefix stays findable for later hits.

A prefix hit of L tokens needs, besides the full-attention blocks below L, the
sliding blocks under positions L-W+1 .. L-1 (and the block of the last token when
a full hit reads that token's K/V in place): ``longest_hit`` returns the longest L
whose window is still cached. Block hashes are the coordinator's; this pool keys on
them too, so a block index names the same tokens in both pools.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyprefix.cache.block_pool import BlockPool, ImportHold
from hyprefix.cache.coordinator import CacheKind, PrefixHit, hit_num_blocks
from hyprefix.request import Request

NO_BLOCK = -1  # a table entry whose block left the window (or was never taken)


@dataclass
class _Table:
    blocks: list[int]  # block id per block index of the request; NO_BLOCK below ``first``
    first: int = 0  # index of the first block the request still holds
    published: int = 0  # blocks below this index were offered to the hash index


class SlidingWindowKV(CacheKind):
    """``window``: the widest sliding window of the model's layers (each layer masks
    its own; a block is given back only when it left the widest)."""

    name = "sliding_window"
    has_own_blocks = True

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool = True) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.window = window
        self.enable_caching = enable_caching
        self._tables: dict[str, _Table] = {}
        self.blocks_released = 0  # blocks given back by running requests (left their window)

    def first_needed_block(self, position: int) -> int:
        """Index of the first block a token at ``position`` (or later) attends to."""
        return max(0, position - self.window + 1) // self.block_size

    # -------------------------------------------------------------- admission
    def longest_hit(self, request: Request, limit: int, cached_blocks: int) -> int:
        if not self.enable_caching:
            return 0
        hashes = request.block_hashes
        tokens = limit
        while tokens > 0:
            needed = self.needed_blocks(request, tokens, cached_blocks)
            missing = next((i for i in reversed(needed) if self.pool.lookup(hashes[i]) is None), None)
            if missing is None:
                return tokens
            tokens = missing * self.block_size  # the longest hit whose window ends before that block
        return 0

    def needed_blocks(self, request: Request, tokens: int, cached_blocks: int) -> range:
        """Indices of the window blocks a hit skipping ``tokens`` reads (``cached_blocks`` of
        the request's blocks cached in the coordinator's index)."""
        return range(self.first_needed_block(tokens), hit_num_blocks(request, tokens, cached_blocks, self.block_size))

    def _hit_ids(self, request: Request, hit: PrefixHit) -> tuple[int, list[int]]:
        """(first block index, cached block ids from it up to the hit's end)."""
        first = self.first_needed_block(hit.num_tokens)
        ids = [self.pool.lookup(h) for h in request.block_hashes[first: len(hit.blocks)]]
        assert all(i is not None for i in ids), "a hit's window must be cached"
        return first, ids  # type: ignore[return-value]

    def can_allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None) -> bool:
        if hit is None:
            table = self._tables[request.request_id]
            return self._missing(len(table.blocks), num_tokens) <= self.pool.num_free
        _, ids = self._hit_ids(request, hit)
        free_hits = sum(1 for i in ids if self.pool.is_free(i))
        return self._missing(len(hit.blocks), num_tokens) <= self.pool.num_free - free_hits

    def allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None) -> None:
        """Grow the request's table to ``num_tokens`` tokens (on admission, taking
        the hit's window first); ``can_allocate`` said it fits."""
        if hit is not None:
            first, ids = self._hit_ids(request, hit)
            self.pool.acquire(ids)
            self._tables[request.request_id] = _Table([NO_BLOCK] * first + ids, first, len(hit.blocks))
        table = self._tables[request.request_id]
        new = self.pool.allocate(self._missing(len(table.blocks), num_tokens))
        assert new is not None, "allocate() without room: call can_allocate() first"
        table.blocks.extend(new)
        self.pool.take_forgotten()  # evicted hashes: nothing keys on this pool's blocks but itself

    def _missing(self, have: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - have)

    # ---------------------------------------------------------- lower tier
    def reserve_import(self, request: Request, count: int) -> ImportHold | None:
        """Fresh blocks (held, unpublished) for ``count`` of the request's window blocks read
        from a lower tier, or None when the pool has no room. The request's blocks this pool
        already caches are held until ``publish_import`` or the pool's ``end_import``, so the room
        never comes from the window the imported blocks complete, nor do the steps between."""
        held = [b for h in request.block_hashes if (b := self.pool.lookup(h)) is not None]
        hold = self.pool.reserve_import(held, count)
        self.pool.take_forgotten()  # evicted hashes: nothing keys on this pool's blocks but itself
        return hold

    def publish_import(self, block_hashes: list[bytes], hold: ImportHold) -> None:
        """Index the blocks ``reserve_import``'s caller filled and let them and the held window
        go (tail first): cached, findable, held by nobody (a hash indexed meanwhile leaves its
        copy private)."""
        for block_hash, block_id in zip(block_hashes, hold.blocks, strict=True):
            self.pool.publish(block_id, block_hash)
        self.pool.end_import(hold)

    # ------------------------------------------------------------------ steps
    def shrink(self, request: Request) -> None:
        """Give back the blocks the request's next tokens cannot see (tail first,
        like every release, so older blocks are evicted before newer ones)."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        first = min(self.first_needed_block(request.num_computed_tokens), len(table.blocks))
        if first <= table.first:
            return
        gone = table.blocks[table.first: first]
        table.blocks[table.first: first] = [NO_BLOCK] * len(gone)
        table.first = first
        self.pool.release(list(reversed(gone)))
        self.blocks_released += len(gone)

    def window_table(self, request: Request, start: int) -> tuple[int, list[int]]:
        """(first block index, block ids from it on) for a step computing from ``start``."""
        table = self._tables[request.request_id]
        first = self.first_needed_block(start)
        assert first >= table.first, "a step reads a block the request gave back"
        return first, table.blocks[first:]

    def after_step(self, request: Request) -> None:
        """Index the request's complete blocks (the coordinator extended its hashes)."""
        table = self._tables.get(request.request_id)
        if table is None or not self.enable_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table.blocks))
        for i in range(max(table.published, table.first), full):
            self.pool.publish(table.blocks[i], request.block_hashes[i])
        table.published = max(table.published, full)

    def release(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self.pool.release([b for b in reversed(table.blocks) if b != NO_BLOCK])

    def reset(self) -> None:
        self.pool.reset_cache()
        self.pool.take_forgotten()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        pool = self.pool
        return {"swa_blocks_total": pool.num_blocks, "swa_blocks_used": pool.num_used,
                "swa_blocks_cached": pool.num_cached_free, "swa_blocks_released": self.blocks_released}

    def check_invariants(self, running_ids: set[str], lookup: Callable[[bytes], int | None]) -> None:
        assert set(self._tables) <= running_ids, "a sliding-window table outlived its request"
        refs: dict[int, int] = {}
        for table in self._tables.values():
            assert all(b == NO_BLOCK for b in table.blocks[: table.first]), "a given-back block is still listed"
            for block_id in table.blocks[table.first:]:
                assert block_id != NO_BLOCK, "a hole inside a request's window"
                refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_invariants(refs)
