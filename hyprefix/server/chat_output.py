"""A chat choice's text as the assistant message (or stream deltas) clients expect:
reasoning split off by ``--reasoning-parser`` (``reasoning_content``, as vLLM), then tool
calls read by the request's tool mode: ``auto`` with ``--tool-call-parser``, or
``required`` / a named function, whose output the grammar engine holds to a JSON array of
calls / the function's arguments (``tool_constraint``).

gpt-oss's harmony format (``openai_gptoss`` / ``openai``, ``harmony.py``) is read whole: either
flag says the model writes harmony, so its replies are decoded with their special tokens
(``ChatOutputRules.sampling_overrides``) and split into reasoning (the analysis channel),
content and calls in one pass. Calls are returned under ``auto`` (the ``openai`` tool
parser), ``required`` and a named function (a grammar of a harmony call,
``harmony_tool_grammar``); under ``none``, or with the reasoning parser alone, a call
message is left out, never shown as content; the analysis channel is ``reasoning_content``
with either flag (vLLM reads every gpt-oss reply this way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyprefix.server.harmony import harmony_tool_grammar, read_harmony
from hyprefix.server.tool_parsers import (
    PARSERS,
    TOOL_CALL_PARSERS,
    Parsed,
    ParsedCall,
    ToolCallStreamer,
    ToolParser,
    held_back,
    json_call,
    json_value_end,
    new_call_id,
)
from hyprefix.structured.spec import StructuredOutputs

REASONING_PARSERS = ("qwen3", "openai_gptoss")
HARMONY_REASONING, HARMONY_TOOLS = "openai_gptoss", "openai"  # the parsers of gpt-oss's harmony format
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str, final: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a Qwen3-style reply: a leading ``<think>...</think>`` block
    is the reasoning (as written, less the newlines after ``<think>``), the content starts
    after the newlines that follow ``</think>``; without one the whole reply is content (with a closing tag alone, as
    when the prompt opened the block, the text before it is the reasoning). While the text
    grows, a partial tag at its end is held back."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        body = stripped[len(THINK_START):]
        if THINK_END in body:
            reasoning, content = body.split(THINK_END, 1)
            return reasoning.lstrip("\n"), content.lstrip("\n")
        return body[:len(body) - (0 if final else held_back(body, THINK_END))].lstrip("\n"), ""
    if final and THINK_END in text:
        reasoning, content = text.split(THINK_END, 1)
        return reasoning.lstrip("\n"), content.lstrip("\n")
    if not final and THINK_START.startswith(stripped):  # may be the start of <think>
        return None, ""
    return None, text


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}``."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        position = text.find("[")
        calls: list[ParsedCall] = []
        while position >= 0:
            start = text.find("{", position)
            if start < 0:
                break
            end = json_value_end(text, start)
            call = json_call(text[start:end] if end is not None else text[start:], final or end is not None)
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            position = end
        return Parsed("", calls)


class NamedParser(ToolParser):
    """A named ``tool_choice``: the whole output is the function's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [ParsedCall(self.function, text, final)])


def tool_constraint(tools: list[dict], mode: str, function: str | None, parallel: bool) -> StructuredOutputs:
    """The grammar of a ``required`` or named tool choice: a JSON array of calls, each one of
    the tools with arguments valid for its schema (one call without ``parallel``), or the
    named function's arguments."""
    def params(tool: dict) -> dict:
        return tool["function"].get("parameters") or {"type": "object"}

    if mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == function)
        return StructuredOutputs(json=params(tool))
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": params(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat-output options (``serve`` flags of vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        pairs = ((self.reasoning_parser, HARMONY_REASONING, self.tool_call_parser, HARMONY_TOOLS),
                 (self.tool_call_parser, HARMONY_TOOLS, self.reasoning_parser, HARMONY_REASONING))
        for parser, harmony, other, partner in pairs:  # harmony is read whole: its parsers go together
            if parser == harmony and other not in (None, partner):
                raise ValueError(f"{harmony} reads gpt-oss's harmony format and {other} does not: use "
                                 f"--reasoning-parser {HARMONY_REASONING} with --tool-call-parser {HARMONY_TOOLS}")


