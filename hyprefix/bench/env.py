"""Facts about the machine a benchmark runs on: libraries, CPU use of other processes,
memory, and the matmul peak in the run's dtype."""

from __future__ import annotations

import datetime as dt
import importlib
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any


def require(module: str) -> Any:
    """Import a library of the ``bench`` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"hyprefix bench needs {module}, which is not installed: "
                          "pip install 'hyprefix[bench]'") from exc


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import hyprefix
    from hyprefix.hardware import device_caps

    caps = device_caps("cpu")
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "hostname": platform.node(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "hyprefix": hyprefix.__version__, "cpu_model": caps.name, "cpu_kind": caps.kind(),
            "device_caps": caps.to_dict(), "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
            "torch_num_threads": torch.get_num_threads(), "load_average_at_start": load_average()}


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes spent busy since boot (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """How much CPU *other* processes used while the benchmark ran: machine-wide busy
    time minus this process's own CPU time. ``other_cores_avg`` near 0 means a quiet
    machine; near the core count means the arms were sharing the CPU. /proc/stat counts
    in clock ticks (10 ms), so spans shorter than ``min_seconds`` report None."""

    min_seconds = 0.5

    def __init__(self) -> None:
        self._t0 = self._own0 = 0.0
        self._busy0: float | None = None

    def start(self) -> None:
        self._t0, self._busy0 = time.perf_counter(), _busy_cpu_seconds()
        t = os.times()
        self._own0 = t.user + t.system

    def stop(self) -> dict[str, float | None]:
        wall = time.perf_counter() - self._t0
        t = os.times()
        own = t.user + t.system - self._own0
        busy1 = _busy_cpu_seconds()
        other = None if busy1 is None or self._busy0 is None else max(0.0, busy1 - self._busy0 - own)
        return {"wall_seconds": round(wall, 2), "own_cpu_seconds": round(own, 2),
                "other_cpu_seconds": None if other is None else round(other, 2),
                "other_cores_avg": None if other is None or wall < self.min_seconds else round(other / wall, 2)}


def rss_bytes() -> int | None:
    """Resident memory of this process now (from /proc/self/statm)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


class RssPeak:
    """Peak resident memory of this process during a run, sampled every ``interval`` seconds
    by a thread (every arm lives in this process, so the growth over the start is what the
    run itself needed: KV caches, activations)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-peak", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes() or 0)

    def start(self) -> None:
        self.start_bytes = self.peak = rss_bytes() or 0
        self._thread.start()

    def stop(self) -> dict[str, float | None]:
        self._stop.set()
        self._thread.join()
        ok = self.start_bytes > 0
        return {"rss_start_gib": round(self.start_bytes / 2**30, 3) if ok else None,
                "rss_peak_gib": round(max(self.peak, rss_bytes() or 0) / 2**30, 3) if ok else None}


READ_BYTES = 512 * 2**20


def measure_read_rates(runs: int = 12, warmup: int = 2, nbytes: int = READ_BYTES) -> list[float]:
    """Memory read rates (GB/s, 1e9 bytes) with this process's torch threads: ``sum`` over a
    float32 tensor far larger than the caches, once per run. A decode step streams every
    weight once, so weight bytes over this rate is its floor."""
    import torch

    x = torch.ones(nbytes // 4)
    for _ in range(warmup):
        x.sum()
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        x.sum()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return rates


def read_rate_now(runs: int = 5) -> float:
    """The median of a few ``measure_read_rates`` samples (~0.1 s): the rate of this moment."""
    rates = sorted(measure_read_rates(runs=runs, warmup=1))
    return rates[len(rates) // 2]


def read_bandwidth(rates: list[float]) -> dict[str, Any]:
    """Best and median of ``measure_read_rates`` samples (several calls' worth may be pooled)."""
    import torch

    rates = sorted(rates)
    return {"bytes": READ_BYTES, "runs": len(rates), "gb_per_s": rates[-1], "median_gb_per_s": rates[len(rates) // 2],
            "rates_gb_per_s": rates, "threads": torch.get_num_threads()}


def measure_matmul_peak(dtype: Any, m: int = 2048, k: int = 2048, n: int = 8192, runs: int = 6,
                        warmup: int = 2, seed: int = 0) -> dict[str, Any]:
    """Best-of-``runs`` GFLOP/s of ``linear(x[m, k], w[n, k])`` (2·m·k·n FLOPs a call) through
    ``torch.nn.functional.linear`` and, where the engine prepacks weights of ``dtype``
    (``DeviceCaps.prepack``), the prepacked oneDNN linear: ``gflops`` is the best of them (a
    practical ceiling for this CPU, threads and torch build), ``path`` the engine's path."""
    import torch

    from hyprefix.hardware import device_caps
    from hyprefix.models.linear_methods import packed_linear
    from hyprefix.models.weights import pack_weight

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    paths = {"plain": lambda: torch.nn.functional.linear(x, w)}
    if device_caps(x.device).prepack(dtype):
        packed = pack_weight(w)
        paths["prepacked"] = lambda: packed_linear(x, packed, None)
    best: dict[str, float] = {}
    with torch.inference_mode():
        for name, fn in paths.items():
            for _ in range(warmup):
                fn()
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    by_path = {name: 2.0 * m * k * n / seconds / 1e9 for name, seconds in best.items()}
    return {"dtype": str(dtype).replace("torch.", ""), "m": m, "k": k, "n": n, "runs": runs, "path": list(paths)[-1],
            "gflops": max(by_path.values()), "gflops_by_path": by_path}
