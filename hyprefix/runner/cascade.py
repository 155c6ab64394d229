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
# A row in no group still reads the head of its table as a view (no copy into the
# padded batch) when those block ids form one range of at least this many tokens.
MIN_SOLO_RUN_TOKENS = 256


@dataclass(frozen=True)
class SharedPrefix:
    rows: list[int]  # decode rows (in batch order) that share the prefix
    blocks: list[int]  # the shared physical block ids, in order

    @property
    def contiguous(self) -> bool:
        """True when the block ids form one range, in any order: the cache slice from the
        smallest id is then a view, no gather. (Every key of a shared prefix is visible to
        every query, and attention does not depend on the order of its keys: positions
        are already rotated into them.)"""
        return max(self.blocks) - min(self.blocks) + 1 == len(self.blocks)


def plan_shared_prefixes(tables: list[list[int]], context_lens: list[int], block_size: int,
                         min_saved_tokens: int | None = None, min_solo_run_tokens: int | None = None,
                         ) -> tuple[list[SharedPrefix], list[int]]:
    """Groups of decode rows with common leading blocks, and each row's shared block count.

    Each row belongs to at most one group. The rows are split like a trie of their
    block tables: a set of rows either shares its longest common prefix as one group, or
    splits by the next block into subsets that each share more, whichever saves more
    K/V reads. So two system prompts behind a common chat-template block become two
    groups, and one short row does not cut the prefix of the others. A shared block
    always ends before the row's current token (whose K/V lives in a block of its
    own), so every row keeps a non-empty tail.

    A row left out of every group becomes a group of its own when the head of its
    table is a long range of block ids (in any order): it is read in place instead of being
    copied into the padded batch of tails (a long private context is the common case
    without sharing, and the copy dominated decode attention there).
    """
    min_saved = MIN_SAVED_TOKENS if min_saved_tokens is None else min_saved_tokens
    limits = [(n - 1) // block_size for n in context_lens]  # blocks a row may share

    def best(rows: list[int], depth: int) -> tuple[int, list[SharedPrefix]]:
        """The best plan (K/V rows saved, groups) for ``rows``, which share ``table[:depth]``."""
        first = tables[rows[0]]
        length, limit = depth, min(limits[r] for r in rows)
        while length < limit and all(tables[r][length] == first[length] for r in rows[1:]):
            length += 1
        saved = (len(rows) - 1) * length * block_size
        whole = (saved, [SharedPrefix(rows=rows, blocks=first[:length])]) if saved >= min_saved else (0, [])
        deeper: dict[int, list[int]] = {}
        for r in rows:
            if limits[r] > length:
                deeper.setdefault(tables[r][length], []).append(r)
        split_saved, split_groups = 0, []
        for sub in deeper.values():
            if len(sub) >= 2:
                sub_saved, sub_groups = best(sub, length + 1)
                split_saved += sub_saved
                split_groups += sub_groups
        return whole if whole[0] >= split_saved else (split_saved, split_groups)

    buckets: dict[int, list[int]] = {}
    for row, table in enumerate(tables):
        if limits[row] >= 1:
            buckets.setdefault(table[0], []).append(row)
    groups: list[SharedPrefix] = []
    for rows in buckets.values():
        if len(rows) >= 2:
            groups += best(rows, 1)[1]
    shared = [0] * len(tables)
    for g in groups:
        for r in g.rows:
            shared[r] = len(g.blocks)
    solo_min = MIN_SOLO_RUN_TOKENS if min_solo_run_tokens is None else min_solo_run_tokens
    for row, table in enumerate(tables):
        if shared[row] == 0 and limits[row] * block_size >= solo_min:
            # the longest head of the table whose ids form one range (freed blocks come
            # back tail first, so a reused run is often in descending order)
            run, low, high = 1, table[0], table[0]
            while run < limits[row]:
                low, high = min(low, table[run]), max(high, table[run])
                if high - low != run:
                    break
                run += 1
            if run * block_size >= solo_min:
                groups.append(SharedPrefix(rows=[row], blocks=table[:run]))
                shared[row] = run
    return groups, shared
