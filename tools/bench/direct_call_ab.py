"""What ``runner/decode_graph._direct_call`` (the batch-1 graph called with its flat inputs,
without the bytecode Dynamo made to gather them) buys against Dynamo's own call, with its guards
and with public ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: two engines in one
process on the same model, batch-1 time per token alternated over ten rounds, the ratio per round.

    python tools/bench/direct_call_ab.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hyprefix.runner.decode_graph as decode_graph
from hyprefix import LLM, SamplingParams

TOKENS = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)


def engine(model: str, generator: torch.Generator) -> LLM:
    llm = LLM(model, num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
    llm.generate([torch.randint(10, 4000, (128,), generator=generator).tolist()], TOKENS, use_tqdm=False)  # compile
    return llm


def tpot_ms(llm: LLM, generator: torch.Generator) -> float:
    prompt = torch.randint(10, 4000, (128,), generator=generator).tolist()
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], TOKENS, use_tqdm=False)
    return (time.perf_counter() - t - first) / (TOKENS.max_tokens - 1) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model whose batch-1 steps run a graph")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    direct = engine(args.model, generator)
    kept = decode_graph._direct_call
    decode_graph._direct_call = lambda *_args, **_kwargs: None  # the next engine's step goes through Dynamo
    dynamo = engine(args.model, generator)
    decode_graph._direct_call = kept
    for phase in ("Dynamo with its guards", "skip_guard_eval_unsafe=True"):
        if phase != "Dynamo with its guards":
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        ratios = [tpot_ms(dynamo, generator) / tpot_ms(direct, generator) for _ in range(10)]
        print(f"{phase}: Dynamo / direct call, median {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
