"""What a request's output must match: vLLM's ``StructuredOutputsParams`` (exactly one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object``). Plain data; the grammar
engine compiles it (``grammar.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hyprefix.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """``json``: a JSON schema (a dict or its JSON text); ``regex``: a regular expression
    (Rust ``regex`` syntax) the whole output matches; ``choice``: one of these strings;
    ``grammar``: a Lark or GBNF grammar; ``json_object``: any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(given) or 'none'}", param="structured_outputs")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise RequestError(f"the JSON schema is not valid JSON: {exc}", param="structured_outputs") from exc
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise RequestError("a JSON schema must be an object", param="structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise RequestError("choice must be a non-empty list of strings", param="structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{name} must be a non-empty string", param="structured_outputs")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints, the compiled-grammar cache's key."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)
