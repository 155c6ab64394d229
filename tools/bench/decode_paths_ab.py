"""Decode speed of the compiled decode graphs against the eager decode (``--enforce-eager``),
offline and served: time per output token, the arms alternated round by round.

Offline: two engines in one process (the default, and one with ``enforce_eager=True``), fresh
random prompts each round, median decode step time (prefill steps left out).
Served: two running servers (start one with ``--enforce-eager``), streamed ``/v1/completions``
with ``logprobs: 0`` (a random model's tokens often decode to empty text, which a stream leaves
out without logprobs), time per output token from the first to the last chunk as the client sees
it, the median over a round's concurrent streams.

    python tools/bench/decode_paths_ab.py --model demo-qwen3.5-0.8b --batch 8
    python tools/bench/decode_paths_ab.py --url graphs=http://127.0.0.1:8091 \\
        --url eager=http://127.0.0.1:8092 --batch 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time


def offline_round(engine, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    from hyprefix import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(f"ab-{time.monotonic_ns()}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    steps, outputs = [], {}
    counts = engine.runner.decode_steps  # decode-only steps by path: a step that adds one is timed
    while engine.has_unfinished():
        before = sum(counts.values())
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if sum(counts.values()) > before:
            steps.append(time.perf_counter() - t0)
    engine.reset_prefix_cache()
    return statistics.median(steps), [outputs[k] for k in sorted(outputs)]


def served_round(url: str, model: str | None, prompts: list[list[int]], tokens: int) -> float:
    import httpx

    per_stream: list[float] = []

    def one(prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "logprobs": 0, **({"model": model} if model else {})}
        times = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
        per_stream.append((times[-1] - times[0]) / (len(times) - 1))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(per_stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="offline: model path or demo alias")
    parser.add_argument("--dtype", default="auto", help="offline: the engines' --dtype")
    parser.add_argument("--url", action="append", default=[], help="served: NAME=URL, twice (no --model)")
    parser.add_argument("--served-model", default=None, help="served: the model name to request")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=256, help="random prompt tokens")
    parser.add_argument("--output-len", type=int, default=48, help="greedy tokens per request")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the arms alternated")
    args = parser.parse_args()
    if bool(args.model) == bool(args.url):
        parser.error("give --model (offline) or two --url (served)")
    rng = random.Random(0)
    times: dict[str, list[float]] = {}
    same = 0
    if args.model:
        from hyprefix import LLM

        arms = {"graphs": LLM(args.model, dtype=args.dtype, log_stats_interval=0),
                "eager": LLM(args.model, dtype=args.dtype, log_stats_interval=0, enforce_eager=True)}
        for llm in arms.values():
            llm.engine.warmup()
    else:
        arms = dict(u.split("=", 1) for u in args.url)
    for r in range(args.rounds):
        prompts = [[rng.randrange(100, 4000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        tokens = {}
        for name in order:
            if args.model:
                step, tokens[name] = offline_round(arms[name].engine, prompts, args.output_len)
            else:
                step = served_round(arms[name], args.served_model, prompts, args.output_len)
            times.setdefault(name, []).append(step)
        same += len(set(map(str, tokens.values()))) == 1 if tokens else 0
    for name, values in times.items():
        print(f"{name}: {statistics.median(values) * 1e3:.1f} ms per token (rounds: "
              + ", ".join(f"{v * 1e3:.1f}" for v in values) + ")")
    first, second = list(times)
    print(f"{second} / {first}: {statistics.median(times[second]) / statistics.median(times[first]):.3f}")
    if args.model:
        print(f"rounds with identical greedy tokens: {same} of {args.rounds}")


if __name__ == "__main__":
    main()
