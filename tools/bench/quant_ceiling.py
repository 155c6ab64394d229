"""Batch-1 ``quant_linear`` on Q4K or Q6 tiles: the kernel's compute ceiling against its memory stream.

- in cache: one matrix of ``--rows`` x ``--k`` (small enough for the cores' L2) multiplied 200
  times: what the kernel computes a second when reading costs nothing;
- stream: ``--mats`` matrices of ``--stream-rows`` x ``--k`` cycled (far beyond every cache);
- ``torch.sum`` over as many bytes: what this machine reads a second now.

Rates are the tiles' bytes (codes, scales, super-block scales) a second, best (median) of 7.
Where the in-cache rate is below what ``torch.sum`` reads, decode at batch 1 is bound by the
kernel's arithmetic, not by memory (docs/perf-log.md, 2026-12-07).

    python tools/bench/quant_ceiling.py --threads 2 1 [--format q6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hyprefix.kernels import quant_linear as ql
from hyprefix.runner.huge_pages import move_to_huge_pages


def q4k_matrix(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random Q4_K codes, scale and min codes, super-block scales, packed as Q4K tiles."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    codes = torch.randint(0, 64, (n, k // 32, 2), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 256, 2, generator=gen) * 0.01).half()
    return list(ql.pack(q, codes, d))


def q6_matrix(n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random Q6_K codes, int8 scales per 16 columns and float16 d per 256, packed as Q6 tiles."""
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 0.01).half()
    return list(ql.pack(q, scales, d))


def rate(nbytes: int, fn: Callable[[], object], reps: int = 7) -> str:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return f"{nbytes / min(times) / 1e9:.1f} ({nbytes / statistics.median(times) / 1e9:.1f}) GB/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=2048, help="columns (a multiple of 256)")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024], help="rows of the in-cache matrices")
    parser.add_argument("--stream-rows", type=int, default=1536, help="rows of each streamed matrix")
    parser.add_argument("--mats", type=int, default=96, help="streamed matrices")
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="torch threads, each a run")
    parser.add_argument("--format", choices=("q4k", "q6"), default="q4k", help="the tiles' format (GGUF Q4_K, Q6_K)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="stream from transparent huge pages, as the engine's weights are (runner/huge_pages.py)")
    args = parser.parse_args()
    if not ql.available():
        raise SystemExit("the quant_linear kernel is not built for this CPU")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.k)
    matrix = q4k_matrix if args.format == "q4k" else q6_matrix
    streamed = [matrix(args.stream_rows, args.k, gen) for _ in range(args.mats)]
    if args.huge_pages and not move_to_huge_pages([t for m in streamed for t in m]):
        raise SystemExit("transparent huge pages are not available here")
    stream_bytes = sum(t.numel() * t.element_size() for m in streamed for t in m)
    flat = torch.ones(stream_bytes // 4)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            m = matrix(rows, args.k, gen)
            nbytes = sum(t.numel() * t.element_size() for t in m)
            print(f"{threads} threads, in cache {rows} x {args.k} ({nbytes / 2**20:.2f} MiB): "
                  f"{rate(200 * nbytes, lambda m=m, rows=rows: [ql.quant_linear(x, m, rows) for _ in range(200)])}")
        shape = f"{args.mats} x {args.stream_rows} x {args.k} ({stream_bytes / 2**20:.0f} MiB)"
        print(f"{threads} threads, stream {shape}: "
              f"{rate(stream_bytes, lambda: [ql.quant_linear(x, m, args.stream_rows) for m in streamed])}")
        print(f"{threads} threads, torch.sum over as many bytes: {rate(stream_bytes, flat.sum)}")


if __name__ == "__main__":
    main()
