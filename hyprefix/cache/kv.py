"""Per-request block tables over a shared ``BlockPool``.

A request's block table covers every token whose K/V has been (or is about to
be) written. Blocks are released tail first so that, once content hashing is on,
chain tails are evicted before their heads.
"""

from __future__ import annotations

from hyprefix.cache.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(request_id)))

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens. On failure nothing changes."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need == 0:
            self._tables.setdefault(request_id, [])
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        self._tables.setdefault(request_id, []).extend(new)
        return True

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(list(reversed(table)))

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_invariants(refs)
