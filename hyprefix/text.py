"""Checks on user text, and a conversation's token ids (no torch)."""

from __future__ import annotations

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


def chat_token_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template (the one
    implementation behind ``LLM.chat``, the server and the replicas' router); bad input
    raises RequestError."""
    from jinja2 import TemplateError

    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    check_texts(messages, "messages", param="messages")
    if tokenizer.chat_template is None:
        raise RequestError("this model's tokenizer has no chat template", param="messages")
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
    except TemplateError as exc:
        raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc
    return list(ids)
