"""OpenAI-shaped response models and the chunks of a streamed response (server-sent events).
Their requests are ``protocol.py``'s."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    def add(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.prompt_tokens_details.cached_tokens += cached_tokens


class CacheRetention(BaseModel):
    """What the request's ``cache_control`` (or the server's ``--tool-call-retention-s``) got: its
    prefix's first ``tokens`` tokens kept ``ttl_s`` seconds after it finished (capped by the
    server's limits; 0 and 0: nothing kept). The least over the call's choices."""

    ttl_s: float
    tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, log-probability, the top
    ones by text, and where its text starts in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one prompt logprob entry (``prompt_logprobs``: per position, token id -> this)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids: the ids the engine was fed
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    cache_retention: CacheRetention | None = None  # where a retention was asked (cache_control)
    priority: int | None = None  # the priority granted, where the request sent one (--highest-request-priority)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's field)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: the rendered conversation's ids
    cache_retention: CacheRetention | None = None  # where a retention was asked or tool calls were kept
    priority: int | None = None  # the priority granted, where the request sent one (--highest-request-priority)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: each token as the vocabulary spells it


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hyprefix"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ----------------------------------------------------------- stream chunks
def completion_chunk(request_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None = None, token_ids: list[int] | None = None,
                     logprobs: dict[str, Any] | None = None, stop_reason: str | int | None = None,
                     prompt_token_ids: list[int] | None = None,
                     retention: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if retention is not None:  # a choice's final chunk: what its retention got
        chunk["cache_retention"] = retention
    return chunk


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
               stop_reason: str | int | None = None, token_ids: list[int] | None = None,
               prompt_token_ids: list[int] | None = None, retention: dict[str, Any] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [choice]}
    if prompt_token_ids is not None:  # vLLM's: top level, as on the whole response
        chunk["prompt_token_ids"] = prompt_token_ids
    if retention is not None:  # a choice's final chunk: what its retention got
        chunk["cache_retention"] = retention
    return chunk


def usage_chunk(request_id: str, created: int, model: str, object: str, usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": object, "created": created, "model": model, "choices": [],
            "usage": usage.model_dump()}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"
