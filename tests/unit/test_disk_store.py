"""Unit tests of the disk tier's block store (``hyprefix/disk/store.py``) on real files
under ``tmp_path``: round trips, restarts, LRU and budget, every refusal reason, temp files,
a writer killed mid-loop, two processes and several threads on one directory."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyprefix.disk.format import FORMAT_VERSION, MAGIC, DiskIdentity
from hyprefix.disk.store import STALE_TMP_SECONDS, DiskBlockStore

REPO = Path(__file__).resolve().parents[2]
IDENTITY = DiskIdentity("test-model@rev1", "kv float16 block_size=16 [2, 16, 4, 8]")
BIG = 1 << 30


def h(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def payload_of(i: int) -> bytes:
    """Distinct bytes and sizes per key, so a wrong file can never pass for the right one."""
    return h(i) * (1 + i % 7) + bytes([i % 251])


def make(directory: Path, capacity: int = BIG, identity: DiskIdentity = IDENTITY, **kwargs) -> DiskBlockStore:
    return DiskBlockStore(directory, identity, capacity, **kwargs)


def block_files(store: DiskBlockStore) -> dict[str, int]:
    """Final-named files under the store's identity directory: name -> size (temp files left out)."""
    return {p.name: p.stat().st_size for p in store.path.glob("*/*") if not p.name.startswith(".tmp-")}


def file_size(store: DiskBlockStore, i: int) -> int:
    return store.header_size + len(payload_of(i))


def header_size(identity: DiskIdentity = IDENTITY) -> int:
    with tempfile.TemporaryDirectory() as directory:
        return DiskBlockStore(directory, identity, 0).header_size


def set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def run_python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


# ------------------------------------------------------------------ imports and keys
def test_imports_without_torch():
    code = """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import hyprefix.disk.store
        print("ok")
    """
    proc = run_python(code)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "ok"


@pytest.mark.parametrize("kind", ["", "KV", "k-v", "kv.1", "a" * 17, "ü"])
def test_bad_kind_rejected(tmp_path, kind):
    store = make(tmp_path)
    for call in (lambda: store.put(kind, h(0), b"x"), lambda: store.get(kind, h(0)),
                 lambda: store.contains(kind, h(0)), lambda: store.remove(kind, h(0))):
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("block_hash", [b"", b"x" * 31, b"x" * 33, "x" * 32])
def test_bad_hash_rejected(tmp_path, block_hash):
    store = make(tmp_path)
    with pytest.raises(ValueError):
        store.put("kv", block_hash, b"x")
    with pytest.raises(ValueError):
        store.get("kv", block_hash)


def test_bad_identity_and_capacity_rejected(tmp_path):
    with pytest.raises(ValueError):
        DiskIdentity("a\0b", "c")
    with pytest.raises(ValueError):
        make(tmp_path, capacity=-1)


# ------------------------------------------------------------------ round trip and restart
def test_round_trip_and_counters(tmp_path):
    store = make(tmp_path)
    assert store.get("kv", h(0)) is None  # miss on an empty store
    assert store.put("kv", h(0), payload_of(0))
    assert store.put("state", h(0), bytearray(b"state bytes"))  # same hash, other kind: another file
    assert store.put("swa", h(1), memoryview(payload_of(1)))
    assert store.put("kv", h(2), b"")  # an empty payload is a valid block
    assert store.get("kv", h(0)) == payload_of(0)
    assert store.get("state", h(0)) == b"state bytes"
    assert store.get("swa", h(1)) == payload_of(1)
    assert store.get("kv", h(2)) == b""
    assert store.get("kv", h(1)) is None  # the kind is part of the key
    assert store.contains("swa", h(1)) and not store.contains("kv", h(1))

    path = store.path_for("kv", h(0))
    assert path == tmp_path / IDENTITY.dirname / h(0).hex()[:2] / f"{h(0).hex()}.kv"
    assert len(IDENTITY.dirname) == 16
    assert path.read_bytes().startswith(MAGIC)

    sizes = [file_size(store, 0), store.header_size + 11, file_size(store, 1), store.header_size]
    stats = store.stats()
    assert (stats.entries, stats.bytes_used, stats.writes, stats.bytes_written) == (4, sum(sizes), 4, sum(sizes))
    assert (stats.hits, stats.misses, stats.bytes_read) == (4, 2, sum(sizes))
    assert (stats.evictions, stats.refused, stats.write_errors) == (0, {}, 0)
    assert sum(block_files(store).values()) == stats.bytes_used


