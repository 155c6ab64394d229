"""Batch-1 TPOT against the active-bytes roofline, in one process, at the read rate of the moment:

    .venv/bin/python tools/bench/tpot_roofline.py MODEL.gguf [--rounds 6] [--min-rate 45]
    .venv/bin/python tools/bench/tpot_roofline.py MODEL.gguf --minutes 14 --ab HYPREFIX_X=1

A round is one request through ``LLM``: a fresh random 128-token prompt (no prefix hit) and 64
greedy tokens; its TPOT is (finish - first token) / 63 from the request's metrics. The roofline is
``decode_weight_bytes`` (attention, router, norms, head and a token's top-k share of the experts)
over ``bench.env.read_rate_now`` probed right before the round. A VM's read rate swings between
modes minute to minute (docs/benchmarks.md, "MoE on CPU"): ``--min-rate`` skips moments below it.

``--ab VAR=VALUE`` builds a second engine with VAR set while it loads (a setting read when an
engine is built or its step compiled) and times the two in alternated pairs, the order flipped
each pair; it reports B/A per pair, their median and a one-sided sign test. Nothing else may run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from unittest.mock import patch

from hyprefix import LLM, SamplingParams
from hyprefix.bench.env import read_rate_now

PROMPT_TOKENS, DECODE_TOKENS = 128, 64


def tpot(llm: LLM, rng: random.Random) -> float:
    """One round's seconds a token after the first."""
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]}
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    return (m.finished_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)


def build(model: str, env: dict[str, str], rng: random.Random) -> LLM:
    """An engine, warmed up by one round, built with ``env`` set (then restored)."""
    with patch.dict(os.environ, env):
        llm = LLM(model=model)
        tpot(llm, rng)
    return llm


def sign_test(ratios: list[float]) -> float:
    """One-sided p of at least this many B/A < 1 among these pairs, were B and A alike."""
    n, k = len(ratios), sum(r < 1 for r in ratios)
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file or model directory")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (pairs with --ab) to time, unless --minutes")
    parser.add_argument("--minutes", type=float, default=None, help="time rounds for this long instead")
    parser.add_argument("--min-rate", type=float, default=0.0, help="skip moments whose read rate (GB/s) is below")
    parser.add_argument("--ab", default=None, metavar="VAR=VALUE", help="time a second engine built with VAR=VALUE")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    engines = {"A": build(args.model, {}, rng)}
    if args.ab:
        var, _, value = args.ab.partition("=")
        engines["B"] = build(args.model, {var: value}, rng)
    weight_bytes = engines["A"].engine.model_facts.decode_weight_bytes
    end = time.time() + 60 * args.minutes if args.minutes else math.inf
    results: dict[str, list[float]] = {name: [] for name in engines}
    ratios: list[float] = []

    def more() -> bool:
        return time.time() < end if args.minutes else len(results["A"]) < args.rounds

    while more():
        rate = read_rate_now()
        if rate < args.min_rate:
            time.sleep(0.5)
            continue
        order = list(engines) if len(ratios) % 2 == 0 else list(reversed(engines))
        seconds = {name: tpot(engines[name], rng) for name in order}
        roofline = weight_bytes / (rate * 1e9)
        cells = "  ".join(f"{name} {s * 1e3:.2f} ms ({s / roofline:.2f}x)" for name, s in sorted(seconds.items()))
        print(f"{time.strftime('%H:%M:%S')}  read {rate:.1f} GB/s, roofline {roofline * 1e3:.2f} ms  {cells}",
              flush=True)
        for name, s in seconds.items():
            results[name].append(s)
        if args.ab:
            ratios.append(seconds["B"] / seconds["A"])
    for name, values in sorted(results.items()):
        if values:
            print(f"{name}: {len(values)} rounds, median TPOT {statistics.median(values) * 1e3:.2f} ms")
    if ratios:
        print(f"B/A over {len(ratios)} pairs: median {statistics.median(ratios):.3f}, mean "
              f"{statistics.mean(ratios):.3f}, B faster in {sum(r < 1 for r in ratios)}, sign test p = "
              f"{sign_test(ratios):.3f}")


if __name__ == "__main__":
    main()
