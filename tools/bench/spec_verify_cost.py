"""What verification costs: time per output token of plain decoding against speculative decoding
whose drafts are always right (the plain run's own continuation, fed in place of the n-gram
proposer), batch 1, one process, the arms alternated. On random-weight models, which never
repeat themselves, this is the ceiling speculation reaches at ``num_speculative_tokens`` drafts
all accepted: the verification step's cost against a decode step's. Hybrids stop drafts before
block boundaries, so some steps there carry fewer or none.

A greedy token that parts from the plain run (bf16 rounds the verification's prefill path
differently at near ties) ends that request's drafts; the counts printed say how many verified.

    python tools/bench/spec_verify_cost.py --model demo-qwen3.5-0.8b --dtype float32
"""

from __future__ import annotations

import argparse
import random
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model path or demo alias")
    parser.add_argument("--dtype", default="auto", help="--dtype of the engines")
    parser.add_argument("--quantization", default=None, help="--quantization of the engines")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per verification")
    parser.add_argument("--prompt-len", type=int, default=300, help="random prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="greedy tokens per request")
    parser.add_argument("--prompts", type=int, default=2, help="requests per round, one at a time")
    parser.add_argument("--rounds", type=int, default=3, help="rounds")
    args = parser.parse_args()

    from hyprefix import LLM, SamplingParams, speculative

    common = dict(dtype=args.dtype, quantization=args.quantization, log_stats_interval=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    plain = LLM(args.model, **common)
    plain.engine.warmup()
    known = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain.generate(prompts, params, use_tqdm=False),
                                                          strict=True)]

    def right_drafts(self, tokens: list[int], k: int) -> list[int]:
        for sequence in known:
            if sequence[:len(tokens)] == tokens:
                return sequence[len(tokens):len(tokens) + k]
        return []

    speculative.DraftState.propose = right_drafts
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    spec = LLM(args.model, speculative_config=config, **common)
    spec.engine.warmup()
    times: dict[str, list[float]] = {"plain": [], "speculative": []}
    for _ in range(args.rounds):
        for name, llm in (("plain", plain), ("speculative", spec)):
            for prompt in prompts:
                llm.engine.reset_prefix_cache()
                times[name].append(llm.generate([prompt], params, use_tqdm=False)[0].tpot)
    a, b = statistics.median(times["plain"]), statistics.median(times["speculative"])
    stats = spec.get_stats()
    print(f"{args.model}: plain {a * 1e3:.1f} ms/token, speculative with right drafts {b * 1e3:.1f} ms/token = "
          f"{a / b:.2f}x ({stats['spec_decode_num_drafts']} verifications, "
          f"{stats['spec_decode_num_accepted_tokens']} of {stats['spec_decode_num_draft_tokens']} drafts accepted)")


if __name__ == "__main__":
    main()
