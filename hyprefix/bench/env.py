"""Facts about the machine and libraries a benchmark ran on, for its JSON record."""

from __future__ import annotations

import datetime as dt
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any


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


def max_rss_gib() -> float | None:
    """Peak resident memory of this process so far (all arms together), GiB."""
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # ru_maxrss is KiB on Linux
    except (ImportError, OSError):
        return None


def environment() -> dict[str, Any]:
    import torch
    import transformers

    import hyprefix
    from hyprefix.hardware import device_caps

    caps = device_caps("cpu")

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hyprefix": hyprefix.__version__,
        "cpu_model": caps.name,
        "cpu_kind": caps.kind(),
        "device_caps": caps.to_dict(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_num_threads": torch.get_num_threads(),
        "load_average_at_start": load_average(),
    }


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
    """Peak resident memory of this process while it runs, sampled every ``interval``
    seconds by a background thread (every arm lives in the one process, so the growth
    over the start is what a run itself needed: KV caches, activations)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.start_bytes: int | None = None
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while True:
            now = rss_bytes()
            if now is not None and (self.peak_bytes is None or now > self.peak_bytes):
                self.peak_bytes = now
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        self.start_bytes = self.peak_bytes = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="rss-peak", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float | None]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        gib = 2**30
        if self.start_bytes is None or self.peak_bytes is None:
            return {"rss_start_gib": None, "rss_peak_gib": None}
        return {"rss_start_gib": round(self.start_bytes / gib, 3), "rss_peak_gib": round(self.peak_bytes / gib, 3)}
