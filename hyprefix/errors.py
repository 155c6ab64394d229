"""The engine's typed user errors (no torch)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses because of what the caller sent, never an internal
    failure. ``param`` names the offending field (OpenAI's error ``param``: ``prompt``,
    ``messages``, ``max_tokens``, ...), ``code`` is OpenAI's error code where one exists
    (``context_length_exceeded``). A ``ValueError``, so offline callers catch it as one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
