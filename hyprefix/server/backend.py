"""What the OpenAI app serves from: ``ServingBackend``, and ``LocalBackend``, one engine
in this process (``hyprefix serve``). ``hyprefix.replicas`` has the Ray Serve one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from hyprefix.async_engine import AsyncEngine
from hyprefix.engine import Engine
from hyprefix.errors import RequestError
from hyprefix.metrics import ServerMetrics
from hyprefix.server.chat_output import ChatOptions
from hyprefix.server.limits import ServerLimits
from hyprefix.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from hyprefix.server.responses import DetokenizeResponse, TokenizeResponse
from hyprefix.server.serving import OpenAIServing, Tokenization, request_error
from hyprefix.server.status import engine_status

# A generation endpoint answers a response (a pydantic model or its dict) or, for a
# stream, an iterator of SSE events; client errors raise ``APIError``.
Answer = Any | AsyncIterator[str]


class ServingBackend(Protocol):
    model_names: list[str]
    max_model_len: int

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def health(self) -> str:
        """"ok", or why not ("dead", "stopping", ...): the app answers 503 then."""

    async def metrics_text(self) -> bytes: ...

    async def status(self) -> dict[str, Any]:
        """``/status``: the engine's stats, configuration and last requests (``server/status.py``)."""

    async def reset_prefix_cache(self) -> int: ...

    async def completions(self, body: CompletionRequest, tenant: str | None) -> Answer: ...

    async def chat(self, body: ChatCompletionRequest, tenant: str | None) -> Answer: ...

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """vLLM's ``/tokenize``: without the engine thread (``serving.Tokenization``)."""

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse: ...

    # generation control (``server/control.py``)
    async def update_weights(self, model_path: str, weight_version: str | None,
                             abort_all_requests: bool) -> dict[str, Any]: ...

    async def weight_version(self) -> str: ...

    async def pause(self, mode: str) -> int: ...

    async def resume(self) -> None: ...

    async def abort(self, rid: str | None) -> int:
        """Abort a call by id (None: every request in flight); returns how many requests."""


class LocalBackend:
    """One engine on its own thread in this process. ``replica`` labels its metrics
    (a replica of a Ray Serve deployment)."""

    def __init__(self, engine: Engine, model_names: list[str], limits: ServerLimits | None = None,
                 replica: str | None = None, chat: ChatOptions | None = None) -> None:
        self.engine = engine
        self.replica = replica
        self.started_at = time.time()
        self.model_names = model_names
        self.max_model_len = engine.max_model_len
        self.limits = limits or ServerLimits()
        self.async_engine = AsyncEngine(engine, stall_timeout=self.limits.stream_stall_timeout or None)
        self.metrics = ServerMetrics(lambda: self.async_engine.stats, model_names[0], replica=replica)
        self.async_engine.on_outputs = self.metrics.observe
        self.serving = OpenAIServing(self.async_engine, model_names, self.limits, chat)
        self.tokenization = Tokenization(engine.tokenizer, engine.vocab_size, engine.max_model_len, model_names)

    def start(self) -> None:
        self.async_engine.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.async_engine.shutdown)

    async def health(self) -> str:
        if self.async_engine.is_running:
            return "ok"
        return "dead" if self.async_engine.dead else "stopping"

    async def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    async def status(self) -> dict[str, Any]:
        args = self.engine.args
        config = {"block_size": args.block_size, "max_model_len": self.max_model_len,
                  "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": args.enable_prefix_caching,
                  "disk_cache_bytes_capacity": int(args.disk_cache_gb * 2**30) if args.disk_cache_dir else 0}
        return engine_status(self.model_names, self.async_engine.stats, self.metrics.recent.snapshot(), config,
                             self.started_at, self.replica)

    async def reset_prefix_cache(self) -> int:
        return await self.async_engine.call(self.engine.reset_prefix_cache)

    async def completions(self, body: CompletionRequest, tenant: str | None) -> Answer:
        return await self.serving.completions(body, tenant)

    async def chat(self, body: ChatCompletionRequest, tenant: str | None) -> Answer:
        return await self.serving.chat(body, tenant)

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        return await self.tokenization.tokenize(body)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        return await self.tokenization.detokenize(body)

    async def update_weights(self, model_path: str, weight_version: str | None,
                             abort_all_requests: bool) -> dict[str, Any]:
        try:
            return await self.async_engine.update_weights(model_path, weight_version, abort_all_requests)
        except RequestError as exc:
            raise request_error(exc, "model_path") from exc

    async def weight_version(self) -> str:
        return self.engine.weight_version

    async def pause(self, mode: str) -> int:
        return await self.async_engine.pause(mode)

    async def resume(self) -> None:
        await self.async_engine.resume()

    async def abort(self, rid: str | None) -> int:
        return await self.serving.abort(rid)
