"""A request's routing key: the engine's own chained block hashes of its prompt,
computed where requests arrive (no weights, no torch), so a router can match them
against what each replica announced in its cache events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyprefix.cache.hashing import extend_hashes, root_hash


@dataclass(frozen=True)
class RoutingKey:
    hashes: tuple[bytes, ...] = ()
    block_aligned: bool = False  # the prompt ends on a block boundary (matters to hybrids)


@dataclass
class RequestHasher:
    """The block hashes a replica serving ``model_identity`` with ``block_size`` computes
    for a prompt: ``tokenizer`` must be the replica's own (it sends it at start)."""

    tokenizer: Any
    model_identity: str
    block_size: int

    def key(self, token_ids: Sequence[int], cache_salt: str | None = None) -> RoutingKey:
        hashes: list[bytes] = []
        extend_hashes(hashes, root_hash(self.model_identity, cache_salt), token_ids, self.block_size)
        return RoutingKey(tuple(hashes), bool(token_ids) and len(token_ids) % self.block_size == 0)

    def prompt_key(self, prompt: str | Sequence[int], cache_salt: str | None = None) -> RoutingKey:
        """A completion prompt: text (tokenized as the engine does) or token ids."""
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        return self.key(ids, cache_salt)
