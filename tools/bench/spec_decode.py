"""Speculative decoding (prompt lookup) against plain decoding: time per output token of chat
requests, two engines in one process, their requests interleaved (arm order rotated every
round) so the machine's noise hits them alike.

Workloads, each a list of chat requests run one at a time (batch 1: per-token latency):

- ``copy``: a passage followed by an instruction to repeat it or to edit it lightly (what agent
  loops, code edits and RAG answers do with their context);
- ``chat``: plain questions whose answers do not repeat the prompt.

Greedy. The arms' tokens are compared and the requests whose tokens differ are counted: with
activation-quantized matmuls (int8, GGUF) the kernels round differently for a different number of
rows (a verification step computes 1 + k rows), so tokens can part at near ties, as they do
between batch sizes without speculation. Per arm and workload: the median
over rounds of (sum of decode seconds) / (sum of tokens after the first), decode seconds being
finish - first token; the ratio plain / speculative (> 1: speculation is faster); and the
drafts' mean accepted length.

    python tools/bench/spec_decode.py --model smol-q8.gguf --quantization int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PASSAGES = [
    "The river town of Alder Creek was built in 1852 by settlers who came for the timber. Its main street ran "
    "parallel to the water, lined with a general store, a blacksmith, a church and two saloons. In spring the "
    "river flooded the lower fields, and the farmers learned to plant late. By 1880 the railroad reached the "
    "town, and the mill on the east bank shipped lumber as far as Chicago. The mill burned down in 1911, and "
    "most of the young people left for the cities. Today the town has four hundred residents, a small museum "
    "in the old station, and a festival every August that celebrates the first settlers.",
    "def merge_intervals(intervals):\n    \"\"\"Merge overlapping intervals and return them sorted.\"\"\"\n"
    "    if not intervals:\n        return []\n    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = [list(intervals[0])]\n    for start, end in intervals[1:]:\n        last = merged[-1]\n"
    "        if start <= last[1]:\n            last[1] = max(last[1], end)\n        else:\n"
    "            merged.append([start, end])\n    return [tuple(pair) for pair in merged]\n",
    "To reset your password, open the settings page and choose Account. Select Security, then Change "
    "password. Enter your current password, then the new one twice. The new password must have at least "
    "twelve characters, one number and one symbol. Press Save. You will receive an email confirming the "
    "change. If you did not make this change, contact support within 24 hours so we can lock the account.",
]
INSTRUCTIONS = [
    "Repeat the text above exactly, word for word.",
    "Rewrite the text above, changing nothing except fixing any spelling mistakes. Output the full text.",
]
QUESTIONS = [
    "Write a short story about a robot who learns to cook.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe a day at the beach for a child who has never seen the sea.",
    "Give me some tips for learning a new language as an adult.",
    "Why is the sky blue? Explain it simply.",
    "Write a poem about autumn leaves.",
]


def workloads() -> dict[str, list[list[dict]]]:
    copy = [[{"role": "user", "content": f"{passage}\n\n{instruction}"}]
            for passage in PASSAGES for instruction in INSTRUCTIONS]
    chat = [[{"role": "user", "content": question}] for question in QUESTIONS]
    return {"copy": copy, "chat": chat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model path or demo alias")
    parser.add_argument("--dtype", default="auto", help="--dtype of the engines")
    parser.add_argument("--quantization", default=None, help="--quantization of the engines")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}', help="the speculative arm's config")
    parser.add_argument("--max-tokens", type=int, default=256, help="greedy tokens at most per request")
    parser.add_argument("--rounds", type=int, default=3, help="passes over every workload per arm")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from hyprefix import LLM, SamplingParams

    common = dict(dtype=args.dtype, quantization=args.quantization, log_stats_interval=0)
    arms = {"plain": LLM(args.model, **common),
            "speculative": LLM(args.model, speculative_config=args.speculative_config, **common)}
    for llm in arms.values():
        llm.engine.warmup()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    loads = workloads()
    # per workload, arm: per round (decode seconds, tokens after the first, drafts, accepted)
    runs: dict[str, dict[str, list[tuple[float, int, int, int]]]] = {w: {a: [] for a in arms} for w in loads}
    tokens_of: dict[str, dict[str, list[list[int]]]] = {w: {} for w in loads}
    for round_ in range(args.rounds):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for workload, chats in loads.items():
            for name in order:
                llm = arms[name]
                llm.engine.reset_prefix_cache()  # every round starts cold, as the first
                seconds, tokens, drafts, accepted, outs = 0.0, 0, 0, 0, []
                for messages in chats:
                    out = llm.chat(messages, params, use_tqdm=False)[0]
                    m = out.metrics
                    seconds += m.finished_time - m.first_token_time
                    tokens += len(out.outputs[0].token_ids) - 1
                    drafts += m.spec_num_drafts
                    accepted += m.spec_num_accepted_tokens
                    outs.append(out.outputs[0].token_ids)
                runs[workload][name].append((seconds, tokens, drafts, accepted))
                if tokens_of[workload].setdefault(name, outs) != outs:
                    raise SystemExit(f"{name} gave other tokens in round {round_} of {workload}: not deterministic")
    results = {}
    for workload in loads:
        plain, spec = tokens_of[workload]["plain"], tokens_of[workload]["speculative"]
        row: dict = {"requests": len(plain), "identical": sum(a == b for a, b in zip(plain, spec, strict=True))}
        for name in arms:
            tpot = statistics.median(s / max(1, t) for s, t, _, _ in runs[workload][name])
            drafts = sum(d for _, _, d, _ in runs[workload][name])
            accepted = sum(a for _, _, _, a in runs[workload][name])
            row[name] = {"tpot_ms": 1e3 * tpot, "tokens": runs[workload][name][0][1] + len(loads[workload]),
                         "drafts": drafts, "mean_accepted_length": 1 + accepted / drafts if drafts else None}
        row["speedup"] = row["plain"]["tpot_ms"] / row["speculative"]["tpot_ms"]
        results[workload] = row
        spec_row = row["speculative"]
        mal = spec_row["mean_accepted_length"]
        print(f"{workload:5s}: plain {row['plain']['tpot_ms']:.2f} ms/token, speculative {spec_row['tpot_ms']:.2f} "
              f"ms/token = {row['speedup']:.2f}x ({spec_row['tokens']} tokens, {spec_row['drafts']} verifications, "
              f"mean accepted length {mal:.2f}; {row['identical']}/{row['requests']} requests' tokens identical)"
              if mal else
              f"{workload:5s}: plain {row['plain']['tpot_ms']:.2f}, speculative {spec_row['tpot_ms']:.2f} ms/token = "
              f"{row['speedup']:.2f}x (no drafts)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "time": time.time()}, f, indent=2)


if __name__ == "__main__":
    main()
