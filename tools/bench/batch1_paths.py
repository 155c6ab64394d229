"""Batch-1 time per output token of two ways one model's decode steps can run, two engines in one
process on the same model, 128-token prompts and 64 tokens, the two alternated round by round.

``kernel-graph``: the one-call ``DecodeModel`` kernel (``kernels/decode_layers.cpp``) against the
compiled batch-1 graph the same model runs without it (six rounds, medians of each).

``captured-dynamo``: the batch-1 graph as the engine calls it, captured (``runner/graph_capture``:
Inductor's code called with its flat inputs, without Dynamo) against the same graph called through
Dynamo, with its guards and then under the public
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (ten rounds each, the ratio per round).

    python tools/bench/batch1_paths.py kernel-graph MODEL.gguf
    python tools/bench/batch1_paths.py captured-dynamo [smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models.llama import LlamaForCausalLM
from hyprefix.runner.decode_graph import DecodeGraphs
from hyprefix.runner.graph_capture import backend_for

TOKENS = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)


def engine(model: str, generator: torch.Generator) -> LLM:
    """An engine, warmed up (its graph compiled) on one request."""
    llm = LLM(model, num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
    llm.generate([torch.randint(10, 4000, (128,), generator=generator).tolist()], TOKENS, use_tqdm=False)
    return llm


def engine_patched(model: str, generator: torch.Generator, owner: object, name: str, value: object) -> LLM:
    """An engine made while ``owner.name`` is ``value`` (restored after)."""
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        return engine(model, generator)
    finally:
        setattr(owner, name, kept)


def tpot_ms(llm: LLM, generator: torch.Generator) -> float:
    """Decode time per token on a fresh prompt: a request of 65 tokens less one of a single token."""
    prompt = torch.randint(10, 4000, (128,), generator=generator).tolist()
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], TOKENS, use_tqdm=False)
    return (time.perf_counter() - t - first) / (TOKENS.max_tokens - 1) * 1000


def alternated(arms: dict[str, LLM], generator: torch.Generator, rounds: int) -> dict[str, list[float]]:
    """Each arm's time per token, one request per arm per round."""
    out: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, llm in arms.items():
            out[name].append(tpot_ms(llm, generator))
    return out


def kernel_graph(model: str, generator: torch.Generator) -> None:
    kernel = engine(model, generator)
    graph = engine_patched(model, generator, LlamaForCausalLM, "use_decode_kernel", lambda self: False)
    for name, values in alternated({"kernel": kernel, "graph": graph}, generator, 6).items():
        print(f"{name}: median {statistics.median(values):.2f} ms per token ({', '.join(f'{v:.2f}' for v in values)})")
    print("decode steps by path:", kernel.engine.runner.decode_steps, graph.engine.runner.decode_steps)


def through_dynamo(llm: LLM) -> None:
    """Make ``llm``'s batch-1 graph run through Dynamo (the traced code it was captured from)."""
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    compiled = torch.compile(DecodeGraphs._step, fullgraph=True, dynamic=False, backend=backend_for(graphs._options))

    def step(inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return compiled(graphs, *inputs, runner.kv_caches, [], runner.block_size)
    graphs._steps[1] = step


def captured_dynamo(model: str, generator: torch.Generator) -> None:
    captured = engine(model, generator)
    dynamo = engine(model, generator)
    through_dynamo(dynamo)
    for phase in ("Dynamo with its guards", "skip_guard_eval_unsafe=True"):
        if phase != "Dynamo with its guards":
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        times = alternated({"captured": captured, "dynamo": dynamo}, generator, 10)
        ratios = [b / a for a, b in zip(times["captured"], times["dynamo"], strict=True)]
        print(f"{phase}: Dynamo / captured call, median {statistics.median(ratios):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)})")


COMPARISONS: dict[str, Callable[[str, torch.Generator], None]] = {
    "kernel-graph": kernel_graph, "captured-dynamo": captured_dynamo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("comparison", choices=sorted(COMPARISONS), help="which two decode paths to compare")
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct",
                        help="a model path or name (default: %(default)s, whose batch-1 steps run a graph)")
    args = parser.parse_args()
    COMPARISONS[args.comparison](args.model, torch.Generator().manual_seed(0))


if __name__ == "__main__":
    main()
