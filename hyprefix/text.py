"""Checks on user text (no torch)."""

from __future__ import annotations


def check_text(value: str, what: str) -> None:
    """Raise ValueError unless ``value`` encodes as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode (lone surrogate U+{ord(value[exc.start]):04X} "
                         f"at position {exc.start})") from None


def check_texts(value: object, what: str) -> None:
    """``check_text`` on every string inside nested lists and dicts (keys included)."""
    if isinstance(value, str):
        check_text(value, what)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_texts(key, f"a key of {what}")
            check_texts(item, f"{what}.{key}" if isinstance(key, str) else what)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_texts(item, f"{what}[{i}]")
