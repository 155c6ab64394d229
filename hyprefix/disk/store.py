"""Content-addressed block files on local disk: the storage layer of the prefix cache's disk tier.

One file holds the bytes of one cache block, named by what it holds: the key is ``(kind,
block_hash)``, ``kind`` a short tag (``"kv"``, ``"state"``, ``"swa"``) and ``block_hash`` the
chained 32-byte digest of ``hashing.py``, whose root already names the model, the weight
version and the tenant salt. Equal keys therefore mean equal bytes, which is what lets every
write be idempotent and every race between writers harmless. Files survive restarts.

Layout::

    directory/<16 hex of blake2b(format version, model, layout)>/<hash hex[:2]>/<hash hex>.<kind>

A store only ever lists its own identity directory, so another model, payload layout or file
format version never sees (or evicts) these files.

The file format and its checks are ``format.py``'s.

Invariants:
- a final-named file is only ever created by ``os.replace`` of a completely written temp file
  (``.tmp-<pid>-<random>`` in the same shard), so a crash leaves at most a temp file, which is
  never indexed; start-up removes temp files older than ``STALE_TMP_SECONDS`` (a younger one may
  belong to a live writer sharing the directory);
- ``bytes_used`` is the sum of the sizes (header included) of the indexed files and, together
  with the bytes reserved by writes in flight, never exceeds ``capacity_bytes``: a write reserves
  its size (evicting least recently used entries first) before it creates its temp file;
- the index holds no key whose file this process is writing or deleting; a ``put`` of a key that
  is being deleted is refused rather than letting the delete remove the fresh file.

Threads: one lock guards the index and the counters; file I/O runs outside it, so a get and a
put of different keys proceed in parallel.

Processes sharing one directory are safe: renames are atomic, a file another process deleted is
a plain miss, and a file another process wrote after our scan is unknown to us until
``refresh()`` (a ``put`` of the same key just replaces it with identical bytes). The budget,
however, is per process: each store enforces ``capacity_bytes`` on the files *it knows*, so the
directory as a whole can exceed it. Give each replica its own subdirectory for an exact budget;
a shared directory is correct but its budget is approximate.

LRU order is this process's (insertion and ``get`` order); on start-up it is seeded by file
mtime, oldest first, and a hit touches the file's mtime (``touch_on_hit``) so that the order
survives a restart. ``fsync=False`` is safe: a file left short or garbled by a power loss fails
validation and is refused; ``fsync=True`` only narrows what such a loss takes away.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hyprefix.disk.format import (
    FIXED_HEADER,
    U32,
    DiskIdentity,
    Key,
    Refused,
    check_key,
    encode_header,
    encode_identity,
    parse_name,
    read_payload,
)

STALE_TMP_SECONDS = 60.0  # a temp file this old has no live writer left
TMP_PREFIX = ".tmp-"


@dataclass
class DiskStoreStats:
    """Counters since the store was built. Byte counts are file sizes (header included), the
    disk I/O actually done; ``misses`` counts every ``get`` that returned None, refusals too."""

    entries: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    evictions: int
    refused: dict[str, int] = field(default_factory=dict)  # reason -> files refused and deleted
    write_errors: int = 0  # puts that failed on an OSError (disk full, ...): not stored, no raise


@dataclass(slots=True)
class _Entry:
    size: int
    seq: int  # when it joined the index: refresh() only drops entries older than its scan


@dataclass(slots=True)
class _Pending:
    size: int
    cancelled: bool = False  # a remove() or clear() ran while it was written: delete it after


def _unlink(path: str) -> None:
    """Delete a file; one already gone, or that cannot be deleted, is left to be (it stays unindexed)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


