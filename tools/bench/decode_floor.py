"""Where an int8 batch-1 decode step's time goes against its memory roofline, in one process:

    .venv/bin/python tools/bench/decode_floor.py MODEL.gguf [--context 128] [--rounds 6]

Each round measures, back to back (the machine's read rate swings between rounds):

- ``sum``: the read rate of ``bench.env.read_rate_now`` (``sum`` over 256 MB); the roofline is
  the model's int8 weight bytes over it;
- ``one call``: the int8 kernel over one weight holding all those bytes (in huge pages where the
  engine puts its weights there);
- ``121 calls``: the model's own weights, one kernel call each in forward order, from Python;
- ``step``: the median engine step (the decode step, one ``DecodeModel`` call where the int8
  kernel runs, sampling and bookkeeping).

Then, once, ``sum`` over tensors of 64 KB to 32 MB holding the same bytes in all: the rate of
short reads, which a layer's weights are (0.35 to 1.8 MB for SmolLM2-135M). Needs a CPU where
the int8 kernel runs (AVX512-VNNI or AVX2).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hyprefix import LLM, SamplingParams
from hyprefix.bench.env import read_rate_now
from hyprefix.kernels import int8_linear as kernel
from hyprefix.models.quant import Int8Tiles, Int8Weight
from hyprefix.models.weights import MatrixForms
from hyprefix.runner.huge_pages import move_to_huge_pages


def _seconds(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed decode steps")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not kernel.available():
        raise SystemExit("the int8 kernel does not run on this CPU (it needs AVX512-VNNI or AVX2 on x86)")
    llm = LLM(model=args.model, quantization="int8", dtype="float32", log_stats_interval=0)
    engine = llm.engine
    weights = [w for module in engine.runner.model.modules()
               if isinstance(module, MatrixForms) and isinstance(w := module.int8, Int8Tiles)]
    nbytes = sum(w.nbytes for w in weights)
    inputs = {w.tiles.shape[1] * 4: torch.randn(1, w.tiles.shape[1] * 4) for w in weights}
    k = weights[0].tiles.shape[1] * 4  # one weight of the first one's K (per-group scales) holding as many bytes
    rows = nbytes // (k + k // 32 * 2) // 16 * 16
    big = Int8Tiles.pack(Int8Weight(torch.randint(-127, 128, (rows, k), dtype=torch.int8), torch.rand(rows, k // 32)))
    move_to_huge_pages([big.tiles, big.scales])  # where the engine's weights are (runner/huge_pages.py)

    def each_call() -> None:
        for w in weights:
            w.matmul(inputs[w.tiles.shape[1] * 4], None)

    prompt = [random.Random(0).randrange(3, 10_000) for _ in range(args.context)]
    params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)

    def step_seconds() -> float:
        engine.add_requests([(f"floor-{random.random()}", prompt, params)])
        engine.step()  # the prefill
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    step_seconds()
    each_call()
    print(f"{len(weights)} int8 weights, {nbytes / 1e6:.1f} MB; {torch.get_num_threads()} threads")
    for _ in range(args.rounds):
        rate = read_rate_now()
        roof = nbytes / (rate * 1e9)
        one = _seconds(lambda: big.matmul(inputs[k], None)) * nbytes / big.nbytes
        loop, step = _seconds(each_call), step_seconds()
        print(f"sum {rate:5.1f} GB/s, roofline {roof * 1e3:.2f} ms | one call {one / roof:.2f}x | "
              f"{len(weights)} calls {loop / roof:.2f}x | step {step * 1e3:.2f} ms = {step / roof:.2f}x")
    big = None  # frees its bytes for the chunks
    print(f"sum over {nbytes / 1e6:.0f} MB in tensors of " + " | ".join(
        f"{kb} KB: {_chunked_rate(kb, nbytes):.1f} GB/s" for kb in (64, 352, 1024, 4096, 32768)))


def _chunked_rate(kb: int, nbytes: int) -> float:
    """GB/s of ``sum`` over float32 tensors of ``kb`` KB, about ``nbytes`` in all, one after another."""
    chunks = [torch.ones(kb * 256) for _ in range(max(1, nbytes // (kb * 1024)))]
    return len(chunks) * kb * 1024 / _seconds(lambda: [c.sum() for c in chunks], runs=3) / 1e9

if __name__ == "__main__":
    main()
