"""What one replica holds, rebuilt from its cache events (``cache/events.py``), and the
prefix of a request it can reuse. No torch, no network: a router feeds it events.

A dense replica's hit is the longest run of the request's block hashes it holds. A
hybrid's hit stops at the last block of that run whose end holds a state checkpoint
(or, for the request's final block, a checkpoint one token before its end); a replica
that announced no state event is dense.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hyprefix.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, StateRemoved, StateStored


@dataclass
class PrefixIndex:
    hybrid: bool = False  # set by the first state event, or by whoever knows the model
    blocks: set[bytes] = field(default_factory=set)
    states: set[bytes] = field(default_factory=set)  # checkpoint at the block's end
    states_before_last: set[bytes] = field(default_factory=set)  # one token before the block's end

    def apply(self, events: Iterable[CacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
            elif isinstance(event, (StateStored, StateRemoved)):
                self.hybrid = True
                target = self.states_before_last if event.before_last_token else self.states
                if isinstance(event, StateStored):
                    target.update(event.block_hashes)
                else:
                    target.difference_update(event.block_hashes)

    def clear(self) -> None:
        self.blocks.clear()
        self.states.clear()
        self.states_before_last.clear()

    def cached_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` this replica holds K/V for."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def usable_blocks(self, hashes: Sequence[bytes], prompt_is_block_aligned: bool = False) -> float:
        """Blocks of the prefix a request with these block hashes would skip here. For a
        hybrid, up to the last cached block with a checkpoint at its end; a block-aligned
        prompt whose every block is cached also resumes from the checkpoint one token
        before its end (returned as the full count less a token's worth, ``n - 0.5``)."""
        n = self.cached_blocks(hashes)
        if not self.hybrid:
            return n
        if n and n == len(hashes) and prompt_is_block_aligned and hashes[n - 1] in self.states_before_last:
            return n - 0.5
        while n and hashes[n - 1] not in self.states:
            n -= 1
        return n
