"""OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``run_server`` (uvicorn)."""

from __future__ import annotations

from hyprefix.server.api import DEMO_MODEL_NAME, build_app, run_server

__all__ = ["DEMO_MODEL_NAME", "build_app", "run_server"]
