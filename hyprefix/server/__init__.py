"""OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``run_server`` (uvicorn).

Imported lazily, so ``hyprefix.server.limits`` (the CLI's flags) loads no web framework."""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "run_server"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hyprefix.server import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
