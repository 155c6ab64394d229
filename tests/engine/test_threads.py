"""An engine built on one thread and stepped on another runs as fast as one that stays on a
single thread: its decode steps take the same fast path (counted, never timed), and no
thread that is done with the engine keeps OpenMP workers (``hyprefix/openmp.py``: two pools
throttle every worker's spin-wait, so each barrier of a step sleeps in the kernel)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.async_engine import AsyncEngine
from hyprefix.config import EngineArgs
from hyprefix.engine import Engine
from hyprefix.kernels import decode_layers
from hyprefix.openmp import _loaded_libgomp, release_workers

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
PR_SET_NAME = 15

needs_libgomp = pytest.mark.skipif(_loaded_libgomp() is None, reason="torch runs no GNU OpenMP runtime here")


def _named_threads(name: str) -> int:
    """Threads of this process whose OS name is ``name`` (a thread's new threads inherit it)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # it exited meanwhile
            count += (task / "comm").read_text().strip() == name
    return count


def _in_named_thread(name: str, fn: Callable[[], object]) -> object:
    """Run ``fn`` on a new thread whose OS name is ``name``; return its result or raise its error."""
    box: dict[str, object] = {}

    def run() -> None:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode(), 0, 0, 0)
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _parallel_work() -> None:
    torch.ones(1 << 22).mul_(2).sum()  # large enough for ATen's parallel_for to use every thread


@needs_libgomp
def test_threads_done_with_an_engine_leave_no_openmp_workers(tiny_models):
    """Workers a thread starts carry its name: after ``Engine(...)`` / ``LLM(...)`` and after
    ``generate`` returns, none is left; parallel work on the same thread starts them again
    (so the count does see a pool)."""
    path, _ = tiny_models["llama"]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    name = "hpx-omp-check"
    try:
        def check() -> list[int]:
            counts = []
            _parallel_work()
            counts.append(_named_threads(name) - 1)  # workers of this thread's pool (the thread itself is one)
            assert release_workers()
            counts.append(_named_threads(name) - 1)
            llm = LLM(str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True)
            counts.append(_named_threads(name) - 1)
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            counts.append(_named_threads(name) - 1)
            _parallel_work()
            counts.append(_named_threads(name) - 1)
            return counts

        assert _in_named_thread(name, check) == [1, 0, 0, 0, 1]
    finally:
        torch.set_num_threads(threads)


def _fast_path_engine(path: Path, fast: str) -> Engine:
    kwargs = {"quantization": "int8", "enforce_eager": True} if fast == "kernel" else {}
    return Engine(EngineArgs(model=str(path), dtype="float32", num_kv_blocks=64, log_stats_interval=0, **kwargs))


@pytest.mark.parametrize("fast", ["kernel", "graph"])
def test_decode_steps_on_the_engine_thread_take_the_fast_path(tiny_models, fast):
    """Built on this thread, stepped on the server's engine thread: every decode step runs the
    model's one-call kernel (int8) or the compiled decode graph (float32), as offline."""
    if fast == "kernel" and not decode_layers.available():
        pytest.skip("the decode_layers kernel does not run here")
    path, _ = tiny_models["llama"]
    engine = _fast_path_engine(path, fast)
    engine.warmup()
    before = dict(engine.runner.decode_steps)

    async def serve() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            for i, prompt in enumerate(PROMPTS):  # one at a time: batch-1 decode steps
                stream = ae.open_stream()
                await ae.add(stream, [f"r{i}"], lambda eng, i=i, prompt=prompt: eng.add_request(f"r{i}", prompt,
                                                                                                  GREEDY))
                async for _ in stream:
                    pass
        finally:
            ae.shutdown()

    asyncio.run(serve())
    steps = {path: engine.runner.decode_steps[path] - before[path] for path in before}
    assert steps[fast] == len(PROMPTS) * (GREEDY.max_tokens - 1), steps
    assert sum(steps.values()) == steps[fast]
    assert engine.get_stats()[f"decode_steps_{fast}"] == engine.runner.decode_steps[fast]


def test_decode_steps_are_counted_by_path(tiny_models):
    """An eager engine counts its decode steps as eager, and prefill steps not at all."""
    path, _ = tiny_models["llama"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True, log_stats_interval=0)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["decode_steps_eager"] == GREEDY.max_tokens - 1  # both prompts decode together
    assert stats["decode_steps_kernel"] == stats["decode_steps_graph"] == 0


def test_release_workers_is_safe_anywhere():
    """On any thread, with or without a pool, any number of times."""
    supported = release_workers()
    assert release_workers() == supported
    assert _in_named_thread("hpx-omp-safe", release_workers) == supported
    assert supported == (_loaded_libgomp() is not None and os.uname().sysname == "Linux")
