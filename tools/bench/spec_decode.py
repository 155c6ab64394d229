"""Speculative decoding (prompt lookup) against plain decoding: time per output token of chat
requests, two engines in one process, their requests interleaved (arm order rotated every
round) so the machine's noise hits them alike.

Workloads, each a list of chat requests run one at a time (batch 1: per-token latency):

- ``copy``: a passage followed by an instruction to repeat it or to edit it lightly (what agent
  loops, code edits and RAG answers do with their context);
- ``chat``: plain questions whose answers do not repeat the prompt (greedy);
- ``chat-t1``: the same questions sampled at temperature 1 (a seed per request).

Greedy but for ``chat-t1``. The arms' tokens are compared and the requests whose tokens differ are counted: with
activation-quantized matmuls (int8, GGUF) the kernels round differently for a different number of
rows (a verification step computes 1 + k rows), so tokens can part at near ties, as they do
between batch sizes without speculation. Per arm and workload: the median
over rounds of (sum of decode seconds) / (sum of tokens after the first), decode seconds being
finish - first token; the ratio plain / speculative (> 1: speculation is faster); and the
drafts' mean accepted length.

    python tools/bench/spec_decode.py --model smol-q8.gguf --quantization int8

Served (the path a client meets): start two servers on the same model, one with
``--speculative-config``, and pass their URLs; the requests go to ``/v1/chat/completions``,
streamed, one at a time, the servers alternated request by request. Decode seconds are then
last chunk - first chunk as the client sees them, tokens the usage's completion tokens.

    python tools/bench/spec_decode.py --url plain=http://127.0.0.1:8091 --url speculative=http://127.0.0.1:8092
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


def workloads() -> dict[str, tuple[list[list[dict]], float]]:
    """Name -> (chats, temperature). ``chat-t1`` samples (temperature 1, a seed per request): its
    text repeats itself far less than greedy text, so most drafts fail and the back-off is what
    keeps speculation from costing time."""
    copy = [[{"role": "user", "content": f"{passage}\n\n{instruction}"}]
            for passage in PASSAGES for instruction in INSTRUCTIONS]
    chat = [[{"role": "user", "content": question}] for question in QUESTIONS]
    return {"copy": (copy, 0.0), "chat": (chat, 0.0), "chat-t1": (chat, 1.0)}


class OfflineArm:
    """An ``LLM``: decode seconds from the request's metrics, drafts from its spec counts."""

    def __init__(self, llm, max_tokens: int) -> None:
        self.llm = llm
        self.max_tokens = max_tokens
        llm.engine.warmup()

    def reset(self) -> None:
        self.llm.engine.reset_prefix_cache()

    def run(self, messages: list[dict], temperature: float, seed: int) -> tuple[float, int, int, int, list[int]]:
        from hyprefix import SamplingParams

        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=self.max_tokens)
        out = self.llm.chat(messages, params, use_tqdm=False)[0]
        m = out.metrics
        ids = out.outputs[0].token_ids
        return m.finished_time - m.first_token_time, len(ids), m.spec_num_drafts, m.spec_num_accepted_tokens, ids


class ServedArm:
    """A server's ``/v1/chat/completions``, streamed: decode seconds between the first and the
    last chunk with content, tokens from the usage; drafts from ``/metrics`` differences."""

    def __init__(self, url: str, max_tokens: int) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=600)
        self.model = self.client.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        self.max_tokens = max_tokens

    def reset(self) -> None:
        self.client.post(f"{self.url}/reset_prefix_cache")

    def _counters(self) -> tuple[float, float]:
        from prometheus_client.parser import text_string_to_metric_families

        values = {"hyprefix:spec_decode_num_drafts": 0.0, "hyprefix:spec_decode_num_accepted_tokens": 0.0}
        for family in text_string_to_metric_families(self.client.get(f"{self.url}/metrics").text):
            if family.name in values:
                values[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        return values["hyprefix:spec_decode_num_drafts"], values["hyprefix:spec_decode_num_accepted_tokens"]

    def run(self, messages: list[dict], temperature: float, seed: int) -> tuple[float, int, int, int, str]:
        drafts0, accepted0 = self._counters()
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": temperature,
                "seed": seed,
                "stream": True, "stream_options": {"include_usage": True}}
        first = last = None
        text, tokens = [], 0
        with self.client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
                        text.append(choice["delta"]["content"])
        drafts1, accepted1 = self._counters()
        seconds = (last - first) if first is not None else 0.0
        return seconds, tokens, int(drafts1 - drafts0), int(accepted1 - accepted0), "".join(text)


