"""One interface between the scheduler and every kind of per-layer cache (no torch).

A model's layers keep their past in one of a few kinds of cache:

- attention KV, full or sliding-window (``AttentionKV``): K/V in paged blocks of
  the KV pool; a request can resume at any position whose blocks are cached;
- recurrent state, Mamba2 now and Gated DeltaNet next (``RecurrentStateCache``):
  one live state per running request, and checkpoints of it keyed by block hash;
  a request can resume only where a checkpoint was taken.

The coordinator owns what every kind keys on: the block tables and the prefix
index of content-hashed blocks (``KVCacheManager``; with no attention layer the
blocks hold no tensors and only index the cache). It asks each kind how much of a
cached prefix it can resume from and takes the shortest, and passes every kind
each event of a request's life. The scheduler calls only the coordinator and never
learns which kinds a model has: a dense model is the case with one kind.

Contract of a kind (``CacheKind``): every method sees the request's
``block_hashes`` already extended to its known tokens; ``longest_hit`` may only
shorten a hit; state copies it needs before a forward are returned as
``StateOp``s; whatever it keys on a block dies when the pool forgets the block
(``forget``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hyprefix.cache.kv import KVCacheManager
from hyprefix.request import Request

StateOp = tuple[int | None, int]  # (checkpoint slot to restore or None for zeros, live slot)
Taps = tuple[tuple[int, int], ...]  # (position, checkpoint slot): save the state after that position


@dataclass(frozen=True)
class PrefixHit:
    """What admission can reuse for a request."""

    blocks: list[int]  # cached blocks the request takes (their tokens are skipped)
    num_tokens: int  # tokens skipped: a full hit still computes the last token
    kv_blocks: int  # length of the KV hit before any kind shortened it
    dense_tokens: int  # what attention alone would skip
    write_kv: bool  # False: the first computed token's K/V already sits in a shared block
    wait_for: str | None = None  # a running request computing the next block: wait for it


@dataclass(frozen=True)
class StepCache:
    """A request's cache view for one step."""

    block_table: list[int]
    state_slot: int = -1  # live state slot (models with recurrent layers)
    state_taps: Taps = ()


