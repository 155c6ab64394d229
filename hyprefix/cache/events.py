"""What the prefix cache announces as it changes (no torch), for routers outside the engine.

The KV events are vLLM's (``vllm.distributed.kv_events``): ``BlockStored`` when full
blocks become findable, ``BlockRemoved`` when the cache forgets them (eviction, reset),
``AllBlocksCleared`` when nothing is left. Hashes are this engine's chained block hashes
(``hashing.py``: model identity and cache salt in the root), one per ``block_size``
tokens, so a router that hashes a request the same way can look its prefix up.

Hybrid models (Mamba2 layers) add what vLLM does not say: a cached KV block is a usable
hit only where a recurrent-state checkpoint sits (``state_pool.py``), so ``StateStored`` /
``StateRemoved`` name the blocks whose end holds one (``before_last_token``: the state one
token before the block's end, which an identical block-aligned prompt resumes from).

Order is the cache's own: a hash removed and stored again appears in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # the block before the first one; None at the root
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class StateStored:
    block_hashes: list[bytes]
    before_last_token: bool = False


@dataclass(frozen=True)
class StateRemoved:
    block_hashes: list[bytes]
    before_last_token: bool = False


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
StateEvent = StateStored | StateRemoved
CacheEvent = KVEvent | StateEvent


@dataclass
class EventLog:
    """Events since the last ``drain``; off, ``add`` keeps nothing (the default: no
    publisher, no cost). Consecutive removals of one kind fold into one event."""

    enabled: bool = False
    _events: list[CacheEvent] = field(default_factory=list)

    def add(self, event: CacheEvent) -> None:
        if not self.enabled:
            return
        last = self._events[-1] if self._events else None
        same_removal = (isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved)) or (
            isinstance(event, StateRemoved) and isinstance(last, StateRemoved)
            and last.before_last_token == event.before_last_token)
        if same_removal:
            last.block_hashes.extend(event.block_hashes)
        else:
            self._events.append(event)

    def drain(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events


@dataclass
class SaveLog:
    """What a pool's lower tier (the disk tier, ``disk/``) must save before the bytes are
    rewritten: (key, block id or slot) of every cached entry the pool evicts (its bytes intact
    until the step that reuses it) and, with ``on_publish`` (write-through), of every entry it
    makes findable. Plain data the pool appends to; the cache coordinator drains it
    (``CacheCoordinator.take_saves``) and hands it to the tier: the pool calls nothing."""

    on_publish: bool = False
    entries: list[tuple[bytes, int]] = field(default_factory=list)

    def take(self) -> list[tuple[bytes, int]]:
        entries, self.entries = self.entries, []
        return entries
