"""Checks on user text, a conversation's token ids, and the common prefix of two sequences (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hyprefix.errors import RequestError


def check_text(value: str, what: str, param: str | None = None) -> None:
    """Raise ``RequestError`` unless ``value`` encodes as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid Unicode (lone surrogate U+{ord(value[exc.start]):04X} "
                         f"at position {exc.start})", param=param) from None


def check_texts(value: object, what: str, param: str | None = None) -> None:
    """``check_text`` on every string inside nested lists and dicts (keys included)."""
    if isinstance(value, str):
        check_text(value, what, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_texts(key, f"a key of {what}", param)
            check_texts(item, f"{what}.{key}" if isinstance(key, str) else what, param)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_texts(item, f"{what}[{i}]", param)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation and how to render it with the tokenizer's chat template (vLLM's
    chat arguments): ``tools`` (OpenAI tool definitions, given to the template as ``tools``),
    ``add_generation_prompt``, ``continue_final_message`` (the last message, an assistant's,
    stays open for the model to continue), ``chat_template`` (a Jinja template instead of
    the tokenizer's), ``template_kwargs`` (more variables, e.g. ``enable_thinking``) and
    ``reasoning_effort`` (OpenAI's request field, the template's ``reasoning_effort``: only a
    template that reads that variable can honour it). ``tools_must_render``: the tools reach the
    model only through the template (tool_choice "auto"), so a template that reads no ``tools``
    cannot honour them."""

    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    tools_must_render: bool = False


# Template variables a request may not set through ``template_kwargs``: the renderer's own.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "add_generation_prompt",
                                       "continue_final_message", "chat_template", "tokenize", "return_dict",
                                       "documents", "tokenizer_kwargs", "return_tensors", "padding",
                                       "truncation", "max_length", "return_assistant_tokens_mask"})


def chat_token_ids(tokenizer: Any, messages: list[dict] | ChatPrompt, add_generation_prompt: bool = True,
                   add_special_tokens: bool = False) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template (the one
    implementation behind ``LLM.chat``, the server, ``/tokenize`` and the replicas' router);
    bad input raises RequestError. ``messages``: the messages, or a ``ChatPrompt`` (whose own
    ``add_generation_prompt`` then counts). The rendered text is tokenized without the
    tokenizer's special tokens (the template writes its own, as transformers does);
    ``add_special_tokens`` adds them (vLLM's ``/tokenize`` option)."""
    from jinja2 import TemplateError

    chat = messages if isinstance(messages, ChatPrompt) else ChatPrompt(messages, None, add_generation_prompt)
    if not isinstance(chat.messages, list) or not chat.messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    check_texts(chat.messages, "messages", param="messages")
    check_texts(chat.tools, "tools", param="tools")
    if chat.continue_final_message and chat.add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
    if chat.continue_final_message and chat.messages[-1].get("role") != "assistant":
        raise RequestError("continue_final_message needs an assistant message last", param="continue_final_message")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat.template_kwargs))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
    if chat.chat_template is None and tokenizer.chat_template is None:
        raise RequestError("this model's tokenizer has no chat template", param="messages")
    kwargs, template = dict(chat.template_kwargs), chat.chat_template or tokenizer.chat_template
    if chat.tools and chat.tools_must_render and "tools" not in template_variables(template):
        raise RequestError("this model's chat template takes no tools, so the model cannot see them; send "
                           'tool_choice "required" or a named function (the output is then held to the tools), or '
                           "a chat_template that renders tools", param="tools")
    if chat.reasoning_effort is not None:
        if "reasoning_effort" in kwargs:
            raise RequestError("reasoning_effort is given both as a field and in chat_template_kwargs",
                               param="reasoning_effort")
        if "reasoning_effort" not in template_variables(template):
            raise RequestError("this model's chat template takes no reasoning_effort", param="reasoning_effort")
        kwargs["reasoning_effort"] = chat.reasoning_effort
    try:
        rendered = tokenizer.apply_chat_template(
            chat.messages, tools=chat.tools, add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message, chat_template=chat.chat_template,
            tokenize=not add_special_tokens, return_dict=False, **kwargs)
    except TemplateError as exc:
        raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
    except ValueError as exc:  # e.g. continue_final_message on a template that cannot
        raise RequestError(f"the chat template could not render the messages: {exc}", param="messages") from exc
    if add_special_tokens:  # rendered as text: tokenized as a completion prompt would be
        return list(tokenizer.encode(rendered, add_special_tokens=True))
    return list(rendered)


@lru_cache(maxsize=16)
def _variables_of(source: str) -> frozenset[str]:
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return frozenset(meta.find_undeclared_variables(Environment().parse(source)))
    except TemplateSyntaxError:  # apply_chat_template names the error when it renders
        return frozenset()


def template_variables(template: str | dict | None) -> frozenset[str]:
    """The variables a chat template reads from its caller (every template of a named set)."""
    if isinstance(template, dict):
        return frozenset().union(*(_variables_of(t) for t in template.values() if isinstance(t, str)))
    return _variables_of(template) if isinstance(template, str) else frozenset()


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (token ids, block hashes) ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
