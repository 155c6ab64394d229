"""Chained content hashes of full KV blocks.

``h_0 = H(root, tokens of block 0)``, ``h_i = H(h_{i-1}, tokens of block i)``,
with ``root = H(model identity, cache salt)``: equal hashes mean equal token
prefixes under the same weights and tenant, so the K/V in the block is
interchangeable. blake2b with a 32-byte digest (collision resistant; Python's
``hash()`` is not).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_SIZE = 32


def root_hash(model_identity: str, cache_salt: str | None = None) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"hyprefix-root")
    h.update(model_identity.encode())
    h.update(b"\x00salt\x00" if cache_salt is not None else b"\x00nosalt\x00")
    if cache_salt is not None:
        h.update(cache_salt.encode())
    return h.digest()


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def extend_hashes(hashes: list[bytes], root: bytes, tokens: Sequence[int], block_size: int) -> None:
    """Append the hashes of every full block of ``tokens`` not yet in ``hashes``."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(block_hash(parent, tokens[i * block_size:(i + 1) * block_size]))
