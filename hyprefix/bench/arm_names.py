"""Arm names: which engine an arm runs and with which settings (no torch).

Grammar, one for every in-process arm: ``BASE[SEP PART[+PART ...]]`` where ``SEP`` is ``@`` or
``+`` (``hyprefix@bfloat16`` and ``hyprefix+bfloat16`` are one arm) and the parts, in any order, are

- ``DTYPE`` (at most one): the arm's ``--dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``);
- ``kv-FORMAT`` (hyprefix arms, at most one): its ``--kv-cache-dtype`` (``kv-int8``);
- ``NAME=VALUE`` (hyprefix arms): any ``EngineArgs`` field, its name in dashes as the flag spells
  it, e.g. ``scheduling-policy=cache-aware``, ``max-retention-s=0``, ``max-num-seqs=4``. Numbers
  and words as on the command line (``true``/``false`` for a switch, ``none`` for an optional
  field's None). Such an option overrides the bench's own flag of the same field for that arm.

So ``hyprefix+scheduling-policy=cache-aware+scheduling-max-wait-s=1000000`` and
``hyprefix@bfloat16+kv-int8+max-retention-s=0``. A value cannot hold ``+``, ``@`` or ``,`` (the
``--arms`` separator): write ``1000000``, not ``1e+6``. Names are checked before any work
(``check_arm_names``): an unknown field or a value ``EngineArgs`` refuses is a ``ValueError``
naming the arm, and two names that parse to the same arm are refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence
from typing import Any

from hyprefix.config import DTYPES as ARM_DTYPES

ARM_BASES = ("hyprefix", "hyprefix-nocache", "transformers", "llama.cpp")
# Fields an option may not set: the base name, the dtype part and the kv part say them.
_OWN_PARTS = {"model": "the bench's --model", "dtype": "the @DTYPE part", "kv_cache_dtype": "the kv-FORMAT part",
              "enable_prefix_caching": "the base name (hyprefix / hyprefix-nocache)"}
_SEP = re.compile(r"[@+]")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parts(name: str) -> tuple[str, list[str]]:
    """(base, parts): the base ends at the first ``@`` or ``+``; ``@`` may only start the parts."""
    match = _SEP.search(name)
    if match is None:
        return name, []
    base, rest = name[:match.start()], name[match.end():]
    return base, rest.split("+")


def split_arm(name: str) -> tuple[str, str | None]:
    """``"hyprefix@float32"`` -> ("hyprefix", "float32"); a name without a dtype part has none of its own."""
    base, parts = _parts(name)
    return base, next((p for p in parts if p in ARM_DTYPES), None)


def arm_kv_cache_dtype(name: str) -> str | None:
    """``"hyprefix@bfloat16+kv-int8"`` -> "int8": the arm's --kv-cache-dtype, None where it names none."""
    return next((p.removeprefix("kv-") for p in _parts(name)[1] if p.startswith("kv-") and "=" not in p), None)


def _option_value(field: dataclasses.Field, text: str) -> Any:
    kind = str(field.type)
    if "None" in kind and text.lower() == "none":
        return None
    if kind in ("bool", "bool | None"):
        if text.lower() not in (*_TRUE, *_FALSE):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in _TRUE
    for name, parse in (("int", int), ("float", float)):
        if kind in (name, f"{name} | None"):
            return parse(text)
    return text


def arm_engine_options(name: str) -> dict[str, Any]:
    """The ``NAME=VALUE`` parts of an arm name as ``EngineArgs`` keyword arguments, checked by
    building ``EngineArgs`` from them; ``ValueError`` naming the arm on an unknown field, a field
    the name sets otherwise, a bad value, or options on an arm other than hyprefix's."""
    from hyprefix.config import EngineArgs

    base, parts = _parts(name)
    options = [p for p in parts if "=" in p]
    if options and not base.startswith("hyprefix"):
        raise ValueError(f"arm {name!r}: only hyprefix arms take engine options (NAME=VALUE parts)")
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    out: dict[str, Any] = {}
    for part in options:
        flag, _, text = part.partition("=")
        key = flag.replace("-", "_")
        if key not in fields or not flag or "_" in flag:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0].replace('_', '-')}?)" if close else ""
            raise ValueError(f"arm {name!r}: {flag!r} is not an engine option{hint}; options are EngineArgs "
                             f"fields in dashes, e.g. scheduling-policy=cache-aware")
        if key in _OWN_PARTS:
            raise ValueError(f"arm {name!r}: {flag} is set by {_OWN_PARTS[key]}, not by an option")
        if key in out:
            raise ValueError(f"arm {name!r}: {flag} given twice")
        try:
            out[key] = _option_value(fields[key], text)
            EngineArgs(**out)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"arm {name!r}: bad value for {flag}: {exc}") from exc
    return out


def _suffix_ok(name: str) -> bool:
    """Whether the dtype and kv parts are well formed (options are checked by ``arm_engine_options``)."""
    from hyprefix.config import KV_CACHE_DTYPES

    base, parts = _parts(name)
    plain = [p for p in parts if "=" not in p]
    dtypes = [p for p in plain if not p.startswith("kv-")]
    kvs = [p.removeprefix("kv-") for p in plain if p.startswith("kv-")]
    return ("@" not in name[len(base) + 1:] and len(dtypes) <= 1 and all(d in ARM_DTYPES for d in dtypes)
            and len(kvs) <= 1 and all(k in KV_CACHE_DTYPES for k in kvs) and (not kvs or base.startswith("hyprefix")))


def arm_config(name: str) -> tuple[str, str | None, str | None, tuple[tuple[str, Any], ...]]:
    """What the name asks for, whatever its spelling: (base, dtype, kv format, sorted options)."""
    return (*split_arm(name), arm_kv_cache_dtype(name), tuple(sorted(arm_engine_options(name).items())))


def check_arm_names(names: Sequence[str], allowed: Sequence[str], servers: Sequence[str] = ()) -> None:
    """``servers``: the names of the ``--url`` arms (no @DTYPE: a server runs its own)."""
    clash = [s for s in servers if split_arm(s)[0] in ARM_BASES or servers.count(s) > 1]
    if clash:
        raise ValueError(f"server arm names must be distinct and differ from {', '.join(ARM_BASES)}: {clash[0]}")
    bad = [a for a in names if a not in servers and (split_arm(a)[0] not in allowed or not _suffix_ok(a))]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"arms must be distinct names from {', '.join([*servers, *allowed])}, each but a server "
                         f"optionally with @DTYPE ({', '.join(ARM_DTYPES)}), a hyprefix arm also with +kv-FORMAT "
                         f"(its --kv-cache-dtype) and +NAME=VALUE engine options (e.g. "
                         f"hyprefix@bfloat16+kv-int8, hyprefix+scheduling-policy=cache-aware), got {','.join(names)}")
    configs = [arm_config(a) for a in names if a not in servers]  # raises on a bad option
    same = [a for a, c in zip([a for a in names if a not in servers], configs, strict=True) if configs.count(c) > 1]
    if same:
        raise ValueError(f"arms {', '.join(same)} are the same arm spelled twice")
