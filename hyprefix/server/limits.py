"""What one HTTP call may ask for: the ``hyprefix serve`` limits (flags of the same names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerLimits:
    max_request_seqs: int = field(default=256, metadata={
        "help": "most sequences (prompts x n) one request may ask for; more is a 400"})
    max_request_tokens: int = field(default=1 << 20, metadata={
        "help": "most tokens one request may ask for, n x (prompt tokens + max_tokens) over its prompts; "
                "more is a 400"})
    max_request_body_mb: float = field(default=16.0, metadata={
        "help": "answer 413 to a request body over this many MiB"})
    stream_stall_timeout: float = field(default=60.0, metadata={
        "help": "abort a stream whose client has read nothing for this many seconds while output waits "
                "(0: never)"})

    def __post_init__(self) -> None:
        for name in ("max_request_seqs", "max_request_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (math.isfinite(self.max_request_body_mb) and self.max_request_body_mb > 0):
            raise ValueError(f"max_request_body_mb must be a number > 0, got {self.max_request_body_mb!r}")
        if not (math.isfinite(self.stream_stall_timeout) and self.stream_stall_timeout >= 0):
            raise ValueError(f"stream_stall_timeout must be a number >= 0, got {self.stream_stall_timeout!r}")

    @property
    def max_body_bytes(self) -> int:
        return max(1, int(self.max_request_body_mb * 2**20))

    def check_seqs(self, num_prompts: int, n: int) -> None:
        from hyprefix.server.protocol import APIError  # not at import: the CLI reads the flags here

        if num_prompts * n > self.max_request_seqs:
            raise APIError(400, f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                           f"n={n}); the server allows at most {self.max_request_seqs} per request "
                           "(--max-request-seqs)", param="n", code="request_too_large")
