"""The command line's one source: ``ServerArgs`` and ``EngineArgs`` fields become the flags,
deprecated names still work, and the docs' flag tables are rendered from the same parser."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

import pytest

from hyprefix.cli import build_parser, engine_args
from hyprefix.config import DEPRECATED_NAMES, EngineArgs
from hyprefix.flag_docs import DOCUMENTS, flag_table, render, stale
from hyprefix.server.args import ServerArgs, server_args
from hyprefix.server.limits import ServerLimits

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_every_server_field_is_a_flag_and_round_trips(monkeypatch):
    monkeypatch.delenv("HYPREFIX_API_KEY", raising=False)
    ns = parse("--host", "0.0.0.0", "--port", "9001", "--served-model-name", "a", "b", "--api-key", "k1",
               "--cache-per-key", "--no-access-log", "--max-request-seqs", "7", "--stream-stall-timeout", "0",
               "--replicas", "3", "--replica-router", "pow2", "--replica-cpus", "1.5", "--ray-address", "auto",
               "--routing-balance-abs", "4", "--routing-balance-rel", "2.0", "--routing-min-match", "0.5")
    got = server_args(ns)
    assert got == ServerArgs(host="0.0.0.0", port=9001, served_model_name=("a", "b"), api_key=("k1",),
                             cache_per_key=True, access_log=False,
                             limits=ServerLimits(max_request_seqs=7, stream_stall_timeout=0.0), replicas=3,
                             replica_router="pow2", replica_cpus=1.5, ray_address="auto", routing_balance_abs=4,
                             routing_balance_rel=2.0, routing_min_match=0.5)
    assert got.model_names == ["a", "b"] and got.api_keys == ["k1"]
    assert server_args(parse()) == ServerArgs()  # the flags' defaults are the dataclass's


def test_api_keys_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("HYPREFIX_API_KEY", "x,y")
    assert server_args(parse()).api_key == ("x", "y")
    assert server_args(parse("--api-key", "z")).api_key == ("z",)


@pytest.mark.parametrize("kwargs, message", [
    ({"cache_per_key": True}, "--cache-per-key needs --api-key"),
    ({"replica_router": "random"}, "replica_router"),
    ({"replicas": -1}, "replicas"),
    ({"replica_cpus": 0.0}, "replica_cpus"),
    ({"port": 70000}, "port"),
    ({"api_key": [""]}, "api_key"),
])
def test_bad_server_args_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_deprecated_engine_names_still_work_with_a_warning(caplog):
    with pytest.warns(DeprecationWarning, match="use state_cache_memory_gb"):
        args = EngineArgs(mamba_cache_memory_gb=0.25)
    assert args.state_cache_memory_gb == 0.25
    assert dataclasses.replace(args, seed=1).state_cache_memory_gb == 0.25
    assert "mamba_cache_memory_gb" not in {f.name for f in dataclasses.fields(EngineArgs)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert EngineArgs(max_state_checkpoints=9).max_state_checkpoints == 9  # the new name: no warning
    with caplog.at_level(logging.WARNING, logger="hyprefix"):
        ns = parse("--max-mamba-checkpoints", "7", "--mamba-cache-memory-gb", "0.5")
    assert (engine_args(ns).max_state_checkpoints, engine_args(ns).state_cache_memory_gb) == (7, 0.5)
    assert "--max-mamba-checkpoints is deprecated; use --max-state-checkpoints" in caplog.text
    assert set(DEPRECATED_NAMES.values()) <= {f.name for f in dataclasses.fields(EngineArgs)}


def test_the_docs_flag_tables_match_the_command_line():
    """Fails when a flag, its default or its help changed and the tables were not
    regenerated: run ``python -m hyprefix.flag_docs``."""
    assert stale(ROOT) == []
    readme = (ROOT / "README.md").read_text()
    assert "<!-- flags:serve -->" in readme  # the README carries the table of every serve flag
    for name in DOCUMENTS:
        assert "<!-- flags:" in (ROOT / name).read_text(), name


def test_a_drifted_table_is_detected_and_rewritten():
    table = flag_table("serve", "server")
    assert "`--port`" in table and "`8000`" in table
    doc = f"intro\n<!-- flags:serve:server -->\n{table.replace('8000', '8001')}<!-- /flags -->\nend\n"
    fixed = render(doc)
    assert fixed != doc and "`8000`" in fixed and "`8001`" not in fixed
    assert render(fixed) == fixed
    with pytest.raises(ValueError, match="no argument group"):
        flag_table("serve", "nonsense")
