"""The disk tier under the prefix cache (no torch): which blocks and state checkpoints
go to disk, which come back, and the threads that move their bytes.

The memory cache stays the only place a step reads. The disk tier is a second place a
block (or a recurrent-state checkpoint) can live, found by the same chained hash, whose
root names the model, its weight version and the tenant's salt: another model, version
or tenant cannot even name another's files (``DiskBlockStore`` adds a header check).

- **Saves.** By default a block is written when the memory pool evicts it (write-back):
  the pool reports the evicted (hash, block) pair while scheduling, and the engine copies
  the block's bytes out before the step that reuses it runs, then hands them to the
  writer thread. With ``write_through`` every block is also written once it is
  published, so a crash loses nothing already computed; at a clean shutdown ``flush``
  writes what memory still holds. Checkpoints follow the same path: saved when evicted,
  when their KV block dies, or (write-through) when committed; so do the blocks of a
  sliding-window pool of its own (Gemma 3, Mistral), as ``.swa`` files. A save whose key is
  already on disk is skipped; when the writer falls behind by more than
  ``max_queued_bytes``, further saves are dropped and counted (a save never stalls a step).
- **Loads.** When a waiting request's memory hit ends where the disk has more of its
  chain (and, for hybrids, a checkpoint to resume from; for sliding-window layers with a
  pool of their own, the window's blocks below the hit), the tier starts reading those
  files on the reader thread and the request waits (others keep running). Once read,
  the engine reserves free memory blocks for them and a copier thread fills them while
  steps go on; at the start of a later step they are published, before scheduling: from
  then on they are ordinary memory hits. A file that fails
  its checks ends the loaded run there; a load that came back short lets the request plan
  one more from what is left (each such load removed a file from the index, so this ends:
  a damaged window block or checkpoint falls back to an earlier position, not to none).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hyprefix.cache.coordinator import DISK_WAIT, hit_num_blocks
from hyprefix.cache.disk_store import DiskBlockStore
from hyprefix.cache.state_pool import before_last_token, block_of
from hyprefix.request import Request

if TYPE_CHECKING:
    from hyprefix.cache.sliding import SlidingWindowKV

__all__ = ["DISK_WAIT", "DiskTier", "Loaded"]

log = logging.getLogger("hyprefix")

KV, SWA, STATE, STATE_BEFORE_LAST = "kv", "swa", "state", "statebl"
Payload = bytes | memoryview  # a block's or checkpoint's bytes (``runner/block_io.py``)


def state_file(key: bytes) -> tuple[str, bytes]:
    """(store kind, hash) of a state pool key (a block hash or its before-last-token key)."""
    block = block_of(key)
    return (STATE if block == key else STATE_BEFORE_LAST), block


def _background() -> None:
    """Run the calling thread (the writer) at the lowest priority (nice 19 on Linux): where
    steps keep every CPU busy it gets a sliver of one, so writes wait and steps do not;
    where a CPU is free it writes at full speed. Writes that fall too far behind are dropped
    and counted (``save``)."""
    if sys.platform == "linux":  # where a thread id names the thread
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass
class Loaded:
    """What a load read: the longest run of valid KV payloads from ``first_block`` on,
    the sliding-window blocks that were on disk, and the checkpoint (pool key, payload)
    when every block it needs came back."""

    request: Request
    first_block: int
    kv: list[tuple[bytes, Payload]] = field(default_factory=list)  # (block hash, payload)
    swa: list[tuple[bytes, Payload]] = field(default_factory=list)  # (block hash, payload)
    state: tuple[bytes, Payload] | None = None
    short: bool = False  # a file of the plan was missing or refused (and so left the store's index)


@dataclass(frozen=True)
class _Plan:
    kv_hashes: list[bytes]  # main-pool blocks to read, from the memory hit's end on
    state_key: bytes | None  # checkpoint to read (None: in memory, or the model has none)
    swa_hashes: list[bytes]  # sliding-window blocks to read (those the window pool lacks)


@dataclass
class _Load:
    future: Future[Loaded]
    taken: bool = False  # handed to the engine to import (``ready``)
    imported: bool = False  # in memory, or given up on: the request stops waiting (``finish``)


@dataclass
class DiskTierStats:
    hit_tokens: int = 0  # tokens of blocks brought back from disk into memory
    loads: int = 0  # requests that read from disk
    saves_skipped: int = 0  # already on disk
    saves_dropped: int = 0  # the writer was too far behind
    imports_dropped: int = 0  # loads (or their window part) that found no room in memory


class DiskTier:
    """``kv_block_bytes`` 0: no attention layer keeps its K/V in the main pool (none at all,
    or all in a window pool), whose blocks then only index the cache and need no files.
    ``has_state``: the model keeps recurrent-state checkpoints. ``window``: the sliding-window
    layers' own pool, whose blocks are kept as ``SWA`` files."""

    def __init__(self, store: DiskBlockStore, block_size: int, kv_block_bytes: int, has_state: bool,
                 write_through: bool = False, max_queued_bytes: int = 1 << 30,
                 window: SlidingWindowKV | None = None) -> None:
        self.store = store
        self.block_size = block_size
        self.kv_files = kv_block_bytes > 0
        self.has_state = has_state
        self.window = window
        self.write_through = write_through
        self.max_queued_bytes = max_queued_bytes
        self.stats = DiskTierStats()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hyprefix-disk-write", initializer=_background)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hyprefix-disk-read")
        self._queued_bytes = 0  # payload bytes queued and not yet written (the writer subtracts)
        self._queued = threading.Condition()  # guards the two fields around it
        # Saves queued and not yet written, found by loads as if on disk: a block evicted from
        # memory is never in neither place while the (low-priority) writer catches up.
        self._unwritten: dict[tuple[str, bytes], Payload] = {}
        self._saves: list[tuple[str, bytes, int]] = []  # (store kind, hash, block id or checkpoint slot)
        self._loads: dict[str, _Load] = {}
        self._tried: set[str] = set()

    # ------------------------------------------------------------------- saves
    def note_kv(self, block_hash: bytes, block_id: int) -> None:
        """A KV block to save before ``block_id`` is written again (evicted or published)."""
        if self.kv_files:
            self._saves.append((KV, block_hash, block_id))

    def note_swa(self, block_hash: bytes, block_id: int) -> None:
        """A sliding-window block to save before ``block_id`` of the window pool is written again."""
        self._saves.append((SWA, block_hash, block_id))

    def note_state(self, key: bytes, slot: int) -> None:
        """A checkpoint to save before ``slot`` is written again."""
        kind, block = state_file(key)
        self._saves.append((kind, block, slot))

    def take_saves(self) -> list[tuple[str, bytes, int]]:
        """Saves noted since the last call whose keys are not on disk yet: the caller reads
        each one's bytes now (before its block or slot is reused) and passes them to ``save``."""
        saves, self._saves = self._saves, []
        out, seen = [], set()
        for kind, block_hash, source in saves:
            if (kind, block_hash) in seen or self._has(kind, block_hash):
                self.stats.saves_skipped += 1
                continue
            seen.add((kind, block_hash))
            out.append((kind, block_hash, source))
        return out

    def save(self, kind: str, block_hash: bytes, payload: Payload, wait: bool = False) -> None:
        """Write on the writer thread; dropped (and counted) past ``max_queued_bytes``.
        ``wait``: write now on this thread (at shutdown, where the interpreter takes no
        new thread work)."""
        if wait:
            self.store.put(kind, block_hash, payload)
            return
        with self._queued:
            if self._queued_bytes + len(payload) > self.max_queued_bytes:
                self.stats.saves_dropped += 1
                return
            self._queued_bytes += len(payload)
            self._unwritten[kind, block_hash] = payload
        self._writer.submit(self._write, kind, block_hash, payload)

    def _write(self, kind: str, block_hash: bytes, payload: Payload) -> None:
        """On the writer thread (the store counts and survives I/O errors itself)."""
        try:
            self.store.put(kind, block_hash, payload)
        except Exception:
            log.exception("disk cache: writing a %s file failed", kind)
        finally:
            with self._queued:
                self._queued_bytes -= len(payload)
                self._unwritten.pop((kind, block_hash), None)
                self._queued.notify_all()

    # ------------------------------------------------- disk, and writes on their way there
    def _has(self, kind: str, block_hash: bytes) -> bool:
        with self._queued:
            if (kind, block_hash) in self._unwritten:
                return True
        return self.store.contains(kind, block_hash)

    def _get(self, kind: str, block_hash: bytes) -> Payload | None:
        with self._queued:
            payload = self._unwritten.get((kind, block_hash))
        return payload if payload is not None else self.store.get(kind, block_hash)

    def _prefix_run(self, kind: str, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` are on disk or on their way there."""
        with self._queued:
            unwritten = {h for k, h in self._unwritten if k == kind} if self._unwritten else set()
        run = 0
        while True:
            run += self.store.prefix_run(kind, hashes[run:])
            start = run
            while run < len(hashes) and hashes[run] in unwritten:
                run += 1
            if run == start:
                return run

    def flush(self) -> None:
        """Wait for every queued write (also at exit, when the executor takes no new work)."""
        with self._queued:
            self._queued.wait_for(lambda: self._queued_bytes == 0)

    # ------------------------------------------------------------------- loads
    def wants_wait(self, request: Request, mem_blocks: int, hit_tokens: int,
                   state_lookup: Callable[[bytes], int | None] | None) -> bool:
        """Whether the request should wait for disk reads: a load of it is under way, or
        one starts now because the disk holds more of its prefix than memory
        (``mem_blocks`` KV blocks in memory, resumable at ``hit_tokens``).
        ``state_lookup``: the memory checkpoint index (hybrids)."""
        rid = request.request_id
        load = self._loads.get(rid)
        if load is not None:
            return not load.imported
        if rid in self._tried:
            return False
        plan = self._plan(request, mem_blocks, hit_tokens, state_lookup)
        if plan is None:
            return False
        self._tried.add(rid)
        self.stats.loads += 1
        future = self._reader.submit(self._read, request, mem_blocks, plan)
        self._loads[rid] = _Load(future)
        return True

    def _plan(self, request: Request, mem_blocks: int, hit_tokens: int,
              state_lookup: Callable[[bytes], int | None] | None) -> _Plan | None:
        """What to read for the furthest position past the memory hit (``hit_tokens``) that
        the disk and memory together can resume from: every main-pool block below it, a
        checkpoint there (hybrids), the window's blocks below it (a window pool); None when
        the disk adds nothing."""
        if not self.kv_files and not self.has_state and self.window is None:
            return None  # nothing of this model is ever written
        bs, hashes = self.block_size, request.block_hashes
        rest = hashes[mem_blocks:]
        run = self._prefix_run(KV, rest) if self.kv_files else len(rest)
        avail = mem_blocks + run
        stateful = self.has_state and state_lookup is not None
        for position, key in self._candidates(request, avail, stateful):
            if position <= hit_tokens:
                return None
            state_key = None
            if key is not None and state_lookup(key) is None:  # type: ignore[misc]
                if not self._has(*state_file(key)):
                    continue
                state_key = key
            swa = self._window_reads(request, position, avail)
            if swa is None:
                continue
            kv_hashes = hashes[mem_blocks:hit_num_blocks(request, position, avail, bs)]
            if not kv_hashes and state_key is None and not swa:
                return None
            return _Plan(kv_hashes, state_key, swa)
        return None

    def _candidates(self, request: Request, avail: int, stateful: bool) -> list[tuple[int, bytes | None]]:
        """Positions a hit could resume from, furthest first, each with the checkpoint key it
        needs (``stateful``) or None; ``avail``: blocks of the request in memory or on disk."""
        bs, n, hashes = self.block_size, request.num_tokens, request.block_hashes
        boundaries = range(min(avail, (n - 1) // bs), 0, -1)
        if not stateful:
            furthest = min(avail * bs, n - 1)
            lower = [(j * bs, None) for j in boundaries if j * bs < furthest] if self.window is not None else []
            return [(furthest, None), *lower]
        candidates: list[tuple[int, bytes | None]] = []
        if n % bs == 0 and avail * bs >= n and not request.output_token_ids:
            candidates.append((n - 1, before_last_token(hashes[n // bs - 1])))
        return candidates + [(j * bs, hashes[j - 1]) for j in boundaries]

    def _window_reads(self, request: Request, position: int, avail: int) -> list[bytes] | None:
        """Hashes of the window blocks a hit at ``position`` reads that only the disk holds
        ([] without a window pool); None when one is in neither place."""
        if self.window is None:
            return []
        out = []
        for i in self.window.needed_blocks(request, position, avail):
            block_hash = request.block_hashes[i]
            if self.window.pool.lookup(block_hash) is not None:
                continue
            if not self._has(SWA, block_hash):
                return None
            out.append(block_hash)
        return out

    def _read(self, request: Request, first_block: int, plan: _Plan) -> Loaded:
        """On the reader thread: the payloads. The KV run stops at the first missing or
        refused file; a window block or checkpoint that fails is left out (scheduling then
        finds the hit those read allow)."""
        loaded = Loaded(request, first_block)
        for block_hash in plan.kv_hashes:
            payload = self._get(KV, block_hash) if self.kv_files else b""
            if payload is None:
                loaded.short = True
                return loaded
            loaded.kv.append((block_hash, payload))
        for block_hash in plan.swa_hashes:
            payload = self._get(SWA, block_hash)
            if payload is None:
                loaded.short = True
            else:
                loaded.swa.append((block_hash, payload))
        if plan.state_key is not None:
            payload = self._get(*state_file(plan.state_key))
            if payload is None:
                loaded.short = True
            else:
                loaded.state = (plan.state_key, payload)
        return loaded

    def ready(self) -> list[Loaded]:
        """Loads whose reads have finished, each returned once: the engine imports them now
        and calls ``finish`` when they are in memory."""
        out = []
        for load in self._loads.values():
            if not load.taken and load.future.done():
                load.taken = True
                out.append(load.future.result())
        return out

    def finish(self, loaded: Loaded) -> None:
        """The load's blocks are in memory (or were dropped): its request stops waiting. One
        that came back short is forgotten instead, so the request plans again from what is left."""
        rid = loaded.request.request_id
        load = self._loads.get(rid)
        if load is None or not load.future.done() or load.future.result() is not loaded:
            return  # released meanwhile (and perhaps loading again under the same id)
        if loaded.short:
            del self._loads[rid]
            self._tried.discard(rid)
        else:
            load.imported = True

    def loading(self) -> list[Future[Loaded]]:
        """Reads under way."""
        return [load.future for load in self._loads.values() if not load.taken]

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: forget its load (a read still under way
        finishes and is dropped)."""
        self._loads.pop(request_id, None)
        self._tried.discard(request_id)

    def close(self) -> None:
        self.flush()
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
