"""Batch-1 TPOT against the active-bytes roofline, in one process, at the read rate of the moment:

    .venv/bin/python tools/bench/tpot_roofline.py MODEL.gguf [--rounds 6] [--min-rate 45]
    .venv/bin/python tools/bench/tpot_roofline.py MODEL.gguf --minutes 14 --ab HYPREFIX_X=1
    .venv/bin/python tools/bench/tpot_roofline.py MODEL.gguf --per-token --minutes 10 --min-rate 60

A round is one request through ``LLM``: a fresh random 128-token prompt (no prefix hit) and 64
greedy tokens; its TPOT is (finish - first token) / 63 from the request's metrics. The roofline is
``decode_weight_bytes`` (attention, router, norms, head and a token's top-k share of the experts)
over ``bench.env.read_rate_now`` probed right before the round. A VM's read rate swings between
modes minute to minute (docs/benchmarks.md, "MoE on CPU"): ``--min-rate`` skips moments below it.

``--per-token`` pairs each decode step with a ``sum`` over as many bytes as the step's weights
(a float32 buffer on huge pages, as the weights are), timed right after it: a step's time over
that pass's is its multiple of the roofline at that very moment. The rate swings within a second,
so a probe before a 64-token round can miss the round's mode; the pairs cannot. It reports the
median multiple over the steps whose pass read at least ``--min-rate``, and over all.

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
from collections.abc import Callable
from unittest.mock import patch

import torch

from hyprefix import LLM, SamplingParams
from hyprefix.bench.env import read_rate_now
from hyprefix.runner.huge_pages import move_to_huge_pages

PROMPT_TOKENS, DECODE_TOKENS = 128, 64


def round_request(rng: random.Random) -> tuple[dict, SamplingParams]:
    """A fresh random prompt (no prefix hit) and greedy decoding to ``DECODE_TOKENS``."""
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]}
    return prompt, SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)


def tpot(llm: LLM, rng: random.Random) -> float:
    """One round's seconds a token after the first."""
    prompt, params = round_request(rng)
    return llm.generate([prompt], params, use_tqdm=False)[0].tpot


def paired_steps(llm: LLM, rng: random.Random, stream: torch.Tensor) -> list[tuple[float, float]]:
    """One round stepped by hand: (seconds of a decode step, seconds of a ``sum`` over ``stream``
    right after it) for each step after the one that made the first token."""
    engine, (prompt, params) = llm.engine, round_request(rng)
    engine.add_request(f"paired-{rng.getrandbits(64):x}", prompt, params)
    pairs: list[tuple[float, float]] = []
    decoding = False
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        stream.sum()
        if decoding:
            pairs.append((t1 - t0, time.perf_counter() - t1))
        decoding = decoding or any(o.outputs[0].token_ids for o in outputs)
    return pairs


def rounds_left(args: argparse.Namespace) -> Callable[[int], bool]:
    """Whether another round runs after ``done`` ones: until ``--minutes`` pass, else ``--rounds``."""
    if args.minutes:
        end = time.time() + 60 * args.minutes
        return lambda done: time.time() < end
    return lambda done: done < args.rounds


def per_token(llm: LLM, rng: random.Random, args: argparse.Namespace) -> None:
    """``--per-token``: rounds of paired steps; each round's line, then the medians."""
    weight_bytes = llm.engine.model_facts.decode_weight_bytes
    stream = torch.ones(weight_bytes // 4)
    if not move_to_huge_pages([stream]):
        print("note: no transparent huge pages here; the pass streams 4 KiB pages")
    more, rounds = rounds_left(args), 0
    pairs: list[tuple[float, float]] = []
    while more(rounds):
        got = paired_steps(llm, rng, stream)
        rounds += 1
        pairs += got
        fast = [s / r for s, r in got if weight_bytes / r / 1e9 >= args.min_rate]
        step_ms, pass_ms = (statistics.median(col) * 1e3 for col in zip(*got, strict=True))
        summary = f", median {statistics.median(fast):.2f}x" if fast else ""
        print(f"{time.strftime('%H:%M:%S')}  {len(got)} steps, median step {step_ms:.2f} ms, pass {pass_ms:.2f} ms;"
              f" at >= {args.min_rate:g} GB/s: {len(fast)} steps{summary}", flush=True)
    fast_pairs = [p for p in pairs if weight_bytes / p[1] / 1e9 >= args.min_rate] if args.min_rate > 0 else []
    for label, chosen in (("all", pairs), (f">= {args.min_rate:g} GB/s", fast_pairs)):
        if chosen:
            multiples = sorted(s / r for s, r in chosen)
            print(f"{label}: {len(chosen)} steps, step / pass median {statistics.median(multiples):.3f}x "
                  f"(quartiles {multiples[len(multiples) // 4]:.3f}-{multiples[3 * len(multiples) // 4]:.3f}), "
                  f"median step {statistics.median(s for s, _ in chosen) * 1e3:.2f} ms, pass read "
                  f"{weight_bytes / statistics.median(r for _, r in chosen) / 1e9:.1f} GB/s")


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
    parser.add_argument("--min-rate", type=float, default=0.0,
                        help="skip moments whose read rate (GB/s) is below (--per-token: also sum up apart the "
                             "steps whose pass read at least this)")
    parser.add_argument("--ab", default=None, metavar="VAR=VALUE", help="time a second engine built with VAR=VALUE")
    parser.add_argument("--per-token", action="store_true",
                        help="pair every decode step with a read pass of the step's weight bytes")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    args = parser.parse_args()
    if args.per_token and args.ab:
        parser.error("--per-token times one engine: leave out --ab")
    rng = random.Random(args.seed)
    engines = {"A": build(args.model, {}, rng)}
    if args.per_token:
        return per_token(engines["A"], rng, args)
    if args.ab:
        var, _, value = args.ab.partition("=")
        engines["B"] = build(args.model, {var: value}, rng)
    weight_bytes = engines["A"].engine.model_facts.decode_weight_bytes
    more = rounds_left(args)
    results: dict[str, list[float]] = {name: [] for name in engines}
    ratios: list[float] = []
    while more(len(results["A"])):
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
