"""Decode speed while the disk tier writes: time per output token of batches of fresh
requests on three engines in one process, their batches interleaved (arm order rotated
every round) so the machine's noise hits them alike:

- ``off``: no disk tier;
- ``write-back``: ``--disk-cache-dir``, a KV pool that holds about one batch, so every batch
  evicts (and writes) the one before it while it prefills and decodes;
- ``write-through``: ``--disk-cache-write-through``, every block written as it is computed.

Every arm has the same pool. Reports each arm's median TPOT over the rounds (per round:
the median over its requests of (end - first token) / (tokens - 1)), the ratio to ``off``,
the bytes each wrote and the share of its run the engine thread spent copying blocks out
for the writer (the rest of the cost is the writer thread's CPU beside the steps).

    python tools/bench/disk_write_tpot.py --model smol-q8.gguf --quantization int8
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model path or demo alias")
    parser.add_argument("--dtype", default="auto", help="--dtype of the engines")
    parser.add_argument("--quantization", default=None, help="--quantization of the engines")
    parser.add_argument("--batch", type=int, default=8, help="requests per batch, submitted together")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (random ids, fresh every batch)")
    parser.add_argument("--output-len", type=int, default=192, help="greedy tokens per request")
    parser.add_argument("--rounds", type=int, default=6, help="batches per arm")
    parser.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from hyprefix import LLM, SamplingParams

    tokens_per_batch = args.batch * (args.prompt_len + args.output_len)
    blocks = int(1.25 * tokens_per_batch / 16) + 2 * args.batch  # about one batch: the next one evicts it
    work = Path(tempfile.mkdtemp(prefix="hyprefix-disk-tpot-"))
    common = dict(dtype=args.dtype, quantization=args.quantization, num_kv_blocks=blocks, log_stats_interval=0,
                  max_num_seqs=args.batch)
    arms = {"off": LLM(args.model, **common),
            "write-back": LLM(args.model, disk_cache_dir=str(work / "back"), **common),
            "write-through": LLM(args.model, disk_cache_dir=str(work / "through"), disk_cache_write_through=True,
                                 **common)}
    for llm in arms.values():
        llm.engine.warmup()
    # The engine thread's own share: copying blocks out for the writer (``DiskConnector.before_forward``).
    copy_s = dict.fromkeys(arms, 0.0)
    for name, llm in arms.items():
        disk = llm.engine.disk
        if disk is not None:
            def timed(*a, _save=disk.before_forward, _name=name, **k):
                t0 = time.perf_counter()
                _save(*a, **k)
                copy_s[_name] += time.perf_counter() - t0
            disk.before_forward = timed
    busy_s = dict.fromkeys(arms, 0.0)
    # Every decode-only step's time, for the tail (a writer that held the GIL at low priority
    # would show there, not in the median).
    steps_ms: dict[str, list[float]] = {name: [] for name in arms}
    for name, llm in arms.items():
        def timed_step(_step=llm.engine.step, _sched=llm.engine.scheduler, _name=name):
            decode_only = bool(_sched.running) and not _sched.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in _sched.running)
            t0 = time.perf_counter()
            out = _step()
            if decode_only:
                steps_ms[_name].append((time.perf_counter() - t0) * 1e3)
            return out
        llm.engine.step = timed_step
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)
    tpot: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    try:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                prompts = [rng.choices(range(10, args.vocab), k=args.prompt_len) for _ in range(args.batch)]
                t0 = time.perf_counter()
                outs = arms[name].generate(prompts, params, use_tqdm=False)
                busy_s[name] += time.perf_counter() - t0
                per = [o.tpot for o in outs]
                tpot[name].append(statistics.median(per) * 1e3)
            print(f"round {r + 1}: " + ", ".join(f"{n} {tpot[n][-1]:.2f} ms" for n in names), flush=True)
        for llm in arms.values():
            if llm.engine.disk is not None:
                llm.engine.disk.tier.flush()  # the writes still queued
        written = {name: llm.get_stats().get("disk_cache_bytes_written", 0) for name, llm in arms.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(tpot["off"])
    result = {}
    for name in names:
        med = statistics.median(tpot[name])
        share = copy_s[name] / busy_s[name]
        steps = sorted(steps_ms[name])
        p99, worst = (steps[int(0.99 * (len(steps) - 1))], steps[-1]) if steps else (0.0, 0.0)
        result[name] = {"tpot_ms_median": med, "tpot_ms_rounds": tpot[name], "ratio_to_off": med / base,
                        "bytes_written": written[name], "engine_thread_copy_share": share,
                        "step_ms_p99": p99, "step_ms_max": worst}
        print(f"{name:>14}: TPOT median {med:.2f} ms ({med / base:.3f}x off; rounds "
              f"{min(tpot[name]):.2f}-{max(tpot[name]):.2f}), wrote {written[name] / 1e6:.0f} MB, "
              f"engine thread copying blocks out {share:.1%} of the run; steps p99 {p99:.1f} ms, max {worst:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "pool_blocks": blocks, "arms": result}, indent=1))


if __name__ == "__main__":
    main()
