"""``hyprefix bench``: argument parsing and orchestration of a benchmark run."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from hyprefix.config import DTYPES

WORKLOADS = ("throughput", "shared-prefix", "rl-burst", "multi-turn", "random")
PREFIX_WORKLOADS = ("shared-prefix", "rl-burst", "multi-turn", "random")
DEFAULT_ARMS = {"throughput": ["hyprefix", "transformers"]}
PREFIX_DEFAULT_ARMS = ["hyprefix", "hyprefix-nocache", "transformers"]
DEFAULT_MODEL = "demo-dense-0.6b"
# Workload flags (argparse dest) -> the workload's field, per workload; a flag given for a
# workload that does not take it is an error. None defaults mean the workload's default.
WORKLOAD_FLAGS: dict[str, dict[str, str]] = {
    "shared-prefix": {"num_requests": "num_requests", "system_len": "system_len", "suffix_len": "suffix_len",
                      "groups": "groups", "output_len": "output_len"},
    "rl-burst": {"num_prompts": "num_prompts", "num_samples": "num_samples", "prompt_len": "prompt_len",
                 "output_len": "output_len"},
    "multi-turn": {"conversations": "conversations", "turns": "turns", "system_len": "system_len",
                   "message_len": "message_len", "output_len": "output_len"},
    "random": {"num_requests": "num_requests", "prompt_len": "prompt_len", "range_ratio": "range_ratio",
               "output_len": "output_len"},
}
THROUGHPUT_ONLY_FLAGS = ("decode_prompt_len", "decode_tokens", "batch_sizes")
ENGINE_FLAGS = ("compare_model", "kv_cache_memory_gb", "mamba_cache_memory_gb", "max_num_batched_tokens")
ONLINE_FLAGS = ("url", "served_model", "max_concurrency", "request_rate")
PREFIX_ONLY_FLAGS = (*ENGINE_FLAGS, *ONLINE_FLAGS)


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
                       help="model directory or hub id, or a demo alias: demo-dense-0.6b (the default, Qwen3-0.6B-"
                            "shaped), demo-hybrid-0.5b (NemotronH-shaped), demo-dense-tiny, demo-hybrid-tiny")
    bench.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="every arm's dtype (default auto: the engine's choice for this CPU, and the same "
                            "dtype for transformers); throughput arms may name their own, e.g. hyprefix@float32")
    bench.add_argument("--arms", type=_str_list, default=None,
                       help="comma-separated engines to compare, run interleaved in this order (throughput: "
                            "hyprefix,transformers; prefix workloads: hyprefix,hyprefix-nocache,transformers)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats per case; medians are reported")
    bench.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (and sampling seeds)")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads for every arm (default: the usable CPU cores)")
    bench.add_argument("--out", default=None, help="write all numbers as JSON to this path")
    bench.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to this directory")

    thr = bench.add_argument_group("throughput workload")
    thr.add_argument("--prompt-len", type=int, default=None,
                     help="throughput: prefill prompt length (default 1024); rl-burst: prompt length (default 512); "
                          "random: mean prompt length (default 512)")
    thr.add_argument("--decode-prompt-len", type=int, default=None,
                     help="prompt length of decode requests (default 128)")
    thr.add_argument("--decode-tokens", type=int, default=None, help="new tokens per decode request (default 64)")
    thr.add_argument("--batch-sizes", type=_int_list, default=None,
                     help="decode batch sizes, comma-separated (default 1,16)")

    pre = bench.add_argument_group("request workloads (shared-prefix, rl-burst, multi-turn, random)")
    pre.add_argument("--num-requests", type=int, default=None,
                     help="shared-prefix: requests sharing a system prompt (default 8); random: requests (default 32)")
    pre.add_argument("--range-ratio", type=float, default=None,
                     help="random: prompt lengths uniform in prompt-len * (1 -/+ ratio) (default 0.5)")
    pre.add_argument("--groups", type=int, default=None,
                     help="shared-prefix: distinct system prompts, each with --num-requests requests (default 4)")
    pre.add_argument("--system-len", type=int, default=None,
                     help="shared-prefix: shared system prompt (default 1024); multi-turn: (default 256)")
    pre.add_argument("--suffix-len", type=int, default=None, help="shared-prefix: unique user suffix (default 64)")
    pre.add_argument("--num-prompts", type=int, default=None, help="rl-burst: distinct prompts (default 1)")
    pre.add_argument("--num-samples", type=int, default=None, help="rl-burst: samples per prompt (default 8)")
    pre.add_argument("--conversations", type=int, default=None, help="multi-turn: conversations (default 4)")
    pre.add_argument("--turns", type=int, default=None, help="multi-turn: turns per conversation (default 6)")
    pre.add_argument("--message-len", type=int, default=None, help="multi-turn: user message length (default 64)")
    pre.add_argument("--output-len", type=int, default=None,
                     help="output tokens per request (shared-prefix: default 16; others: 32)")
    pre.add_argument("--compare-model", default=None,
                     help="also run the hyprefix arm on this model (same token ids) and compare prefix hit rates")
    pre.add_argument("--kv-cache-memory-gb", type=float, default=None,
                     help="engine arms' KV pool (default: room for every token of the workload)")
    pre.add_argument("--mamba-cache-memory-gb", type=float, default=None,
                     help="engine arms' Mamba checkpoint pool (default 1)")
    pre.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="engine arms' token budget per step (default 2048)")
    online = bench.add_argument_group(
        "online driver (request workloads against a running OpenAI-compatible server, instead of in-process arms)")
    online.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    online.add_argument("--served-model", default=None,
                        help="model name to request (default: the first one the server lists)")
    online.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight (default: a whole round at once)")
    online.add_argument("--request-rate", type=float, default=None,
                        help="requests per second, Poisson arrivals (default: all at once)")
    pre.add_argument("--enforce-eager", action="store_true",
                     help="engine arms: no torch.compile'd kernels (quick runs on tiny models)")
    bench.set_defaults(func=func)


def resolve_model(name: str | None) -> tuple[str, str]:
    """(path or hub id, label) of a ``--model`` value: demo aliases become their cached
    directory (built on first use)."""
    from hyprefix.demo import resolve_demo_alias

    name = name or DEFAULT_MODEL
    return resolve_demo_alias(name) or name, name


def build_workload(ns: argparse.Namespace) -> Any:
    """The workload object of a prefix-cache ``--workload`` from the flags."""
    from hyprefix.bench.workloads import WORKLOAD_CLASSES

    flags = WORKLOAD_FLAGS[ns.workload]
    every = {dest for mapping in WORKLOAD_FLAGS.values() for dest in mapping}
    wrong = sorted(d for d in every - set(flags) if getattr(ns, d, None) is not None)
    if wrong:
        raise ValueError(f"--workload {ns.workload} does not take "
                         + ", ".join("--" + d.replace("_", "-") for d in wrong))
    kwargs = {field: getattr(ns, dest) for dest, field in flags.items() if getattr(ns, dest, None) is not None}
    return WORKLOAD_CLASSES[ns.workload](seed=ns.seed, **kwargs)


def run_bench(ns: argparse.Namespace) -> int:
    if ns.workload == "throughput":
        return _run_throughput(ns)
    if ns.workload in PREFIX_WORKLOADS:
        return _run_prefix(ns)
    raise ValueError(f"unknown workload {ns.workload!r}; valid: {', '.join(WORKLOADS)}")


def _run_throughput(ns: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from hyprefix.bench.arms import run_dtype
    from hyprefix.bench.env import CpuMeter, environment, load_average, usable_cores
    from hyprefix.bench.peak import measure_matmul_peak
    from hyprefix.bench.report import format_throughput, write_json
    from hyprefix.bench.throughput import ThroughputConfig, load_arm, run_throughput
    from hyprefix.hardware import DTYPES, device_caps

    given = [f for f in (*(d for m in WORKLOAD_FLAGS.values() for d in m if d != "prompt_len"),
                         *PREFIX_ONLY_FLAGS) if getattr(ns, f, None) is not None]
    if given or getattr(ns, "enforce_eager", False):
        flags = [*given, *(["enforce_eager"] if getattr(ns, "enforce_eager", False) else [])]
        raise ValueError("--workload throughput does not take " + ", ".join("--" + f.replace("_", "-") for f in flags))
    cfg = ThroughputConfig(prompt_len=1024 if ns.prompt_len is None else ns.prompt_len,
                           decode_prompt_len=128 if ns.decode_prompt_len is None else ns.decode_prompt_len,
                           decode_tokens=64 if ns.decode_tokens is None else ns.decode_tokens,
                           batch_sizes=tuple(ns.batch_sizes or (1, 16)),
                           repeats=ns.repeats, seed=ns.seed, arms=tuple(ns.arms or DEFAULT_ARMS["throughput"]))
    threads = ns.threads or usable_cores()
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)  # one process, so both arms run with the same thread count
    env = environment()
    meter = CpuMeter()
    meter.start()

    # model build, peak, arm loads, then warm-up and timed runs
    total = 2 + len(cfg.arms) + cfg.num_runs()
    caps = device_caps("cpu")
    with logging_redirect_tqdm(), tqdm(total=total, desc="bench throughput", unit="run") as bar:
        progress = _Progress(bar)
        progress("model")
        model, _ = resolve_model(ns.model)
        dtype = run_dtype(model, ns.dtype)
        progress(f"{dtype} matmul peak")
        peak = measure_matmul_peak(dtype=DTYPES[dtype])
        arms: dict[str, Any] = {}
        for name in cfg.arms:
            progress(f"load {name}")
            arms[name] = load_arm(name, model, ns.dtype, cfg)
        cpu_kind = "native-bf16" if caps.native_bf16 else "no-native-bf16"
        result = run_throughput(arms, model, cfg, peak, progress=progress, cpu_kind=cpu_kind)
        progress.finish()

    env["load_average_at_end"] = load_average()
    result = {"model": model, "dtype": _dtype_label(ns.dtype, dtype),
              "environment": env, "peak": peak.to_dict(),
              "arm_info": {name: arm.info() for name, arm in arms.items()}, "cpu_contention": meter.stop(),
              **result}
    print(format_throughput(result))
    if ns.out:
        path = write_json(result, ns.out)
        logging.getLogger("hyprefix.bench").info("wrote %s", path)
    if ns.plot:
        from hyprefix.bench.plots import plot_throughput

        for path in plot_throughput(result, ns.plot):
            logging.getLogger("hyprefix.bench").info("wrote %s", path)
    return 0


def _run_prefix(ns: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from hyprefix.bench.arms import run_dtype
    from hyprefix.bench.env import CpuMeter, environment, load_average, max_rss_gib, usable_cores
    from hyprefix.bench.online import SERVER_ARM, ServerArm
    from hyprefix.bench.prefix import COMPARE_ARM, PrefixBenchConfig, load_arm, run_prefix_bench, summarise
    from hyprefix.bench.report import format_prefix, write_json

    log = logging.getLogger("hyprefix.bench")
    wrong = [f for f in THROUGHPUT_ONLY_FLAGS if getattr(ns, f, None) is not None]
    if wrong:
        raise ValueError(f"--workload {ns.workload} does not take "
                         + ", ".join("--" + f.replace("_", "-") for f in wrong))
    workload = build_workload(ns)
    if ns.url:
        wrong = [f for f in ENGINE_FLAGS if getattr(ns, f, None) is not None]
        if wrong or ns.enforce_eager or (ns.arms and ns.arms != [SERVER_ARM]):
            flags = [*wrong, *(["enforce_eager"] if ns.enforce_eager else []), *(["arms"] if ns.arms else [])]
            raise ValueError("--url benchmarks the server's own configuration; it does not take "
                             + ", ".join("--" + f.replace("_", "-") for f in flags))
    elif ns.max_concurrency is not None or ns.request_rate is not None or ns.served_model is not None:
        raise ValueError("--max-concurrency, --request-rate and --served-model need --url (offline arms submit "
                         "each round at once)")
    elif ns.arms and SERVER_ARM in ns.arms:
        raise ValueError(f"the {SERVER_ARM} arm needs --url")
    engine_kwargs: dict[str, Any] = {k: getattr(ns, k) for k in
                                     ("kv_cache_memory_gb", "mamba_cache_memory_gb", "max_num_batched_tokens")
                                     if getattr(ns, k) is not None}
    if ns.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    default_arms = [SERVER_ARM] if ns.url else PREFIX_DEFAULT_ARMS
    cfg = PrefixBenchConfig(arms=tuple(ns.arms or default_arms), repeats=ns.repeats, dtype=ns.dtype,
                            seed=ns.seed, engine_kwargs=engine_kwargs)
    if ns.compare_model and "hyprefix" not in cfg.arms:
        raise ValueError("--compare-model compares prefix hit rates with the hyprefix arm: add it to --arms")
    threads = ns.threads or usable_cores()
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)  # one process, so every arm runs with the same thread count
    env = environment()
    meter = CpuMeter()
    meter.start()

    server = None
    if ns.url:
        server = ServerArm(ns.url, ns.served_model, max_concurrency=ns.max_concurrency,
                           request_rate=ns.request_rate, seed=ns.seed)
        server.needs_token_ids = workload.num_rounds > 1
        model, label = server.model, f"{server.model} at {ns.url}"
    else:
        model, label = resolve_model(ns.model)
    compare = resolve_model(ns.compare_model) if ns.compare_model else None
    names = [*cfg.arms, *([COMPARE_ARM] if compare else [])]
    models = {name: (compare[1] if name == COMPARE_ARM and compare else label) for name in names}
    # load + warm-up of every arm, then the timed runs
    total = 2 * len(names) + cfg.repeats * len(names)
    with logging_redirect_tqdm(), tqdm(total=total, desc=f"bench {ns.workload}", unit="run") as bar:
        progress = _Progress(bar)
        arms: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for name in names:
            progress(f"load {name}")
            path = compare[0] if name == COMPARE_ARM and compare else model
            if server is not None:
                arms[name] = server
                continue
            try:
                arms[name] = load_arm(name, path, workload, cfg)
            except Exception as exc:  # transformers may not support the architecture
                if name != "transformers":
                    raise
                log.warning("skipping the transformers arm: loading %s failed: %s", path, exc)
                skipped[name] = f"loading failed: {type(exc).__name__}: {exc}"
        runs, failed = run_prefix_bench(arms, workload, cfg.repeats, progress=progress)
        skipped.update(failed)
        progress.finish()
        bar.update(bar.total - bar.n)

    env["load_average_at_end"] = load_average()
    env["max_rss_gib"] = max_rss_gib()  # the whole process: every arm's weights and caches
    arm_info = {name: arm.info() for name, arm in arms.items()}
    if server is not None:
        server.close()
    summary = summarise(runs, workload, models, skipped)
    result = {
        "model": model,
        "models": {"model": label, "model_path": model, "compare_model": compare[1] if compare else None,
                   "compare_model_path": compare[0] if compare else None},
        "dtype": ns.dtype if server is not None else _dtype_label(ns.dtype, run_dtype(model, ns.dtype)),
        "environment": env,
        "config": {"arms": list(cfg.arms), "repeats": cfg.repeats, "seed": cfg.seed, "engine_kwargs": engine_kwargs,
                   "cache_between_repeats": "one engine per arm, reset_prefix_cache() before every timed run"},
        "arm_info": arm_info,
        "cpu_contention": meter.stop(),
        **summary,
    }
    print(format_prefix(result))
    if ns.out:
        path = write_json(result, ns.out)
        log.info("wrote %s", path)
    if ns.plot:
        from hyprefix.bench.plots import plot_prefix

        for path in plot_prefix(result, ns.plot):
            log.info("wrote %s", path)
    return 0


def _dtype_label(requested: str, resolved: str) -> str:
    """``--dtype`` as run: "auto -> float32" when auto resolved to float32."""
    return requested if resolved == requested else f"{requested} -> {resolved}"


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
