"""Retention: a finished request's prefix kept for T seconds (no torch).

An agent calls a tool between two turns of one conversation; while the tool runs, plain LRU
may evict the conversation's blocks, and the next turn computes its whole context again. A
request may ask to keep its prefix for a while after it finishes (``SamplingParams.cache_ttl_s``;
the server's ``cache_control`` field, Anthropic's prompt-caching shape as SGLang's and Dynamo's
pinning took it; ``--tool-call-retention-s`` for chat turns that end in tool calls). Rules:

- **What.** When a request finishes (not when it is aborted or preempted), its *retention* takes
  the blocks of its prompt + output that a next turn can hit: its full, published blocks from
  the first on, shortened to where every cache kind can resume (``CacheCoordinator._resumable``:
  hybrids to the furthest state checkpoint, sliding-window models to a position whose window
  blocks are cached). With them it keeps that checkpoint (hybrids) and those window blocks.
- **Evicted last.** A retained entry stays cached and findable. While unreferenced it waits in a
  free list of its own (``BlockPool.mark_retained``, ``StatePool.mark_retained``) that the pool
  reuses only once no other free block (or checkpoint) is left, so every unretained cached entry
  goes first; then the least recently freed retained one goes, and its retention loses it
  (``take_retention_lost``). So a retention never makes a request wait or fail: it only orders
  eviction. A retained block that is hit is referenced as any block; its retention goes on.
- **Budget.** Retentions hold at most ``budget_fraction`` of each pool (main KV blocks, sliding-window
  blocks, checkpoint slots), and the retentions of one tenant (``Request.tenant``; requests
  without one share the tenant ``""``) at most ``tenant_fraction`` of it; an entry held by several
  retentions counts once. A retention that does not fit is *capped*: it keeps the longest head of
  its prefix that fits (shortened again to where every kind can resume), possibly nothing. Its
  time is capped at ``max_s``. The request learns what it got (``RetentionGrant``: seconds and
  tokens kept; 0 and 0 when nothing).
- **Expiry.** At ``finish time + ttl`` (the scheduler's clock; checked at every step and every
  grant) a retention ends: its entries no other retention holds become plain cached entries, as
  if freed then (LRU as before). ``release`` ends one early (the server, for a turn that did not
  end in tool calls); ``reset_prefix_cache`` ends every one.
- **Tiers and events.** Nothing else changes: a retained block evicted from memory is saved to the
  disk tier and announced (``BlockRemoved``) as any evicted block; the cache-aware policy's
  ``cached_tokens`` counts retained blocks as any cached block.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from hyprefix.outputs import RetentionGrant
from hyprefix.request import Request

if TYPE_CHECKING:
    from hyprefix.cache.kv import KVCacheManager
    from hyprefix.cache.sliding import SlidingWindowKV
    from hyprefix.cache.state_pool import StatePool

DEFAULT_MAX_RETENTION_S = 3600.0  # Anthropic's longest cache_control ttl ("1h")
DEFAULT_BUDGET_FRACTION = 0.5
DEFAULT_TENANT_FRACTION = 0.25
NO_GRANT = RetentionGrant(0.0, 0)


@dataclass(frozen=True)
class RetentionConfig:
    """``max_s``: the longest retention a request gets; ``budget_fraction``: the share of each pool
    retentions may hold; ``tenant_fraction``: the share one tenant's retentions may hold."""

    max_s: float = DEFAULT_MAX_RETENTION_S
    budget_fraction: float = DEFAULT_BUDGET_FRACTION
    tenant_fraction: float = DEFAULT_TENANT_FRACTION

    def __post_init__(self) -> None:
        for name in ("budget_fraction", "tenant_fraction"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"retention {name} must be in [0, 1], got {value!r}")
        if not 0 <= self.max_s < float("inf"):
            raise ValueError(f"max retention must be a number of seconds >= 0, got {self.max_s!r}")


class Keeper(Protocol):
    """What a pool offers retention (``BlockPool``, ``StatePool``): entries are block ids or slots."""

    def mark_retained(self, ids: list[int]) -> None: ...

    def unmark_retained(self, ids: list[int]) -> None: ...

    def retained_ids(self) -> set[int]: ...

    def take_retention_lost(self) -> list[int]: ...