def test_put_of_present_key_does_not_rewrite(tmp_path):
    store = make(tmp_path)
    assert store.put("kv", h(0), payload_of(0))
    before = store.path_for("kv", h(0)).stat()
    assert store.put("kv", h(0), b"other bytes would be a hash collision")
    after = store.path_for("kv", h(0)).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert store.get("kv", h(0)) == payload_of(0)
    assert store.stats().writes == 1


def test_restart_finds_identical_bytes(tmp_path):
    store = make(tmp_path)
    for i in range(30):
        assert store.put(("kv", "state", "swa")[i % 3], h(i), payload_of(i))
    again = make(tmp_path)
    assert (again.stats().entries, again.stats().bytes_used) == (30, store.stats().bytes_used)
    for i in range(30):
        assert again.get(("kv", "state", "swa")[i % 3], h(i)) == payload_of(i)
    assert again.stats().refused == {}


def test_prefix_run(tmp_path):
    store = make(tmp_path)
    for i in (0, 1, 2, 4):
        store.put("kv", h(i), payload_of(i))
    assert store.prefix_run("kv", [h(i) for i in range(6)]) == 3
    assert store.prefix_run("kv", []) == 0
    assert store.prefix_run("kv", [h(3), h(0)]) == 0
    assert store.prefix_run("state", [h(0)]) == 0


# ------------------------------------------------------------------ LRU and budget
def test_lru_eviction_order(tmp_path):
    store = make(tmp_path, capacity=3 * (header_size() + len(payload_of(0))))
    for i in (0, 7, 14):  # equal sizes: i % 7 == 0
        assert store.put("kv", h(i), payload_of(i))
    assert store.get("kv", h(0)) == payload_of(0)  # 0 becomes most recently used
    assert store.put("kv", h(7), payload_of(7))  # present: only refreshes 7
    assert store.put("kv", h(21), payload_of(21))  # evicts 14, the least recently used
    assert not store.contains("kv", h(14)) and not store.path_for("kv", h(14)).exists()
    assert store.put("kv", h(28), payload_of(28))  # evicts 0
    assert [store.contains("kv", h(i)) for i in (0, 7, 21, 28)] == [False, True, True, True]
    assert store.stats().evictions == 2
    assert sum(block_files(store).values()) <= store.capacity_bytes


def test_payload_over_capacity_not_stored(tmp_path):
    store = make(tmp_path / "store", capacity=header_size() + len(payload_of(0)) + 10)
    assert store.put("kv", h(0), payload_of(0))
    assert not store.put("kv", h(1), b"x" * store.capacity_bytes)
    assert store.contains("kv", h(0))  # nothing was evicted for a write that cannot fit
    assert not store.contains("kv", h(1)) and not store.path_for("kv", h(1)).exists()
    assert make(tmp_path / "zero", capacity=0).put("kv", h(0), b"") is False


