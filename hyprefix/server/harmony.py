"""gpt-oss's harmony chat format, read from a reply's text with its special tokens kept:
vLLM's ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser openai``.

The prompt ends with ``<|start|>assistant``; the model then writes messages, each a header
(an optional recipient ``to=functions.NAME``, in the role part or after the channel, and
``<|channel|>CHANNEL``, an optional content type, possibly after ``<|constrain|>``), then
``<|message|>``, the body, and ``<|end|>`` (more follows, after ``<|start|>ROLE``),
``<|call|>`` (a tool call: generation stops) or ``<|return|>`` (done: generation stops)::

    <|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather
    <|channel|>commentary json<|message|>{"location":"Paris"}<|call|>

A message to ``functions.NAME`` is a tool call (its body the arguments, as written); else
the ``analysis`` channel is reasoning and the others (``final``, and ``commentary`` without a
recipient: a preamble shown to the user) are content, as vLLM reads them. Messages of one
kind are joined with newlines; a message to another recipient (a built-in tool this server
does not run) is left out unless it is reasoning, as is one by another author. No markup
ever reaches the reasoning or the content.

The ``openai-harmony`` package is not used: it downloads its vocabulary on first use. This
reads the decoded text, so a body that spells a special token out in plain text (rare; the
model writes special tokens as such) is read as that token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from hyprefix.server.tool_parsers import ParsedCall, held_back
from hyprefix.structured.spec import StructuredOutputs

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL)
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_RECIPIENT = re.compile(r"to=(\S+)")
# What a reply written in harmony starts with (its role is the prompt's ``<|start|>assistant``)
_OPENERS = (CHANNEL, START, "to=")
FUNCTIONS = "functions."


@dataclass
class HarmonyMessage:
    role: str
    channel: str | None
    recipient: str | None
    body: str
    complete: bool  # ended by <|end|>, <|call|> or <|return|>, or by the next message


@dataclass
class HarmonyReply:
    reasoning: str | None  # None: no analysis message (yet)
    content: str
    calls: list[ParsedCall]


def _header(raw: str) -> tuple[str, str | None, str | None]:
    """(role, channel, recipient) of a header's text (markers other than ``<|channel|>``
    already taken out); the role is the assistant where the header names none (the first
    message's role is the prompt's)."""
    role_part, _, channel_part = raw.partition(CHANNEL)
    recipient = _RECIPIENT.search(role_part) or _RECIPIENT.search(channel_part)
    roles = [w for w in role_part.split() if not w.startswith("to=")]
    channels = [w for w in channel_part.split() if not w.startswith("to=")]
    return (roles[0] if roles else "assistant"), (channels[0] if channels else None), (
        recipient.group(1) if recipient else None)


def split_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of a reply's text so far. While the text grows (``final`` False) a
    partial marker at its end is held back, and a reply that may still turn out to open with
    a header gives nothing yet; each message's body so far is then a prefix of its body in any
    longer text. A reply that does not open with a header (a continued final message, a model
    that writes no harmony) starts with a body of the final channel."""
    if not final:
        text = text[:len(text) - max(held_back(text, m) for m in MARKERS)]
        opening = text.lstrip()
        if any(o.startswith(opening) for o in _OPENERS) and not opening.startswith(_OPENERS):
            return []
    messages: list[HarmonyMessage] = []
    state, header = "header", ""  # state: "header", "body" or "between" (after an end)
    if not text.lstrip().startswith(_OPENERS):
        messages.append(HarmonyMessage("assistant", "final", None, "", False))
        state = "body"
    for piece in _SPLIT.split(text):
        if not piece:
            continue
        if state == "body" and piece not in MARKERS:
            messages[-1].body += piece
        elif state == "body" and piece in (START, CHANNEL, *_ENDS):
            messages[-1].complete = True  # a new header without an end (tolerated) ends it too
            state, header = ("between", "") if piece in _ENDS else ("header", piece)
        elif state == "header" and piece == MESSAGE:
            messages.append(HarmonyMessage(*_header(header), "", False))
            state = "body"
        elif state == "header" and piece in (START, *_ENDS):  # a header cut short: dropped
            state, header = ("header", "") if piece == START else ("between", "")
        elif state == "header":
            header += " " if piece == CONSTRAIN else piece
        elif state == "between" and piece in (START, CHANNEL):
            state, header = "header", "" if piece == START else piece
        # else: a stray <|message|> or <|constrain|> in a body, or text between messages: dropped
    return messages


def read_harmony(text: str, final: bool) -> HarmonyReply:
    """The reasoning, content and tool calls of a reply's text so far (``split_messages``):
    each grows as the text does, so stream deltas are differences of successive reads."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ParsedCall] = []
    for message in split_messages(text, final):
        if message.role != "assistant":
            continue
        recipient = message.recipient
        if recipient is not None and recipient.startswith(FUNCTIONS):
            calls.append(ParsedCall(recipient[len(FUNCTIONS):], message.body, message.complete or final))
        elif message.channel == "analysis":
            reasoning.append(message.body)
        elif recipient is None:
            content.append(message.body)
    return HarmonyReply("\n".join(reasoning) if reasoning else None, "\n".join(content), calls)


def harmony_tool_grammar(tools: list[dict], function: str | None) -> StructuredOutputs:
    """The grammar of a ``required`` (``function`` None) or named tool choice for a model that
    writes harmony: an optional analysis message, then one call, written as gpt-oss's chat
    template writes calls (``<|start|>assistant to=functions.NAME<|channel|>commentary
    json<|message|>ARGS<|call|>``), to one of the tools (the named one) with arguments valid
    for its schema. One call a reply: gpt-oss ends its turn at each call (``<|call|>``)."""
    chosen = [t["function"] for t in tools if function is None or t["function"]["name"] == function]
    rules = [
        "start: analysis? call",
        f'analysis: {CHANNEL} "analysis" {MESSAGE} REASONING {END} {START} "assistant"',
        "REASONING: /(?s:.*)/",
        "call: " + " | ".join(f"call{i}" for i in range(len(chosen))),
    ]
    for i, tool in enumerate(chosen):
        schema = {**(tool.get("parameters") or {"type": "object"}), "x-guidance": {"whitespace_flexible": False}}
        rules.append(f'call{i}: {json.dumps(" to=" + FUNCTIONS + tool["name"])} {CHANNEL} "commentary json" '
                     f"{MESSAGE} args{i} {CALL}")
        rules.append(f"args{i}: %json {json.dumps(schema)}")
    return StructuredOutputs(grammar="\n".join(rules))
