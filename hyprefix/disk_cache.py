"""The engine's side of the disk tier: moves bytes between the cache tensors
(``runner/block_io.py``) and the tier's threads (``cache/disk_tier.py``) at the points
of a step where that is safe.

Order within a step (``Engine.step``):
1. ``import_ready``: imports whose copies finished are published (the scheduler then sees
   them as ordinary memory hits), and loads whose reads finished get fresh memory blocks
   (what their allocation evicted is saved first) that the copier thread fills while
   steps go on;
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
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from hyprefix.cache.block_pool import ImportHold
from hyprefix.cache.coordinator import CacheCoordinator
from hyprefix.cache.disk_store import DiskBlockStore, DiskIdentity
from hyprefix.cache.disk_tier import KV, SWA, DiskTier, Loaded, Payload, state_file
from hyprefix.cache.plan import GIB, attach_disk
from hyprefix.cache.sliding import SlidingWindowKV
from hyprefix.cache.state_pool import StatePool
from hyprefix.request import Status
from hyprefix.runner.block_io import BlockIO

log = logging.getLogger("hyprefix")


@dataclass
class _Import:
    """A load on its way into memory: blocks held unpublished and a checkpoint slot reserved
    (engine thread), filled by the copier thread, published by a later step."""

    loaded: Loaded
    first: int  # index of the request's first block imported
    kv: list[tuple[bytes, Payload]]  # (block hash, payload)
    kv_hold: ImportHold  # fresh blocks for ``kv``, and the prefix they extend, held
    swa: list[tuple[bytes, Payload]] = field(default_factory=list)
    swa_hold: ImportHold | None = None
    state_slot: int | None = None
    copied: Future[None] = field(default_factory=Future)


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
        t0 = time.perf_counter()
        touched = io.touch()
        log.info("disk cache: %.0f MiB of KV and checkpoint pools touched in %.1fs (restores write there beside "
                 "running steps)", touched / 2**20, time.perf_counter() - t0)
        found = self.store.stats()
        log.info("disk cache %s: %d files, %.1f of %.1f GiB", self.store.path, found.entries,
                 found.bytes_used / GIB, capacity_gb)
        self._closed = False
        # Copies of loaded payloads into memory run here, beside the steps: a restore of a
        # long prompt touches many pool pages, and a step must not wait for that.
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="hyprefix-disk-import")
        self._imports: list[_Import] = []  # in the order they started
        # hashes of the blocks they bring (counted: two imports may bring one block)
        self._incoming: dict[str, Counter[bytes]] = {KV: Counter(), SWA: Counter()}
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
        self._detach(cancel=True)
        log.warning("weights updated in place: the disk cache is off until restart")
        return True

    def _detach(self, cancel: bool = False) -> None:
        """Turn the tier off: the cache goes on as if it had none (no saves, no loads; a read
        under way is never imported). Imports being copied are waited for and published, or
        let go unpublished (``cancel``)."""
        self._publish_copied(wait_all=True, cancel=cancel)
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
        saves = self.tier.take_saves()
        blocks = {kind: [(h, b) for k, h, b in saves if k == kind] for kind in (KV, SWA)}
        for kind, noted in blocks.items():  # blocks in one gather per layer
            for (block_hash, _), payload in zip(noted, self.io.read_blocks(kind == SWA, [b for _, b in noted]),
                                                strict=True):
                self.tier.save(kind, block_hash, payload, wait)
        for kind, key, slot in saves:
            if kind not in blocks:
                self.tier.save(kind, key, self.io.read_state(slot), wait)

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
        """Publish the imports whose copies finished, and start importing the loads whose
        reads finished. ``requests``: the scheduler's live requests (a load of one that
        finished or was aborted meanwhile is dropped)."""
        if self._weights_changed():
            return
        self._publish_copied()
        for loaded in self.tier.ready():
            request = loaded.request
            if requests.get(request.request_id) is not request or request.status == Status.RUNNING:
                continue
            job = self._reserve(loaded)
            if job is None:
                self.tier.finish(loaded)
                continue
            if job.kv or job.swa or job.state_slot is not None:
                job.copied = self._copier.submit(self._copy, job)
            else:  # all of it in memory or on its way there: done once the imports before it are
                job.copied.set_result(None)
            self._incoming[KV].update(h for h, _ in job.kv)
            self._incoming[SWA].update(h for h, _ in job.swa)
            self._imports.append(job)

    def _reserve(self, loaded: Loaded) -> _Import | None:
        """On the engine thread: memory for what the load read, less what memory gained
        meanwhile (blocks held and unpublished, a checkpoint slot reserved); None when the
        KV blocks find no room. What the reservations evicted is saved before returning, so
        the copier may overwrite it."""
        request, first = loaded.request, loaded.first_block
        pool = self.cache.kv.pool
        kv = loaded.kv
        while kv and (pool.lookup(kv[0][0]) is not None or kv[0][0] in self._incoming[KV]):
            kv, first = kv[1:], first + 1
        hold = self.cache.reserve_import(request, first, len(kv))
        if hold is None:
            self.tier.stats.imports_dropped += 1
            return None
        job = _Import(loaded, first, kv, hold)
        if loaded.swa and self.window is not None:
            swa = [(h, payload) for h, payload in loaded.swa
                   if self.window.pool.lookup(h) is None and h not in self._incoming[SWA]]
            swa_hold = self.window.reserve_import(request, len(swa))
            if swa_hold is None:
                self.tier.stats.imports_dropped += 1
            else:
                job.swa, job.swa_hold = swa, swa_hold
        if loaded.state is not None and self.states is not None:
            job.state_slot = self.states.reserve(loaded.state[0], for_import=True)
        self.save_noted()
        return job

    def _copy(self, job: _Import) -> None:
        """On the copier thread: the payloads into the reserved blocks and slot."""
        for (_, payload), block_id in zip(job.kv, job.kv_hold.blocks, strict=True):
            self.io.write_kv(block_id, payload)
        for (_, payload), block_id in zip(job.swa, job.swa_hold.blocks if job.swa_hold else (), strict=True):
            self.io.write_swa(block_id, payload)
        if job.state_slot is not None:
            assert job.loaded.state is not None
            self.io.write_state(job.state_slot, job.loaded.state[1])

    def _publish_copied(self, wait_all: bool = False, cancel: bool = False) -> None:
        """On the engine thread: publish the imports whose copies finished, in the order they
        started (a later one may count on blocks an earlier one brings; ``wait_all``: every
        one, waiting), and let their requests go on. An import is let go unpublished when
        ``cancel`` (the weights changed: its bytes are the old weights') or when its request's
        hashes no longer name its blocks (a weight update cleared them)."""
        while self._imports and (wait_all or self._imports[0].copied.done()):
            job = self._imports.pop(0)
            self._untrack(job)
            try:
                job.copied.result()  # a copy that raised is a bug: raise it here, on the engine thread
            except BaseException:
                self._release(job)
                raise
            request, hashes = job.loaded.request, [h for h, _ in job.kv]
            if cancel or request.block_hashes[job.first:job.first + len(hashes)] != hashes:
                self._release(job)
            else:
                self._publish(job)
            self.tier.finish(job.loaded)

    def _publish(self, job: _Import) -> None:
        self.cache.publish_import(job.loaded.request, job.first, job.kv_hold)
        self.tier.stats.hit_tokens += len(job.kv) * self.cache.block_size
        if job.swa_hold is not None and self.window is not None:
            self.window.publish_import([h for h, _ in job.swa], job.swa_hold)
        if job.state_slot is not None and self.states is not None:
            assert job.loaded.state is not None
            _, block = state_file(job.loaded.state[0])
            if self.cache.kv.pool.lookup(block) is not None:  # a checkpoint must sit on a cached block
                self.states.commit(job.state_slot)
            else:
                self.states.cancel(job.state_slot)

    def _release(self, job: _Import) -> None:
        """Let the job's blocks and slot go unpublished."""
        self.cache.cancel_import(job.kv_hold)
        if job.swa_hold is not None and self.window is not None:
            self.window.pool.end_import(job.swa_hold)
        if job.state_slot is not None and self.states is not None:
            self.states.cancel(job.state_slot)

    def _untrack(self, job: _Import) -> None:
        for kind, pairs in ((KV, job.kv), (SWA, job.swa)):
            incoming = self._incoming[kind]
            incoming.subtract(h for h, _ in pairs)
            self._incoming[kind] = +incoming

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing else to run: block until a read or a copy finishes (instead of spinning on steps)."""
        if self._off:
            return
        # the oldest import only: a later one may be copied already and still wait for it
        busy = self.tier.loading() + [job.copied for job in self._imports[:1]]
        if busy:
            wait(busy, timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        store, tier = self.store.stats(), self.tier.stats
        return {"disk_cache_hit_tokens": tier.hit_tokens, "disk_cache_loads": tier.loads,
                "disk_cache_bytes_read": store.bytes_read, "disk_cache_bytes_written": store.bytes_written,
                "disk_cache_evictions": store.evictions, "disk_cache_refused": sum(store.refused.values()),
                "disk_cache_saves_dropped": tier.saves_dropped, "disk_cache_imports_dropped": tier.imports_dropped,
                "disk_cache_files": store.entries,
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
        self._copier.shutdown(wait=True)
        self.tier.close()
        log.info("disk cache: memory written out in %.1fs (%d files)", time.perf_counter() - t0,
                 self.store.stats().entries)
