"""OpenAI-shaped request models (their responses are ``responses.py``'s).

Requests are validated strictly (a string is not a number, a float is not an
integer). A field this server does not know is a 400 naming it, never silently
ignored; fields OpenAI or vLLM define that hyprefix cannot honour are accepted only at
their neutral value (``unsupported``). ``null`` is accepted wherever OpenAI accepts it.
docs/serving.md has the table of every field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hyprefix.errors import RequestError
from hyprefix.sampling import MAX_PRIORITY, MIN_PRIORITY
from hyprefix.structured.spec import StructuredOutputs
from hyprefix.text import ChatPrompt


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


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
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's; only its neutral value

    def unsupported(self) -> list[str]:
        return ["stream_options.continuous_usage_stats"] if self.continuous_usage_stats else []


TokenId = Annotated[int, Field(ge=0)]

# Anthropic's default cache_control ttl ("5m"); units its ttl strings and Dynamo's take
DEFAULT_CACHE_TTL_S = 300.0
_TTL = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*")
_TTL_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


class CacheControl(_Request):
    """Keep this request's prefix cached after it finishes (``SamplingParams.cache_ttl_s``):
    Anthropic's prompt-caching marker, ``{"type": "ephemeral", "ttl": "5m"}``, as SGLang's and
    Dynamo's pinning take it, on the request. ``ttl``: "30s", "5m", "1h" or a number of seconds
    (default "5m"); capped by the server's ``--max-retention-s`` (the response's
    ``cache_retention`` says what was granted)."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | int | float | None = None

    def seconds(self) -> float:
        """The ttl in seconds; ``RequestError`` (a 400, ``param: "cache_control"``) when it is not
        a duration >= 0."""
        ttl = self.ttl
        if ttl is None:
            return DEFAULT_CACHE_TTL_S
        if isinstance(ttl, str):
            match = _TTL.fullmatch(ttl)
            if match is None:
                raise RequestError(f'cache_control ttl must be a duration such as "30s", "5m", "1h" or a number of '
                                   f"seconds, got {ttl!r}", param="cache_control")
            ttl = float(match[1]) * _TTL_UNITS[match[2]]
        if not math.isfinite(ttl) or ttl < 0:
            raise RequestError(f"cache_control ttl must be a number of seconds >= 0, got {self.ttl!r}",
                               param="cache_control")
        return float(ttl)


