"""Command line: hyprefix serve | generate | make-demo-model | bench."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from hyprefix.config import EngineArgs
from hyprefix.server.limits import ServerLimits


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field (``--no-enable-prefix-caching`` for booleans)."""
    group = parser.add_argument_group("engine (EngineArgs; the same names as LLM(...) keyword arguments)")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"] + ("" if f.default is None else " (default: %(default)s)")
        if f.type in ("bool", bool):
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                               help=f.metadata["help"])
            continue
        kind = {"int": int, "float": float, "int | None": int, "str": str, "str | None": str}.get(str(f.type), str)
        group.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=f.metadata.get("choices"),
                           help=text)


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    from hyprefix.routing.policy import RoutingRule

    group = parser.add_argument_group("replicas (Ray Serve; needs the 'replicas' extra)")
    group.add_argument("--replicas", type=int, default=0, metavar="N",
                       help="serve with N engine replicas on Ray Serve behind one app (default: 0, one engine in "
                            "this process, no Ray)")
    group.add_argument("--replica-router", choices=["prefix", "pow2"], default="prefix",
                       help="prefix: to the replica holding the longest cached prefix (from its KV events), "
                            "balanced against load; pow2: Ray Serve's power-of-two choices (blind to prefixes)")
    group.add_argument("--replica-cpus", type=float, default=None,
                       help="Ray CPUs per replica, also its torch threads (default: the cluster's CPUs / N)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster ('auto': the one `ray start --head` started here) instead of "
                            "starting a local one")
    rule = RoutingRule()
    group.add_argument("--routing-balance-abs", type=int, default=rule.balance_abs,
                       help="route to the least loaded replica when the most loaded has more than this many "
                            "requests more... (SGLang's --balance-abs-threshold; default: %(default)s)")
    group.add_argument("--routing-balance-rel", type=float, default=rule.balance_rel,
                       help="...and more than this many times as many (SGLang's --balance-rel-threshold; "
                            "default: %(default)s)")
    group.add_argument("--routing-min-match", type=float, default=rule.min_match,
                       help="else to the longest cached prefix if it covers at least this fraction of the "
                            "prompt's blocks, else least loaded (SGLang's --cache-threshold; default: %(default)s)")


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def cmd_generate(ns: argparse.Namespace) -> int:
    from hyprefix.llm import LLM
    from hyprefix.sampling import SamplingParams

    args = engine_args(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=ns.sampling_seed)
    if ns.chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([ns.prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    print(completion.text)
    m = out.metrics
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
          f"ttft={m.first_token_time - m.arrival_time:.3f}s, "
          f"total={m.finished_time - m.arrival_time:.3f}s]", file=sys.stderr)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    env_keys = [key for key in os.environ.get("HYPREFIX_API_KEY", "").split(",") if key]
    api_keys = ns.api_key or env_keys or None
    limits = ServerLimits(**{name: getattr(ns, name) for name, *_ in ServerLimits.flags()})
    if ns.replicas:
        return _serve_replicas(ns, api_keys, limits)
    from hyprefix.server import run_server

    run_server(engine_args(ns), host=ns.host, port=ns.port, model_names=ns.served_model_name, api_key=api_keys,
               cache_per_key=ns.cache_per_key,
               access_log=ns.access_log, log_level=ns.log_level, limits=limits)
    return 0


def _serve_replicas(ns: argparse.Namespace, api_keys: list[str] | None, limits: ServerLimits) -> int:
    from hyprefix.replicas import require_ray
    from hyprefix.routing.policy import RoutingRule

    try:
        require_ray()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from hyprefix.replicas.app import ReplicasConfig, run_replicas

    config = ReplicasConfig(engine=engine_args(ns), num_replicas=ns.replicas, router=ns.replica_router,
                            rule=RoutingRule(ns.routing_balance_abs, ns.routing_balance_rel, ns.routing_min_match),
                            replica_cpus=ns.replica_cpus, model_names=ns.served_model_name, api_key=api_keys,
                            cache_per_key=ns.cache_per_key, limits=limits, access_log=ns.access_log)
    run_replicas(config, host=ns.host, port=ns.port, address=ns.ray_address)
    return 0


def cmd_make_demo_model(ns: argparse.Namespace) -> int:
    from hyprefix.demo import make_demo_model

    path = make_demo_model(ns.arch, ns.out, size=ns.size)
    print(path)
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from hyprefix.bench.cli import run_bench

    return run_bench(ns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyprefix", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the demo model without --model)")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) clients use (default: --model, or hyprefix-demo)")
    serve.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/* with one of these keys (default: "
                            "$HYPREFIX_API_KEY, comma-separated)")
    serve.add_argument("--cache-per-key", action="store_true",
                       help="each API key is a tenant: its requests share cached prefixes only with requests "
                            "made with the same key, whatever cache_salt they send")
    serve.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                       help="log one line per HTTP request")
    for name, kind, default, help_text in ServerLimits.flags():
        serve.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=default,
                           help=f"{help_text} (default: %(default)s)")
    add_replica_flags(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="one-shot generation for quick checks")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt with the chat template")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("make-demo-model", help="write a deterministic random-weight demo model")
    demo.add_argument("--arch", default="dense", choices=["dense", "hybrid", "deltanet"],
                      help="dense: Qwen3-style; hybrid: NemotronH-style (Mamba2); deltanet: Qwen3.5-style")
    demo.add_argument("--size", default="tiny", choices=["tiny", "bench"],
                      help="tiny: for tests and the quick start; bench: the benchmark shapes (default: %(default)s)")
    demo.add_argument("--out", required=True, help="directory to write the checkpoint and tokenizer to")
    demo.set_defaults(func=cmd_make_demo_model)

    from hyprefix.bench.cli import add_bench_parser

    add_bench_parser(sub, cmd_bench)

    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
