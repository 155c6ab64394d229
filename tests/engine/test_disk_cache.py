"""The prefix cache's disk tier end to end (``disk/connector.py``, ``disk/tier.py``): blocks
and recurrent-state checkpoints written at shutdown (close, atexit), on eviction (write-back)
and when computed (write-through), found again by a fresh engine or after memory evicted them,
with greedy tokens identical to an engine without the disk; damaged, foreign and over-budget
files. The store's own rules (file format, LRU, races) are tests/unit/test_disk_store.py's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hyprefix import LLM, SamplingParams
from hyprefix.cache.coordinator import DISK_WAIT
from hyprefix.cache.plan import GIB
from hyprefix.request import Request
from tests.support.compare import random_prompts
from tests.support.models import build_tiny_model
from tests.support.plain_scheduling import kv

MODELS = ("demo-dense-tiny", "demo-hybrid-tiny", "demo-qwen3.5-tiny")
HYBRIDS = ("demo-hybrid-tiny", "demo-qwen3.5-tiny")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 16  # the default block size
PROMPT, OTHER_1, OTHER_2 = random_prompts([300, 300, 300], seed=5)
FULL_BLOCKS = len(PROMPT) // BS  # 18: 288 tokens
REPO = Path(__file__).resolve().parents[2]


def make(model: str, disk: Path | None = None, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(model, dtype=kwargs.pop("dtype", "float32"), enforce_eager=True, log_stats_interval=0,
               disk_cache_dir=None if disk is None else str(disk), **kwargs)


def greedy(llm: LLM, prompt=PROMPT) -> tuple[list[int], int]:
    """(greedy token ids, cached prompt tokens) of one prompt."""
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    llm.check_invariants()
    return out.outputs[0].token_ids, out.num_cached_tokens


def disk_stats(llm: LLM) -> dict[str, int]:
    return {k.removeprefix("disk_cache_"): v for k, v in llm.get_stats().items() if k.startswith("disk_cache_")}


def files(directory: Path, suffix: str = "") -> list[Path]:
    """The block files under ``directory`` (every identity subdirectory), temp files excluded."""
    return sorted(p for p in directory.glob("*/*/*") if p.is_file() and not p.name.startswith(".")
                  and p.name.endswith(suffix))


def block_paths(llm: LLM, prompt=PROMPT, salt: str | None = None) -> list[Path]:
    """The .kv file paths of the prompt's full blocks, in order, in ``llm``'s store."""
    probe = Request("probe", list(prompt), GREEDY, cache_salt=salt)
    hashes = kv(llm.engine.scheduler).update_hashes(probe)
    return [llm.engine.disk.store.path_for("kv", h) for h in hashes]


@pytest.fixture(scope="module")
def reference():
    """model -> greedy tokens of a prompt on an engine without the disk tier (one engine per model)."""
    engines: dict[str, LLM] = {}
    memo: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def tokens(model: str, prompt=PROMPT) -> list[int]:
        key = (model, tuple(prompt))
        if key not in memo:
            if model not in engines:
                engines[model] = make(model)
            engines[model].reset_prefix_cache()
            memo[key] = greedy(engines[model], prompt)[0]
        return memo[key]

    return tokens


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, reference) -> Path:
    """A directory demo-dense-tiny wrote at close after one PROMPT; tests copy it before using it."""
    path = tmp_path_factory.mktemp("dense-disk")
    llm = make("demo-dense-tiny", path)
    assert greedy(llm)[0] == reference("demo-dense-tiny")
    llm.engine.close()
    assert len(files(path, ".kv")) >= FULL_BLOCKS
    return path


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "disk"
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ subprocesses
CHILD = r"""
import json, sys, time
from hyprefix import LLM, SamplingParams
model, directory, prompt, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
llm = LLM(model, dtype="float32", enforce_eager=True, log_stats_interval=0, num_kv_blocks=64,
          disk_cache_dir=directory, disk_cache_write_through=(mode == "kill"))
prompts = prompt if isinstance(prompt[0], list) else [prompt]
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
if mode == "kill":  # wait for the writes queued so far (not close, not atexit: this process gets SIGKILLed)
    llm.engine.disk.tier.flush()
