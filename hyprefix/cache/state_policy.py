"""Where hybrid models take Mamba state checkpoints and how hits use them (no torch).

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

from hyprefix.cache.state import StateCache, before_last_token
from hyprefix.request import Request

StateOp = tuple[int | None, int]  # (checkpoint slot to restore or None for zeros, live slot)
Taps = tuple[tuple[int, int], ...]  # (position, checkpoint slot)


@dataclass
class _Plan:
    taps: list[int] = field(default_factory=list)  # absolute positions still to checkpoint
    # (slot, provisional, tokens the request must have computed before the commit)
    reserved: list[tuple[int, bool, int]] = field(default_factory=list)
    provisional: bytes | None = None  # hash of the request's current decode checkpoint


class StatePolicy:
    def __init__(self, states: StateCache, block_size: int, hashes: Callable[[Request], list[bytes]]) -> None:
        """``hashes(request)``: the request's full-block hashes, extended to its known tokens."""
        self.states = states
        self.block_size = block_size
        self._hashes = hashes
        self._plans: dict[str, _Plan] = {}
        self.hybrid_hit_tokens_lost = 0

    def hybrid_hit(self, request: Request, kv_hit_blocks: int) -> tuple[int, int | None]:
        """(usable hit blocks, checkpoint slot to restore or None for a zero state).

        The usable hit is the longest L at or below both the KV hit and the
        request's last token that has a checkpoint at exactly L: the final token of
        a fully cached block-aligned prompt, or a block boundary.
        """
        bs = self.block_size
        hashes = request.block_hashes
        best = self._best_hit(request.num_tokens, kv_hit_blocks)
        if best % bs:  # the final token of a fully cached block-aligned prompt
            slot = self.states.lookup(self._key(hashes, best))
            if slot is not None:
                return best // bs + 1, slot
        for blocks in range(best // bs, 0, -1):
            slot = self.states.lookup(hashes[blocks - 1])
            if slot is not None:
                return blocks, slot
        return 0, None

    def admit(self, request: Request, kv_hit_blocks: int, hit_tokens: int, restore: int | None) -> StateOp:
        """Assign the live slot, count the hit lost to missing checkpoints and plan
        the checkpoints; returns the state op that initialises the live slot."""
        bs, n = self.block_size, request.num_tokens
        self.hybrid_hit_tokens_lost += self._best_hit(n, kv_hit_blocks) - hit_tokens
        live = self.states.assign_live(request.request_id)
        if restore is not None:
            self.states.touch(restore)
        last = (n - 1) // bs * bs
        divergence = min(kv_hit_blocks * bs, last)
        # Only a fresh prompt: after a preemption n includes output tokens, and only an
        # identical prompt + output could reuse that state.
        before_last = n - 1 if n % bs == 0 and not request.output_token_ids else 0
        taps = sorted({p for p in (divergence, last, before_last) if p > hit_tokens})
        self._plans[request.request_id] = _Plan(taps=taps)
        return restore, live

    def _best_hit(self, num_tokens: int, kv_hit_blocks: int) -> int:
        """The longest hit a checkpoint could give: what a dense model would hit."""
        bs = self.block_size
        if num_tokens % bs == 0 and kv_hit_blocks * bs >= num_tokens:
            return num_tokens - 1
        return min(kv_hit_blocks * bs, num_tokens - 1) // bs * bs

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

    def request_tap(self, owner: Request, position: int) -> None:
        """Another request waits for ``owner``'s blocks and will branch off at
        ``position``: have the owner checkpoint there if it has not passed it yet."""
        plan = self._plans.get(owner.request_id)
        if plan is not None and position > owner.num_computed_tokens and position not in plan.taps:
            plan.taps = sorted([*plan.taps, position])

    def plan_step(self, request: Request, start: int, n: int, decoding: bool) -> tuple[int, Taps]:
        """(live slot, taps as (position, checkpoint slot)) for computing
        positions ``start .. start + n - 1`` this step."""
        plan = self._plans[request.request_id]
        live = self.states.live_slot(request.request_id)
        assert live is not None
        end = start + n
        wanted = [(p, False) for p in plan.taps if start < p <= end]
        plan.taps = [p for p in plan.taps if p > end]
        if decoding and end % self.block_size == 0:
            wanted.append((end, True))
        if not wanted or self.states.capacity == 0:
            return live, ()
        hashes = self._hashes(request)
        taps = []
        for pos, provisional in wanted:
            slot = self.states.reserve(self._key(hashes, pos))
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
            block_hash = self.states.commit(slot)
            if provisional and block_hash is not None:
                if plan.provisional is not None:
                    self.states.drop_key(plan.provisional)
                plan.provisional = block_hash
        plan.reserved = pending

    def release(self, request: Request) -> None:
        """The request finished, was aborted or preempted: free its live slot; its
        committed checkpoints stay (the latest decode one is the finish checkpoint)."""
        plan = self._plans.pop(request.request_id, None)
        if plan is not None:
            for slot, _, _ in plan.reserved:
                self.states.cancel(slot)
        self.states.release_live(request.request_id)

    def check_invariants(self, running_ids: set[str], kv_lookup) -> None:
        """Live slots, plans and reserved checkpoint slots belong exactly to the
        running requests, and every checkpoint sits on a cached block."""
        self.states.check_invariants(kv_lookup)
        assert self.states.live_request_ids == running_ids, "live Mamba slots out of sync with running requests"
        assert set(self._plans) == running_ids, "checkpoint plans out of sync with running requests"
        held = [slot for plan in self._plans.values() for slot, _, _ in plan.reserved]
        assert len(held) == len(set(held)) and set(held) == self.states.reserved_slots, \
            "a checkpoint reservation is not held by exactly one running request"