@dataclass(frozen=True)
class ChatOutputRules:
    """How a request's chat replies are read: its reasoning parser, tool mode ("none",
    "auto", "required", "named"), the named function, the tool parser name, its tools."""

    reasoning_parser: str | None = None
    tool_mode: str = "none"
    function: str | None = None
    tool_parser: str | None = None
    tools: tuple[dict, ...] = ()
    parallel_tool_calls: bool = True

    @property
    def harmony(self) -> bool:
        """Whether replies are read as gpt-oss's harmony format (either of its parsers)."""
        return self.reasoning_parser == HARMONY_REASONING or self.tool_parser == HARMONY_TOOLS

    def sampling_overrides(self) -> dict[str, Any]:
        """``SamplingParams`` arguments these rules set over the request's own: a harmony reply
        is decoded with its special tokens (the parser reads them; clients get only the parsed
        fields, whatever ``skip_special_tokens`` they sent), and a required or named tool
        choice's grammar is then a harmony call rather than JSON alone."""
        if not self.harmony:
            return {}
        overrides: dict[str, Any] = {"skip_special_tokens": False}
        if self.tool_mode in ("required", "named"):
            overrides["structured_outputs"] = harmony_tool_grammar(list(self.tools), self.function)
        return overrides

    def parser(self) -> ToolParser | None:
        """The tool parser of a reply not in harmony (None: no calls are read)."""
        if self.tool_mode == "auto":
            return PARSERS[self.tool_parser](list(self.tools))
        if self.tool_mode == "required":
            return RequiredParser()
        if self.tool_mode == "named":
            return NamedParser(self.function)
        return None


def _calls(parsed: Parsed, parallel: bool) -> list[dict[str, Any]]:
    calls = [c for c in parsed.calls if c.name is not None]
    if not parallel:
        calls = calls[:1]
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def final_message(rules: ChatOutputRules, text: str, finish_reason: str | None
                  ) -> tuple[dict[str, Any], str | None]:
    """The assistant message (content, reasoning_content, tool_calls) of a whole reply and its
    finish reason (``tool_calls`` where auto or required calls were made)."""
    if rules.harmony:
        return _harmony_message(rules, text, finish_reason)
    reasoning, content = split_reasoning(text, True) if rules.reasoning_parser else (None, text)
    message: dict[str, Any] = {"content": content, "tool_calls": []}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    parser = rules.parser()
    if parser is None:
        return message, finish_reason
    parsed = parser.parse(content, True)
    calls = _calls(parsed, rules.parallel_tool_calls)
    if not calls:
        return message, finish_reason
    message["content"] = parsed.content or None
    message["tool_calls"] = calls
    called = rules.tool_mode in ("auto", "required") and finish_reason == "stop"
    return message, "tool_calls" if called else finish_reason


def _harmony_message(rules: ChatOutputRules, text: str, finish_reason: str | None
                     ) -> tuple[dict[str, Any], str | None]:
    """``final_message`` of a harmony reply: calls only where the tool mode reads them."""
    reply = read_harmony(text, True)
    calls = _calls(Parsed(reply.content, reply.calls), rules.parallel_tool_calls) if rules.tool_mode != "none" else []
    message: dict[str, Any] = {"content": reply.content or (None if calls else ""), "tool_calls": calls}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    called = bool(calls) and rules.tool_mode in ("auto", "required") and finish_reason == "stop"
    return message, "tool_calls" if called else finish_reason


class ChatStreamer:
    """One streamed choice: each call of ``deltas`` with the choice's text so far returns the
    delta (``reasoning_content``, ``content``, ``tool_calls``) since the last one."""

    def __init__(self, rules: ChatOutputRules) -> None:
        self.rules = rules
        parser = None if rules.harmony else rules.parser()
        self.tools = ToolCallStreamer(parser) if parser is not None or rules.harmony else None
        self.reasoning_sent = 0
        self.content_sent = 0

    def deltas(self, text: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.rules.harmony:
            reply = read_harmony(text, final)
            reasoning, content = reply.reasoning, reply.content
            parsed = Parsed(content, reply.calls if self.rules.tool_mode != "none" else [])
        else:
            reasoning, content = split_reasoning(text, final) if self.rules.reasoning_parser else (None, text)
            parsed = None
        if reasoning is not None and len(reasoning) > self.reasoning_sent:
            delta["reasoning_content"] = reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(reasoning)
        if self.tools is None:
            if len(content) > self.content_sent:
                delta["content"] = content[self.content_sent:]
                self.content_sent = len(content)
            return delta
        new_content, calls = self.tools.deltas(content, final) if parsed is None else self.tools.parsed_deltas(parsed)
        if not self.rules.parallel_tool_calls:
            calls = [c for c in calls if c["index"] == 0]
        if new_content:
            delta["content"] = new_content
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called_tools(self) -> bool:
        """Whether the reply so far holds a tool call (any tool mode, a named function's too)."""
        return self.tools is not None and self.tools.called

    def finish_reason(self, reason: str | None) -> str | None:
        called = self.called_tools and self.rules.tool_mode in ("auto", "required")
        return "tool_calls" if called and reason == "stop" else reason
