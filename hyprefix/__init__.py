"""hyprefix: an LLM inference engine whose prefix cache makes shared prefixes nearly free.

The public names are imported lazily (PEP 562) so that the torch-free modules
(``hyprefix.scheduler``, ``hyprefix.cache``) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyprefix.config import EngineArgs
    from hyprefix.engine import Engine
    from hyprefix.llm import LLM
    from hyprefix.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from hyprefix.sampling import SamplingParams

_EXPORTS = {
    "LLM": "hyprefix.llm",
    "CompletionOutput": "hyprefix.outputs",
    "Engine": "hyprefix.engine",
    "EngineArgs": "hyprefix.config",
    "RequestMetrics": "hyprefix.outputs",
    "RequestOutput": "hyprefix.outputs",
    "SamplingParams": "hyprefix.sampling",
}

__all__ = ["LLM", "CompletionOutput", "Engine", "EngineArgs", "RequestMetrics", "RequestOutput",
           "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyprefix' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
