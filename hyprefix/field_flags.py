"""A dataclass field as a command-line option: how ``EngineArgs``, ``ServerArgs`` and
``ServerLimits`` fields become ``hyprefix`` flags, the same way for all three."""

from __future__ import annotations

import argparse
import dataclasses

_KINDS = {"int": int, "int | None": int, "float": float, "float | None": float}


def add_field_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, aliases: tuple[str, ...] = (),
                   action: type[argparse.Action] | None = None) -> None:
    """``--field-name`` (and ``--alias`` spellings) storing into ``f.name``, with the field's
    metadata ``help`` (its default shown) and, where given, ``choices``, ``metavar`` and
    ``nargs``; a boolean field gets ``--name`` / ``--no-name``. ``action``: the store action
    of a non-boolean field (argparse's own when None)."""
    flags = ["--" + name.replace("_", "-") for name in (f.name, *aliases)]
    if f.type in ("bool", bool):
        group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=f.metadata["help"])
        return
    kwargs = {k: f.metadata[k] for k in ("choices", "metavar", "nargs") if k in f.metadata}
    if action is not None:
        kwargs["action"] = action
    shown = "" if f.default is None else " (default: %(default)s)"
    group.add_argument(*flags, dest=f.name, type=_KINDS.get(str(f.type), str), default=f.default,
                       help=f.metadata["help"] + shown, **kwargs)
