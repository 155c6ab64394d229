"""OpenAI-shaped request and response models.

Requests are validated strictly (a string is not a number, a float is not an
integer); unknown fields are ignored, as OpenAI clients send optional ones this
server does not know. Fields OpenAI defines that hyprefix cannot honour are
accepted only at their neutral value, so a request is never silently served
differently from what it asked for.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ------------------------------------------------------------------ errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()


# ---------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # OpenAI fields hyprefix cannot honour: accepted only at their neutral value
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[str]:
        """Names of fields set to something this server cannot do."""
        bad = [name for name in ("frequency_penalty", "presence_penalty") if getattr(self, name)]
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def sampling_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` arguments shared by both endpoints (not max_tokens)."""
        kwargs: dict[str, Any] = dict(n=self.n, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                                      stop_token_ids=self.stop_token_ids)
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k is not None:
            kwargs["top_k"] = -1 if self.top_k == 0 else self.top_k
        return kwargs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    return_token_ids: bool = False  # vLLM extension: each choice (and stream chunk) carries its token ids
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs is not None:
            bad.append("logprobs")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        content = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content or ""
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(_Request):
    type: str


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs or self.top_logprobs:
            bad.append("logprobs")
        if self.tools:
            bad.append("tools")
        if self.response_format is not None and self.response_format.type != "text":
            bad.append("response_format")
        return bad

    def max_new_tokens(self, num_prompt_tokens: int, max_total_tokens: int) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else whatever room the
        prompt leaves in ``max_total_tokens`` (the context, capped by the KV pool)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return max(1, max_total_tokens - num_prompt_tokens)


# --------------------------------------------------------------- responses
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


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
                     finish_reason: str | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict[str, str],
               finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, created: int, model: str, object: str, usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "object": object, "created": created, "model": model, "choices": [],
            "usage": usage.model_dump()}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"
