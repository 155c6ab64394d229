"""``ServerArgs``: the server's own options, one definition for ``hyprefix serve``'s flags,
``run_server`` and the replicas (the engine's are ``EngineArgs``).

Each field's metadata carries its help (and choices, metavar, nargs); ``add_server_flags``
builds the command line from them, grouped by ``group``. No web framework at import: the
CLI reads the flags here."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields

from hyprefix.field_flags import add_field_flag
from hyprefix.routing.policy import RoutingRule
from hyprefix.server.chat_output import REASONING_PARSERS, ChatOptions
from hyprefix.server.limits import ServerLimits
from hyprefix.server.tool_parsers import TOOL_CALL_PARSERS

REPLICA_ROUTERS = ("prefix", "pow2")
API_KEY_ENV = "HYPREFIX_API_KEY"

_SERVER = "server"
_REPLICAS = "replicas (Ray Serve; needs the 'replicas' extra)"
_CHAT = "tool calls and reasoning (chat)"
_RULE = RoutingRule()


def _opt(default, help: str, group: str = _SERVER, **argparse_kwargs):
    return field(default=default, metadata={"help": help, "group": group, **argparse_kwargs})


@dataclass(frozen=True)
class ServerArgs:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    served_model_name: tuple[str, ...] | None = _opt(
        None, "model name(s) clients use (default: --model, or smollm2-135m-instruct)", nargs="+", metavar="NAME")
    api_key: tuple[str, ...] | None = _opt(
        None, f"require 'Authorization: Bearer KEY' on /v1/* with one of these keys (default: ${API_KEY_ENV}, "
              "comma-separated)", nargs="+", metavar="KEY")
    cache_per_key: bool = _opt(False, "each API key is a tenant: its requests share cached prefixes only with "
                                      "requests made with the same key, whatever cache_salt they send")
    access_log: bool = _opt(True, "log one line per HTTP request")
    limits: ServerLimits = field(default_factory=ServerLimits, metadata={"group": "request limits"})
    enable_auto_tool_choice: bool = _opt(
        False, "read tool calls from the model's text when a request lets it choose (tool_choice auto, the default "
               "with tools); needs --tool-call-parser", _CHAT)
    tool_call_parser: str | None = _opt(
        None, "how the model writes tool calls: hermes (<tool_call>JSON</tool_call>: Qwen2.5, Qwen3), qwen3_coder "
              "(<function=...><parameter=...>: Qwen3-Coder, Qwen3.5), llama3_json, openai (gpt-oss's harmony messages "
              "to functions.NAME; its analysis channel is reasoning_content)", _CHAT, choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _opt(
        None, "return the reply's reasoning as reasoning_content: qwen3 (<think>...</think>), openai_gptoss "
              "(gpt-oss's harmony analysis channel; tool-call messages are left out without --tool-call-parser "
              "openai)", _CHAT,
        choices=REASONING_PARSERS)
    replicas: int = _opt(0, "serve with N engine replicas on Ray Serve behind one app (0: one engine in this "
                            "process, no Ray)", _REPLICAS, metavar="N")
    replica_router: str = _opt("prefix", "prefix: to the replica holding the longest cached prefix (from its KV "
                                         "events), balanced against load; pow2: Ray Serve's power-of-two choices "
                                         "(blind to prefixes)", _REPLICAS, choices=REPLICA_ROUTERS)
    replica_cpus: float | None = _opt(None, "Ray CPUs per replica, also its torch threads (default: the cluster's "
                                            "CPUs / N)", _REPLICAS)
    ray_address: str | None = _opt(None, "join this Ray cluster ('auto': the one `ray start --head` started here) "
                                         "instead of starting a local one", _REPLICAS)
    routing_balance_abs: int = _opt(
        _RULE.balance_abs, "route to the least loaded replica when the most loaded has more than this many "
                           "requests more... (SGLang's --balance-abs-threshold)", _REPLICAS)
    routing_balance_rel: float = _opt(
        _RULE.balance_rel, "...and more than this many times as many (SGLang's --balance-rel-threshold)", _REPLICAS)
    routing_min_match: float = _opt(
        _RULE.min_match, "else to the longest cached prefix if it covers at least this fraction of the prompt's "
                         "blocks, else least loaded (SGLang's --cache-threshold)", _REPLICAS)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("served_model_name", "api_key"):  # lists from the CLI or a caller: kept as tuples
            value = getattr(self, name)
            if value is not None:
                value = (value,) if isinstance(value, str) else tuple(value)
                if not value or not all(isinstance(v, str) and v for v in value):
                    raise ValueError(f"{name} must be non-empty strings, got {value!r}")
                object.__setattr__(self, name, value)
        if self.cache_per_key and not self.api_key:
            raise ValueError("--cache-per-key needs --api-key")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.replica_router not in REPLICA_ROUTERS:
            raise ValueError(f"replica_router must be one of {REPLICA_ROUTERS}, got {self.replica_router!r}")
        if self.replica_cpus is not None and not (math.isfinite(self.replica_cpus) and self.replica_cpus > 0):
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus}")
        self.chat  # noqa: B018 - validates the chat options

    @property
    def chat(self) -> ChatOptions:
        return ChatOptions(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser)

    @property
    def model_names(self) -> list[str] | None:
        return list(self.served_model_name) if self.served_model_name else None

    @property
    def api_keys(self) -> list[str] | None:
        return list(self.api_key) if self.api_key else None

    @classmethod
    def with_env_api_key(cls, **kwargs) -> ServerArgs:
        """``ServerArgs(**kwargs)``, the keys of ``$HYPREFIX_API_KEY`` (comma-separated)
        standing in for an ``api_key`` not given."""
        if not kwargs.get("api_key"):
            kwargs["api_key"] = env_api_keys() or None
        return cls(**kwargs)


def env_api_keys() -> list[str]:
    """The keys of ``$HYPREFIX_API_KEY`` (comma-separated; empty entries dropped)."""
    return [key for key in os.environ.get(API_KEY_ENV, "").split(",") if key]


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``ServerArgs`` field (and per ``ServerLimits`` field), in its group,
    defaults shown."""
    groups: dict[str, argparse._ArgumentGroup] = {}

    def group(name: str) -> argparse._ArgumentGroup:
        if name not in groups:
            groups[name] = parser.add_argument_group(name)
        return groups[name]

    for f in fields(ServerArgs):
        if f.name == "limits":
            for limit in fields(ServerLimits):
                add_field_flag(group(f.metadata["group"]), limit)
            continue
        add_field_flag(group(f.metadata["group"]), f)


def server_args(ns: argparse.Namespace) -> ServerArgs:
    """The ``ServerArgs`` of parsed ``add_server_flags`` flags."""
    limits = ServerLimits(**{f.name: getattr(ns, f.name) for f in fields(ServerLimits)})
    values = {f.name: getattr(ns, f.name) for f in fields(ServerArgs) if f.name != "limits"}
    return ServerArgs.with_env_api_key(limits=limits, **values)
