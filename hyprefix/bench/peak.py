"""The machine's bf16 matmul peak, measured at the start of a benchmark.

A fixed GEMM (``torch.nn.functional.linear`` of an ``m x k`` input by an ``n x k``
weight, 2048 x 2048 by 8192 x 2048 by default) is timed several times after a warm-up;
the best run gives the attainable GFLOP/s. It is what the prefill's "fraction of peak"
is divided by: a practical ceiling for this CPU, thread count and torch build, not the
vendor's theoretical number.
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

    def to_dict(self) -> dict:
        return asdict(self)


def measure_matmul_peak(m: int = 2048, k: int = 2048, n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                        runs: int = 6, warmup: int = 2, seed: int = 0) -> PeakResult:
    """Best-of-``runs`` GFLOP/s of ``linear(x[m, k], w[n, k])`` (2·m·k·n FLOPs per call)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    flops = 2.0 * m * k * n
    times: list[float] = []
    with torch.inference_mode():
        for _ in range(warmup):
            torch.nn.functional.linear(x, w)
        for _ in range(runs):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t0)
    best = min(times)
    return PeakResult(m=m, k=k, n=n, dtype=str(dtype).replace("torch.", ""), runs=runs, best_seconds=best,
                      gflops=flops / best / 1e9, all_gflops=[flops / t / 1e9 for t in times])