class DiskBlockStore:
    """A budgeted, LRU-evicted, crash-safe map ``(kind, block_hash) -> bytes`` on disk.

    ``directory`` may be shared by stores of other identities (each keeps to its subdirectory)
    and, with the caveats of the module docstring, by other processes of the same identity.
    """

    def __init__(self, directory: str | os.PathLike[str], identity: DiskIdentity, capacity_bytes: int,
                 *, fsync: bool = False, touch_on_hit: bool = True) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.touch_on_hit = touch_on_hit
        self.path = Path(directory) / identity.dirname
        self._root = str(self.path)
        self._identity_tail = encode_identity(identity)
        self._header_size = FIXED_HEADER.size + len(self._identity_tail) + U32.size
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, _Entry] = OrderedDict()  # first key is evicted next
        self._pending: dict[Key, _Pending] = {}  # puts between reservation and rename
        self._doomed: dict[Key, int] = {}  # keys whose file some thread is deleting -> how many
        self._clearing = 0  # clear() calls in flight: puts are refused meanwhile
        self._clears = 0  # clear() calls begun: a refresh that saw one begin learns nothing
        self._scanning = 0  # refresh() calls between their scan and their merge
        self._deleted_while_scanning: set[Key] = set()  # a scan may have listed them: not to learn
        self._seq = 0
        self._used = 0
        self._reserved = 0
        self._hits = self._misses = self._bytes_read = self._bytes_written = 0
        self._writes = self._evictions = self._write_errors = 0
        self._refused: dict[str, int] = {}
        os.makedirs(self._root, exist_ok=True)
        self.refresh()

    # ------------------------------------------------------------------ public API
    @property
    def header_size(self) -> int:
        """Bytes each file adds to its payload (what ``capacity_bytes`` counts besides payloads)."""
        return self._header_size

    def path_for(self, kind: str, block_hash: bytes) -> Path:
        """Where the file of a key lives (whether or not it exists)."""
        return Path(self._path(check_key(kind, block_hash)))

    def contains(self, kind: str, block_hash: bytes) -> bool:
        """Whether the key is indexed (no I/O: the file may since have gone, see ``get``)."""
        key = check_key(kind, block_hash)
        with self._lock:
            return key in self._index

    def prefix_run(self, kind: str, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` are indexed under ``kind`` (no I/O)."""
        keys = [check_key(kind, h) for h in hashes]
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
            return len(keys)

    def get(self, kind: str, block_hash: bytes) -> bytes | None:
        """The payload stored under the key, or None: not indexed, deleted by another process
        (the key is dropped), or refused (the file is deleted and counted by reason). A hit moves
        the key to the most recently used end."""
        key = check_key(kind, block_hash)
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._misses += 1
                return None
        path = self._path(key)
        try:
            payload, size = self._read(path, key)
        except FileNotFoundError:
            with self._lock:
                self._drop_locked(key, entry)
                self._misses += 1
            return None
        except Refused as refusal:
            self._refuse(key, entry, path, refusal.reason, refusal.inode)
            return None
        with self._lock:
            if self._index.get(key) is entry:
                self._index.move_to_end(key)
            self._hits += 1
            self._bytes_read += size
        if self.touch_on_hit:
            with contextlib.suppress(OSError):
                os.utime(path)
        return payload

    def put(self, kind: str, block_hash: bytes, payload: bytes | bytearray | memoryview) -> bool:
        """Store ``payload`` under the key; returns whether it is (or already was) stored.

        A key already indexed only moves to the most recently used end: same hash, same bytes.
        Least recently used entries are evicted until the new file fits; a file larger than
        ``capacity_bytes`` is not stored. False also for a write that failed on an OSError
        (counted in ``write_errors``) and for a key being removed or cleared meanwhile.
        ``payload`` must be a C-contiguous buffer; the caller may reuse it once this returns."""
        key = check_key(kind, block_hash)
        view = memoryview(payload).cast("B")
        size = self._header_size + view.nbytes
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
                return True
            pending = self._pending.get(key)
            if pending is not None:  # another thread is writing these very bytes
                return not pending.cancelled
            if key in self._doomed or self._clearing or self._reserved + size > self.capacity_bytes:
                return False
            victims = self._evict_locked(size)
            pending = self._pending[key] = _Pending(size)
            self._reserved += size
        self._delete(victims)
        ok = committed = False
        try:
            header = encode_header(self._identity_tail, kind, block_hash, view.nbytes, zlib.crc32(view))
            ok = self._write(key, header, view)
        finally:
            with self._lock:
                del self._pending[key]
                self._reserved -= size
                committed = ok and not pending.cancelled
                if committed:
                    self._seq += 1
                    self._index[key] = _Entry(size, self._seq)
                    self._used += size
                    self._writes += 1
                    self._bytes_written += size
                elif ok:  # written, but removed or cleared meanwhile: delete it again
                    self._doom_locked(key)
                else:
                    self._write_errors += 1
        if ok and not committed:
            self._delete([key])
        return committed

    def remove(self, kind: str, block_hash: bytes) -> bool:
        """Delete the key's file (also when only another process knows it); returns whether it
        was indexed. A put of the key in flight is cancelled."""
        key = check_key(kind, block_hash)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used -= entry.size
            pending = self._pending.get(key)
            if pending is not None:
                pending.cancelled = True
            self._doom_locked(key)
        self._delete([key])
        return entry is not None

    def clear(self) -> int:
        """Delete every block file of this identity, known to this process or not (temp files of
        live writers excepted); returns how many files were deleted. Puts in flight are
        cancelled and puts made meanwhile refused."""
        with self._lock:
            self._clearing += 1
            self._clears += 1
            self._index.clear()
            self._used = 0
            for pending in self._pending.values():
                pending.cancelled = True
        removed = 0
        try:
            for shard in self._shards():
                for entry in self._scandir(shard):
                    if parse_name(entry.name) is not None:
                        try:
                            os.unlink(entry.path)
                            removed += 1
                        except OSError:
                            pass
        finally:
            with self._lock:
                self._clearing -= 1
        return removed

    def refresh(self) -> int:
        """Re-scan the directory (names and ``stat`` only, no contents): learn the files other
        processes wrote, forget those they deleted, delete stale temp files, and evict down to
        the budget. New files join at the most recently used end, oldest mtime first (at
        start-up that seeds the whole order). Returns how many entries were learned."""
        with self._lock:
            scan_seq, clears = self._seq, self._clears
            self._scanning += 1
        try:
            found = self._scan()
        except BaseException:
            with self._lock:
                self._end_scan_locked()
            raise
        found.sort(key=lambda item: item[0])
        learned = 0
        with self._lock:
            skip = self._end_scan_locked()  # in this lock section: no deletion slips in before the merge
            if self._index:
                on_disk = {key for _, key, _ in found}
                for key, entry in list(self._index.items()):
                    if entry.seq <= scan_seq and key not in on_disk:  # gone before or during the scan
                        self._drop_locked(key, entry)
            if not self._clearing and self._clears == clears:
                for _, key, size in found:
                    if key in self._index or key in self._pending or key in self._doomed or key in skip:
                        continue
                    self._seq += 1
                    self._index[key] = _Entry(size, self._seq)
                    self._used += size
                    learned += 1
            victims = self._evict_locked(0)
        self._delete(victims)
        return learned

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return DiskStoreStats(
                entries=len(self._index), bytes_used=self._used, capacity_bytes=self.capacity_bytes,
                hits=self._hits, misses=self._misses, bytes_read=self._bytes_read,
                bytes_written=self._bytes_written, writes=self._writes, evictions=self._evictions,
                refused=dict(self._refused), write_errors=self._write_errors)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------------ internals
    def _path(self, key: Key) -> str:
        hexname = key[1].hex()
        return os.path.join(self._root, hexname[:2], f"{hexname}.{key[0]}")

    def _drop_locked(self, key: Key, entry: _Entry) -> None:
        """Forget ``key`` if it is still this very entry (a newer put of it stays)."""
        if self._index.get(key) is entry:
            del self._index[key]
            self._used -= entry.size

    def _evict_locked(self, need: int) -> list[Key]:
        """Drop LRU entries until ``need`` more bytes fit; the caller deletes the returned keys'
        files (outside the lock), which stay doomed until then."""
        victims = []
        while self._index and self._used + self._reserved + need > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._used -= entry.size
            self._evictions += 1
            self._doom_locked(key)
            victims.append(key)
        return victims

    def _delete(self, keys: list[Key]) -> None:
        """Delete the files of doomed keys, then let puts of them through again."""
        if not keys:
            return
        for key in keys:
            _unlink(self._path(key))
        with self._lock:
            for key in keys:
                self._undoom_locked(key)

    def _end_scan_locked(self) -> set[Key]:
        """The keys doomed since (at least) this scan began; a refresh must not learn them."""
        self._scanning -= 1
        skip = self._deleted_while_scanning
        if not self._scanning:
            self._deleted_while_scanning = set()
        return skip

    def _doom_locked(self, key: Key) -> None:
        """Mark ``key``'s file as being deleted: no put of it, no refresh learning it, until
        ``_undoom_locked``. A scan in flight may list the file before it goes, so its refresh must
        not learn it either."""
        self._doomed[key] = self._doomed.get(key, 0) + 1
        if self._scanning:
            self._deleted_while_scanning.add(key)

    def _undoom_locked(self, key: Key) -> None:
        left = self._doomed[key] - 1
        if left:
            self._doomed[key] = left
        else:
            del self._doomed[key]
        if self._scanning:
            self._deleted_while_scanning.add(key)

    def _refuse(self, key: Key, entry: _Entry, path: str, reason: str, inode: tuple[int, int] | None) -> None:
        with self._lock:
            self._drop_locked(key, entry)
            self._refused[reason] = self._refused.get(reason, 0) + 1
            self._misses += 1
            self._doom_locked(key)
        try:
            # Delete the file we judged, not one another process renamed over it since.
            if inode is None or _inode(os.stat(path)) == inode:
                os.unlink(path)
        except OSError:
            pass
        with self._lock:
            self._undoom_locked(key)

    def _read(self, path: str, key: Key) -> tuple[bytes, int]:
        """(payload, file size) of a valid file. Raises FileNotFoundError for a file that is not
        there and ``Refused`` for anything else."""
        try:
            f = open(path, "rb")  # noqa: SIM115 -- closed by the with below
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise Refused("io") from exc
        with f:
            try:
                st = os.fstat(f.fileno())
            except OSError as exc:
                raise Refused("io") from exc
            try:
                return read_payload(f, self._identity_tail, st.st_size, key), st.st_size
            except Refused as refusal:
                refusal.inode = _inode(st)
                raise
            except OSError as exc:
                raise Refused("io", _inode(st)) from exc

    def _write(self, key: Key, header: bytes, view: memoryview) -> bool:
        """Write to a temp file in the shard and rename it onto the final name; False (and no
        file left behind) on an OSError."""
        path = self._path(key)
        shard = os.path.dirname(path)
        tmp = os.path.join(shard, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:  # first file of this shard (or the shard was deleted)
                os.makedirs(shard, exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
        except OSError:
            return False
        try:
            with open(fd, "wb") as f:
                f.write(header)
                f.write(view)
                if self.fsync:
                    f.flush()
                    os.fsync(fd)
            os.replace(tmp, path)
        except BaseException as exc:
            _unlink(tmp)
            if isinstance(exc, OSError):
                return False
            raise
        return True

    def _shards(self) -> list[str]:
        return [entry.path for entry in self._scandir(self._root)
                if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False)]

    @staticmethod
    def _scandir(path: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(path) as it:
                return list(it)
        except OSError:  # deleted meanwhile (clear() elsewhere, an operator): nothing there
            return []

    def _scan(self) -> list[tuple[float, Key, int]]:
        """(mtime, key, size) of every block file on disk; deletes stale temp files."""
        found = []
        now = time.time()
        for shard in self._shards():
            shard_name = os.path.basename(shard)
            for entry in self._scandir(shard):
                name = entry.name
                try:
                    if name.startswith(TMP_PREFIX):
                        if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                            _unlink(entry.path)
                        continue
                    key = parse_name(name)
                    if key is None or not name.startswith(shard_name) or not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # deleted between the listing and the stat
                    continue
                found.append((st.st_mtime, key, st.st_size))
        return found


def _inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