class _SamplingRequest(_Request):
    model: str | None = None
    # vLLM's: the client's id for the call (the response id is "cmpl-" / "chatcmpl-" and it), which
    # /abort_request takes as its ``rid``; two calls in flight cannot share one
    request_id: str | None = Field(None, min_length=1, max_length=256)
    n: int | None = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # OpenAI fields with no effect on the output, accepted at these values
    store: bool | None = False
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # extensions (vLLM names and meanings)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    cache_salt: str | None = Field(None, min_length=1)
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    prompt_logprobs: int | None = Field(None, ge=-1)
    return_token_ids: bool | None = False  # each choice (and stream chunk) carries its token ids
    # vLLM's: lower is served earlier under --scheduling-policy priority; non-zero is a 400 under the others
    priority: int | None = Field(None, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # keep the prefix after the request finishes (Anthropic's shape; cache/retention.py)
    cache_control: CacheControl | None = None
    # structured outputs: vLLM's field, and its older guided_* names
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> list[str]:
        """Names of fields set to something this server cannot do."""
        bad = ["store"] if self.store else []
        return bad + (self.stream_options.unsupported() if self.stream_options else [])

    def structured(self) -> tuple[str, StructuredOutputs] | None:
        """The output constraint and the field that set it; a 400 when two fields set one."""
        given: list[tuple[str, StructuredOutputs]] = []
        if self.structured_outputs is not None:
            given.append(("structured_outputs", _structured(self.structured_outputs, "structured_outputs")))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                given.append((name, _structured({name.removeprefix("guided_"): value}, name)))
        given += self._response_format() + self._tool_constraint()
        if len(given) > 1:
            raise APIError(400, f"set one output constraint, not {' and '.join(name for name, _ in given)}",
                           param=given[1][0])
        return given[0] if given else None

    def _response_format(self) -> list[tuple[str, StructuredOutputs]]:
        return []

    def _tool_constraint(self) -> list[tuple[str, StructuredOutputs]]:
        return []

    def logprobs_wanted(self) -> int | None:
        """Top logprobs per output token (0: the sampled token's alone); None: none."""
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` arguments shared by both endpoints (not max_tokens); a field left
        out or null takes the ``SamplingParams`` default."""
        kwargs: dict[str, Any] = {}
        for name in ("n", "seed", "stop", "ignore_eos", "stop_token_ids", "temperature", "top_p", "min_p",
                     "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "bad_words",
                     "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "priority"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.top_k is not None:
            kwargs["top_k"] = -1 if self.top_k == 0 else self.top_k
        if self.logit_bias:
            kwargs["logit_bias"] = _token_keys(self.logit_bias)
        if self.cache_control is not None:
            kwargs["cache_ttl_s"] = self.cache_control.seconds()
        if self.logprobs_wanted() is not None:
            kwargs["logprobs"] = self.logprobs_wanted()
        structured = self.structured()
        if structured is not None:
            kwargs["structured_outputs"] = structured[1]
        return kwargs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1


def _structured(fields: dict[str, Any], param: str) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except TypeError as exc:
        unknown = sorted(set(fields) - set(StructuredOutputs.__dataclass_fields__))
        raise APIError(400, f"{param}: {', '.join(unknown) or 'a field'} is not supported by this server",
                       param=param) from exc
    except RequestError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from exc


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """logit_bias's keys (token ids as JSON strings) as ints; a 400 naming a bad key."""
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of != self.choices:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = self.logprobs  # echo gives the prompt's logprobs too (OpenAI)
        return kwargs

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's name)
    # Sent back by clients that replay an assistant message as they received it; no effect.
    refusal: str | None = None
    annotations: list[Any] | None = None
    function_call: None = None
    audio: None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: text content joined, tool calls with their
        arguments parsed from JSON (templates format them as objects), as vLLM gives them."""
        content = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _json_arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:  # Qwen's templates read it as such, gpt-oss's as ``thinking``
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


def _json_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"a tool call's arguments are not valid JSON: {exc}", param="messages") from exc


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class _ChatTemplate(_Request):
    """A conversation and how to render it: the fields the chat endpoint and the chat form
    of ``/tokenize`` share, so both render a conversation into the same token ids."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's field (gpt-oss reads it in its template): a 400 where the template does not take it
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools or ()]

    def chat_prompt(self) -> ChatPrompt:
        """The conversation and how to render it (``text.chat_token_ids``)."""
        return ChatPrompt(
            [m.template_dict() for m in self.messages],
            self.tool_dicts() or None,
            add_generation_prompt=self.add_generation_prompt is not False,
            continue_final_message=bool(self.continue_final_message), chat_template=self.chat_template,
            template_kwargs=dict(self.chat_template_kwargs or {}), reasoning_effort=self.reasoning_effort,
            # with tool_choice "auto" (the default) only the template tells the model the tools exist
            tools_must_render=bool(self.tools) and getattr(self, "tool_choice", None) in (None, "auto"))


class ChatCompletionRequest(_SamplingRequest, _ChatTemplate):
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    echo: bool | None = False  # vLLM's

    def tool_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function): ``tool_choice``, by
        default "auto" with tools and "none" without; a 400 for a choice the tools cannot meet."""
        choice = self.tool_choice
        if choice is None:
            return ("auto" if self.tools else "none"), None
        if isinstance(choice, str):
            if choice != "none" and not self.tools:
                raise APIError(400, f'tool_choice "{choice}" needs tools', param="tool_choice")
            return choice, None
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', param="tool_choice")
        if name not in [tool.function.name for tool in self.tools or ()]:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return "named", name

    def _tool_constraint(self) -> list[tuple[str, StructuredOutputs]]:
        mode, function = self.tool_mode()
        if mode not in ("required", "named"):
            return []
        from hyprefix.server.chat_output import tool_constraint

        return [("tool_choice", tool_constraint(self.tool_dicts(), mode, function,
                                                self.parallel_tool_calls is not False))]

    def _response_format(self) -> list[tuple[str, StructuredOutputs]]:
        """OpenAI's response_format as a constraint: json_object, or json_schema (strict or not,
        the output always matches the schema)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return []
        if fmt.type == "json_object":
            return [("response_format", StructuredOutputs(json_object=True))]
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        return [("response_format", _structured({"json": fmt.json_schema.schema_}, "response_format"))]

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self, num_prompt_tokens: int, max_total_tokens: int) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else whatever room the
        prompt leaves in ``max_total_tokens`` (the context, capped by the KV pool)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return max(1, max_total_tokens - num_prompt_tokens)


class TokenizeCompletionRequest(_Request):
    """vLLM's ``/tokenize`` of a text: its ids as ``/v1/completions`` would feed them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplate):
    """vLLM's ``/tokenize`` of a conversation: rendered exactly as ``/v1/chat/completions``
    renders it. ``add_special_tokens`` (off by default, as the template writes its own)
    tokenizes the rendered text with the tokenizer's special tokens added."""

    model: str | None = None
    add_special_tokens: bool | None = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------- responses
