"""Package layering: kernels build on torch alone, never on the models that use them."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hyprefix"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_kernels_do_not_import_models_or_the_runner():
    offenders = {path.name: sorted(m for m in imported_modules(path)
                                   if m.startswith(("hyprefix.models", "hyprefix.runner", "hyprefix.engine")))
                 for path in sorted((PACKAGE / "kernels").glob("*.py"))}
    assert not {name: mods for name, mods in offenders.items() if mods}
