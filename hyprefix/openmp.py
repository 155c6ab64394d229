"""The OpenMP runtime's worker threads: one pool per thread that runs parallel work, and
how a thread gives its pool back.

Why it matters. PyTorch's Linux wheels run their parallel CPU work (ATen's ``parallel_for``,
oneDNN, MKL) and our kernels' ``#pragma omp parallel`` on GNU OpenMP (libgomp). libgomp
gives every native thread that starts a parallel region a pool of its own workers, kept
until that thread exits. Between regions (and at every barrier inside one) a worker
busy-waits for a while before it sleeps in the kernel, but only while the threads libgomp
manages over *all* pools number no more than the CPUs; past that it spins for a tiny
fraction of that time and then sleeps, so each barrier pays a futex wake-up. An engine
loaded and warmed up on one thread (a server's main thread, a Ray actor's constructor, a
user's ``LLM(...)``) and stepped on another (the server's engine thread, a user's worker
thread) had two pools, twice the CPUs in threads, and every decode step's barriers slept.

The contract that keeps one pool alive: a thread that is done driving an engine (it built
one, or ``LLM.generate`` returned) calls ``release_workers()``. The next thread to step the
engine creates its pool on its first parallel region, at the cost of starting the workers
again. ``tests/engine/test_threads.py`` checks that the thread that builds an engine, or runs
``LLM.generate``, leaves no workers behind.

libgomp 9 and later (and the one torch ships) implement OpenMP 5.0's
``omp_pause_resource_all``, which stops the calling thread's pool. Other runtimes (LLVM's
libomp, Intel's libiomp5) or none at all: ``release_workers`` does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger("hyprefix")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: stop the threads, keep what is cheap to keep


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp this process has loaded (torch's), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import torch  # noqa: F401  (loads torch's OpenMP runtime, whose copy must be the one paused)

    path = _loaded_libgomp()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all  # the loaded copy: dlopen of a mapped file
    except (OSError, AttributeError):
        log.debug("%s has no omp_pause_resource_all; OpenMP worker pools stay with their threads", path)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def _loaded_libgomp() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libgomp"):
                    return path
    except OSError:
        pass
    return None


def release_workers() -> bool:
    """Stop the OpenMP worker pool of the calling thread, if it has one. Call from a thread
    that is done driving an engine, never from inside a parallel region. Returns whether the
    runtime supports it (True even when this thread had no pool)."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
