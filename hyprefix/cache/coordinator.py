"""One interface between the scheduler and every kind of per-layer cache (no torch).

A model's layers keep their past in one of a few kinds of cache:

- attention KV (``AttentionKV``): K/V in paged blocks of the KV pool; a request
  can resume at any position whose blocks are cached;
- sliding-window attention KV (``SlidingWindowKV``, ``sliding.py``): K/V of the
  sliding layers in a pool of their own, given back as it leaves the window; a
  request can resume where the window before the position is still cached;
- recurrent state, Mamba2 and Gated DeltaNet alike (``RecurrentStateCache``):
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
shorten a hit; a kind with blocks of its own says whether they fit
(``can_allocate``) before anything changes, so admission and growth stay all or
nothing; state copies it needs before a forward are returned as ``StateOp``s;
whatever it keys on a coordinator block dies when the pool forgets the block
(``forget``).

Finished requests' prefixes a request asked to keep (``retention.py``) are the coordinator's
``retention``: it holds blocks of every pool (main, window, checkpoints) that a hit at the kept
prefix's end reads, where ``_resumable`` says every kind can resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hyprefix.cache.block_pool import ImportHold
from hyprefix.cache.events import AllBlocksCleared, SaveLog
from hyprefix.cache.kv import KVCacheManager
from hyprefix.cache.retention import Retention
from hyprefix.cache.state_pool import block_of, checkpoint_position
from hyprefix.request import Request

DISK_WAIT = "<disk>"  # ``PrefixHit.wait_for`` of a request whose blocks a lower tier is loading

# The pool an entry a lower tier saves or loads belongs to: the main KV pool, the sliding-window
# layers' own pool, the recurrent-state checkpoints (keys: a block hash or its before-last-token key).
KV, SWA, STATE = "kv", "swa", "state"
Saved = tuple[str, bytes, int]  # (pool, key, block id or checkpoint slot) whose bytes to save now

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


def hit_num_blocks(request: Request, tokens: int, cached_blocks: int, block_size: int) -> int:
    """Blocks a hit skipping ``tokens`` holds when ``cached_blocks`` of the request's
    blocks are cached: those of the skipped tokens, and for a full hit the block of
    the last token too when it is cached (its K/V is read there, not rewritten)."""
    full = tokens == request.num_tokens - 1 and tokens < cached_blocks * block_size
    return -(-(tokens + full) // block_size)


@dataclass(frozen=True)
class StepCache:
    """A request's cache view for one step."""

    block_table: list[int]
    state_slot: int = -1  # live state slot (models with recurrent layers)
    state_taps: Taps = ()
    window_first_block: int = 0  # sliding-window layers: index of the first block they read
    window_blocks: list[int] | None = None  # their block ids from there on (None: no pool of their own)


class CacheKind:
    """A kind of per-layer cache behind the coordinator; the defaults are what a
    cache that lives wholly in the shared KV blocks does (nothing)."""

    name = "kind"
    has_live_state = False  # keeps a per-request state slot (at most one kind per model)
    has_own_blocks = False  # keeps K/V blocks in a pool of its own (at most one kind per model)
    wants_branch_points = False  # asks to checkpoint where waiting requests will branch off

    def longest_hit(self, request: Request, limit: int, cached_blocks: int) -> int:
        """The longest prefix of at most ``limit`` tokens this kind can resume from: a
        block boundary, or the prompt's last token when ``limit`` is (a full hit).
        ``cached_blocks``: how many of the request's blocks the coordinator found."""
        return limit

    def can_allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None) -> bool:
        """Whether ``allocate`` fits (``hit`` given: on admission)."""
        return True

    def allocate(self, request: Request, num_tokens: int, hit: PrefixHit | None) -> None:
        """Room for the request's first ``num_tokens`` tokens (``hit`` given: on admission)."""

    def admit(self, request: Request, hit: PrefixHit) -> StateOp | None:
        """The request was admitted with ``hit``; the state copy its first step needs."""
        return None

    def shrink(self, request: Request) -> None:
        """Before a step of the request: give back what its next tokens cannot read."""

    def window_table(self, request: Request, start: int) -> tuple[int, list[int]]:
        """(first block index, block ids from it on) of a kind with blocks of its own."""
        raise NotImplementedError

    def plan_step(self, request: Request, start: int, n: int) -> tuple[int, Taps]:
        """(live state slot, taps) for computing positions ``start .. start + n - 1``."""
        return -1, ()

    def branch_point(self, owner_id: str, position: int) -> None:
        """A waiting request will resume at ``position`` of what ``owner_id`` computes."""

    def after_step(self, request: Request) -> None:
        """A step of the request has finished and its complete blocks are published."""

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted."""

    def forget(self, block_hash: bytes, evicted: bool = True) -> None:
        """The pool stopped indexing this block: evicted to make room, or dropped (reset)."""

    def reset(self) -> None:
        """Forget whatever the kind caches that no request holds."""

    def stats(self) -> dict[str, int]:
        return {}

    def check_invariants(self, running_ids: set[str], lookup: Callable[[bytes], int | None]) -> None:
        """``lookup``: the prefix index (hash -> block id)."""


class AttentionKV(CacheKind):
    """Attention layers whose K/V lives in the coordinator's blocks, so any cached
    prefix is usable: full attention, and sliding windows when they get no pool of
    their own (``SlidingWindowKV``)."""

    name = "attention"


class LowerTier(Protocol):
    """A tier under the memory cache (the scheduler side of a KV connector, as vLLM's; the disk
    tier, ``disk/tier.py``). The coordinator asks it, at a request's admission, how much more
    of the prefix it can bring (``num_loadable_tokens``), and tells it when a request is gone.
    Its bytes move through ``reserve_load`` / ``publish_load`` and ``take_saves``."""

    def num_loadable_tokens(self, request: Request, mem_blocks: int, hit_tokens: int,
                            memory: CacheCoordinator) -> int:
        """Tokens past the memory hit (``hit_tokens``; ``mem_blocks`` KV blocks cached) that a
        load under way, or one started now, brings: the request waits for them. 0: it does not."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: forget its load."""
        ...


