"""The engine's side of the disk tier: moves bytes between the cache tensors
(``runner/block_io.py``) and the tier's threads (``cache/disk_tier.py``) at the points
of a step where that is safe.

Order within a step (``Engine.step``):
1. ``import_ready``: loads that finished are copied into fresh memory blocks and
   published (what their allocation evicted is saved first), then the scheduler sees
   them as ordinary memory hits;
2. the scheduler runs (its allocations note the blocks and checkpoints they evict);
3. ``save_noted``: the noted blocks are copied out, before the forward that reuses them;
4. the forward; after it, with write-through, ``save_noted`` again for what the step
   published.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

from hyprefix.cache.coordinator import CacheCoordinator
from hyprefix.cache.disk_store import DiskBlockStore, DiskIdentity
from hyprefix.cache.disk_tier import KV, SWA, DiskTier, Loaded, state_file
from hyprefix.cache.plan import GIB, attach_disk
from hyprefix.cache.sliding import SlidingWindowKV
from hyprefix.cache.state_pool import StatePool
from hyprefix.request import Status
from hyprefix.runner.block_io import BlockIO

log = logging.getLogger("hyprefix")


class DiskCache:
    def __init__(self, directory: str, capacity_gb: float, write_through: bool, model_identity: str,
                 cache: CacheCoordinator, io: BlockIO) -> None:
        self.cache = cache
        self.io = io
        self.model_identity = model_identity
        self.store = DiskBlockStore(Path(directory), DiskIdentity(model_identity, io.layout), int(capacity_gb * GIB))
        self.window = next((kind for kind in cache.kinds if isinstance(kind, SlidingWindowKV)), None)
        self.tier = DiskTier(self.store, cache.block_size, io.kv_block_bytes, has_state=io.state_bytes > 0,
                             write_through=write_through, window=self.window)
        self.states: StatePool | None = attach_disk(cache, self.tier)
        found = self.store.stats()
        log.info("disk cache %s: %d files, %.1f of %.1f GiB", self.store.path, found.entries,
                 found.bytes_used / GIB, capacity_gb)
        self._closed = False
        self._off = False  # the weights changed in place (``_weights_changed``)
        ref = weakref.ref(self)
        atexit.register(lambda: (disk := ref()) is not None and disk.close())

    # ------------------------------------------------------------ weight updates
    def _weights_changed(self) -> bool:
        """Whether the weights were updated in place (``Engine.update_weights``); the first
        call that sees it turns the tier off for good (no saves, no loads, nothing written at
        close).

        After an update, hashes chain from a root (``<checkpoint>|weights=<version>#<n>``)
        that is unique in this process only: another process that updates the same
        checkpoint to other weights under the same version (the default version is the
        update's number) would hit these files. Requests in flight also go on under their
        old root with the new weights, so even blocks under the checkpoint's own root are
        no longer safe to write. (What memory held before the update is not written out
        either: that would stall the step that finds the update for the whole pool.)"""
        if self._off:
            return True
        if self.cache.kv.model_identity == self.model_identity:
            return False
        self._detach()
        log.warning("weights updated in place: the disk cache is off until restart")
        return True

    def _detach(self) -> None:
        """Turn the tier off: the cache goes on as if it had none (no saves, no loads; a load
        under way is never imported)."""
        self._off = True
        pool = self.cache.kv.pool
        pool.on_evict = pool.on_publish = None
        if self.window is not None:
            self.window.pool.on_evict = self.window.pool.on_publish = None
        if self.states is not None:
            self.states.on_evict = self.states.on_commit = None
        self.cache.lower = None
        self.tier.take_saves()

    # ------------------------------------------------------------------ saves
    def save_noted(self, wait: bool = False) -> None:
        """Copy out every block and checkpoint noted since the last call and queue its write
        (``wait``: write it now)."""
        if self._off:
            return
        read = {KV: self.io.read_kv, SWA: self.io.read_swa}
        for kind, block_hash, source in self.tier.take_saves():
            self.tier.save(kind, block_hash, read.get(kind, self.io.read_state)(source), wait)

    def flush_memory(self) -> None:
        """Write every cached block and checkpoint memory holds that the disk lacks, and wait."""
        for block_hash, block_id in self.cache.kv.pool.indexed():
            self.tier.note_kv(block_hash, block_id)
        for block_hash, block_id in self.window.pool.indexed() if self.window is not None else ():
            self.tier.note_swa(block_hash, block_id)
        for key, slot in self.states.committed() if self.states is not None else ():
            self.tier.note_state(key, slot)
        self.tier.flush()
        self.save_noted(wait=True)

    # ------------------------------------------------------------------ loads
    def import_ready(self, requests: dict) -> None:
        """Bring finished loads into memory. ``requests``: the scheduler's live requests
        (a load of one that finished or was aborted meanwhile is dropped)."""
        if self._weights_changed():
            return
        for loaded in self.tier.ready():
            request = loaded.request
            if requests.get(request.request_id) is not request or request.status == Status.RUNNING:
                continue
            self._import(loaded)

    def _import(self, loaded: Loaded) -> None:
        request, first = loaded.request, loaded.first_block
        pool = self.cache.kv.pool
        # The loaded run, less what memory gained meanwhile at its start.
        kv = loaded.kv
        while kv and pool.lookup(kv[0][0]) is not None:
            kv, first = kv[1:], first + 1
        ids = self.cache.reserve_import(request, first, len(kv)) if kv else []
        if ids is None:
            self.tier.stats.imports_dropped += 1
            return
        self.save_noted()  # what the allocation evicted, before its blocks are overwritten
        for (_, payload), block_id in zip(kv, ids, strict=True):
            self.io.write_kv(block_id, payload)
        self.cache.publish_import(request, first, ids)
        self.tier.stats.hit_tokens += len(ids) * self.cache.block_size
        if loaded.swa and self.window is not None:
            self._import_window(loaded)
        if loaded.state is not None and self.states is not None:
            self._import_state(*loaded.state)

    def _import_window(self, loaded: Loaded) -> None:
        """The loaded sliding-window blocks into the window's own pool (less what it gained
        meanwhile)."""
        window = self.window
        assert window is not None
        swa = [(h, payload) for h, payload in loaded.swa if window.pool.lookup(h) is None]
        ids = window.reserve_import(loaded.request, len(swa)) if swa else []
        if ids is None:
            self.tier.stats.imports_dropped += 1
            return
        self.save_noted()  # what the allocation evicted, before its blocks are overwritten
        for (_, payload), block_id in zip(swa, ids, strict=True):
            self.io.write_swa(block_id, payload)
        window.publish_import([h for h, _ in swa], ids)

    def _import_state(self, key: bytes, payload: bytes) -> None:
        pool = self.cache.kv.pool
        _, block = state_file(key)
        if pool.lookup(block) is None:  # a checkpoint must sit on a cached block
            return
        slot = self.states.reserve(key)
        if slot is None:
            return
        self.save_noted()  # a checkpoint the reservation evicted
        self.io.write_state(slot, payload)
        self.states.commit(slot)

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing else to run: block until a load finishes (instead of spinning on steps)."""
        loading = self.tier.loading() if not self._off else []
        if loading:
            wait(loading, timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        store, tier = self.store.stats(), self.tier.stats
        return {"disk_cache_hit_tokens": tier.hit_tokens, "disk_cache_loads": tier.loads,
                "disk_cache_bytes_read": store.bytes_read, "disk_cache_bytes_written": store.bytes_written,
                "disk_cache_evictions": store.evictions, "disk_cache_refused": sum(store.refused.values()),
                "disk_cache_saves_dropped": tier.saves_dropped, "disk_cache_files": store.entries,
                "disk_cache_bytes_used": store.bytes_used}

    def close(self) -> None:
        """Write out what memory holds and stop the threads (idempotent; also at exit). The
        engine may go on without the tier."""
        if self._closed:
            return
        self._closed = True
        t0 = time.perf_counter()
        if not self._weights_changed():
            self.flush_memory()
        self._detach()
        self.tier.close()
        log.info("disk cache: memory written out in %.1fs (%d files)", time.perf_counter() - t0,
                 self.store.stats().entries)
