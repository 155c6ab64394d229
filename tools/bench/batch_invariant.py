"""What the batch-invariant mode (``--batch-invariant``) costs, offline:

    .venv/bin/python tools/bench/batch_invariant.py MODEL [--dtype float32] [--repeats 3]

Two engines of the same model, one in the default mode and one with ``batch_invariant=True``
(prefix caching off in both), are measured in interleaved rounds: decode time per output token
(TPOT, (finish - first token) / (tokens - 1) of each request, median) at batch 1 and at batch 8,
and prefill throughput (``--prefill-batch`` prompts of ``--prompt-len`` tokens, one output token
each: prompt tokens over the wall time of the call). Each engine warms up first (the default
mode compiles its decode graphs). The report gives each mode's median over rounds and the median
over rounds of the ratio within a round (invariant / default for TPOT, default / invariant for
throughput: how many times slower the mode is), so a slow stretch of a shared machine weighs on
both sides of a ratio. ``--eager-baseline`` adds the default mode with ``enforce_eager=True``
(no compiled decode graphs, as in the invariant mode) as a third engine, reported beside them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps

MODES = ("default", "invariant", "eager")


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def tpot(llm: LLM, batch: int, args, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = llm.generate(prompts(batch, args.decode_prompt_len, llm.engine.vocab_size, seed), params, use_tqdm=False)
    return statistics.median(o.tpot for o in outs)


def prefill(llm: LLM, args, seed: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    batch = prompts(args.prefill_batch, args.prompt_len, llm.engine.vocab_size, seed)
    t0 = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return args.prefill_batch * args.prompt_len / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens of each decode request")
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each prefill request")
    parser.add_argument("--prefill-batch", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager-baseline", action="store_true", help="also the default mode with enforce_eager")
    args = parser.parse_args()

    modes = MODES if args.eager_baseline else MODES[:2]
    llms = {mode: LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, batch_invariant=mode == "invariant",
                      enforce_eager=mode == "eager", max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=4096)
            for mode in modes}
    for llm in llms.values():  # compiles (default mode) and first-touch costs outside the rounds
        tpot(llm, 1, args, seed=0)
        tpot(llm, 8, args, seed=0)
        prefill(llm, args, seed=0)
    results: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    for round_ in range(args.repeats):
        for mode, llm in llms.items():
            res = results[mode]
            res.setdefault("decode batch 1", []).append(1000 * tpot(llm, 1, args, seed=round_ + 1))
            res.setdefault("decode batch 8", []).append(1000 * tpot(llm, 8, args, seed=round_ + 1))
            res.setdefault("prefill", []).append(prefill(llm, args, seed=round_ + 1))

    caps = device_caps("cpu")
    print(f"{args.model} ({args.dtype}), {caps.describe()}, {torch.get_num_threads()} threads, "
          f"{args.repeats} rounds")
    for name, unit in (("decode batch 1", "ms TPOT"), ("decode batch 8", "ms TPOT"), ("prefill", "tok/s")):
        base, inv = results["default"][name], results["invariant"][name]
        ratios = [(i / b) if unit != "tok/s" else (b / i) for b, i in zip(base, inv, strict=True)]
        eager = f" | enforce_eager {statistics.median(results['eager'][name]):8.2f}" if "eager" in modes else ""
        print(f"  {name:<15} default {statistics.median(base):8.2f} {unit:<8} invariant "
              f"{statistics.median(inv):8.2f} {unit:<8} invariant is {statistics.median(ratios):.2f}x slower{eager}")


if __name__ == "__main__":
    main()