def test_smaller_capacity_at_restart_evicts_oldest(tmp_path):
    store = make(tmp_path)
    past = time.time_ns() - 100 * 10**9
    for i in range(10):
        store.put("kv", h(7 * i), payload_of(7 * i))  # equal sizes
        set_mtime(store.path_for("kv", h(7 * i)), past + i * 10**9)
    size = file_size(store, 0)
    small = make(tmp_path, capacity=4 * size + size // 2)
    assert small.stats().evictions == 6 and small.stats().bytes_used == 4 * size
    assert [small.contains("kv", h(7 * i)) for i in range(10)] == [False] * 6 + [True] * 4
    assert len(block_files(small)) == 4


def test_hit_touches_mtime_so_lru_survives_restart(tmp_path):
    store = make(tmp_path)
    old = time.time_ns() - 100 * 10**9
    for n, i in enumerate((0, 7, 14)):
        store.put("kv", h(i), payload_of(i))
        set_mtime(store.path_for("kv", h(i)), old + n * 10**9)
    assert store.get("kv", h(0)) == payload_of(0)  # oldest write, most recent use
    restarted = make(tmp_path, capacity=2 * file_size(store, 0))
    assert [restarted.contains("kv", h(i)) for i in (0, 7, 14)] == [True, False, True]

    untouched = make(tmp_path / "untouched", touch_on_hit=False)
    untouched.put("kv", h(0), payload_of(0))
    set_mtime(untouched.path_for("kv", h(0)), old)
    assert untouched.get("kv", h(0)) == payload_of(0)
    assert untouched.path_for("kv", h(0)).stat().st_mtime_ns == old


class LruModel:
    """The reference: an LRU map of file sizes under a byte budget."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, int] = OrderedDict()

    def put(self, i: int, size: int) -> bool:
        if i in self.entries:
            self.entries.move_to_end(i)
            return True
        if size > self.capacity:
            return False
        while sum(self.entries.values()) + size > self.capacity:
            self.entries.popitem(last=False)
        self.entries[i] = size
        return True

    def get(self, i: int) -> bool:
        if i in self.entries:
            self.entries.move_to_end(i)
            return True
        return False


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "remove", "restart"]), st.integers(0, 11)),
               max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, files=st.integers(0, 6))
def test_matches_lru_model_and_never_exceeds_budget(tmp_path, ops, files):
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    capacity = files * (header_size() + 32 * 4)
    store = make(directory, capacity=capacity, touch_on_hit=False)
    model = LruModel(capacity)
    for op, i in ops:
        if op == "put":
            assert store.put("kv", h(i), payload_of(i)) == model.put(i, file_size(store, i))
        elif op == "get":
            assert (store.get("kv", h(i)) == payload_of(i)) == model.get(i)
            assert store.get("kv", h(i + 100)) is None
        elif op == "remove":
            assert store.remove("kv", h(i)) == (model.entries.pop(i, None) is not None)
        else:  # restart; distinct mtimes in the model's order make the scan's seeding exact
            base = time.time_ns() - 1000 * 10**9
            for n, j in enumerate(model.entries):
                set_mtime(store.path_for("kv", h(j)), base + n * 10**9)
            store = make(directory, capacity=capacity, touch_on_hit=False)
        on_disk = block_files(store)
        assert sum(on_disk.values()) <= capacity
        assert set(on_disk) == {f"{h(i).hex()}.kv" for i in model.entries}
        assert store.stats().bytes_used == sum(on_disk.values())
    assert store.stats().refused == {}


# ------------------------------------------------------------------ refusals
def flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def assert_refused(store: DiskBlockStore, kind: str, block_hash: bytes, reason: str) -> None:
    path = store.path_for(kind, block_hash)
    misses = store.stats().misses
    assert store.get(kind, block_hash) is None
    assert not path.exists()
    assert not store.contains(kind, block_hash)
    assert store.stats().refused == {reason: 1}
    assert store.stats().misses == misses + 1
    assert store.stats().bytes_used == sum(block_files(store).values())


@pytest.mark.parametrize(("damage", "reason"), [
    ("payload", "payload_crc"),
    ("header_hash", "header_crc"),
    ("header_layout", "header_crc"),
    ("header_crc", "header_crc"),
    ("magic", "magic"),
    ("version", "version"),
    ("truncated", "length"),
    ("extended", "length"),
    ("empty", "length"),
])
def test_damaged_file_refused_and_removed(tmp_path, damage, reason):
    store = make(tmp_path)
    store.put("kv", h(0), payload_of(0))
    store.put("kv", h(1), payload_of(1))
    path = store.path_for("kv", h(0))
    size = path.stat().st_size
    header = store.header_size
    if damage == "payload":
        flip(path, size - 3, 0x01)
    elif damage == "header_hash":
        flip(path, 40)  # inside the block hash
    elif damage == "header_layout":
        flip(path, header - 20)  # inside the layout string
    elif damage == "header_crc":
        flip(path, header - 1)
    elif damage == "magic":
        flip(path, 0)
    elif damage == "version":
        flip(path, len(MAGIC))
    elif damage == "truncated":
        os.truncate(path, size - 1)
    elif damage == "extended":
        path.write_bytes(path.read_bytes() + b"\0")
    else:
        os.truncate(path, 0)
    assert_refused(store, "kv", h(0), reason)
    assert store.get("kv", h(1)) == payload_of(1)  # its neighbour is untouched


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_any_flipped_byte_is_refused(tmp_path, where, mask):
    store = make(Path(tempfile.mkdtemp(dir=tmp_path)))
    store.put("kv", h(3), payload_of(3))
    path = store.path_for("kv", h(3))
    flip(path, int(where * path.stat().st_size), mask)
    assert store.get("kv", h(3)) is None
    assert not path.exists()
    assert sum(store.stats().refused.values()) == 1


def test_other_format_version_refused(tmp_path):
    store = make(tmp_path)
    store.put("kv", h(0), payload_of(0))
    path = store.path_for("kv", h(0))
    data = bytearray(path.read_bytes())
    data[len(MAGIC):len(MAGIC) + 2] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    assert_refused(store, "kv", h(0), "version")


@pytest.mark.parametrize("rename", ["other_hash", "other_kind"])
def test_file_copied_under_another_name_refused(tmp_path, rename):
    store = make(tmp_path)
    store.put("kv", h(0), payload_of(0))
    kind, block_hash = ("kv", h(1)) if rename == "other_hash" else ("state", h(0))
    target = store.path_for(kind, block_hash)
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(store.path_for("kv", h(0)).read_bytes())
    store = make(tmp_path)  # the restart indexes the copy by its name
    assert store.contains(kind, block_hash)
    assert_refused(store, kind, block_hash, "key")
    assert store.get("kv", h(0)) == payload_of(0)


def test_other_identity_sees_nothing_and_refuses_moved_files(tmp_path):
    first = make(tmp_path)
    for i in range(5):
        first.put("kv", h(i), payload_of(i))
    other_model = make(tmp_path, identity=DiskIdentity("other-model@rev1", IDENTITY.layout))
    other_layout = make(tmp_path, identity=DiskIdentity(IDENTITY.model, "kv bfloat16 block_size=16"))
    for store in (other_model, other_layout):
        assert store.path != first.path
        assert store.stats().entries == 0 and store.get("kv", h(0)) is None
        assert store.prefix_run("kv", [h(i) for i in range(5)]) == 0
    assert other_model.clear() == 0
    assert len(block_files(first)) == 5  # another identity's clear() leaves these alone

    source, target = first.path_for("kv", h(2)), other_model.path_for("kv", h(2))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)  # an operator moved it by hand: same name, wrong identity
    assert other_model.refresh() == 1
    assert_refused(other_model, "kv", h(2), "identity")


def test_vanished_file_is_a_plain_miss(tmp_path):
    store = make(tmp_path)
    store.put("kv", h(0), payload_of(0))
    store.path_for("kv", h(0)).unlink()  # another process evicted it
    assert store.contains("kv", h(0))
    assert store.get("kv", h(0)) is None
    assert not store.contains("kv", h(0))
    stats = store.stats()
    assert (stats.refused, stats.misses, stats.entries, stats.bytes_used) == ({}, 1, 0, 0)


# ------------------------------------------------------------------ temp files and crashes
def test_stale_temp_files_removed_young_ones_kept(tmp_path):
    store = make(tmp_path)
    store.put("kv", h(0), payload_of(0))
    shard = store.path_for("kv", h(0)).parent
    stale, young = shard / ".tmp-12345-deadbeef", shard / ".tmp-12345-cafef00d"
    stale.write_bytes(b"half a block")
    young.write_bytes(b"a live writer's block")
    set_mtime(stale, time.time_ns() - int((STALE_TMP_SECONDS + 5) * 10**9))
    restarted = make(tmp_path)
    assert not stale.exists() and young.exists()
    assert restarted.stats().entries == 1
    assert restarted.get("kv", h(0)) == payload_of(0)
    assert restarted.clear() == 1 and young.exists()  # clear() spares live writers' temp files


def test_failed_write_leaves_nothing_and_releases_its_reservation(tmp_path, monkeypatch):
    store = make(tmp_path, capacity=2 * (header_size() + 1000))

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    assert not store.put("kv", h(0), b"x" * 1000)
    monkeypatch.undo()
    assert store.stats().write_errors == 1
    assert not store.contains("kv", h(0))
    assert list(store.path.glob("*/*")) == []  # the temp file went too
    assert store.put("kv", h(0), b"x" * 1000) and store.put("kv", h(1), b"y" * 1000)
    assert store.stats().evictions == 0


KILLED_WRITER = """
    import hashlib, sys
    from hyprefix.disk.store import DiskBlockStore, DiskIdentity
    store = DiskBlockStore(sys.argv[1], DiskIdentity(sys.argv[2], sys.argv[3]), 1 << 40)
    i = 0
    while True:
        block_hash = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
        assert store.put("kv", block_hash, block_hash * 8192)  # 256 KiB: a kill most likely lands mid-write
        print(i, flush=True)
        i += 1
"""


def test_writer_killed_mid_loop_leaves_only_valid_or_absent_entries(tmp_path):
    proc = run_python(KILLED_WRITER, str(tmp_path), IDENTITY.model, IDENTITY.layout)
    acked = -1
    try:
        while acked < 40:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            acked = int(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    store = make(tmp_path)
    known = {h(i): i for i in range(acked + 1000)}
    for name in block_files(store):
        assert bytes.fromhex(name.split(".")[0]) in known  # no stray final-named file
    for block_hash in known:
        got = store.get("kv", block_hash)
        assert got is None or got == block_hash * 8192
        if known[block_hash] <= acked:
            assert got == block_hash * 8192  # acknowledged puts are durable against a process kill
    assert store.stats().refused == {}


DIES_BEFORE_RENAME = """
    import hashlib, os, sys
    from hyprefix.disk.store import DiskBlockStore, DiskIdentity
    store = DiskBlockStore(sys.argv[1], DiskIdentity(sys.argv[2], sys.argv[3]), 1 << 40)
    os.replace = lambda src, dst: os._exit(3)  # the process dies with the block written, not renamed
    store.put("kv", hashlib.blake2b(b"x", digest_size=32).digest(), b"payload" * 100)
"""


def test_process_dying_before_the_rename_leaves_only_a_temp_file(tmp_path):
    proc = run_python(DIES_BEFORE_RENAME, str(tmp_path), IDENTITY.model, IDENTITY.layout)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    store = make(tmp_path)
    (tmp,) = store.path.glob("*/*")
    assert tmp.name.startswith(".tmp-") and tmp.stat().st_size == store.header_size + 700
    assert store.stats().entries == 0  # a young temp file is left to its (possibly live) writer
    set_mtime(tmp, time.time_ns() - int((STALE_TMP_SECONDS + 5) * 10**9))
    assert make(tmp_path).stats().entries == 0
    assert list(store.path.glob("*/*")) == []  # a stale one is removed at start-up


# ------------------------------------------------------------------ processes and threads
SHARING_PROCESS = """
    import hashlib, random, sys
    from hyprefix.disk.store import DiskBlockStore, DiskIdentity

    def h(i):
        return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()

    def payload_of(i):
        return h(i) * (1 + i % 7) + bytes([i % 251])

    root, model, layout, capacity, seed, n_ops = sys.argv[1:]
    store = DiskBlockStore(root, DiskIdentity(model, layout), int(capacity))
    rng = random.Random(int(seed))
    for n in range(int(n_ops)):
        i = rng.randrange(48)
        if rng.random() < 0.5:
            store.put("kv", h(i), payload_of(i))
        else:
            got = store.get("kv", h(i))
            if got is not None and got != payload_of(i):
                sys.exit(f"wrong bytes for key {i}")
        if n % 50 == 0:
            store.refresh()
    stats = store.stats()
    if stats.refused:
        sys.exit(f"refused {stats.refused}")
    print(stats.hits, stats.writes)
"""


def test_two_processes_share_a_directory(tmp_path):
    capacity = 16 * (header_size() + 4 * 32)
    proc = run_python(SHARING_PROCESS, str(tmp_path), IDENTITY.model, IDENTITY.layout, str(capacity), "1", "1500")
    store = make(tmp_path, capacity=capacity)
    rng = random.Random(2)
    n = 0
    while proc.poll() is None or n < 300:
        i = rng.randrange(48)
        if rng.random() < 0.5:
            store.put("kv", h(i), payload_of(i))
        else:
            got = store.get("kv", h(i))
            assert got is None or got == payload_of(i), i
        if n % 50 == 0:
            store.refresh()
        n += 1
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert int(out.split()[1]) > 0  # the child wrote

    store.refresh()  # learn everything the child left behind
    found = [i for i in range(48) if store.get("kv", h(i)) is not None]
    assert all(store.get("kv", h(i)) in (None, payload_of(i)) for i in range(48))
    assert found
    assert store.stats().refused == {}


def test_threads_put_and_get_at_once(tmp_path):
    store = make(tmp_path, capacity=12 * (header_size() + 4 * 32))
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for n in range(400):
            i = rng.randrange(40)
            roll = rng.random()
            if roll < 0.45:
                store.put("kv", h(i), payload_of(i))
            elif roll < 0.9:
                got = store.get("kv", h(i))
                if got is not None and got != payload_of(i):
                    errors.append(f"wrong bytes for {i}")
            elif roll < 0.97:
                store.remove("kv", h(i))
            else:
                store.refresh()
            if n % 100 == 0 and store.stats().bytes_used > store.capacity_bytes:
                errors.append("over budget")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = store.stats()
    on_disk = block_files(store)
    assert set(on_disk) == {f"{h(i).hex()}.kv" for i in range(40) if store.contains("kv", h(i))}
    assert stats.bytes_used == sum(on_disk.values()) <= store.capacity_bytes
    assert stats.refused == {} and stats.write_errors == 0
    assert [p.name for p in store.path.glob("*/.tmp-*")] == []
    for i in range(40):
        assert store.get("kv", h(i)) in (None, payload_of(i))


def test_threads_putting_the_same_key(tmp_path):
    store = make(tmp_path)
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def put() -> None:
        barrier.wait()
        results.append(store.put("kv", h(0), payload_of(0) * 5000))

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert store.stats().writes == 1 and len(block_files(store)) == 1
    assert store.get("kv", h(0)) == payload_of(0) * 5000


# ------------------------------------------------------------------ remove, clear, refresh, scale
def test_remove_and_clear(tmp_path):
    store = make(tmp_path)
    for i in range(6):
        store.put("kv", h(i), payload_of(i))
    assert store.remove("kv", h(0)) and not store.path_for("kv", h(0)).exists()
    assert not store.remove("kv", h(0))
    other = make(tmp_path)
    other.put("kv", h(10), payload_of(10))  # a file this store does not know
    assert store.clear() == 6
    assert block_files(store) == {} and store.stats().entries == 0 and store.stats().bytes_used == 0
    assert store.put("kv", h(1), payload_of(1)) and store.get("kv", h(1)) == payload_of(1)


def test_refresh_learns_and_forgets_other_writers_files(tmp_path):
    mine, theirs = make(tmp_path), make(tmp_path)  # two stores stand in for two processes
    theirs.put("kv", h(0), payload_of(0))
    theirs.put("kv", h(1), payload_of(1))
    assert not mine.contains("kv", h(0))
    assert mine.put("kv", h(0), payload_of(0))  # replaces their identical file atomically
    assert mine.refresh() == 1 and mine.get("kv", h(1)) == payload_of(1)
    theirs.remove("kv", h(1))
    assert mine.refresh() == 0 and not mine.contains("kv", h(1))
    assert mine.stats().entries == 1 and mine.stats().bytes_used == file_size(mine, 0)


def test_scan_of_20k_files(tmp_path):
    store = make(tmp_path)
    for i in range(20_000):
        store.put("kv", h(i), b"")
    (store.path / "not-a-shard").write_bytes(b"ignored")
    (store.path_for("kv", h(0)).parent / "README").write_bytes(b"ignored")
    restarted = make(tmp_path)
    assert restarted.stats().entries == 20_000
    assert restarted.stats().bytes_used == 20_000 * store.header_size
    assert restarted.prefix_run("kv", [h(i) for i in range(100)]) == 100
