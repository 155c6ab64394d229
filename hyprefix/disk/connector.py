"""The disk tier as the engine core drives it: the worker side of the connector. It moves
bytes between the cache tensors (``block_io.py``) and the tier's threads (``tier.py``) at
the points of a step where that is safe, and reaches the memory pools only through the cache
coordinator (``reserve_load`` / ``publish_load`` / ``cancel_load``, ``take_saves``).

Order within a step (``EngineCore.step``):
1. ``before_schedule``: imports whose copies finished are published (the scheduler then
   sees them as ordinary memory hits), and loads whose reads finished get fresh memory
   blocks (what their allocation evicted is saved first) that the copier thread fills while
   steps go on;
2. the scheduler runs (the pools record the entries its allocations evict);
3. ``before_forward``: those entries are copied out, before the forward that reuses them;
4. the forward; after it, with write-through, ``after_step`` saves what the step published.
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

from hyprefix.cache.coordinator import KV, STATE, SWA, CacheCoordinator, LoadHold
from hyprefix.cache.plan import GIB
from hyprefix.disk.block_io import BlockIO
from hyprefix.disk.store import DiskBlockStore, DiskIdentity
from hyprefix.disk.tier import DiskTier, Loaded, Payload
from hyprefix.request import Status

log = logging.getLogger("hyprefix")


@dataclass
class _Import:
    """A load on its way into memory: memory held unpublished (engine thread), filled by the
    copier thread, published by a later step."""

    loaded: Loaded
    hold: LoadHold
    payloads: list[Payload]  # in ``hold.targets()`` order
    copied: Future[None] = field(default_factory=Future)


class DiskConnector:
    """``create`` builds one over an engine's cache and runner (``--disk-cache-dir``)."""

    def __init__(self, directory: str, capacity_gb: float, write_through: bool, model_identity: str,
                 cache: CacheCoordinator, io: BlockIO) -> None:
        self.cache = cache
        self.io = io
        self.model_identity = model_identity
        self.store = DiskBlockStore(Path(directory), DiskIdentity(model_identity, io.layout), int(capacity_gb * GIB))
        self.tier = DiskTier(self.store, cache.block_size, io.kv_block_bytes, has_state=io.state_bytes > 0,
                             write_through=write_through)
        cache.attach_lower(self.tier, write_through)
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
        # hashes of the blocks they bring, by pool (counted: two imports may bring one block)
        self._incoming: dict[str, Counter[bytes]] = {KV: Counter(), SWA: Counter()}
        self._off = False  # the weights changed in place (``_weights_changed``)
        ref = weakref.ref(self)
        atexit.register(lambda: (disk := ref()) is not None and disk.close())

    @classmethod
    def create(cls, config, cache: CacheCoordinator, runner, model_identity: str) -> DiskConnector:
        """Over ``runner``'s K/V and state tensors (``config``: an ``engine_config.DiskCacheConfig``)."""
        layout = runner.model.kv_layout
        in_window_pool = [runner.has_window_pool and layout.window(i) is not None for i in range(layout.num_layers)]
        io = BlockIO(runner.kv_caches, [i for i, w in enumerate(in_window_pool) if not w], runner.recurrent_states,
                     runner.block_size, window_pool_layers=[i for i, w in enumerate(in_window_pool) if w])
        return cls(config.directory, config.capacity_gb, config.write_through, model_identity, cache, io)

    @property
    def write_through(self) -> bool:
        return self.tier.write_through

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
        self.cache.detach_lower()
        self.tier.take_saves()

    # ------------------------------------------------------------------ saves
    def before_forward(self, wait: bool = False) -> None:
        """Copy out every entry the pools recorded since the last call and queue its write
        (``wait``: write it now): before the forward that may rewrite them."""
        if self._off:
            return
        self.tier.note(self.cache.take_saves())
        saves = self.tier.take_saves()
        blocks = {kind: [(h, b) for k, h, b in saves if k == kind] for kind in (KV, SWA)}
        for kind, noted in blocks.items():  # blocks in one gather per layer
            for (block_hash, _), payload in zip(noted, self.io.read_blocks(kind == SWA, [b for _, b in noted]),
                                                strict=True):
                self.tier.save(kind, block_hash, payload, wait)
        for kind, key, slot in saves:
            if kind not in blocks:
                self.tier.save(kind, key, self.io.read_state(slot), wait)

    def after_step(self) -> None:
        """Write-through: save what the step published."""
        if self.write_through:
            self.before_forward()

    def flush_memory(self) -> None:
        """Write every cached block and checkpoint memory holds that the disk lacks, and wait."""
        self.tier.note(self.cache.cached_entries())
        self.tier.flush()
        self.before_forward(wait=True)

    # ------------------------------------------------------------------ loads
    def before_schedule(self, requests: dict) -> None:
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
            if job.payloads:
                job.copied = self._copier.submit(self._copy, job)
            else:  # all of it in memory or on its way there: done once the imports before it are
                job.copied.set_result(None)
            self._incoming[KV].update(job.hold.kv)
            self._incoming[SWA].update(job.hold.swa)
            self._imports.append(job)

    def _reserve(self, loaded: Loaded) -> _Import | None:
        """On the engine thread: memory for what the load read, less what memory gained
        meanwhile; None when the KV blocks find no room. What the reservations evicted is
        saved before returning, so the copier may overwrite it."""
        hold = self.cache.reserve_load(loaded.request, loaded.first_block, [h for h, _ in loaded.kv],
                                       [h for h, _ in loaded.swa], loaded.state[0] if loaded.state else None,
                                       set(self._incoming[KV]), set(self._incoming[SWA]))
        if hold is None or hold.window_dropped:
            self.tier.stats.imports_dropped += 1
        if hold is None:
            return None
        read = {(KV, h): payload for h, payload in loaded.kv} | {(SWA, h): payload for h, payload in loaded.swa}
        if loaded.state is not None:
            read[STATE, loaded.state[0]] = loaded.state[1]
        job = _Import(loaded, hold, [read[pool, key] for pool, key, _ in hold.targets()])
        self.before_forward()
        return job

    def _copy(self, job: _Import) -> None:
        """On the copier thread: the payloads into the reserved blocks and slot."""
        for (pool, _, target), payload in zip(job.hold.targets(), job.payloads, strict=True):
            self.io.write(pool, target, payload)

    def _publish_copied(self, wait_all: bool = False, cancel: bool = False) -> None:
        """On the engine thread: publish the imports whose copies finished, in the order they
        started (a later one may count on blocks an earlier one brings; ``wait_all``: every
        one, waiting), and let their requests go on. An import is let go unpublished when
        ``cancel`` (the weights changed: its bytes are the old weights') or when its request's
        hashes no longer name its blocks (a weight update cleared them)."""
        while self._imports and (wait_all or self._imports[0].copied.done()):
            job = self._imports.pop(0)
            for pool, hashes in ((KV, job.hold.kv), (SWA, job.hold.swa)):
                self._incoming[pool].subtract(hashes)
                self._incoming[pool] = +self._incoming[pool]
            try:
                job.copied.result()  # a copy that raised is a bug: raise it here, on the engine thread
            except BaseException:
                self.cache.cancel_load(job.hold)
                raise
            request, hold = job.loaded.request, job.hold
            if cancel or request.block_hashes[hold.first_block:hold.first_block + len(hold.kv)] != hold.kv:
                self.cache.cancel_load(hold)
            else:
                self.cache.publish_load(request, hold)
                self.tier.stats.hit_tokens += len(hold.kv) * self.cache.block_size
            self.tier.finish(job.loaded)

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
