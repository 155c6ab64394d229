"""Sliding-window KV memory on a long-context workload.

Runs the same requests twice through the engine: with the sliding-window layers'
K/V in a pool of their own (blocks given back as they leave the window: the
default) and with every layer's K/V in the main pool (``disable_hybrid_swa_memory``:
every block kept). After every step it reads how many blocks each pool has in use
and reports the peak K/V bytes in use, whether the greedy tokens of both runs
agree (exactly in float32; in bf16 the window pool's shorter attention rows round
differently, and random-token prompts have near-ties), and a second round that
shares each prompt's prefix (hits longer than the window).

    python tools/bench/swa_memory.py                      # Gemma 3 270M GGUF (fetched by make test)
    python tools/bench/swa_memory.py --model DIR --prompt-len 8192 --requests 4 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(model: str, dtype: str, prompts: list[list[int]], followups: list[list[int]], output_len: int,
        window_pool: bool) -> dict:
    from hyprefix import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory_gb=4.0, max_num_seqs=len(prompts),
              disable_hybrid_swa_memory=not window_pool, log_stats_interval=0)
    engine = llm.engine
    per_block = engine.memory_bytes["kv_pool"] // engine.cache.kv.num_blocks
    swa = engine.memory_bytes["swa_pool"]
    per_window_block = swa // max(1, engine.get_stats()["swa_blocks_total"]) if swa else 0
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    result: dict = {"window_pool": window_pool, "rounds": []}
    for name, batch in (("long prompts", prompts), ("shared prefixes", followups)):
        for i, p in enumerate(batch):
            engine.add_request(f"{name}-{i}", {"prompt_token_ids": p}, params)
        peak, peak_blocks, tokens, cached = 0, (0, 0), {}, {}
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
                    cached[out.request_id] = out.num_cached_tokens
            stats = engine.get_stats()
            used = stats["kv_blocks_used"] * per_block + stats["swa_blocks_used"] * per_window_block
            if used > peak:
                peak, peak_blocks = used, (stats["kv_blocks_used"], stats["swa_blocks_used"])
        result["rounds"].append({"round": name, "seconds": time.perf_counter() - t0, "peak_kv_bytes": peak,
                                 "peak_blocks_main_swa": peak_blocks, "tokens": tokens,
                                 "cached_tokens": sorted(cached.values())})
    result["stats"] = engine.get_stats()
    result["pool_bytes"] = {"main_per_block": per_block, "swa_per_block": per_window_block}
    engine.check_invariants()
    return result


def main() -> None:
    from hyprefix.catalog import GEMMA3, fetch_model
    from hyprefix.hardware import device_caps

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the Gemma 3 270M GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model = args.model or str(fetch_model(GEMMA3))

    from hyprefix.models.loader import load_config, resolve_model_dir

    vocab = int(load_config(resolve_model_dir(model)).vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    # Round 2: each prompt's first 3/4 plus a new tail (a hit longer than the window).
    followups = [p[: 3 * len(p) // 4] + [rng.randrange(3, vocab) for _ in range(64)] for p in prompts]
    runs = [run(model, args.dtype, prompts, followups, args.output_len, window_pool=w) for w in (True, False)]
    own, shared = runs
    mib = 2**20
    print(f"CPU: {device_caps('cpu').name}; {args.requests} requests x {args.prompt_len} prompt tokens "
          f"+ {args.output_len} output, then {args.requests} follow-ups sharing 3/4 of each prompt")
    for i, name in enumerate(("long prompts", "shared prefixes")):
        a, b = own["rounds"][i], shared["rounds"][i]
        same = sum(a["tokens"][k] == b["tokens"][k] for k in a["tokens"])
        print(f"{name}: peak K/V in use {a['peak_kv_bytes'] / mib:.1f} MiB with the window pool vs "
              f"{b['peak_kv_bytes'] / mib:.1f} MiB keeping every block ({b['peak_kv_bytes'] / a['peak_kv_bytes']:.2f}x"
              f" less); blocks (main, window) {a['peak_blocks_main_swa']} vs {b['peak_blocks_main_swa']}; "
              f"wall time ratio keep-all / window pool {b['seconds'] / a['seconds']:.2f}; cached tokens "
              f"{a['cached_tokens']} vs {b['cached_tokens']}; greedy outputs equal for {same}/{len(a['tokens'])} "
              "requests")
    print(f"window blocks given back by running requests: {own['stats']['swa_blocks_released']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