class CacheKind:
    """A kind of per-layer cache behind the coordinator; the defaults are what a
    cache that lives wholly in the shared KV blocks does (nothing)."""

    name = "kind"
    has_live_state = False  # keeps a per-request state slot (at most one kind per model)
    wants_branch_points = False  # asks to checkpoint where waiting requests will branch off

    def longest_hit(self, request: Request, limit: int) -> int:
        """The longest prefix of at most ``limit`` tokens this kind can resume from: a
        block boundary, or the prompt's last token when ``limit`` is (a full hit)."""
        return limit

    def admit(self, request: Request, hit: PrefixHit) -> StateOp | None:
        """The request was admitted with ``hit``; the state copy its first step needs."""
        return None

    def plan_step(self, request: Request, start: int, n: int) -> tuple[int, Taps]:
        """(live state slot, taps) for computing positions ``start .. start + n - 1``."""
        return -1, ()

    def branch_point(self, owner_id: str, position: int) -> None:
        """A waiting request will resume at ``position`` of what ``owner_id`` computes."""

    def after_step(self, request: Request) -> None:
        """A step of the request has finished and its complete blocks are published."""

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted."""

    def forget(self, block_hash: bytes) -> None:
        """The pool stopped indexing this block."""

    def stats(self) -> dict[str, int]:
        return {}

    def check_invariants(self, running_ids: set[str], lookup: Callable[[bytes], int | None]) -> None:
        """``lookup``: the prefix index (hash -> block id)."""


class AttentionKV(CacheKind):
    """Full or sliding-window attention layers: their K/V lives in the shared
    blocks, so any cached prefix is usable. Sliding-window layers keep every block
    (a window-aware cache could free blocks that left every window; not done)."""

    name = "attention"


class CacheCoordinator:
    def __init__(self, kv: KVCacheManager, kinds: Sequence[CacheKind]) -> None:
        if not kinds:
            raise ValueError("a model needs at least one kind of cache")
        if sum(kind.has_live_state for kind in kinds) > 1:
            raise ValueError("at most one kind of recurrent state per model (one live slot per request)")
        self.kv = kv
        self.kinds = tuple(kinds)
        self._branching = [kind for kind in kinds if kind.wants_branch_points]
        self.hit_tokens_lost = 0  # cached KV a kind could not resume from (no checkpoint there)

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def holds(self, request_id: str) -> bool:
        return self.kv.holds(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    # -------------------------------------------------------------- admission
    def find_hit(self, request: Request) -> PrefixHit:
        """The longest cached prefix every kind can resume from, or whom to wait for."""
        bs = self.kv.block_size
        kv_blocks = self.kv.match_prefix(request)
        dense = min(len(kv_blocks) * bs, request.num_tokens - 1)
        owner = self.kv.pending_owner(request, len(kv_blocks))
        if owner is not None:
            return PrefixHit([], 0, len(kv_blocks), dense, True, wait_for=owner)
        tokens = dense
        while True:  # a kind may only shorten the hit, so this ends
            shortest = min(kind.longest_hit(request, tokens) for kind in self.kinds)
            if shortest == tokens:
                break
            tokens = shortest
        # A full hit keeps the block holding the last token: its K/V is read there, not rewritten.
        covered = tokens + 1 if tokens == request.num_tokens - 1 and tokens < len(kv_blocks) * bs else tokens
        blocks = kv_blocks[: -(-covered // bs)]
        return PrefixHit(blocks, tokens, len(kv_blocks), dense, tokens >= len(blocks) * bs)

    def admit(self, request: Request, hit: PrefixHit, num_tokens: int) -> list[StateOp] | None:
        """Give the request the hit's blocks plus room for ``num_tokens`` tokens and
        tell every kind; None (and no change) when the pool has no room."""
        if not self.kv.admit(request, hit.blocks, num_tokens):
            return None
        self._forget_evicted()
        self.hit_tokens_lost += hit.dense_tokens - hit.num_tokens
        return [op for kind in self.kinds if (op := kind.admit(request, hit)) is not None]

    def note_waiting(self, request: Request) -> None:
        """The request waits this step: kinds that checkpoint branch points learn
        where it will leave the blocks a running request is computing for it."""
        if not self._branching or not self.kv.enable_caching:
            return
        blocks, owner_id = self.kv.shared_path(request)
        bs = self.kv.block_size
        position = min(blocks * bs, (request.num_tokens - 1) // bs * bs)
        if owner_id is not None and position > 0:
            for kind in self._branching:
                kind.branch_point(owner_id, position)

    # ------------------------------------------------------------------ steps
    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow a running request's blocks to hold ``num_tokens``; False and no change when full."""
        grown = self.kv.allocate_slots(request_id, num_tokens)
        self._forget_evicted()
        return grown

    def plan_step(self, request: Request, start: int, n: int) -> StepCache:
        slot, taps = -1, ()
        for kind in self.kinds:
            if kind.has_live_state:  # its taps are keyed by the hashes of blocks this step may complete
                self.kv.update_hashes(request)
                slot, taps = kind.plan_step(request, start, n)
        return StepCache(list(self.kv.block_table(request.request_id)), slot, taps)

    def after_step(self, request: Request) -> None:
        """Publish the request's complete blocks, then let every kind commit."""
        self.kv.publish(request)
        for kind in self.kinds:
            kind.after_step(request)

    def free(self, request: Request) -> None:
        """Release everything the request holds (finish, abort, preemption)."""
        self.kv.free(request.request_id)
        for kind in self.kinds:
            kind.release(request)

    def reset_cache(self) -> int:
        """Forget every cached block no request holds; returns how many."""
        dropped = self.kv.reset_cache()
        self._forget_evicted()
        return dropped

    def _forget_evicted(self) -> None:
        for block_hash in self.kv.pool.take_forgotten():
            for kind in self.kinds:
                kind.forget(block_hash)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        pool = self.kv.pool
        out = {"kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
               "kv_blocks_cached": pool.num_cached_free, "kv_blocks_free": pool.num_free - pool.num_cached_free,
               "hit_tokens_lost": self.hit_tokens_lost}
        for kind in self.kinds:
            out.update(kind.stats())
        return out

    def check_invariants(self, running_ids: set[str]) -> None:
        self.kv.check_invariants(running_ids)
        for kind in self.kinds:
            kind.check_invariants(running_ids, self.kv.pool.lookup)
        if not running_ids:
            assert self.kv.pool.num_used == 0, "blocks referenced while nothing runs"
