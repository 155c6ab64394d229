"""What logprobs and structured outputs cost a decode step, offline and served:

    .venv/bin/python tools/bench/api_overhead.py MODEL [--quantization int8] [--url http://127.0.0.1:8000]

For batch sizes 1 and 16, four variants run interleaved for ``--repeats`` rounds: plain
sampling, ``logprobs=5``, and two JSON schemas that no row completes within ``--tokens``
(a long string; records of an integer and an enum). Each request's time per output token
(TPOT) is (finish - first token) / (tokens - 1); the report gives each variant's median
and its ratio to plain: the median over rounds of the ratio within a round, so a slow
stretch of a shared machine weighs on both sides of a ratio. Offline runs through ``LLM``;
with ``--url`` the same requests stream from a running ``hyprefix serve`` (TPOT from the
chunks' arrival times). Then the grammar compile time of a 20-property schema (the
llguidance tokenizer built once first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from hyprefix import LLM, SamplingParams

# Two JSON schemas no row completes within --tokens: one long string (the grammar allows most
# tokens: its pick is checked, rarely masked), and records of an integer and an enum (mostly
# structure: few tokens allowed, the pick often refused and taken among the allowed ones).
FREE_TEXT = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}
RECORDS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["n", "kind"], "additionalProperties": False}}
VARIANTS = {"plain": {}, "logprobs=5": {"logprobs": 5},
            "json text": {"structured_outputs": {"json": FREE_TEXT}},
            "json records": {"structured_outputs": {"json": RECORDS}}}


def twenty_properties() -> dict:
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "boolean"}, {"enum": ["low", "medium", "high"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 5}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def offline(llm: LLM, batch: int, args, seed: int, variant: dict) -> list[float]:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=args.tokens, ignore_eos=True, **variant)
    outs = llm.generate(prompts(batch, args.prompt_len, llm.engine.vocab_size, seed), params, use_tqdm=False)
    return [o.tpot for o in outs]


async def served(url: str, model: str, batch: int, args, seed: int, variant: dict, vocab: int) -> list[float]:
    import httpx

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> float:
        body = {"model": model, "prompt": prompt, "max_tokens": args.tokens, "temperature": 1.0, "seed": seed,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        if "logprobs" in variant:
            body["logprobs"] = variant["logprobs"]
        if "structured_outputs" in variant:
            body["structured_outputs"] = variant["structured_outputs"]
        times, tokens = [], 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    new = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                    if new:
                        times.append(time.perf_counter())
                        tokens += new
        return (times[-1] - times[0]) / (tokens - 1)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts(batch, args.prompt_len, vocab, seed))))


def report(title: str, results: dict[tuple[int, str], list[list[float]]]) -> None:
    """``results``: per (batch, variant), each round's TPOTs."""
    print(f"\n{title}: TPOT ms, median over requests and rounds (median over rounds of the ratio to plain)")
    for batch in sorted({b for b, _ in results}):
        plain = results[(batch, "plain")]
        cells = []
        for name in VARIANTS:
            rounds = results[(batch, name)]
            ratio = statistics.median(statistics.median(r) / statistics.median(p)
                                      for r, p in zip(rounds, plain, strict=True))
            cells.append(f"{name} {1000 * statistics.median(t for r in rounds for t in r):.2f} ({ratio:.3f}x)")
        print(f"  batch {batch:>2}: " + " | ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--url", default=None, help="also measure a running hyprefix serve of the same model")
    parser.add_argument("--served-model", default=None)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, quantization=args.quantization, dtype=args.dtype, log_stats_interval=0)
    llm.engine.warmup()
    vocab = llm.engine.vocab_size
    results: dict[tuple[int, str], list[list[float]]] = {}
    offline(llm, 2, args, 0, VARIANTS["json text"])  # warm: the llguidance tokenizer, the graphs
    for repeat in range(args.repeats):
        for batch in batches:
            for name, variant in VARIANTS.items():
                results.setdefault((batch, name), []).append(offline(llm, batch, args, 1000 * repeat + batch, variant))
    report("offline (LLM)", results)
    if args.url:
        import httpx

        model = args.served_model or httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        del llm  # the server's engine gets the cores
        results = {}
        asyncio.run(served(args.url, model, 2, args, 0, VARIANTS["json text"], vocab))
        for repeat in range(args.repeats):
            for batch in batches:
                for name, variant in VARIANTS.items():
                    results.setdefault((batch, name), []).append(
                        asyncio.run(served(args.url, model, batch, args, 1000 * repeat + batch, variant, vocab)))
        report(f"served ({args.url})", results)
        return
    from hyprefix.structured.grammar import GrammarCompiler
    from hyprefix.structured.spec import StructuredOutputs

    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)  # cold

    t0 = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - built on first use
    t1 = time.perf_counter()
    compiler.compile(StructuredOutputs(json=twenty_properties()))
    t2 = time.perf_counter()
    compiler.grammar(StructuredOutputs(json=twenty_properties()))
    t3 = time.perf_counter()
    print(f"\ngrammar: llguidance tokenizer {1000 * (t1 - t0):.1f} ms (once per engine); 20-property schema "
          f"compile {1000 * (t2 - t1):.1f} ms; a cached schema's new sequence {1000 * (t3 - t2):.2f} ms")


if __name__ == "__main__":
    main()