@dataclass
class LoadHold:
    """Memory a lower tier's load fills (``CacheCoordinator.reserve_load``): fresh main-pool
    blocks for ``kv`` (the request's blocks from ``first_block`` on), window-pool blocks for
    ``swa`` and a checkpoint slot for ``state_key``, all held, none findable until
    ``publish_load``."""

    first_block: int
    kv: list[bytes]  # hashes, in ``kv_hold.blocks`` order
    kv_hold: ImportHold
    swa: list[bytes] = field(default_factory=list)
    swa_hold: ImportHold | None = None
    state_key: bytes | None = None
    state_slot: int | None = None
    window_dropped: bool = False  # window blocks were wanted and found no room

    def targets(self) -> list[tuple[str, bytes, int]]:
        """(pool, key, block id or slot) of every entry the load's bytes fill."""
        out = [(KV, h, b) for h, b in zip(self.kv, self.kv_hold.blocks, strict=True)]
        out += [(SWA, h, b) for h, b in zip(self.swa, self.swa_hold.blocks if self.swa_hold else (), strict=True)]
        if self.state_slot is not None and self.state_key is not None:
            out.append((STATE, self.state_key, self.state_slot))
        return out


class CacheCoordinator:
    def __init__(self, kv: KVCacheManager, kinds: Sequence[CacheKind]) -> None:
        if not kinds:
            raise ValueError("a model needs at least one kind of cache")
        if sum(kind.has_live_state for kind in kinds) > 1:
            raise ValueError("at most one kind of recurrent state per model (one live slot per request)")
        if sum(kind.has_own_blocks for kind in kinds) > 1:
            raise ValueError("at most one kind with a block pool of its own per model")
        self.kv = kv
        self.kinds = tuple(kinds)
        self._branching = [kind for kind in kinds if kind.wants_branch_points]
        self.hit_tokens_lost = 0  # cached KV a kind could not resume from (no checkpoint there)
        self.lower: LowerTier | None = None  # the disk tier (``attach_lower``)
        self._window = next((kind for kind in kinds if kind.has_own_blocks), None)
        self._states = next((kind.pool for kind in kinds if kind.has_live_state), None)
        # finished requests' prefixes kept a while (``retention.py``; the scheduler grants and expires them)
        self.retention = Retention(kv, self._window, self._states, self._resumable)  # type: ignore[arg-type]

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def holds(self, request_id: str) -> bool:
        return self.kv.holds(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.kv.block_table(request_id)

    # -------------------------------------------------------------- admission
    def find_hit(self, request: Request) -> PrefixHit:
        """The longest cached prefix every kind can resume from, or whom to wait for. A
        request that asks for prompt logprobs computes its whole prompt (no hit)."""
        if request.params.prompt_logprobs is not None:
            return PrefixHit([], 0, 0, 0, True)
        bs = self.kv.block_size
        kv_blocks = self.kv.match_prefix(request)
        dense = min(len(kv_blocks) * bs, request.num_tokens - 1)
        owner = self.kv.pending_owner(request, len(kv_blocks))
        if owner is not None:
            return PrefixHit([], 0, len(kv_blocks), dense, True, wait_for=owner)
        tokens = self._resumable(request, dense, len(kv_blocks))
        if self.lower is not None and self.kv.enable_caching and self.lower.num_loadable_tokens(
                request, len(kv_blocks), tokens, self) > 0:
            return PrefixHit([], 0, len(kv_blocks), dense, True, wait_for=DISK_WAIT)
        blocks = kv_blocks[: hit_num_blocks(request, tokens, len(kv_blocks), bs)]
        return PrefixHit(blocks, tokens, len(kv_blocks), dense, tokens >= len(blocks) * bs)

    def cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix admission could skip from memory now: the longest
        cached run every kind can resume from (``find_hit``'s hit before any wait for a sibling
        or the disk). A pure query: it allocates nothing, moves nothing in an LRU and starts no
        load (the cache-aware scheduling policy ranks waiting requests by it)."""
        if request.params.prompt_logprobs is not None:
            return 0
        kv_blocks = len(self.kv.match_prefix(request))
        return self._resumable(request, min(kv_blocks * self.kv.block_size, request.num_tokens - 1), kv_blocks)

    def _resumable(self, request: Request, tokens: int, cached_blocks: int) -> int:
        """The longest prefix of at most ``tokens`` every kind can resume from."""
        while True:  # a kind may only shorten the hit, so this ends
            shortest = min(kind.longest_hit(request, tokens, cached_blocks) for kind in self.kinds)
            if shortest == tokens:
                return tokens
            tokens = shortest

    def admit(self, request: Request, hit: PrefixHit, num_tokens: int) -> list[StateOp] | None:
        """Give the request the hit's blocks plus room for ``num_tokens`` tokens and
        tell every kind; None (and no change) when a pool has no room."""
        if not self.kv.can_admit(hit.blocks, num_tokens) or not all(
                kind.can_allocate(request, num_tokens, hit) for kind in self.kinds):
            return None
        self.kv.admit(request, hit.blocks, num_tokens)
        self._forget_evicted()
        for kind in self.kinds:
            kind.allocate(request, num_tokens, hit)
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
    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow a running request's blocks to hold ``num_tokens`` (after giving back
        what its next step cannot read); False and no growth when a pool is full."""
        for kind in self.kinds:
            kind.shrink(request)
        rid = request.request_id
        if self.kv.num_new_blocks_needed(rid, num_tokens) > self.kv.pool.num_free or not all(
                kind.can_allocate(request, num_tokens, None) for kind in self.kinds):
            return False
        assert self.kv.allocate_slots(rid, num_tokens)
        self._forget_evicted()
        for kind in self.kinds:
            kind.allocate(request, num_tokens, None)
        return True

    def plan_step(self, request: Request, start: int, n: int) -> StepCache:
        slot, taps = -1, ()
        first, window_blocks = 0, None
        for kind in self.kinds:
            if kind.has_live_state:  # its taps are keyed by the hashes of blocks this step may complete
                self.kv.update_hashes(request)
                slot, taps = kind.plan_step(request, start, n)
            if kind.has_own_blocks:
                first, window_blocks = kind.window_table(request, start)
        return StepCache(list(self.kv.block_table(request.request_id)), slot, taps, first, window_blocks)

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
        if self.lower is not None:
            self.lower.release(request.request_id)

    def reset_cache(self) -> int:
        """Forget every cached block no request holds (retained ones too); returns how many."""
        self.retention.clear()
        dropped = self.kv.reset_cache()
        self._forget_evicted(evicted=False)
        for kind in self.kinds:
            kind.reset()
        if self.kv.pool.num_cached == 0:  # after the removals it implies, so it comes last
            self.kv.events.add(AllBlocksCleared())
        return dropped

    def _forget_evicted(self, evicted: bool = True) -> None:
        for block_hash in self.kv.pool.take_forgotten():
            for kind in self.kinds:
                kind.forget(block_hash, evicted)

    # ------------------------------------------------------------ lower tier
    def attach_lower(self, tier: LowerTier, write_through: bool) -> None:
        """Put ``tier`` under the cache: hits fall through memory to it (``find_hit``), and each
        pool records what the tier must save (``SaveLog``: evicted entries, and with
        ``write_through`` every entry made findable), which ``take_saves`` hands over."""
        self.lower = tier
        for log_owner in self._save_log_owners():
            log_owner.save_log = SaveLog(on_publish=write_through)

    def detach_lower(self) -> None:
        """The cache goes on alone: no loads, nothing recorded to save."""
        self.lower = None
        for log_owner in self._save_log_owners():
            log_owner.save_log = None

    def _save_log_owners(self) -> list:
        owners = [self.kv.pool] + ([self._window.pool] if self._window is not None else [])
        return owners + ([self._states] if self._states is not None else [])

    def take_saves(self) -> list[Saved]:
        """What the pools recorded since the last call: entries whose bytes the tier copies out
        now, before the next forward can rewrite them."""
        out = [(KV, h, b) for h, b in self.kv.pool.save_log.take()] if self.kv.pool.save_log else []
        if self._window is not None and self._window.pool.save_log is not None:
            out += [(SWA, h, b) for h, b in self._window.pool.save_log.take()]
        if self._states is not None and self._states.save_log is not None:
            out += [(STATE, k, slot) for k, slot in self._states.save_log.take()]
        return out

    def cached_entries(self) -> list[Saved]:
        """Every findable entry of every pool (what a lower tier writes out at shutdown)."""
        out = [(KV, h, b) for h, b in self.kv.pool.indexed()]
        out += [(SWA, h, b) for h, b in self._window.pool.indexed()] if self._window is not None else []
        return out + ([(STATE, k, slot) for k, slot in self._states.committed()] if self._states is not None else [])

    @property
    def has_window_pool(self) -> bool:
        """Sliding-window layers keep their K/V in a pool of their own."""
        return self._window is not None

    def in_memory(self, pool: str, key: bytes) -> bool:
        """Whether memory has the entry findable now."""
        if pool == KV:
            return self.kv.pool.lookup(key) is not None
        if pool == SWA:
            return self._window is not None and self._window.pool.lookup(key) is not None
        return self._states is not None and self._states.lookup(key) is not None

    def window_blocks_needed(self, request: Request, tokens: int, cached_blocks: int) -> range:
        """Indices of the sliding-window pool's blocks a hit skipping ``tokens`` reads (empty
        without a window pool)."""
        return self._window.needed_blocks(request, tokens, cached_blocks) if self._window is not None else range(0)

    def reserve_load(self, request: Request, first_block: int, kv: list[bytes], swa: list[bytes],
                     state_key: bytes | None, incoming_kv: set[bytes] = frozenset(),
                     incoming_swa: set[bytes] = frozenset()) -> LoadHold | None:
        """Memory for a load of the request's blocks ``kv`` (from ``first_block`` on), window blocks
        ``swa`` and checkpoint ``state_key``, less what memory has by now or what other loads
        bring (``incoming_kv``, ``incoming_swa``: their hashes); None when the KV blocks find no
        room. Window blocks or a checkpoint that find none are left out. What the reservations
        evicted is recorded to save (``take_saves``) before anyone writes there."""
        while kv and (self.in_memory(KV, kv[0]) or kv[0] in incoming_kv):
            kv, first_block = kv[1:], first_block + 1
        kv_hold = self.kv.reserve_import(request, first_block, len(kv))
        self._forget_evicted()
        if kv_hold is None:
            return None
        hold = LoadHold(first_block, kv, kv_hold)
        # Held even when memory has all of them by now (a hold of 0 fresh blocks): the hold also
        # keeps the request's cached window blocks from eviction until the load is published.
        wanted, swa = bool(swa), [h for h in swa if not self.in_memory(SWA, h) and h not in incoming_swa]
        if wanted and self._window is not None:
            swa_hold = self._window.reserve_import(request, len(swa))
            if swa_hold is not None:
                hold.swa, hold.swa_hold = swa, swa_hold
            else:
                hold.window_dropped = True
        if state_key is not None and self._states is not None:
            position = checkpoint_position(request.block_hashes, state_key, self.block_size)
            hold.state_key, hold.state_slot = state_key, self._states.reserve(state_key, position, for_import=True)
        return hold

    def publish_load(self, request: Request, hold: LoadHold) -> None:
        """The load's bytes are in place: its blocks and checkpoint become ordinary cached
        entries, held by nobody. A checkpoint whose block is not cached is let go."""
        self.kv.publish_import(request, hold.first_block, hold.kv_hold)
        if hold.swa_hold is not None and self._window is not None:
            self._window.publish_import(hold.swa, hold.swa_hold)
        if hold.state_slot is not None and self._states is not None:
            if self.kv.pool.lookup(block_of(hold.state_key)) is not None:  # a checkpoint sits on a cached block
                self._states.commit(hold.state_slot)
            else:
                self._states.cancel(hold.state_slot)

    def cancel_load(self, hold: LoadHold) -> None:
        """Let the load's memory go unpublished."""
        self.kv.pool.end_import(hold.kv_hold)
        if hold.swa_hold is not None and self._window is not None:
            self._window.pool.end_import(hold.swa_hold)
        if hold.state_slot is not None and self._states is not None:
            self._states.cancel(hold.state_slot)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        pool = self.kv.pool
        out = {"kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
               "kv_blocks_cached": pool.num_cached_free, "kv_blocks_free": pool.num_free - pool.num_cached_free,
               "hit_tokens_lost": self.hit_tokens_lost}
        for kind in self.kinds:
            out.update(kind.stats())
        return out | self.retention.stats()

    def check_invariants(self, running_ids: set[str]) -> None:
        self.kv.check_invariants(running_ids)
        for kind in self.kinds:
            kind.check_invariants(running_ids, self.kv.pool.lookup)
        self.retention.check_invariants()
        if not running_ids:
            assert self.kv.pool.num_used == self.kv.pool.num_import_held, "blocks referenced while nothing runs"
