"""The disk tier's write queue (no files: a store whose writes wait for the test)."""

from __future__ import annotations

import threading

from hyprefix.disk.tier import DiskTier


class _GatedStore:
    """Each put waits for its own release; records what was written."""

    def __init__(self) -> None:
        self.gates: list[threading.Event] = [threading.Event() for _ in range(16)]
        self.written: list[bytes] = []
        self.started = 0

    def put(self, kind: str, block_hash: bytes, payload: bytes) -> bool:
        gate = self.gates[self.started]
        self.started += 1
        gate.wait(10)
        self.written.append(block_hash)
        return True

    def contains(self, kind: str, block_hash: bytes) -> bool:
        return False


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_the_queue_bound_counts_only_writes_not_yet_done():
    """A writer that is never idle must not make the bound drop saves forever: bytes leave
    the count as each write finishes, not when the queue drains."""
    store = _GatedStore()
    tier = DiskTier(store, 16, 1, False, max_queued_bytes=3000)
    for i in range(3):
        tier.save("kv", _key(i), b"x" * 1000)
    tier.save("kv", _key(3), b"x" * 1000)  # over the bound: dropped
    assert tier.stats.saves_dropped == 1
    store.gates[0].set()  # the first write finishes; two are still queued
    for _ in range(1000):  # the one writer thread starts the second write only after the first is done
        if store.started >= 2:
            break
        threading.Event().wait(0.01)
    assert store.started == 2
    tier.save("kv", _key(4), b"x" * 1000)  # room for one again
    assert tier.stats.saves_dropped == 1
    for gate in store.gates:
        gate.set()
    tier.flush()
    assert store.written == [_key(0), _key(1), _key(2), _key(4)]
    tier.close()
