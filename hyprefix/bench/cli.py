"""``hyprefix bench``: argument parsing and orchestration of a benchmark run."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

WORKLOADS = ("throughput",)  # shared-prefix, rl-burst, multi-turn, random: later issues


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_bench_parser(sub: argparse._SubParsersAction, func: Callable[[argparse.Namespace], int]) -> None:
    bench = sub.add_parser("bench", help="benchmark hyprefix against plain transformers",
                           description="Benchmark hyprefix against plain transformers on one workload.")
    bench.add_argument("--workload", choices=WORKLOADS, default="throughput")
    bench.add_argument("--model", default=None,
                       help="model directory or hub id (default: the Qwen3-0.6B-shaped bench demo model)")
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench.add_argument("--arms", type=_str_list, default=["hyprefix", "transformers"],
                       help="comma-separated engines to compare, run interleaved in this order")
    bench.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt length (tokens)")
    bench.add_argument("--decode-prompt-len", type=int, default=128, help="prompt length of decode requests")
    bench.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode request")
    bench.add_argument("--batch-sizes", type=_int_list, default=[1, 16], help="decode batch sizes, comma-separated")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats per case; medians are reported")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads for both arms (default: the usable CPU cores)")
    bench.add_argument("--out", default=None, help="write all numbers as JSON to this path")
    bench.set_defaults(func=func)


def run_bench(ns: argparse.Namespace) -> int:
    if ns.workload == "throughput":
        return _run_throughput(ns)
    raise ValueError(f"unknown workload {ns.workload!r}; valid: {', '.join(WORKLOADS)}")


def _run_throughput(ns: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from hyprefix.bench.env import CpuMeter, environment, load_average, usable_cores
    from hyprefix.bench.peak import measure_matmul_peak
    from hyprefix.bench.report import format_throughput, write_json
    from hyprefix.bench.throughput import ThroughputConfig, load_arm, run_throughput

    cfg = ThroughputConfig(prompt_len=ns.prompt_len, decode_prompt_len=ns.decode_prompt_len,
                           decode_tokens=ns.decode_tokens, batch_sizes=tuple(ns.batch_sizes),
                           repeats=ns.repeats, seed=ns.seed, arms=tuple(ns.arms))
    threads = ns.threads or usable_cores()
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)  # one process, so both arms run with the same thread count
    env = environment()
    meter = CpuMeter()
    meter.start()

    # peak, model build, arm loads, then warm-up and timed runs
    total = 2 + len(cfg.arms) + cfg.num_runs()
    with logging_redirect_tqdm(), tqdm(total=total, desc="bench throughput", unit="run") as bar:
        progress = _Progress(bar)
        progress(f"{ns.dtype} matmul peak")
        peak = measure_matmul_peak(dtype=getattr(torch, ns.dtype))
        progress("model")
        model = ns.model
        if model is None:
            from hyprefix.demo import demo_model_path

            model = str(demo_model_path("dense", size="bench"))
        arms: dict[str, Any] = {}
        for name in cfg.arms:
            progress(f"load {name}")
            arms[name] = load_arm(name, model, ns.dtype, cfg)
        result = run_throughput(arms, model, cfg, peak, progress=progress)
        progress.finish()

    env["load_average_at_end"] = load_average()
    result = {"model": model, "dtype": ns.dtype, "environment": env, "peak": peak.to_dict(),
              "arm_info": {name: arm.info() for name, arm in arms.items()}, "cpu_contention": meter.stop(),
              **result}
    print(format_throughput(result))
    if ns.out:
        path = write_json(result, ns.out)
        logging.getLogger("hyprefix.bench").info("wrote %s", path)
    return 0


class _Progress:
    """``progress(what)``: ``what`` starts now, so whatever was running before is done."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.running = False

    def __call__(self, what: str) -> None:
        if self.running:
            self.bar.update(1)
        self.bar.set_postfix_str(what)
        self.running = True

    def finish(self) -> None:
        if self.running:
            self.bar.update(1)
        self.running = False
        self.bar.set_postfix_str("done")
