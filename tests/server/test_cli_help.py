"""Every command-line option says what it does: ``--help`` of each subcommand lists no bare
flag, and the engine flags come from ``EngineArgs`` (one definition, its help and choices)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hyprefix.cli import add_engine_flags, main
from hyprefix.config import EngineArgs


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    captured: dict[str, argparse.ArgumentParser] = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                captured.update(action.choices)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            main(["serve"])
    finally:
        argparse.ArgumentParser.parse_args = original
    return captured


def test_every_option_of_every_command_has_help():
    subparsers = _subparsers()
    assert {"serve", "generate", "bench", "make-demo-model"} <= set(subparsers)
    bare = [f"{name} {action.option_strings[0]}" for name, parser in subparsers.items() for action in parser._actions
            if action.option_strings and action.help in (None, "") and action.dest != "help"]
    assert not bare, f"options without help: {bare}"


def test_engine_flags_come_from_engine_args():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == {f.name for f in dataclasses.fields(EngineArgs)}
    for f in dataclasses.fields(EngineArgs):
        assert actions[f.name].default == f.default and f.metadata["help"] in actions[f.name].help
    assert tuple(actions["dtype"].choices) == ("auto", "float32", "bfloat16", "float16")
    help_text = parser.format_help()
    assert "--kv-cache-memory-gb KV_CACHE_MEMORY_GB" in help_text and "(default: 2.0)" in help_text
    ns = parser.parse_args(["--no-enable-prefix-caching", "--block-size", "32"])
    assert ns.enable_prefix_caching is False and ns.block_size == 32
