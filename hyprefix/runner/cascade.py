"""How decode attention reads each sequence's blocks (no torch).

Sequences that hit the same cached prefix hold the very same block ids at the
start of their block tables. Decode attention then reads that prefix once for
the whole group (all their queries stacked against one K/V), each sequence's
long private part in place, and the short rest (the current token's block and a
few more) in one padded batch; the partial results merge exactly through their
log-sum-exp ("cascade" attention). Reading a shared prefix once instead of once
per sequence is what makes decode over a shared system prompt or N samples of
one prompt cheap, and reading private parts without copying them into a padded
batch is what keeps long contexts cheap: decode attention is memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CascadeThresholds:
    """When decode blocks are worth an attention call of their own (``EngineArgs``
    ``cascade_min_*`` hold the production values; tests on tiny prompts pass small ones)."""

    # A group is worth its extra attention call when it saves reading at least this
    # many K/V token rows (group size - 1 times the shared length).
    min_saved_tokens: int
    # A row's private blocks (after its shared prefix, before its current token's block)
    # get an attention call of their own, instead of a place in the padded batch, when
    # they hold at least this many tokens.
    min_solo_run_tokens: int
    # Where the runner has a fast decode path, a plan that shares prefixes (and so runs the step
    # eagerly) is kept only when reading every row whole would move at least this many times its
    # bytes (``FastPathCost``); 0 keeps every plan.
    min_traffic_ratio: float = 0.0


@dataclass(frozen=True)
class FastPathCost:
    """What a decode step costs on the runner's fast path (the model's one-call decode kernel or
    a compiled decode graph), which reads every row's whole table in place and cannot take a
    cascade plan: a plan that shares prefixes sends the step down the eager path, whose per-op
    overhead must be paid for by the K/V reads it saves (``worth_sharing``)."""

    weight_bytes: int  # what one decode step reads of the weights
    kv_bytes_per_token: int  # K + V of one token over every attention layer
    min_traffic_ratio: float  # ``CascadeThresholds.min_traffic_ratio``
    max_rows: int | None  # the most decode rows the fast path takes (None: any)

    def worth_sharing(self, segments: list[Segment], context_lens: list[int], block_size: int) -> bool:
        """Whether the shared segments of a plan save enough K/V reads to leave the fast path."""
        if self.max_rows is not None and len(context_lens) > self.max_rows:
            return True  # the step runs eagerly anyway
        saved = sum((len(s.rows) - 1) * len(s.blocks) * block_size for s in segments if len(s.rows) > 1)
        whole = self.weight_bytes + self.kv_bytes_per_token * sum(context_lens)
        return whole >= self.min_traffic_ratio * (whole - self.kv_bytes_per_token * saved)


@dataclass(frozen=True)
class Segment:
    """Blocks read in one attention call by every row listed: a shared prefix (several
    rows) or a row's private part (one row)."""

    rows: list[int]  # decode rows (in batch order)
    blocks: list[int]  # physical block ids

    @property
    def contiguous(self) -> bool:
        """True when the block ids form one range, in any order: the cache slice from the
        smallest id is then a view, no gather. (Every key of a shared prefix is visible to
        every query, and attention does not depend on the order of its keys: positions
        are already rotated into them.)"""
        return max(self.blocks) - min(self.blocks) + 1 == len(self.blocks)


def plan_segments(tables: list[list[int]], context_lens: list[int], block_size: int,
                  thresholds: CascadeThresholds) -> tuple[list[Segment], list[int]]:
    """Segments of decode blocks, and per row how many leading blocks they cover.

    Shared segments are groups of rows with common leading blocks that save reading
    at least ``thresholds.min_saved_tokens`` K/V rows; each row belongs to at most one
    group. The rows are split like a trie of their block tables: a set of rows either
    shares its longest common prefix as one group, or splits by the next block into
    subsets that each share more, whichever saves more K/V reads. So two system
    prompts behind a common chat-template block become two groups, and one short row
    does not cut the prefix of the others. A shared block always ends before the row's
    current token (whose K/V lives in a block of its own), so every row keeps a
    non-empty tail.

    Then every row whose private blocks (after its group's prefix, up to its current
    token's block) hold at least ``thresholds.min_solo_run_tokens`` gets them as a
    segment of its own: read in place when the ids form one range, else gathered
    without padding. What the segments do not cover (fewer than
    ``min_solo_run_tokens`` tokens plus the current block) goes to the padded tail
    batch. A row may be in two segments: its group's and its own.
    """
    min_saved = thresholds.min_saved_tokens
    limits = [(n - 1) // block_size for n in context_lens]  # blocks a row may share

    def best(rows: list[int], depth: int) -> tuple[int, list[Segment]]:
        """The best plan (K/V rows saved, groups) for ``rows``, which share ``table[:depth]``."""
        first = tables[rows[0]]
        length, limit = depth, min(limits[r] for r in rows)
        while length < limit and all(tables[r][length] == first[length] for r in rows[1:]):
            length += 1
        saved = (len(rows) - 1) * length * block_size
        whole = (saved, [Segment(rows=rows, blocks=first[:length])]) if saved >= min_saved else (0, [])
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
    groups: list[Segment] = []  # the shared segments, then the private ones
    for rows in buckets.values():
        if len(rows) >= 2:
            groups += best(rows, 1)[1]
    shared = [0] * len(tables)
    for g in groups:
        for r in g.rows:
            shared[r] = len(g.blocks)
    solo_min = thresholds.min_solo_run_tokens
    for row, table in enumerate(tables):
        if (limits[row] - shared[row]) * block_size >= solo_min:
            groups.append(Segment(rows=[row], blocks=table[shared[row]:limits[row]]))
            shared[row] = limits[row]
    return groups, shared