def offline_arms(args) -> dict:
    from hyprefix import LLM

    common = dict(dtype=args.dtype, quantization=args.quantization, log_stats_interval=0)
    return {"plain": OfflineArm(LLM(args.model, **common), args.max_tokens),
            "speculative": OfflineArm(LLM(args.model, speculative_config=args.speculative_config, **common),
                                      args.max_tokens)}


def served_arms(args) -> dict:
    urls = dict(u.split("=", 1) for u in args.url)
    if sorted(urls) != ["plain", "speculative"]:
        raise SystemExit("--url plain=URL --url speculative=URL")
    return {name: ServedArm(urls[name], args.max_tokens) for name in ("plain", "speculative")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path or demo alias (offline)")
    parser.add_argument("--url", action="append", default=None, metavar="NAME=URL",
                        help="served: the plain and the speculative server (names plain and speculative)")
    parser.add_argument("--dtype", default="auto", help="--dtype of the engines")
    parser.add_argument("--quantization", default=None, help="--quantization of the engines")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}', help="the speculative arm's config")
    parser.add_argument("--max-tokens", type=int, default=256, help="greedy tokens at most per request")
    parser.add_argument("--rounds", type=int, default=3, help="passes over every workload per arm")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    if (args.model is None) == (args.url is None):
        raise SystemExit("give --model (offline) or two --url (served)")
    arms = served_arms(args) if args.url else offline_arms(args)
    loads = workloads()
    # per workload, arm: per round (decode seconds, tokens after the first, drafts, accepted)
    runs: dict[str, dict[str, list[tuple[float, int, int, int]]]] = {w: {a: [] for a in arms} for w in loads}
    tokens_of: dict[str, dict[str, list[list[int]]]] = {w: {} for w in loads}
    for round_ in range(args.rounds):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for workload, (chats, temperature) in loads.items():
            totals = {name: [0.0, 0, 0, 0] for name in order}
            outs: dict[str, list] = {name: [] for name in order}
            for name in order:
                arms[name].reset()  # every round starts cold, as the first
            for index, messages in enumerate(chats):  # the arms alternate request by request
                for name in order:
                    seconds, tokens, drafts, accepted, answer = arms[name].run(messages, temperature, 1000 + index)
                    for k, value in enumerate((seconds, tokens - 1, drafts, accepted)):
                        totals[name][k] += value
                    outs[name].append(answer)
            for name in order:
                runs[workload][name].append(tuple(totals[name]))
                outs_name = outs[name]
                first = tokens_of[workload].setdefault(name, outs_name)
                if first != outs_name:
                    where = [(i, next((j for j, (p, q) in enumerate(zip(a, b, strict=False)) if p != q),
                                      min(len(a), len(b))))
                             for i, (a, b) in enumerate(zip(first, outs_name, strict=True)) if a != b]
                    raise SystemExit(f"{name} gave other tokens in round {round_} of {workload} (request, first "
                                     f"position that differs: {where}): not deterministic")
    results = {}
    for workload in loads:
        plain, spec = tokens_of[workload]["plain"], tokens_of[workload]["speculative"]
        row: dict = {"requests": len(plain), "identical": sum(a == b for a, b in zip(plain, spec, strict=True))}
        for name in arms:
            tpot = statistics.median(s / max(1, t) for s, t, _, _ in runs[workload][name])
            drafts = sum(d for _, _, d, _ in runs[workload][name])
            accepted = sum(a for _, _, _, a in runs[workload][name])
            row[name] = {"tpot_ms": 1e3 * tpot, "tokens": runs[workload][name][0][1] + len(loads[workload][0]),
                         "drafts": drafts, "mean_accepted_length": 1 + accepted / drafts if drafts else None}
        row["speedup"] = row["plain"]["tpot_ms"] / row["speculative"]["tpot_ms"]
        results[workload] = row
        spec_row = row["speculative"]
        mal = spec_row["mean_accepted_length"]
        print(f"{workload:7s}: plain {row['plain']['tpot_ms']:.2f} ms/token, speculative {spec_row['tpot_ms']:.2f} "
              f"ms/token = {row['speedup']:.2f}x ({spec_row['tokens']} tokens, {spec_row['drafts']} verifications, "
              f"mean accepted length {mal:.2f}; {row['identical']}/{row['requests']} requests' tokens identical)"
              if mal else
              f"{workload:7s}: plain {row['plain']['tpot_ms']:.2f}, speculative {spec_row['tpot_ms']:.2f} ms/token = "
              f"{row['speedup']:.2f}x (no drafts)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results, "time": time.time()}, f, indent=2)


if __name__ == "__main__":
    main()
