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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hyprefix.cache.coordinator import STATE, CacheCoordinator, Saved, hit_num_blocks
from hyprefix.cache.state_pool import before_last_token, block_of
from hyprefix.disk.store import DiskBlockStore
from hyprefix.request import Request

__all__ = ["DiskTier", "Loaded"]

log = logging.getLogger("hyprefix")

# File kinds (``DiskBlockStore``): the coordinator's pool names, and checkpoints one token before
# a block's end apart from those at its end.
KV, SWA, STATE_BEFORE_LAST = "kv", "swa", "statebl"
Payload = bytes | memoryview  # a block's or checkpoint's bytes (``disk/block_io.py``)


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
    """What a load read: the longest run of valid KV payloads from ``first_block`` on (its
    ``position``: the tokens a hit skips once all of it is in memory),
    the sliding-window blocks that were on disk, and the checkpoint (pool key, payload)
    when every block it needs came back."""

    request: Request
    first_block: int
    position: int
    kv: list[tuple[bytes, Payload]] = field(default_factory=list)  # (block hash, payload)
    swa: list[tuple[bytes, Payload]] = field(default_factory=list)  # (block hash, payload)
    state: tuple[bytes, Payload] | None = None
    short: bool = False  # a file of the plan was missing or refused (and so left the store's index)


@dataclass(frozen=True)
class _Plan:
    position: int  # tokens a hit can skip once the reads are in memory
    kv_hashes: list[bytes]  # main-pool blocks to read, from the memory hit's end on
    state_key: bytes | None  # checkpoint to read (None: in memory, or the model has none)
    swa_hashes: list[bytes]  # sliding-window blocks to read (those the window pool lacks)


@dataclass
class _Load:
    future: Future[Loaded]
    position: int  # tokens a hit skips once the load is in memory
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
    """The scheduler side of the disk tier (``cache.coordinator.LowerTier``): which loads to
    start and what to save, and the threads that read and write files.

    ``kv_block_bytes`` 0: no attention layer keeps its K/V in the main pool (none at all, or all
    in a window pool), whose blocks then only index the cache and need no files. ``has_state``:
    the model keeps recurrent-state checkpoints. A sliding-window pool's blocks (the coordinator
    says whether there is one) are kept as ``SWA`` files."""

    def __init__(self, store: DiskBlockStore, block_size: int, kv_block_bytes: int, has_state: bool,
                 write_through: bool = False, max_queued_bytes: int = 1 << 30) -> None:
        self.store = store
        self.block_size = block_size
        self.kv_files = kv_block_bytes > 0
        self.has_state = has_state
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
    def note(self, saves: list[Saved]) -> None:
        """Entries to save before their block or slot is written again (``CacheCoordinator.take_saves``)."""
        for pool, key, source in saves:
            if pool == STATE:
                kind, key = state_file(key)
                self._saves.append((kind, key, source))
            elif pool != KV or self.kv_files:
                self._saves.append((pool, key, source))

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
    def num_loadable_tokens(self, request: Request, mem_blocks: int, hit_tokens: int,
                            memory: CacheCoordinator) -> int:
        """Tokens past the memory hit that a load of the request brings: one under way, or one
        started now because the disk holds more of its prefix than memory (``mem_blocks`` KV
        blocks in memory, resumable at ``hit_tokens``); 0 when the disk adds nothing (each
        request plans once, and again only after a load came back short)."""
        rid = request.request_id
        load = self._loads.get(rid)
        if load is not None:
            return 0 if load.imported else max(1, load.position - hit_tokens)
        if rid in self._tried:
            return 0
        plan = self._plan(request, mem_blocks, hit_tokens, memory)
        if plan is None:
            return 0
        self._tried.add(rid)
        self.stats.loads += 1
        future = self._reader.submit(self._read, request, mem_blocks, plan)
        self._loads[rid] = _Load(future, plan.position)
        return plan.position - hit_tokens

    def _plan(self, request: Request, mem_blocks: int, hit_tokens: int, memory: CacheCoordinator) -> _Plan | None:
        """What to read for the furthest position past the memory hit (``hit_tokens``) that
        the disk and memory together can resume from: every main-pool block below it, a
        checkpoint there (hybrids), the window's blocks below it (a window pool); None when
        the disk adds nothing."""
        window = memory.has_window_pool
        if not self.kv_files and not self.has_state and not window:
            return None  # nothing of this model is ever written
        bs, hashes = self.block_size, request.block_hashes
        rest = hashes[mem_blocks:]
        run = self._prefix_run(KV, rest) if self.kv_files else len(rest)
        avail = mem_blocks + run
        for position, key in self._candidates(request, avail, window):
            if position <= hit_tokens:
                return None
            state_key = None
            if key is not None and not memory.in_memory(STATE, key):
                if not self._has(*state_file(key)):
                    continue
                state_key = key
            swa = self._window_reads(request, position, avail, memory)
            if swa is None:
                continue
            kv_hashes = hashes[mem_blocks:hit_num_blocks(request, position, avail, bs)]
            if not kv_hashes and state_key is None and not swa:
                return None
            return _Plan(position, kv_hashes, state_key, swa)
        return None

    def _candidates(self, request: Request, avail: int, window: bool) -> list[tuple[int, bytes | None]]:
        """Positions a hit could resume from, furthest first, each with the checkpoint key it
        needs (a model with recurrent state) or None; ``avail``: blocks of the request in memory
        or on disk; ``window``: the model has a sliding-window pool."""
        bs, n, hashes = self.block_size, request.num_tokens, request.block_hashes
        boundaries = range(min(avail, (n - 1) // bs), 0, -1)
        if not self.has_state:
            furthest = min(avail * bs, n - 1)
            lower = [(j * bs, None) for j in boundaries if j * bs < furthest] if window else []
            return [(furthest, None), *lower]
        candidates: list[tuple[int, bytes | None]] = []
        if n % bs == 0 and avail * bs >= n and not request.output_token_ids:
            candidates.append((n - 1, before_last_token(hashes[n // bs - 1])))
        return candidates + [(j * bs, hashes[j - 1]) for j in boundaries]

    def _window_reads(self, request: Request, position: int, avail: int,
                      memory: CacheCoordinator) -> list[bytes] | None:
        """Hashes of the window blocks a hit at ``position`` reads that only the disk holds
        ([] without a window pool); None when one is in neither place."""
        out = []
        for i in memory.window_blocks_needed(request, position, avail):
            block_hash = request.block_hashes[i]
            if memory.in_memory(SWA, block_hash):
                continue
            if not self._has(SWA, block_hash):
                return None
            out.append(block_hash)
        return out

    def _read(self, request: Request, first_block: int, plan: _Plan) -> Loaded:
        """On the reader thread: the payloads. The KV run stops at the first missing or
        refused file; a window block or checkpoint that fails is left out (scheduling then
        finds the hit those read allow)."""
        loaded = Loaded(request, first_block, plan.position)
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
