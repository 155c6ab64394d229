"""The recurrent-state kind of cache (Mamba2 layers; no torch): where checkpoints
of the state are taken and how prefix hits resume from them.

A hybrid hit of length L needs every KV block below L *and* a checkpoint at
exactly L (the recurrent state summarises all tokens before L). Checkpoints are
taken only where they will plausibly be reused:

- the last block boundary before a prompt's final token,
  ``floor((len - 1) / block) * block``: an identical prompt (retries, RL samples,
  ``n > 1``) resumes there and recomputes less than one block; a longer prompt
  that extends it loses at most one block;
- for a block-aligned prompt, one token before its end (keyed
  ``before_last_token(hash of its last block)``): an identical prompt is then a
  full KV hit that resumes at its final token and computes only that token, as
  on a dense model (without it every RL sample would recompute a whole block);
- the divergence point, the block boundary where a prompt leaves the longest
  cached KV path: the next request along either branch resumes there instead of
  at the last checkpoint before it (siblings and branches share the common part);
- the last block boundary of prompt + output when a request finishes: the next
  chat turn resumes there. While decoding, a request keeps one provisional
  checkpoint at its latest full block and drops the previous one, so the pool
  holds one per conversation, not one per 16 generated tokens.

Mid-prompt boundaries and intermediate decode boundaries are not checkpointed:
nobody resumes there unless a prompt diverges there, and then it becomes a
divergence point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hyprefix.cache.coordinator import CacheKind, PrefixHit, StateOp, Taps
from hyprefix.cache.state_pool import StatePool, before_last_token
from hyprefix.request import Request


@dataclass
class _Plan:
    request: Request
    taps: list[int] = field(default_factory=list)  # absolute positions still to checkpoint
    # (slot, provisional, tokens the request must have computed before the commit)
    reserved: list[tuple[int, bool, int]] = field(default_factory=list)
    provisional: bytes | None = None  # hash of the request's current decode checkpoint


class RecurrentStateCache(CacheKind):
    """One live state slot per running request plus checkpoints in ``pool``."""

    name = "recurrent"
    has_live_state = True
    wants_branch_points = True

    def __init__(self, pool: StatePool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._plans: dict[str, _Plan] = {}

    def longest_hit(self, request: Request, limit: int, cached_blocks: int) -> int:
        """The longest L <= ``limit`` with a checkpoint at exactly L: the final token of
        a fully cached block-aligned prompt, or a block boundary."""
        bs = self.block_size
        hashes = request.block_hashes
        # Off a boundary only at the final token of a fully cached block-aligned prompt.
        if limit % bs and self.pool.lookup(self._key(hashes, limit)) is not None:
            return limit
        for blocks in range(limit // bs, 0, -1):
            if self.pool.lookup(hashes[blocks - 1]) is not None:
                return blocks * bs
        return 0

    def admit(self, request: Request, hit: PrefixHit) -> StateOp:
        """Assign the live slot and plan the checkpoints; the op initialises the live
        slot from the checkpoint at the hit (zeros without a hit)."""
        bs, n = self.block_size, request.num_tokens
        live = self.pool.assign_live(request.request_id)
        restore = None
        if hit.num_tokens:
            restore = self.pool.lookup(self._key(request.block_hashes, hit.num_tokens))
            assert restore is not None, "a hit must end on a checkpoint"
            self.pool.touch(restore)
        last = (n - 1) // bs * bs
        divergence = min(hit.kv_blocks * bs, last)
        # Only a fresh prompt: after a preemption n includes output tokens, and only an
        # identical prompt + output could reuse that state.
        before_last = n - 1 if n % bs == 0 and not request.output_token_ids else 0
        taps = sorted({p for p in (divergence, last, before_last) if p > hit.num_tokens})
        self._plans[request.request_id] = _Plan(request, taps=taps)
        return restore, live

    def _commit_after(self, position: int) -> int:
        """Computed tokens after which the checkpoint at ``position`` may become
        findable: its block must be complete (and so published) first. A
        before-last-token state is written one step before its block completes
        when a chunk ends right there."""
        return -(-position // self.block_size) * self.block_size

    def _key(self, hashes: list[bytes], position: int) -> bytes:
        """Checkpoint key of the state after ``position`` tokens."""
        bs = self.block_size
        if position % bs == 0:
            return hashes[position // bs - 1]
        assert (position + 1) % bs == 0, "only block boundaries and before-last-token positions are checkpointed"
        return before_last_token(hashes[position // bs])

    def branch_point(self, owner_id: str, position: int) -> None:
        """Another request waits for ``owner_id``'s blocks and will branch off at
        ``position``: have the owner checkpoint there if it has not passed it yet."""
        plan = self._plans.get(owner_id)
        if plan is not None and position > plan.request.num_computed_tokens and position not in plan.taps:
            plan.taps = sorted([*plan.taps, position])

    def plan_step(self, request: Request, start: int, n: int) -> tuple[int, Taps]:
        """(live slot, taps as (position, checkpoint slot)) for computing
        positions ``start .. start + n - 1`` this step."""
        plan = self._plans[request.request_id]
        live = self.pool.live_slot(request.request_id)
        assert live is not None
        end = start + n
        decoding = bool(request.output_token_ids) and end == request.num_tokens
        wanted = [(p, False) for p in plan.taps if start < p <= end]
        plan.taps = [p for p in plan.taps if p > end]
        if decoding and end % self.block_size == 0:
            wanted.append((end, True))
        if not wanted or self.pool.capacity == 0:
            return live, ()
        hashes = request.block_hashes
        taps = []
        for pos, provisional in wanted:
            slot = self.pool.reserve(self._key(hashes, pos), pos)
            if slot is not None:
                taps.append((pos, slot))
                plan.reserved.append((slot, provisional, self._commit_after(pos)))
        return live, tuple(taps)

    def after_step(self, request: Request) -> None:
        """A step of this request has finished: commit the checkpoints it wrote
        whose blocks are complete (the rest wait for the request's next step)."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        pending = []
        for slot, provisional, commit_after in plan.reserved:
            if request.num_computed_tokens < commit_after:
                pending.append((slot, provisional, commit_after))
                continue
            block_hash = self.pool.commit(slot)
            if provisional and block_hash is not None:
                if plan.provisional is not None:
                    self.pool.drop_key(plan.provisional)
                plan.provisional = block_hash
        plan.reserved = pending

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: free its live slot; its
        committed checkpoints stay (the latest decode one is the finish checkpoint)."""
        plan = self._plans.pop(request.request_id, None)
        if plan is not None:
            for slot, _, _ in plan.reserved:
                self.pool.cancel(slot)
        self.pool.release_live(request.request_id)

    def forget(self, block_hash: bytes, evicted: bool = True) -> None:
        self.pool.drop(block_hash, evicted)

    def stats(self) -> dict[str, int]:
        return {"state_checkpoints_used": self.pool.num_used, "state_checkpoints_capacity": self.pool.capacity}

    def check_invariants(self, running_ids: set[str], kv_lookup: Callable[[bytes], int | None]) -> None:
        """Live slots, plans and reserved checkpoint slots belong exactly to the
        running requests, and every checkpoint sits on a cached block."""
        self.pool.check_invariants(kv_lookup)
        assert self.pool.live_request_ids == running_ids, "live state slots out of sync with running requests"
        assert set(self._plans) == running_ids, "checkpoint plans out of sync with running requests"
        held = [slot for plan in self._plans.values() for slot, _, _ in plan.reserved]
        assert len(held) == len(set(held)) and set(held) == self.pool.reserved_slots, \
            "a checkpoint reservation is not held by exactly one running request"
