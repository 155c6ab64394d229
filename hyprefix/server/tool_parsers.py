"""Tool calls in a model's text, by the formats vLLM's ``--tool-call-parser`` names:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3);
* ``qwen3_coder``: ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``
  (Qwen3-Coder, Qwen3.5), each value converted by the tool's parameter schema;
* ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``), several separated by ``;``;
* ``openai``: gpt-oss's harmony messages to ``functions.NAME`` (``harmony.py``, which reads the
  reasoning and content of such replies too, so ``chat_output.py`` takes them there).

``parse(text, final)`` reads the text so far: the content before the first call (less any
partial markup at its end while the text is still growing) and each call with its name once
known and its arguments so far. Arguments so far are always a prefix of the final
arguments, so a stream sends each call's id and name once and its arguments in pieces
(``ToolCallStreamer``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "openai")


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # JSON text so far (the whole object once ``complete``)
    complete: bool


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could start ``marker`` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _plain_text(text: str, marker: str, final: bool) -> Parsed:
    """A reply with no call (yet): all of it content, less a partial ``marker`` at its end while it grows."""
    return Parsed(text[:len(text) - (0 if final else held_back(text, marker))])


def json_value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON object or array starting at ``text[start]``; None
    while it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def json_call(body: str, final: bool) -> ParsedCall | None:
    """A ``{"name": ..., "arguments": {...}}`` call from its (possibly partial) JSON text."""
    if final:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        match = _ARGUMENTS.search(body)
        start = match.end() if match else -1
        end = json_value_end(body, start) if start >= 0 and body[start:start + 1] in ("{", "[") else None
        raw = body[start:end] if end is not None else json.dumps(args, ensure_ascii=False)
        return ParsedCall(obj["name"], raw, True)
    name = _NAME.search(body)
    match = _ARGUMENTS.search(body)
    arguments = ""
    if match is not None and body[match.end():match.end() + 1] == "{":
        end = json_value_end(body, match.end())
        arguments = body[match.end():end] if end is not None else body[match.end():]
    return ParsedCall(json.loads(f'"{name.group(1)}"') if name else None, arguments, False)


class ToolParser:
    name = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


class TaggedParser(ToolParser):
    """Calls each in a ``<tool_call>...</tool_call>`` block; the content is the text before
    the first block; a final reply with no well-formed call stays text."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return _plain_text(text, self.start, final)
        calls = [call for block in text[first:].split(self.start)[1:]
                 if (call := self._block_call(block, final)) is not None]
        if final and not calls:
            return Parsed(text)
        return Parsed(text[:first], calls)

    def _block_call(self, block: str, final: bool) -> ParsedCall | None:
        """The call in the text after one ``<tool_call>`` (the whole block, or its start so far)."""
        raise NotImplementedError


class HermesParser(TaggedParser):
    name = "hermes"

    def _block_call(self, block: str, final: bool) -> ParsedCall | None:
        return json_call(block.split(self.end)[0].strip(), final or self.end in block)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text[len(self.tag):] if text.startswith(self.tag) else text
        stripped = body.lstrip()
        if not stripped.startswith("{"):
            return _plain_text(text, self.tag, final)
        calls, position = [], len(body) - len(stripped)
        while position < len(body):
            end = json_value_end(body, position)
            call = json_call(body[position:end] if end is not None else body[position:], final or end is not None)
            if call is None:
                return Parsed(text) if final else Parsed("", calls)
            calls.append(call)
            if end is None:
                break
            rest = body[end:].lstrip().lstrip(";").lstrip()
            if not rest.startswith("{"):
                break
            position = len(body) - len(rest)
        return Parsed("", calls)


class Qwen3CoderParser(TaggedParser):
    name = "qwen3_coder"
    _function = re.compile(r"<function=([^>\n]+)>")
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def _block_call(self, block: str, final: bool) -> ParsedCall | None:
        function = self._function.search(block)
        if function is None:
            return None
        name = function.group(1).strip()
        body = block[function.end():].split("</function>")[0]
        params = [(m.group(1).strip(), self._value(name, m.group(1).strip(), m.group(2)))
                  for m in self._parameter.finditer(body)]
        arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                                    for k, v in params)
        complete = final or "</function>" in block
        return ParsedCall(name, arguments + "}" if complete else arguments, complete)

    def _value(self, function: str, parameter: str, raw: str) -> Any:
        """A parameter's text as its schema's type (string, number, boolean, object, array)."""
        schema = (self.tools.get(function, {}).get("parameters") or {}).get("properties", {}).get(parameter, {})
        kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Qwen3CoderParser, Llama3JsonParser)}


class ToolCallStreamer:
    """Turns a growing text into OpenAI stream deltas: content pieces, then each call's id,
    type and name once and its arguments in pieces."""

    def __init__(self, parser: ToolParser | None = None) -> None:
        """``parser``: what ``deltas`` reads the text with (None: only ``parsed_deltas``)."""
        self.parser = parser
        self.content_sent = 0
        self.ids: list[str] = []
        self.named: list[bool] = []
        self.args_sent: list[int] = []

    def deltas(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, tool-call deltas) since the last call."""
        return self.parsed_deltas(self.parser.parse(text, final))

    def parsed_deltas(self, parsed: Parsed) -> tuple[str, list[dict[str, Any]]]:
        """``deltas`` of a reply already parsed (its content and calls so far)."""
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        out: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.ids):
                if call.name is None:
                    break  # its name first
                self.ids.append(new_call_id())
                self.named.append(True)
                self.args_sent.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            piece = call.arguments[self.args_sent[i]:]
            if piece:
                self.args_sent[i] = len(call.arguments)
                if out and out[-1]["index"] == i:
                    out[-1]["function"]["arguments"] += piece
                else:
                    out.append({"index": i, "function": {"arguments": piece}})
        return content, out

    @property
    def called(self) -> bool:
        return bool(self.ids)
