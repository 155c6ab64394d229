"""The package's shape rules (docs/development.md): no module over 500 lines, no function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hyprefix"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_module_over_500_lines_and_no_function_over_80():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long


# The front ends: what users call (LLM, the server and its engine loop, the replicas, the chat
# client, the bench's in-process arms). They reach the engine only through ``Engine.API``.
FRONT_ENDS = ["llm.py", "async_engine.py", "chat_cli.py", "server", "replicas", "bench/arms.py"]


def _engine_attributes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every ``<...>engine.name`` read: a variable or attribute called ``engine``
    (``engine.x``, ``self.engine.x``, ``self.llm.engine.x``), outside ``*Config`` classes, whose
    ``engine`` field holds ``EngineArgs``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            skip.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in skip:
            continue
        receiver = node.value
        named = (isinstance(receiver, ast.Name) and receiver.id == "engine") or (
            isinstance(receiver, ast.Attribute) and receiver.attr == "engine")
        if named:
            found.append((node.lineno, node.attr))
    return found


def test_front_ends_use_only_the_engines_documented_api():
    from hyprefix.engine import Engine

    paths = [p for entry in FRONT_ENDS for p in ([PACKAGE / entry] if entry.endswith(".py")
                                                  else sorted((PACKAGE / entry).rglob("*.py")))]
    outside = []
    seen = set()
    for path in paths:
        for line, name in _engine_attributes(ast.parse(path.read_text())):
            seen.add(name)
            if name not in Engine.API:
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line} engine.{name}")
    assert not outside, outside
    assert {"add_requests", "step", "abort", "get_stats"} <= seen  # the check sees the front ends' calls
    assigned = Engine.__init__.__code__.co_names  # (``self.name = ...`` in ``__init__``)
    missing = [name for name in Engine.API if not hasattr(Engine, name) and name not in assigned]
    assert not missing, missing  # every API name exists
