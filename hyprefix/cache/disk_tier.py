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
  when their KV block dies, or (write-through) when committed. A save whose key is
  already on disk is skipped; when the writer falls behind by more than
  ``max_queued_bytes``, further saves are dropped and counted (a save never stalls a step).
- **Loads.** When a waiting request's memory hit ends where the disk has more of its
  chain (and, for hybrids, a checkpoint to resume from), the tier starts reading those
  files on the reader thread and the request waits (others keep running). Once read,
  the engine copies them into free memory blocks and publishes them, at the start of a
  step, before scheduling: from then on they are ordinary memory hits. A request gets
  one load; a file that fails its checks ends the loaded run there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from hyprefix.cache.disk_store import DiskBlockStore
from hyprefix.cache.state_pool import before_last_token, block_of
from hyprefix.request import Request

log = logging.getLogger("hyprefix")

DISK_WAIT = "<disk>"  # ``PrefixHit.wait_for`` of a request whose blocks are being read from disk

KV, STATE, STATE_BEFORE_LAST = "kv", "state", "statebl"


def state_file(key: bytes) -> tuple[str, bytes]:
    """(store kind, hash) of a state pool key (a block hash or its before-last-token key)."""
    block = block_of(key)
    return (STATE if block == key else STATE_BEFORE_LAST), block


@dataclass
class Loaded:
    """What a load read: the longest run of valid KV payloads from ``first_block`` on,
    and the checkpoint (pool key, payload) when every block it needs came back."""

    request: Request
    first_block: int
    kv: list[tuple[bytes, bytes]] = field(default_factory=list)  # (block hash, payload)
    state: tuple[bytes, bytes] | None = None


@dataclass
class _Load:
    future: Future[Loaded]
    imported: bool = False


@dataclass
class DiskTierStats:
    hit_tokens: int = 0  # tokens of blocks brought back from disk into memory
    loads: int = 0  # requests that read from disk
    saves_skipped: int = 0  # already on disk
    saves_dropped: int = 0  # the writer was too far behind
    imports_dropped: int = 0  # loaded blocks that found no room in memory


class DiskTier:
    """``kv_block_bytes`` 0: the model has no attention layer, its KV blocks only index the
    cache and need no files. ``has_state``: the model keeps recurrent-state checkpoints."""

    def __init__(self, store: DiskBlockStore, block_size: int, kv_block_bytes: int, has_state: bool,
                 write_through: bool = False, max_queued_bytes: int = 1 << 30) -> None:
        self.store = store
        self.block_size = block_size
        self.kv_files = kv_block_bytes > 0
        self.has_state = has_state
        self.write_through = write_through
        self.max_queued_bytes = max_queued_bytes
        self.stats = DiskTierStats()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hyprefix-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="hyprefix-disk-read")
        self._queued_bytes = 0  # payload bytes queued and not yet written (the writer subtracts)
        self._queued = threading.Condition()
        self._saves: list[tuple[str, bytes, int]] = []  # (store kind, hash, block id or checkpoint slot)
        self._loads: dict[str, _Load] = {}
        self._tried: set[str] = set()

    # ------------------------------------------------------------------- saves
    def note_kv(self, block_hash: bytes, block_id: int) -> None:
        """A KV block to save before ``block_id`` is written again (evicted or published)."""
        if self.kv_files:
            self._saves.append((KV, block_hash, block_id))

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
            if (kind, block_hash) in seen or self.store.contains(kind, block_hash):
                self.stats.saves_skipped += 1
                continue
            seen.add((kind, block_hash))
            out.append((kind, block_hash, source))
        return out

    def save(self, kind: str, block_hash: bytes, payload: bytes, wait: bool = False) -> None:
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
        self._writer.submit(self._write, kind, block_hash, payload)

    def _write(self, kind: str, block_hash: bytes, payload: bytes) -> None:
        """On the writer thread (the store counts and survives I/O errors itself)."""
        try:
            self.store.put(kind, block_hash, payload)
        except Exception:
            log.exception("disk cache: writing a %s file failed", kind)
        finally:
            with self._queued:
                self._queued_bytes -= len(payload)
                self._queued.notify_all()

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
        kv_hashes, state_key = plan
        self._tried.add(rid)
        self.stats.loads += 1
        future = self._reader.submit(self._read, request, mem_blocks, kv_hashes, state_key)
        self._loads[rid] = _Load(future)
        return True

    def _plan(self, request: Request, mem_blocks: int, hit_tokens: int,
              state_lookup: Callable[[bytes], int | None] | None) -> tuple[list[bytes], bytes | None] | None:
        """(KV hashes to read from block ``mem_blocks`` on, checkpoint key to read or None),
        or None when the disk adds nothing."""
        if not self.kv_files and not self.has_state:
            # Nothing of this model is ever written (every attention layer keeps its K/V in a
            # sliding-window pool of its own, which the disk does not keep): nothing to read.
            return None
        bs, n, hashes = self.block_size, request.num_tokens, request.block_hashes
        rest = hashes[mem_blocks:]
        run = self.store.prefix_run(KV, rest) if self.kv_files else len(rest)
        avail = mem_blocks + run
        if not self.has_state or state_lookup is None:
            return (hashes[mem_blocks:avail], None) if run and min(avail * bs, n - 1) > hit_tokens else None
        # The furthest position past the memory hit with a checkpoint and all KV below it.
        candidates: list[tuple[int, bytes]] = []
        if n % bs == 0 and avail * bs >= n and not request.output_token_ids:
            candidates.append((n - 1, before_last_token(hashes[n // bs - 1])))
        candidates += [(j * bs, hashes[j - 1]) for j in range(min(avail, (n - 1) // bs), 0, -1)]
        for position, key in candidates:
            if position <= hit_tokens:
                return None
            in_memory = state_lookup(key) is not None
            if in_memory or self.store.contains(*state_file(key)):
                blocks = -(-(position + 1) // bs) if position % bs else position // bs
                kv_hashes = hashes[mem_blocks:blocks]
                if not kv_hashes and in_memory:
                    return None
                return kv_hashes, None if in_memory else key
        return None

    def _read(self, request: Request, first_block: int, kv_hashes: Sequence[bytes],
              state_key: bytes | None) -> Loaded:
        """On the reader thread: the payloads, stopping at the first missing or refused file."""
        loaded = Loaded(request, first_block)
        for block_hash in kv_hashes:
            payload = self.store.get(KV, block_hash) if self.kv_files else b""
            if payload is None:
                return loaded
            loaded.kv.append((block_hash, payload))
        if state_key is not None:
            payload = self.store.get(*state_file(state_key))
            if payload is not None:
                loaded.state = (state_key, payload)
        return loaded

    def ready(self) -> list[Loaded]:
        """Loads whose reads have finished, each returned once: the engine imports them now."""
        out = []
        for load in self._loads.values():
            if not load.imported and load.future.done():
                load.imported = True
                out.append(load.future.result())
        return out

    def loading(self) -> list[Future[Loaded]]:
        return [load.future for load in self._loads.values() if not load.imported]

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: forget its load (a read still under way
        finishes and is dropped)."""
        self._loads.pop(request_id, None)
        self._tried.discard(request_id)

    def close(self) -> None:
        self.flush()
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
