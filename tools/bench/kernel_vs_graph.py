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

path = sys.argv[1]
kernel = LLM(path, num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
orig = LlamaForCausalLM.use_decode_kernel
LlamaForCausalLM.use_decode_kernel = lambda self: False
graph = LLM(path, num_kv_blocks=256, log_stats_interval=0, enable_prefix_caching=False)
LlamaForCausalLM.use_decode_kernel = orig
g = torch.Generator().manual_seed(0)
sp = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
one = SamplingParams(temperature=0, max_tokens=1)
res = {"kernel": [], "graph": []}
for llm in (kernel, graph):
    llm.generate([torch.randint(10, 4000, (128,), generator=g).tolist()], sp, use_tqdm=False)  # warm / compile
for _ in range(6):
    for name, llm in (("kernel", kernel), ("graph", graph)):
        p = torch.randint(10, 4000, (128,), generator=g).tolist()
        t = time.perf_counter(); llm.generate([p], one, use_tqdm=False); t1 = time.perf_counter() - t
        t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); t2 = time.perf_counter() - t
        res[name].append((t2 - t1) / 64 * 1000)
print(path, {k: (round(statistics.median(v), 2), [round(x, 2) for x in v]) for k, v in res.items()},
      kernel.engine.runner.decode_steps, graph.engine.runner.decode_steps)
