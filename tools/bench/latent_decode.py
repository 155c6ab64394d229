"""Microbenchmark of ``hyprefix::decode_attention`` over a DeepSeek-shaped latent cache (16 heads,
D 576, values 512, blocks of 16, random block tables): the latent path (``v_cache`` is
``k_cache``, ``v_dim`` 512) against the general path on a copy of the cache (K and V apart, every
value of D weighed: the arithmetic a latent cache took before ``latent_attention.h``). Batch 1
and 8, contexts 128, 1024 and 4096, float32 and bfloat16; each time is the best of many calls,
the two paths interleaved in rounds so a shared machine's busy spells hit both.

    python tools/bench/latent_decode.py [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from hyprefix.kernels import decode_attention as kernel

HEADS, DIM, VALUES, BLOCK = 16, 576, 512, 16


def best_us(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` calls, in microseconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernel.available(torch.float32):
        raise SystemExit("the decode attention kernel does not run here")
    print(f"threads {args.threads}, ATen ISA {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'dtype':9} {'batch':>5} {'ctx':>5} {'general us':>11} {'latent us':>10} {'speedup':>8}")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 8):
            for ctx in (128, 1024, 4096):
                width = -(-ctx // BLOCK)
                cache = torch.randn(batch * width + 1, BLOCK, 1, DIM, generator=gen).to(dtype)
                copy = cache.clone()
                tables = torch.randperm(batch * width + 1, generator=gen)[:batch * width].view(batch, width)
                lens = torch.full((batch,), ctx)
                q = torch.randn(batch, HEADS, DIM, generator=gen).to(dtype)
                general = lambda: kernel.decode_attention(q, cache, copy, tables, lens, DIM ** -0.5)  # noqa: B023, E731
                latent = lambda: kernel.decode_attention(q, cache, cache, tables, lens, DIM ** -0.5,  # noqa: B023, E731
                                                         v_dim=VALUES)
                reps = max(10, 100_000 // (ctx * batch))
                old, new = float("inf"), float("inf")
                for _ in range(args.rounds):
                    old, new = min(old, best_us(general, reps)), min(new, best_us(latent, reps))
                print(f"{str(dtype).removeprefix('torch.'):9} {batch:5} {ctx:5} {old:11.1f} {new:10.1f} "
                      f"{old / new:7.2f}x")


if __name__ == "__main__":
    main()
