"""Command line: hyprefix serve | chat | generate | make-demo-model | build-kernels | bench."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time

from hyprefix.chat_cli import ChatArgs
from hyprefix.config import DEPRECATED_NAMES, EngineArgs
from hyprefix.field_flags import add_field_flag
from hyprefix.server.args import ServerArgs, add_server_flags, env_api_keys, server_args


class _StoreNamed(argparse._StoreAction):
    """Stores as usual; warns when given under a deprecated name (``DEPRECATED_NAMES``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string in _DEPRECATED_FLAGS:
            logging.getLogger("hyprefix").warning("%s is deprecated; use %s", option_string, self.option_strings[0])
        super().__call__(parser, namespace, values, option_string)


_DEPRECATED_FLAGS = {"--" + old.replace("_", "-") for old in DEPRECATED_NAMES}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field (``--no-enable-prefix-caching`` for booleans);
    a deprecated name of a field is a second spelling of its flag."""
    group = parser.add_argument_group("engine (EngineArgs; the same names as LLM(...) keyword arguments)")
    old_names = {new: old for old, new in DEPRECATED_NAMES.items()}
    for f in dataclasses.fields(EngineArgs):
        aliases = (old_names[f.name],) if f.name in old_names else ()
        add_field_flag(group, f, aliases, action=_StoreNamed)


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


def cmd_chat(ns: argparse.Namespace) -> int:
    from hyprefix.chat_cli import ChatError, Conversation, LocalChat, RemoteChat, run_chat

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()
    chat = ChatArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ChatArgs)})
    args = engine_args(ns)
    if chat.url is not None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would break the replies
        changed = [f.name for f in dataclasses.fields(EngineArgs)
                   if f.name != "model" and getattr(args, f.name) != f.default]
        if changed:
            raise ValueError(f"--url chats with a running server, whose engine is set where it was started: "
                             f"drop {', '.join('--' + n.replace('_', '-') for n in changed)}")
        try:
            backend = RemoteChat(chat.url, chat.api_key or next(iter(env_api_keys()), None), args.model)
        except ChatError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        from hyprefix.catalog import DEFAULT_MODEL
        from hyprefix.engine import Engine

        engine = Engine(args)
        engine.warmup()
        if ns.log_level.upper() == "INFO":  # the default: loading was worth telling, the stats lines are not
            logging.getLogger("hyprefix").setLevel(logging.WARNING)
        backend = LocalChat(engine, args.model or DEFAULT_MODEL)
    return run_chat(backend, chat, Conversation(chat.system))


def cmd_serve(ns: argparse.Namespace) -> int:
    engine, server = engine_args(ns), server_args(ns)
    if server.replicas:
        return _serve_replicas(engine, server)
    from hyprefix.server import run_server

    run_server(engine, server, log_level=ns.log_level)
    return 0


def _serve_replicas(engine: EngineArgs, server: ServerArgs) -> int:
    from hyprefix.replicas import require_ray

    try:
        require_ray()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from hyprefix.replicas.app import ReplicasConfig, run_replicas

    run_replicas(ReplicasConfig(engine=engine, server=server))
    return 0


def cmd_make_demo_model(ns: argparse.Namespace) -> int:
    from hyprefix.demo import make_demo_model

    path = make_demo_model(ns.arch, ns.out, size=ns.size)
    print(path)
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from hyprefix.bench.cli import run_bench

    return run_bench(ns)


def cmd_build_kernels(ns: argparse.Namespace) -> int:
    from hyprefix.kernels.prebuild import build_kernels, kernel_names
    from hyprefix.progress import progress_bar

    t0 = time.perf_counter()
    with progress_bar(total=len(kernel_names()), desc="building kernels", unit="kernel") as bar:
        def report(result) -> None:
            bar.write(result.describe())
            bar.update(1)

        results = build_kernels(ns.jobs, report=report)
    failed = [r.kernel for r in results if not r.ok]
    print(f"kernels built in {time.perf_counter() - t0:.1f}s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed and ns.strict else 0


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (``hyprefix.flag_docs`` renders its tables from it)."""
    parser = argparse.ArgumentParser(prog="hyprefix", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a status page at / "
                                         "(SmolLM2-135M-Instruct without --model)")
    add_engine_flags(serve)
    add_server_flags(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="chat in the terminal with a model (or a server's, --url), the cache's "
                                       "hits shown every turn")
    add_engine_flags(chat)
    chat_group = chat.add_argument_group("chat")
    for f in dataclasses.fields(ChatArgs):
        add_field_flag(chat_group, f)
    chat.set_defaults(func=cmd_chat)

    gen = sub.add_parser("generate", help="one-shot generation for quick checks")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt with the chat template")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("make-demo-model", help="write a deterministic random-weight demo model")
    demo.add_argument("--arch", default="dense", choices=["dense", "hybrid", "deltanet", "lfm2"],
                      help="dense: Qwen3-style; hybrid: NemotronH-style (Mamba2); deltanet: Qwen3.5-style; "
                           "lfm2: LFM2-style (short convolutions)")
    demo.add_argument("--size", default="tiny", choices=["tiny", "bench"],
                      help="tiny: for tests and the quick start; bench: the benchmark shapes (default: %(default)s)")
    demo.add_argument("--out", required=True, help="directory to write the checkpoint and tokenizer to")
    demo.set_defaults(func=cmd_make_demo_model)

    kernels = sub.add_parser("build-kernels", help="compile this CPU's kernels ahead of time (make install runs it)")
    kernels.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                         help="builds at once, one core each (default: this machine's cores, %(default)s)")
    kernels.add_argument("--strict", action="store_true",
                         help="exit with status 1 when a kernel this CPU should run does not build")
    kernels.set_defaults(func=cmd_build_kernels)

    from hyprefix.bench.cli import add_bench_parser

    add_bench_parser(sub, cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
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
