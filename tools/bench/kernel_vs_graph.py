"""Batch-1 time per output token of the one-call ``DecodeModel`` kernel (``kernels/decode_layers.cpp``)
against the compiled batch-1 decode graph the same model runs without it: two engines in one
process, 128-token prompts, 64 tokens, the two alternated over six rounds (medians).

    python tools/bench/kernel_vs_graph.py MODEL.gguf
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models.llama import LlamaForCausalLM


def tpot_ms(llm: LLM, prompt: list[int], tokens: SamplingParams) -> float:
    """Decode time per token: a request of 65 tokens less one of a single token."""
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], tokens, use_tqdm=False)
    return (time.perf_counter() - t - first) / (tokens.max_tokens - 1) * 1000


def main() -> None:
    path = sys.argv[1]
    kernel = LLM(path, num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
    original = LlamaForCausalLM.use_decode_kernel
    LlamaForCausalLM.use_decode_kernel = lambda self: False  # this engine's runner compiles its decode steps
    graph = LLM(path, num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
    LlamaForCausalLM.use_decode_kernel = original
    g = torch.Generator().manual_seed(0)
    tokens = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    for llm in (kernel, graph):  # warm-up (the graph's compile)
        llm.generate([torch.randint(10, 4000, (128,), generator=g).tolist()], tokens, use_tqdm=False)
    results: dict[str, list[float]] = {"kernel": [], "graph": []}
    for _ in range(6):
        for name, llm in (("kernel", kernel), ("graph", graph)):
            results[name].append(tpot_ms(llm, torch.randint(10, 4000, (128,), generator=g).tolist(), tokens))
    for name, values in results.items():
        print(f"{name}: median {statistics.median(values):.2f} ms per token ({', '.join(f'{v:.2f}' for v in values)})")
    print("decode steps by path:", kernel.engine.runner.decode_steps, graph.engine.runner.decode_steps)


if __name__ == "__main__":
    main()