class Ledger:
    """Who retains which entries of one pool, within its budget and tenant limits."""

    def __init__(self, pool: Keeper, capacity: int, config: RetentionConfig) -> None:
        self.pool = pool
        self.budget = int(capacity * config.budget_fraction)
        self.tenant_limit = int(capacity * config.tenant_fraction)
        self.holders: dict[int, dict[int, str]] = {}  # entry -> {grant id: its tenant}
        self.tenants: dict[str, Counter[int]] = {}  # tenant -> entry -> how many of its grants hold it
        self.lost = 0  # retained entries the pool reused before their retention ended

    def sync(self) -> None:
        """Forget the entries the pool reused (or dropped) while retained."""
        for entry in self.pool.take_retention_lost():
            for tenant in self.holders.pop(entry, {}).values():
                self._untenant(tenant, entry)
            self.lost += 1

    def fits(self, tenant: str, entries: Sequence[int]) -> int:
        """How many of ``entries`` (in order) one more grant of ``tenant`` may hold."""
        total, mine = len(self.holders), self.tenants.get(tenant, Counter())
        used = len(mine)
        n = 0
        for entry in entries:
            if entry not in self.holders:
                if total >= self.budget:
                    break
                total += 1
            if entry not in mine:
                if used >= self.tenant_limit:
                    break
                used += 1
            n += 1
        return n

    def hold(self, grant: int, tenant: str, entries: list[int]) -> None:
        new = [entry for entry in entries if entry not in self.holders]
        counts = self.tenants.setdefault(tenant, Counter())
        for entry in entries:
            self.holders.setdefault(entry, {})[grant] = tenant
            counts[entry] += 1
        self.pool.mark_retained(new)

    def release(self, grant: int, entries: list[int]) -> None:
        """End ``grant``'s hold on ``entries`` (those the pool reused meanwhile are skipped)."""
        freed = []
        for entry in entries:
            holders = self.holders.get(entry)
            if holders is None or grant not in holders:
                continue
            self._untenant(holders.pop(grant), entry)
            if not holders:
                del self.holders[entry]
                freed.append(entry)
        self.pool.unmark_retained(freed)

    def _untenant(self, tenant: str, entry: int) -> None:
        counts = self.tenants[tenant]
        counts[entry] -= 1
        if counts[entry] <= 0:
            del counts[entry]
            if not counts:
                del self.tenants[tenant]

    def check_invariants(self) -> None:
        assert set(self.holders) == self.pool.retained_ids(), "retained entries out of sync with the pool"
        assert len(self.holders) <= self.budget, "retentions hold more than their budget"
        recount: dict[str, Counter[int]] = {}
        for entry, grants in self.holders.items():
            assert grants, "an entry held by no grant"
            for tenant in grants.values():
                recount.setdefault(tenant, Counter())[entry] += 1
        assert recount == self.tenants, "tenant counts out of sync"
        assert all(len(counts) <= self.tenant_limit for counts in self.tenants.values()), "a tenant over its limit"


@dataclass
class _Grant:
    request_id: str
    expires: float
    parts: list[tuple[Ledger, list[int]]]