stats = {k: v for k, v in llm.get_stats().items() if k.startswith("disk_cache_")}
print(json.dumps({"tokens": out.outputs[0].token_ids, "stats": stats}), flush=True)
if mode == "kill":
    time.sleep(120)
"""  # mode "exit": returns from the script without closing the engine: only the atexit hook writes


def child(tmp_path: Path, model: str, directory: Path, mode: str, prompts=None,
          name: str = "child") -> tuple[subprocess.Popen, Path]:
    """A process that runs PROMPT (or ``prompts``, reporting the first one's tokens) on an
    engine over ``directory``."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    stderr = tmp_path / f"{name}.stderr"
    proc = subprocess.Popen([sys.executable, str(script), model, str(directory), json.dumps(prompts or PROMPT), mode],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True)
    return proc, stderr


# ------------------------------------------------------------------ 1. restart
@pytest.mark.parametrize("model,first", [("demo-dense-tiny", "atexit"), ("demo-hybrid-tiny", "close"),
                                         ("demo-qwen3.5-tiny", "close")])
def test_restart_hits_what_the_last_process_left(tmp_path, reference, model, first):
    directory = tmp_path / "disk"
    if first == "atexit":  # another process, which never closes its engine: the atexit hook writes
        proc, stderr = child(tmp_path, model, directory, "exit")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.read_text()[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        tokens_a = report["tokens"]
        assert report["stats"]["disk_cache_files"] == 0  # nothing evicted: nothing written before exit
    else:
        llm_a = make(model, directory)
        tokens_a, _ = greedy(llm_a)
        assert disk_stats(llm_a)["files"] == 0
        llm_a.engine.close()
        assert disk_stats(llm_a)["files"] > FULL_BLOCKS - 1
        llm_a.engine.close()  # idempotent
    assert len(files(directory, ".kv")) >= FULL_BLOCKS
    if model in HYBRIDS:
        assert files(directory, ".state") + files(directory, ".statebl"), "no recurrent-state checkpoint written"

    llm_b = make(model, directory)
    tokens_b, cached = greedy(llm_b)
    stats = disk_stats(llm_b)
    assert cached >= 0.9 * len(PROMPT), stats
    assert stats["hit_tokens"] > 0 and stats["loads"] == 1 and stats["refused"] == 0, stats
    assert tokens_b == tokens_a == reference(model)


@pytest.mark.parametrize("model", HYBRIDS)
def test_restart_with_a_block_aligned_prompt(tmp_path, reference, model):
    """A prompt of whole blocks resumes from the checkpoint before its last token (.statebl)."""
    prompt = PROMPT[:FULL_BLOCKS * BS]
    llm_a = make(model, tmp_path)
    tokens_a, _ = greedy(llm_a, prompt)
    llm_a.engine.close()
    assert files(tmp_path, ".statebl")
    llm_b = make(model, tmp_path)
    tokens_b, cached = greedy(llm_b, prompt)
    assert cached == len(prompt) - 1 and disk_stats(llm_b)["hit_tokens"] == len(prompt)
    assert tokens_b == tokens_a == reference(model, prompt)


def test_engine_goes_on_without_the_tier_after_close(tmp_path, dense_dir, reference):
    directory = copy_of(dense_dir, tmp_path)
    llm = make("demo-dense-tiny", directory, num_kv_blocks=24)
    llm.engine.close()
    before = files(directory)
    assert greedy(llm) == (reference("demo-dense-tiny"), 0)  # would load PROMPT's blocks
    for prompt in (OTHER_1, PROMPT):  # would write PROMPT's blocks back as OTHER_1 evicts them
        assert greedy(llm, prompt)[0] == reference("demo-dense-tiny", prompt)
    stats = disk_stats(llm)
    assert stats["loads"] == 0 and stats["bytes_written"] == 0 and files(directory) == before, stats


# ------------------------------------------------------------------ 2. write-back
@pytest.mark.parametrize("model", MODELS)
def test_blocks_evicted_from_memory_come_back_from_disk(tmp_path, reference, model):
    llm = make(model, tmp_path, num_kv_blocks=24)  # one 300-token request at a time
    tokens_a, _ = greedy(llm)
    assert disk_stats(llm)["files"] == 0
    for other in (OTHER_1, OTHER_2):  # evict PROMPT's blocks from memory
        greedy(llm, other)
    llm.engine.disk.tier.flush()  # the writer thread runs at low priority: wait for it
    stats = disk_stats(llm)
    assert stats["files"] >= FULL_BLOCKS and stats["bytes_written"] > 0, stats
    on_disk = {p.name for p in files(tmp_path)}
    assert {p.name for p in block_paths(llm)} <= on_disk  # every full block of PROMPT was written back
    if model in HYBRIDS:
        assert any(name.endswith((".state", ".statebl")) for name in on_disk)  # evicted checkpoints too

    tokens_b, cached = greedy(llm)
    stats = disk_stats(llm)
    assert cached >= 0.9 * len(PROMPT) and stats["hit_tokens"] >= cached - 2 * BS and stats["loads"] == 1, stats
    assert tokens_b == tokens_a == reference(model)


def test_evicted_blocks_not_yet_written_are_found(tmp_path, reference, monkeypatch):
    """A block whose write is still queued (the writer held back here) is found by a load
    as if on disk: eviction never leaves a block in neither place."""
    llm = make("demo-dense-tiny", tmp_path, num_kv_blocks=24)
    gate = threading.Event()
    put = llm.engine.disk.store.put
    monkeypatch.setattr(llm.engine.disk.store, "put", lambda *a, **k: gate.wait(60) and put(*a, **k))
    tokens_a, _ = greedy(llm)
    for other in (OTHER_1, OTHER_2):
        greedy(llm, other)
    assert disk_stats(llm)["files"] == 0  # nothing written yet
    tokens_b, cached = greedy(llm)
    stats = disk_stats(llm)
    assert cached >= 0.9 * len(PROMPT) and stats["loads"] == 1 and stats["bytes_read"] == 0, stats
    assert tokens_b == tokens_a == reference("demo-dense-tiny")
    gate.set()
    llm.engine.disk.tier.flush()
    assert disk_stats(llm)["files"] >= FULL_BLOCKS


@pytest.fixture(scope="module")
def window_models(tmp_path_factory) -> dict[str, str]:
    """Tiny sliding-window models whose window layers keep their K/V in a pool of their own:
    Mistral (every layer a 24-token window: the main pool only indexes) and Gemma 3 (windows
    of 20 beside full-attention layers)."""
    root = tmp_path_factory.mktemp("tiny-window")
    out = {}
    for arch in ("mistral", "gemma3"):
        build_tiny_model(arch, root / arch)
        out[arch] = str(root / arch)
    return out


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_window_pool_blocks_survive_a_restart(tmp_path, reference, window_models, arch):
    """The window pool's blocks are written at close as .swa files and come back after a
    restart, so a window model's hit survives it."""
    model = window_models[arch]
    llm_a = make(model, tmp_path)
    assert llm_a.engine.cache.has_window_pool  # the window layers have their own pool
    tokens_a, _ = greedy(llm_a)
    llm_a.engine.close()
    assert files(tmp_path, ".swa")
    assert bool(files(tmp_path, ".kv")) == (arch == "gemma3")  # Mistral's main pool holds no K/V

    llm_b = make(model, tmp_path)
    tokens_b, cached = greedy(llm_b)
    stats = disk_stats(llm_b)
    assert cached >= 0.9 * len(PROMPT) and stats["loads"] == 1 and stats["refused"] == 0, stats
    assert tokens_b == tokens_a == reference(model)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_window_blocks_evicted_from_memory_come_back_from_disk(tmp_path, reference, window_models, arch):
    """The window pool is small: other prompts evict PROMPT's window blocks, which are
    written back then and read again for the next PROMPT."""
    model = window_models[arch]
    # 64-token chunks: the window pool is 20 blocks (0.8 x 24), not the 132 a 2048-token chunk needs
    llm = make(model, tmp_path, num_kv_blocks=24, max_num_batched_tokens=64)
    assert llm.engine.cache.kinds[-1].pool.num_blocks == 20
    tokens_a, _ = greedy(llm)
    for other in (OTHER_1, OTHER_2):
        assert greedy(llm, other)[0] == reference(model, other)
    llm.engine.disk.tier.flush()
    assert files(tmp_path, ".swa"), disk_stats(llm)
    tokens_b, cached = greedy(llm)
    stats = disk_stats(llm)
    assert cached >= 0.9 * len(PROMPT) and stats["loads"] == 1, stats
    assert tokens_b == tokens_a == reference(model)


def test_damaged_window_block_shortens_the_hit(tmp_path, reference, window_models):
    """A damaged .swa file is refused; the request plans a second load and resumes at the
    furthest position whose window does not need it."""
    model = window_models["gemma3"]
    llm_a = make(model, tmp_path)
    greedy(llm_a)
    llm_a.engine.close()
    llm_b = make(model, tmp_path)
    probe = Request("probe", list(PROMPT), GREEDY)
    hashes = kv(llm_b.engine.scheduler).update_hashes(probe)
    bad = FULL_BLOCKS - 2  # in the window of a hit at 288 (blocks 16 and 17) and at 272
    _flip(llm_b.engine.disk.store.path_for("swa", hashes[bad]))
    tokens, cached = greedy(llm_b)
    stats = disk_stats(llm_b)
    assert stats["refused"] == 1 and stats["loads"] == 2, stats
    assert cached == bad * BS  # its window: blocks 14 and 15
    assert tokens == reference(model)


# ------------------------------------------------------------------ 3. damaged files
def _flip(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "copied"])
def test_damaged_files_are_refused_and_the_hit_stops_before_them(tmp_path, dense_dir, reference, damage):
    directory = copy_of(dense_dir, tmp_path)
    model = "demo-dense-tiny"
    llm = make(model, directory)
    paths = block_paths(llm)
    assert all(p.exists() for p in paths[:FULL_BLOCKS])
    first_bad = {"flipped": 5, "truncated": 3, "copied": 4}[damage]
    if damage == "flipped":  # payload bytes of two blocks: only the first is read
        _flip(paths[5])
        _flip(paths[9], offset_from_end=3000)
    elif damage == "truncated":
        paths[3].write_bytes(paths[3].read_bytes()[:-7])
    else:  # another block's (valid) file under this block's name
        shutil.copyfile(paths[12], paths[4])
    reason = {"flipped": "payload_crc", "truncated": "length", "copied": "key"}[damage]

    tokens, cached = greedy(llm)
    stats = disk_stats(llm)
    assert stats["refused"] == 1 and llm.engine.disk.store.stats().refused == {reason: 1}, stats
    assert not paths[first_bad].exists()  # a refused file is deleted
    assert cached == first_bad * BS and stats["hit_tokens"] == first_bad * BS, stats
    assert tokens == reference(model)

    if damage == "flipped":
        # The second damaged block was never read (the load stopped before it): the file is still
        # there, and on disk, so the close below does not rewrite it; the next engine refuses it.
        assert paths[9].exists()
        llm.engine.close()
        assert paths[5].exists()  # rewritten from memory at close
        llm2 = make(model, directory)
        tokens2, cached2 = greedy(llm2)
        assert disk_stats(llm2)["refused"] == 1 and not paths[9].exists()
        assert cached2 == 9 * BS and tokens2 == reference(model)


@pytest.mark.parametrize("model", HYBRIDS)
def test_damaged_checkpoints_are_refused(tmp_path, reference, model):
    llm_a = make(model, tmp_path)
    greedy(llm_a)
    llm_a.engine.close()
    states = files(tmp_path, ".state") + files(tmp_path, ".statebl")
    assert states
    for path in states:
        _flip(path)
    llm_b = make(model, tmp_path)
    tokens, cached = greedy(llm_b)
    stats = disk_stats(llm_b)
    assert stats["refused"] >= 1 and set(llm_b.engine.disk.store.stats().refused) == {"payload_crc"}, stats
    assert cached < FULL_BLOCKS * BS  # no checkpoint to resume from at the end of the hit
    assert sum(not p.exists() for p in states) == stats["refused"]
    assert tokens == reference(model)


# ------------------------------------------------------------------ 4. identity
def test_another_layout_does_not_see_the_files(tmp_path, dense_dir):
    directory = copy_of(dense_dir, tmp_path)
    before = files(directory)
    llm = make("demo-dense-tiny", directory, dtype="bfloat16")
    tokens, cached = greedy(llm)
    stats = disk_stats(llm)
    assert cached == 0 and stats["hit_tokens"] == 0 and stats["loads"] == 0 and stats["files"] == 0, stats
    llm.engine.close()
    subdirs = [p for p in directory.iterdir() if p.is_dir()]
    assert len(subdirs) == 2  # one per layout, side by side
    assert set(before) <= set(files(directory))  # the float32 files untouched
    # and bfloat16 payloads come back as they were written
    again = make("demo-dense-tiny", directory, dtype="bfloat16")
    assert greedy(again) == (tokens, FULL_BLOCKS * BS) and disk_stats(again)["hit_tokens"] == FULL_BLOCKS * BS


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_blocks_keep_to_their_format_on_disk(tmp_path, dense_dir, kv_cache_dtype):
    """An 8-bit cache's blocks (codes and scales, as stored) go to disk and come back with the same
    tokens; the float32 files of the same model beside them are never read as 8-bit, nor the
    8-bit ones as another 8-bit format."""
    directory = copy_of(dense_dir, tmp_path)
    llm_a = make("demo-dense-tiny", directory, kv_cache_dtype=kv_cache_dtype)
    tokens_a, cached = greedy(llm_a)
    assert cached == 0 and disk_stats(llm_a)["hit_tokens"] == 0
    llm_a.engine.close()
    llm_b = make("demo-dense-tiny", directory, kv_cache_dtype=kv_cache_dtype)
    assert greedy(llm_b) == (tokens_a, FULL_BLOCKS * BS)
    assert disk_stats(llm_b)["hit_tokens"] == FULL_BLOCKS * BS and disk_stats(llm_b)["refused"] == 0
    other = "fp8_e4m3" if kv_cache_dtype == "int8" else "int8"
    assert greedy(make("demo-dense-tiny", directory, kv_cache_dtype=other))[1] == 0


def test_another_model_does_not_see_the_files(tmp_path, dense_dir):
    directory = copy_of(dense_dir, tmp_path)
    llm = make("demo-hybrid-tiny", directory)
    _, cached = greedy(llm)
    stats = disk_stats(llm)
    assert cached == 0 and stats["hit_tokens"] == 0 and stats["loads"] == 0 and stats["files"] == 0, stats


def test_another_tenant_does_not_see_the_files(tmp_path, dense_dir, reference):
    directory = copy_of(dense_dir, tmp_path)
    llm = make("demo-dense-tiny", directory)
    salted = {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}
    tokens, cached = greedy(llm, salted)
    stats = disk_stats(llm)
    assert cached == 0 and stats["hit_tokens"] == 0 and stats["loads"] == 0, stats
    assert tokens == reference("demo-dense-tiny")
    # The same directory serves the unsalted tenant (the files were fine), and the salted blocks
    # written at close are another tenant's files.
    tokens, cached = greedy(llm)
    assert cached == FULL_BLOCKS * BS and disk_stats(llm)["hit_tokens"] == cached
    llm.engine.close()
    salted_paths = block_paths(llm, salt="tenant-b")
    assert all(p.exists() for p in salted_paths)
    assert not {p.name for p in salted_paths} & {p.name for p in block_paths(llm)}


def test_two_engines_write_one_directory_at_once(tmp_path, reference):
    """Two processes on one directory, running at once: both compute PROMPT (the same file
    names raced) and one also OTHER_1; both write at exit. A third engine hits all of it."""
    model = "demo-hybrid-tiny"
    directory = tmp_path / "disk"
    procs = [child(tmp_path, model, directory, "exit", name="a"),
             child(tmp_path, model, directory, "exit", prompts=[PROMPT, OTHER_1], name="b")]
    reports = []
    for proc, stderr in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr.read_text()[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert not list(directory.glob("*/*/.tmp-*"))
    llm = make(model, directory)
    for prompt in (PROMPT, OTHER_1):
        tokens, cached = greedy(llm, prompt)
        assert cached >= 0.9 * len(prompt) and tokens == reference(model, prompt), disk_stats(llm)
    assert disk_stats(llm)["refused"] == 0 and disk_stats(llm)["loads"] == 2
    assert reports[0]["tokens"] == reports[1]["tokens"] == reference(model)


# ------------------------------------------------------------------ 5. write-through
@pytest.mark.parametrize("model", MODELS)
def test_write_through_writes_before_close(tmp_path, reference, model):
    llm = make(model, tmp_path, disk_cache_write_through=True)
    tokens, _ = greedy(llm)
    llm.engine.disk.tier.flush()  # the writes queued so far: writes run on the writer thread
    stats = disk_stats(llm)
    assert stats["files"] >= FULL_BLOCKS and stats["evictions"] == 0, stats
    assert all(p.exists() for p in block_paths(llm)[:FULL_BLOCKS])
    if model in HYBRIDS:
        assert files(tmp_path, ".state") + files(tmp_path, ".statebl")
    assert tokens == reference(model)


def test_write_through_survives_sigkill(tmp_path, reference):
    model = "demo-hybrid-tiny"
    directory = tmp_path / "disk"
    proc, stderr = child(tmp_path, model, directory, "kill")
    guard = threading.Timer(120, proc.kill)  # a child that never reports must not hang the test
    guard.start()
    try:
        line = proc.stdout.readline()
        assert line, stderr.read_text()[-3000:]
        report = json.loads(line)
        assert report["stats"]["disk_cache_files"] >= FULL_BLOCKS, report
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert not [p for p in directory.glob("*/*/.tmp-*")]  # no write was under way: no temp file left

    llm = make(model, directory)
    tokens, cached = greedy(llm)
    stats = disk_stats(llm)
    assert cached >= 0.9 * len(PROMPT) and stats["hit_tokens"] > 0 and stats["refused"] == 0, stats
    assert tokens == report["tokens"] == reference(model)


# ------------------------------------------------------------------ 6. budget
def test_budget_is_kept_by_evicting_files(tmp_path, reference):
    probe = make("demo-dense-tiny", tmp_path / "probe")
    file_size = probe.engine.disk.store.header_size + probe.engine.disk.io.kv_block_bytes
    budget_gb = 6.5 * file_size / GIB  # six files
    budget = int(budget_gb * GIB)

    llm = make("demo-dense-tiny", tmp_path / "disk", num_kv_blocks=24, disk_cache_gb=budget_gb)
    assert greedy(llm)[0] == reference("demo-dense-tiny")
    for other in (OTHER_1, OTHER_2):  # write-back of more than six blocks
        greedy(llm, other)
        stats = disk_stats(llm)
        assert 0 < stats["bytes_used"] <= budget and stats["files"] <= 6, stats
    llm.engine.close()
    stats = disk_stats(llm)
    assert stats["evictions"] > 0 and 0 < stats["bytes_used"] <= budget and stats["files"] == 6, stats
    on_disk = files(tmp_path / "disk")
    assert len(on_disk) == 6 and sum(p.stat().st_size for p in on_disk) == stats["bytes_used"]

    # A restart with a smaller budget evicts down to it.
    smaller = make("demo-dense-tiny", tmp_path / "disk", disk_cache_gb=3.5 * file_size / GIB)
    stats = disk_stats(smaller)
    assert stats["files"] == 3 and stats["evictions"] == 3 and len(files(tmp_path / "disk")) == 3, stats


# ------------------------------------------------------------------ 7. abort while loading
def test_abort_while_waiting_for_disk(tmp_path, dense_dir, reference):
    directory = copy_of(dense_dir, tmp_path)
    llm = make("demo-dense-tiny", directory)
    engine = llm.engine
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()  # starts the load; the request waits for it
    waiting = [r for r in engine.scheduler.requests.values() if r.waiting_on == DISK_WAIT]
    assert len(waiting) == 1 and disk_stats(llm)["loads"] == 1
    assert engine.abort("a")
    engine.check_invariants()
    for _ in range(3):  # the finished read is dropped, nothing imported
        engine.step()
        engine.check_invariants()
    assert not engine.has_unfinished() and disk_stats(llm)["hit_tokens"] == 0
    assert engine.get_stats()["kv_blocks_cached"] == 0

    # Two requests for the same prompt now: one load each; the second imports nothing new.
    outs = llm.generate([PROMPT, {"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    llm.check_invariants()
    assert [o.outputs[0].token_ids for o in outs] == [reference("demo-dense-tiny")] * 2
    assert [o.num_cached_tokens for o in outs] == [FULL_BLOCKS * BS] * 2
    assert disk_stats(llm)["hit_tokens"] == FULL_BLOCKS * BS


def _gate_copies(monkeypatch, disk) -> tuple[threading.Event, set[str]]:
    """Hold the disk tier's import copies until the returned event is set; the set collects
    the names of the threads that ran them."""
    gate, threads = threading.Event(), set()
    copy = disk._copy

    def gated_copy(job):
        threads.add(threading.current_thread().name)
        assert gate.wait(60)
        copy(job)

    monkeypatch.setattr(disk, "_copy", gated_copy)
    return gate, threads


def _step_until_importing(engine, tokens: dict[str, list[int]]) -> None:
    for _ in range(200):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
        if engine.disk._imports:
            return
    raise AssertionError("no import started")


@pytest.mark.parametrize("model", ["demo-dense-tiny", "demo-hybrid-tiny"])
def test_restore_copies_beside_the_steps(tmp_path, reference, model, monkeypatch):
    """A load's bytes go into memory on the copier thread while steps go on: the request
    waits (its blocks, its prefix and a checkpoint slot held, invariants intact) and another
    request decodes and allocates; once the copy is done a step publishes the blocks and the
    request hits them."""
    writer = make(model, tmp_path)
    greedy(writer)
    writer.engine.close()
    llm = make(model, tmp_path)
    engine = llm.engine
    gate, threads = _gate_copies(monkeypatch, engine.disk)
    engine.add_request("other", OTHER_1, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("a", PROMPT, GREEDY)
    tokens: dict[str, list[int]] = {"other": [], "a": []}
    _step_until_importing(engine, tokens)
    before = len(tokens["other"])
    for _ in range(5):  # the other request decodes while the copy waits
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        engine.check_invariants()
    assert len(tokens["other"]) > before and not tokens["a"]
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            if out.request_id == "a" and out.finished:
                assert out.num_cached_tokens >= 0.9 * len(PROMPT)
        engine.check_invariants()
    assert threads == {next(iter(threads))} and "hyprefix-disk-import" in next(iter(threads))
    assert tokens["a"] == reference(model)
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_weight_update_during_a_copy_lets_the_import_go(tmp_path, dense_dir, monkeypatch):
    """A weight update while an import is being copied: the copy's blocks (the old weights'
    K/V) are let go unpublished, the waiting request recomputes under the new weights, and
    nothing is leaked."""
    directory = copy_of(dense_dir, tmp_path)
    llm = make("demo-dense-tiny", directory)
    engine = llm.engine
    gate, _ = _gate_copies(monkeypatch, engine.disk)
    engine.add_request("a", PROMPT, GREEDY)
    tokens: dict[str, list[int]] = {"a": []}
    _step_until_importing(engine, tokens)
    threading.Timer(0.5, gate.set).start()
    new_weights = scaled_weights(1.25)
    llm.update_weights(new_weights)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            if out.finished:
                assert out.num_cached_tokens == 0
        engine.check_invariants()
    assert engine.get_stats()["kv_blocks_used"] == 0 and not engine.disk._imports
    no_disk = make("demo-dense-tiny")
    no_disk.update_weights(new_weights)
    assert tokens["a"] == greedy(no_disk)[0]


@pytest.mark.parametrize("model", ["demo-dense-tiny", "demo-hybrid-tiny"])
def test_loads_under_preemption_and_eviction(tmp_path, model):
    """Shared prefixes in a pool too small for the batch: requests wait on loads while others
    are preempted and evict each other's blocks; two engines in a row on one directory."""
    bases = random_prompts([120, 200], seed=3)
    tails = random_prompts([5 + 7 * i % 40 for i in range(12)], seed=4)
    prompts = [bases[i % 2][: 40 + 23 * i % 160] + tails[i] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in
                make(model, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)]
    for run in range(2):
        llm = make(model, tmp_path, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=96)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.check_invariants()
        assert [o.outputs[0].token_ids for o in outs] == expected, f"run {run}"
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0 and stats["disk_cache_files"] > 0
        if run:
            assert stats["disk_cache_loads"] > 0 and stats["disk_cache_hit_tokens"] > 0
        llm.engine.close()


# ------------------------------------------------------------------ weight updates
def scaled_weights(factor: float) -> list[tuple[str, object]]:
    """demo-dense-tiny's checkpoint tensors, matrices scaled by ``factor``: other weights."""
    from safetensors.torch import load_file

    from hyprefix.demo import demo_model_path

    tensors = load_file(str(demo_model_path("dense") / "model.safetensors"))
    return [(name, t * factor if t.dim() == 2 else t) for name, t in tensors.items()]


def test_weight_update_turns_the_disk_off(tmp_path):
    """After an in-place update the hash root (checkpoint, version, update number) names the
    weights in this process only: a restart that updates to other weights under the same
    default version must not hit the first process's files."""
    model, directory = "demo-dense-tiny", tmp_path / "disk"
    llm_a = make(model, directory)
    llm_a.update_weights(scaled_weights(1.25))  # version "1"
    greedy(llm_a)
    llm_a.engine.close()

    other = scaled_weights(0.8)
    llm_b = make(model, directory)
    llm_b.update_weights(other)  # version "1" too
    tokens, cached = greedy(llm_b)
    stats = disk_stats(llm_b)
    assert cached == 0 and stats["hit_tokens"] == 0 and stats["loads"] == 0, stats
    no_disk = make(model)
    no_disk.update_weights(other)
    assert tokens == greedy(no_disk)[0]


def test_request_in_flight_across_a_weight_update_writes_nothing(tmp_path, reference):
    """A request that goes on across an update computes its later blocks with the new weights
    under its old (the checkpoint's) hashes: they must not reach a later process that runs
    the checkpoint as it is."""
    model, directory = "demo-dense-tiny", tmp_path / "disk"
    llm = make(model, directory, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()  # 64 of its 300 prompt tokens under the old weights
    llm.update_weights(scaled_weights(1.25))
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    engine.close()

    fresh = make(model, directory)
    tokens, cached = greedy(fresh)
    assert cached <= 64 and tokens == reference(model), disk_stats(fresh)


# ------------------------------------------------------------------ 8. config errors
def test_config_errors(tmp_path):
    directory = tmp_path / "never-made"
    with pytest.raises(ValueError, match="prefix caching"):
        make("demo-dense-tiny", directory, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="needs disk_cache_dir"):
        make("demo-dense-tiny", disk_cache_write_through=True)
    with pytest.raises(ValueError, match="disk_cache_gb"):
        make("demo-dense-tiny", directory, disk_cache_gb=0)
    assert not directory.exists()
    assert not os.listdir(tmp_path)


def test_block_io_round_trip_with_payload_parts_off_their_alignment():
    """A bf16 conv state of an odd width puts the float32 matrix after it at an offset that is
    not a multiple of 4: writing a payload back must not depend on that alignment."""
    import torch

    from hyprefix.disk.block_io import BlockIO
    from hyprefix.models.recurrent_state import LayerStateShape, RecurrentLayerState

    gen = torch.Generator().manual_seed(0)
    kv = [(torch.randn(4, 2, 1, 3, generator=gen).bfloat16(), torch.randn(4, 2, 1, 3, generator=gen).bfloat16())]
    states = [RecurrentLayerState.allocate(LayerStateShape(3, 1, (2, 3)), 1, 3, torch.bfloat16, torch.device("cpu"))]
    states[0].ckpt_conv.copy_(torch.randn(3, 3, 1, generator=gen))
    states[0].ckpt_matrix.copy_(torch.randn(3, 2, 3, generator=gen))
    io = BlockIO(kv, [0], states, block_size=2)
    kv_payload, state_payload = io.read_kv(1), io.read_state(2)
    assert len(kv_payload) == io.kv_block_bytes and len(state_payload) == io.state_bytes
    io.write_kv(3, kv_payload)
    io.write_state(0, state_payload)
    assert torch.equal(kv[0][0][3], kv[0][0][1]) and torch.equal(kv[0][1][3], kv[0][1][1])
    assert torch.equal(states[0].ckpt_conv[0], states[0].ckpt_conv[2])
    assert torch.equal(states[0].ckpt_matrix[0], states[0].ckpt_matrix[2])
