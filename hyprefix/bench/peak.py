"""The machine's matmul peak in the run's dtype, measured at the start of a benchmark.

A fixed GEMM (an ``m x k`` input by an ``n x k`` weight, 2048 x 2048 by 8192 x 2048 by
default) is timed several times after a warm-up, through ``torch.nn.functional.linear``
and, where the engine prepacks weights of this dtype (``hardware.DeviceCaps.prepack``),
through the prepacked oneDNN linear too; the best run of either gives the attainable
GFLOP/s. It is what the prefill's "fraction of peak" is divided by: a practical ceiling
for this CPU, thread count and torch build, not the vendor's theoretical number.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class PeakResult:
    m: int
    k: int
    n: int
    dtype: str
    runs: int
    best_seconds: float
    gflops: float
    all_gflops: list[float]
    path: str = "plain"  # the faster path: "plain" (F.linear) or "prepacked" (oneDNN)
    plain_gflops: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def measure_matmul_peak(m: int = 2048, k: int = 2048, n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                        runs: int = 6, warmup: int = 2, seed: int = 0) -> PeakResult:
    """Best-of-``runs`` GFLOP/s of ``linear(x[m, k], w[n, k])`` (2·m·k·n FLOPs per call)."""
    from hyprefix.hardware import device_caps
    from hyprefix.models.layers import pack_weight, packed_linear

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    flops = 2.0 * m * k * n
    paths = {"plain": lambda: torch.nn.functional.linear(x, w)}
    if device_caps(x.device).prepack(dtype):
        packed = pack_weight(w)
        paths["prepacked"] = lambda: packed_linear(x, packed, None)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for name, fn in paths.items():
            for _ in range(warmup):
                fn()
            times[name] = []
            for _ in range(runs):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    path = min(times, key=lambda name: min(times[name]))
    best = min(times[path])
    return PeakResult(m=m, k=k, n=n, dtype=str(dtype).replace("torch.", ""), runs=runs, best_seconds=best,
                      gflops=flops / best / 1e9, all_gflops=[flops / t / 1e9 for t in times[path]], path=path,
                      plain_gflops=flops / min(times["plain"]) / 1e9)
