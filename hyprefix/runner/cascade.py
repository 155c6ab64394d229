"""Which decode sequences share physical KV blocks (no torch).

Sequences that hit the same cached prefix hold the very same block ids at the
start of their block tables. Decode attention then reads that prefix once for
the whole group (all their queries stacked against one K/V) and each sequence's
private tail separately; the two partial results merge exactly through their
log-sum-exp ("cascade" attention). Reading the shared prefix once instead of
once per sequence is what makes decode over a shared system prompt or N samples
of one prompt cheap: decode attention is memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

# A group is worth its extra attention call when it saves reading at least this
# many K/V token rows (group size - 1 times the shared length).
MIN_SAVED_TOKENS = 256


@dataclass(frozen=True)
class SharedPrefix:
    rows: list[int]  # decode rows (in batch order) that share the prefix
    blocks: list[int]  # the shared physical block ids, in order

    @property
    def contiguous(self) -> bool:
        """True when the blocks are consecutive ids: the cache slice is a view, no gather."""
        return self.blocks == list(range(self.blocks[0], self.blocks[0] + len(self.blocks)))


def plan_shared_prefixes(tables: list[list[int]], context_lens: list[int], block_size: int,
                         min_saved_tokens: int | None = None) -> tuple[list[SharedPrefix], list[int]]:
    """Groups of decode rows by common leading blocks, and each row's shared block count.

    Rows are bucketed by their first block id and a bucket shares its longest common
    block-table prefix. A shared block always ends before the row's current token
    (whose K/V lives in a private block), so every row keeps a non-empty tail.
    """
    if min_saved_tokens is None:
        min_saved_tokens = MIN_SAVED_TOKENS
    buckets: dict[int, list[int]] = {}
    for row, table in enumerate(tables):
        if table and context_lens[row] > block_size:
            buckets.setdefault(table[0], []).append(row)
    groups: list[SharedPrefix] = []
    shared = [0] * len(tables)
    for rows in buckets.values():
        if len(rows) < 2:
            continue
        limit = min((context_lens[r] - 1) // block_size for r in rows)
        first = tables[rows[0]]
        length = 0
        while length < limit and all(tables[r][length] == first[length] for r in rows[1:]):
            length += 1
        if length == 0 or (len(rows) - 1) * length * block_size < min_saved_tokens:
            continue
        groups.append(SharedPrefix(rows=rows, blocks=first[:length]))
        for r in rows:
            shared[r] = length
    return groups, shared