class Retention:
    """Every retention of one cache: grants, their expiry and a ledger per pool."""

    def __init__(self, kv: KVCacheManager, window: SlidingWindowKV | None, states: StatePool | None,
                 resumable: Callable[[Request, int, int], int]) -> None:
        self.kv, self.window, self.states, self.resumable = kv, window, states, resumable
        self._grants: dict[int, _Grant] = {}
        self._expiry: list[tuple[float, int]] = []  # (expires, grant id), a min-heap
        self._by_request: dict[str, int] = {}  # finished request id -> its grant (for ``release``)
        self._ids = itertools.count()
        self.configure(RetentionConfig())

    def configure(self, config: RetentionConfig) -> None:
        """Set the limits (before any grant)."""
        assert not self._grants, "retention limits change only while nothing is retained"
        self.config = config
        self.main = Ledger(self.kv.pool, self.kv.pool.num_blocks, config)
        self.window_ledger = Ledger(self.window.pool, self.window.pool.num_blocks, config) \
            if self.window is not None else None
        self.state_ledger = Ledger(self.states, self.states.capacity, config) if self.states is not None else None

    def _ledgers(self) -> list[Ledger]:
        return [ledger for ledger in (self.main, self.window_ledger, self.state_ledger) if ledger is not None]

    def _sync(self) -> None:
        for ledger in self._ledgers():
            ledger.sync()

    # ---------------------------------------------------------------- grants
    def retain(self, request: Request, ttl_s: float, now: float) -> RetentionGrant:
        """Keep the finished ``request``'s prefix (it still holds its blocks) for ``ttl_s`` seconds
        from ``now``, capped by the limits; returns what was granted."""
        self.expire(now)
        ttl_s = min(float(ttl_s), self.config.max_s)
        if ttl_s <= 0 or not self.kv.enable_caching:
            return NO_GRANT
        tenant = request.tenant or ""
        bs = self.kv.block_size
        blocks = []
        for block_hash in self.kv.update_hashes(request)[: request.num_computed_tokens // bs]:
            block_id = self.kv.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        fit = self.main.fits(tenant, blocks)
        tokens = self.resumable(request, fit * bs, fit) if fit else 0
        parts = [(self.main, blocks[: tokens // bs])]
        for ledger, entries in self._kind_entries(request, tokens):
            if ledger.fits(tenant, entries) < len(entries):
                tokens = 0
            parts.append((ledger, entries))
        if tokens == 0:
            return NO_GRANT
        grant = next(self._ids)
        for ledger, entries in parts:
            ledger.hold(grant, tenant, entries)
        self._grants[grant] = _Grant(request.request_id, now + ttl_s, parts)
        heapq.heappush(self._expiry, (now + ttl_s, grant))
        self._by_request[request.request_id] = grant
        return RetentionGrant(ttl_s, tokens)

    def _kind_entries(self, request: Request, tokens: int) -> list[tuple[Ledger, list[int]]]:
        """The window blocks and the checkpoint a hit of ``tokens`` tokens reads (``tokens`` is
        where every kind can resume, so they are all cached)."""
        if tokens == 0:
            return []
        hashes, bs = request.block_hashes, self.kv.block_size
        out = []
        if self.window is not None and self.window_ledger is not None:
            first = self.window.first_needed_block(tokens)
            ids = [self.window.pool.lookup(h) for h in hashes[first: tokens // bs]]
            assert all(i is not None for i in ids), "a resumable position's window is cached"
            out.append((self.window_ledger, ids))
        if self.states is not None and self.state_ledger is not None:
            slot = self.states.lookup(hashes[tokens // bs - 1])
            assert slot is not None, "a resumable position has a checkpoint"
            out.append((self.state_ledger, [slot]))
        return out  # type: ignore[return-value]

    def expire(self, now: float) -> None:
        """End every retention whose time is up."""
        self._sync()
        while self._expiry and self._expiry[0][0] <= now:
            self._end(heapq.heappop(self._expiry)[1])

    def release(self, request_id: str) -> bool:
        """End the retention of a finished request now; False when it has none."""
        self._sync()
        grant = self._by_request.get(request_id)
        if grant is None:
            return False
        self._end(grant)
        return True

    def clear(self) -> None:
        """End every retention (the cache is reset)."""
        self._sync()
        for grant in list(self._grants):
            self._end(grant)
        self._expiry.clear()

    def _end(self, grant_id: int) -> None:
        grant = self._grants.pop(grant_id, None)
        if grant is None:  # released before it expired
            return
        for ledger, entries in grant.parts:
            ledger.release(grant_id, entries)
        if self._by_request.get(grant.request_id) == grant_id:
            del self._by_request[grant.request_id]

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        self._sync()
        out = {"kv_retentions": len(self._grants), "kv_blocks_retained": len(self.main.holders),
               "kv_retained_blocks_evicted": self.main.lost}
        if self.state_ledger is not None:
            out["state_checkpoints_retained"] = len(self.state_ledger.holders)
        if self.window_ledger is not None:
            out["swa_blocks_retained"] = len(self.window_ledger.holders)
        return out

    def check_invariants(self) -> None:
        self._sync()
        for ledger in self._ledgers():
            ledger.check_invariants()
            assert all(grants.keys() <= self._grants.keys() for grants in ledger.holders.values()), \
                "an entry held by an ended retention"
        assert all(self._grants[g].request_id == rid for rid, g in self._by_request.items()), "request index stale"
        assert len(self._expiry) >= len(self._grants), "a retention without an expiry"
