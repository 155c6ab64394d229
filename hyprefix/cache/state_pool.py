"""Recurrent-state slots (no torch): the live slot of each running request and a
budgeted pool of state checkpoints keyed by KV block hash.

A checkpoint holds the recurrent state of every such layer (Mamba2: conv + SSM)
right after the last token of the block whose hash keys it. Rules:
- A slot is reserved when the scheduler plans the step that will compute the
  state (the runner writes it during that step) and committed, i.e. becomes
  findable, only after the step has finished.
- When a reservation finds no free slot, a committed checkpoint is evicted:
  the least recently used (a hit counts as a use), or under the cost-aware
  policy the one of least recency + FLOPs saved (``checkpoint_policy.py``;
  ``reserve`` takes the position the checkpoint sits at); reservations never
  evict each other. Retained checkpoints (``mark_retained``: at the end of a finished
  request's kept prefix, ``retention.py``) go only when no other one is left.
- A checkpoint dies with its KV block: ``drop`` is called for every hash the
  block pool forgets (``CacheCoordinator`` passes them on).
- Zero capacity is valid: nothing is ever checkpointed (hybrid hits disabled).

Keys are block hashes (the state right after the block's last token) or
``before_last_token(h)``: the state one token before the end of block ``h``, which
lets an identical block-aligned prompt resume at its final token. Both die with
block ``h``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from hyprefix.cache.checkpoint_policy import CheckpointPolicy
from hyprefix.cache.events import EventLog, SaveLog, StateRemoved, StateStored

_BEFORE_LAST = b"#before-last"


def before_last_token(block_hash: bytes) -> bytes:
    """Key of the state after every token of block ``block_hash`` but its last."""
    return block_hash + _BEFORE_LAST


def block_of(key: bytes) -> bytes:
    """The KV block hash a checkpoint key depends on."""
    return key[: -len(_BEFORE_LAST)] if key.endswith(_BEFORE_LAST) else key


def checkpoint_position(block_hashes: list[bytes], key: bytes, block_size: int) -> int:
    """The tokens the state ``key`` follows in a request with these block hashes (0 when its
    block is not among them): what a hit on it skips."""
    block = block_of(key)
    if block not in block_hashes:
        return 0
    return (block_hashes.index(block) + 1) * block_size - (block != key)


class StatePool:
    def __init__(self, num_live_slots: int, num_checkpoint_slots: int, events: EventLog | None = None,
                 policy: CheckpointPolicy | None = None) -> None:
        self.capacity = num_checkpoint_slots
        self.policy = policy if policy is not None else CheckpointPolicy()
        self.events = events if events is not None else EventLog()  # StateStored / StateRemoved
        self._free_ckpt = list(range(num_checkpoint_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._index: dict[bytes, int] = {}  # committed: hash -> slot
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # committed slots, least recently used first
        self._kept: OrderedDict[int, bytes] = OrderedDict()  # committed and retained: evicted after ``_lru``
        self._retention_lost: list[int] = []  # retained slots evicted or dropped since the last take
        self._reserved: dict[int, bytes] = {}  # slot -> key being written (not findable yet)
        self._import_slots: set[int] = set()  # those of them a lower tier's import fills
        self._flops: dict[int, float] = {}  # reserved or committed slot -> FLOPs a hit on it saves
        self._last_use: dict[int, int] = {}  # committed slot -> ``_clock`` at its commit or latest use
        self._clock = 0  # logical time: bumped by every commit, touch and end of retention
        # A min-heap: the lowest free slot first, so requests admitted together get
        # ascending slots and decode reads their states as one slice.
        self._free_live = list(range(num_live_slots))
        self._live: dict[str, int] = {}
        # What a lower tier saves: a committed checkpoint whose slot is about to be reused (its
        # bytes intact until the step that rewrites it) and, write-through, each one committed.
        self.save_log: SaveLog | None = None

    # ------------------------------------------------------------------- live
    def assign_live(self, request_id: str) -> int:
        if request_id in self._live:
            return self._live[request_id]
        if not self._free_live:
            raise RuntimeError("no free live state slot (more running requests than max_num_seqs)")
        slot = heapq.heappop(self._free_live)
        self._live[request_id] = slot
        return slot

    def release_live(self, request_id: str) -> None:
        slot = self._live.pop(request_id, None)
        if slot is not None:
            heapq.heappush(self._free_live, slot)

    def live_slot(self, request_id: str) -> int | None:
        return self._live.get(request_id)

    # ------------------------------------------------------------ checkpoints
    @property
    def num_used(self) -> int:
        return len(self._index) + len(self._reserved)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._index.get(block_hash)

    def committed(self) -> list[tuple[bytes, int]]:
        """Every findable (key, slot)."""
        return list(self._index.items())

    def touch(self, slot: int) -> None:
        for lru in (self._lru, self._kept):
            if slot in lru:
                lru.move_to_end(slot)
                self._used(slot)

    def _used(self, slot: int) -> None:
        self._clock += 1
        self._last_use[slot] = self._clock

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._index or block_hash in self._reserved.values()

    def reserve(self, block_hash: bytes, position: int = 0, for_import: bool = False) -> int | None:
        """A slot for a checkpoint to be written (by this step's taps, or ``for_import``: by a
        lower tier's copy, which may span steps), or None (already present or being written,
        no capacity, or refused by the cost-aware admission). ``position``: the tokens the state
        follows, i.e. what a hit on it skips (the cost-aware policy's value; 0 values it at
        nothing). ``commit`` or ``cancel`` ends the reservation."""
        if self.capacity == 0 or self.has(block_hash):
            return None
        flops = self.policy.flops_saved(position)
        if self._free_ckpt:
            slot = self._free_ckpt.pop()
        else:
            slot = self._evict_for(flops)
            if slot is None:
                return None
        self._flops[slot] = flops
        self._reserved[slot] = block_hash
        if for_import:
            self._import_slots.add(slot)
        return slot

    def _evict_for(self, new_flops: float) -> int | None:
        """Evict a committed checkpoint for a new one saving ``new_flops``; its slot, or None
        (only reservations are left, or the admission refuses the new one)."""
        if self._lru and self.policy.cost_aware:
            slots = list(self._lru)  # least recently used first: ties go to the least recent
            last_use = [self._last_use[s] for s in slots]
            flops = [self._flops[s] for s in slots]
            victim = self.policy.victim(last_use, flops)
            if not self.policy.admits(last_use, flops, victim, self._clock + 1, new_flops):
                return None
            slot = slots[victim]
            old_hash = self._lru.pop(slot)
        elif self._lru:  # O(1)
            slot, old_hash = self._lru.popitem(last=False)
        elif self._kept:  # only retained checkpoints are left: the least recently used goes, its retention with it
            slot, old_hash = self._kept.popitem(last=False)
            self._retention_lost.append(slot)
        else:
            return None
        del self._index[old_hash]
        del self._last_use[slot]
        if self.save_log is not None:
            self.save_log.entries.append((old_hash, slot))
        self._announce(StateRemoved, old_hash)
        return slot

    def commit(self, slot: int) -> bytes | None:
        """Make a reserved checkpoint findable; returns its hash."""
        block_hash = self._reserved.pop(slot, None)
        if block_hash is None:
            return None
        self._import_slots.discard(slot)
        self._index[block_hash] = slot
        self._lru[slot] = block_hash
        self._used(slot)
        self._announce(StateStored, block_hash)
        if self.save_log is not None and self.save_log.on_publish:
            self.save_log.entries.append((block_hash, slot))
        return block_hash

    def cancel(self, slot: int) -> None:
        self._import_slots.discard(slot)
        if self._reserved.pop(slot, None) is not None:
            del self._flops[slot]
            self._free_ckpt.append(slot)

    def drop_key(self, key: bytes) -> bool:
        slot = self._index.pop(key, None)
        if slot is None:
            return False
        if slot in self._kept:
            del self._kept[slot]
            self._retention_lost.append(slot)
        else:
            del self._lru[slot]
        del self._flops[slot], self._last_use[slot]
        self._free_ckpt.append(slot)
        self._announce(StateRemoved, key)
        return True

    def _announce(self, kind: type[StateStored] | type[StateRemoved], key: bytes) -> None:
        block = block_of(key)
        self.events.add(kind([block], before_last_token=block != key))

    def drop(self, block_hash: bytes, evicted: bool = False) -> bool:
        """The KV block was forgotten: drop every checkpoint that depends on it (``evicted``:
        its block went to make room, so a lower tier keeps them as it keeps the block)."""
        keys = (block_hash, before_last_token(block_hash))
        if evicted and self.save_log is not None:
            for key in keys:
                slot = self._index.get(key)
                if slot is not None:
                    self.save_log.entries.append((key, slot))
        dropped = self.drop_key(keys[0])
        return self.drop_key(keys[1]) or dropped

    # -------------------------------------------------------------- retention
    def mark_retained(self, slots: list[int]) -> None:
        """Keep these committed checkpoints until ``unmark_retained``: evicted only after every
        other one (then reported by ``take_retention_lost``, as is one dropped with its block)."""
        for slot in slots:
            if slot in self._lru:
                self._kept[slot] = self._lru.pop(slot)

    def unmark_retained(self, slots: list[int]) -> None:
        """End their retention: they rejoin the LRU as if used now."""
        for slot in slots:
            if slot in self._kept:
                self._lru[slot] = self._kept.pop(slot)
                self._used(slot)

    def retained_ids(self) -> set[int]:
        return set(self._kept)

    def take_retention_lost(self) -> list[int]:
        lost, self._retention_lost = self._retention_lost, []
        return lost

    @property
    def reserved_slots(self) -> set[int]:
        """Slots reserved for a step's taps (imports' reservations excluded)."""
        return set(self._reserved) - self._import_slots

    @property
    def live_request_ids(self) -> set[str]:
        return set(self._live)

    def check_invariants(self, kv_lookup) -> None:
        """``kv_lookup(hash)``: the KV block index. Every checkpoint sits on a cached block."""
        assert len(self._index) == len(self._lru) + len(self._kept) and not self._lru.keys() & self._kept.keys()
        for block_hash, slot in self._index.items():
            assert (self._lru.get(slot) or self._kept.get(slot)) == block_hash, "checkpoint LRU out of sync"
            assert kv_lookup(block_of(block_hash)) is not None, "checkpoint on a block that is no longer cached"
        used = set(self._index.values()) | set(self._reserved)
        assert len(used) + len(self._free_ckpt) == self.capacity and not used & set(self._free_ckpt)
        assert self._flops.keys() == used and self._last_use.keys() == set(self._index.values()), \
            "checkpoint costs or uses out of sync"
        assert all(0 < use <= self._clock for use in self._last_use.values())
        live = set(self._live.values())
        assert len(live) == len(self._live) and not live & set(self._free_live)
