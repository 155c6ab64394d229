"""Builds every kernel this CPU runs ahead of time, several at once (``hyprefix build-kernels``).

A kernel is otherwise compiled the first time a process needs it: a first start on a new
machine waits for each build in turn, on the request path. Built here, each in a process of
its own (a compiler runs one thread, so ``jobs`` builds use ``jobs`` cores), they land in
torch's extension cache and every later process only loads them. ``make install`` runs this.

Each build reports one of: built (or loaded from the cache), not for this CPU (its
``DeviceCaps`` field is off, nothing was compiled), or failed (the compiler's error line).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


def _builders() -> dict[str, Callable[[], object]]:
    """Kernel -> the call that builds and loads it in this process (its ``available``).
    Kernels others build on (int8_linear, decode_attention) come first, so their dependents
    find them built or being built (torch's build lock makes a second builder wait)."""
    import torch

    from hyprefix.kernels import (
        bf16_linear,
        decay_scores,
        decode_attention,
        decode_layers,
        int8_linear,
        invariant_linear,
        kv_write,
        packed_linear,
        prefill_attention,
        quant_linear,
        recurrent_decode,
    )

    return {
        "int8_linear": int8_linear.available,
        "decode_attention": lambda: decode_attention.available(torch.float32),
        "prefill_attention": lambda: prefill_attention.available(torch.float32),
        "bf16_linear": bf16_linear.available,
        "invariant_linear": invariant_linear.available,
        "packed_linear": packed_linear.available,
        "quant_linear": quant_linear.available,
        "decode_layers": decode_layers.available,
        "recurrent_decode": recurrent_decode.available,
        "decay_scores": decay_scores.available,
        "kv_write": kv_write.available,
    }


@dataclass
class BuildResult:
    kernel: str
    builds: dict[str, bool]  # build name -> built and loaded (this kernel's and the ones it needs)
    seconds: float
    error: str = ""  # the child's last output lines where it did not report

    @property
    def ok(self) -> bool:
        return not self.error and all(self.builds.values())

    def describe(self) -> str:
        if self.error:
            return f"{self.kernel}: FAILED ({self.error})"
        if not self.builds:
            return f"{self.kernel}: not for this CPU"
        failed = [name for name, ok in self.builds.items() if not ok]
        state = f"FAILED ({', '.join(failed)}; the warning above names the error)" if failed else "ok"
        return f"{self.kernel}: {state} [{', '.join(self.builds)}] {self.seconds:.1f}s"


def build_here(kernel: str) -> dict[str, bool]:
    """Build (or load) ``kernel`` in this process: build name -> success, empty where this CPU
    does not run it."""
    from hyprefix.kernels import build

    _builders()[kernel]()
    return dict(build.ATTEMPTS)


def _build_in_child(kernel: str) -> BuildResult:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hyprefix.kernels.prebuild", kernel],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return BuildResult(kernel, {}, seconds, error=" | ".join(tail) or f"exit status {proc.returncode}")
    if proc.stderr.strip():  # the build's warning, for the user to read
        print(proc.stderr.strip(), file=sys.stderr)
    return BuildResult(kernel, json.loads(lines[-1]), seconds)


def kernel_names() -> tuple[str, ...]:
    """Every kernel ``build_kernels`` builds, in its order."""
    return tuple(_builders())


def build_kernels(jobs: int, kernels: tuple[str, ...] | None = None,
                  report: Callable[[BuildResult], None] | None = None) -> list[BuildResult]:
    """Build ``kernels`` (default: every one) in ``jobs`` child processes at a time; ``report``
    hears each as it ends."""
    def one(kernel: str) -> BuildResult:
        result = _build_in_child(kernel)
        if report is not None:
            report(result)
        return result

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, kernels or kernel_names()))


if __name__ == "__main__":  # the child of ``_build_in_child``: its builds as one JSON line
    print(json.dumps(build_here(sys.argv[1])))
