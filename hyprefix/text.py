"""Checks on user text (no torch)."""

from __future__ import annotations

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
