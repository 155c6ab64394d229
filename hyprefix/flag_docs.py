"""The flag tables of README.md and docs/, rendered from the command line itself
(``cli.build_parser``: ``EngineArgs``' and ``ServerArgs``' fields), so they cannot drift.

A document holds a table between ``<!-- flags:COMMAND[:GROUP] -->`` and ``<!-- /flags -->``:
every option of ``hyprefix COMMAND`` (or of one argument group of it, named by the start
of its title: ``engine``, ``server``, ``request limits``, ``replicas``).

    python -m hyprefix.flag_docs           # rewrite the tables in place
    python -m hyprefix.flag_docs --check   # exit 1 and name the files whose tables are stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DOCUMENTS = ("README.md", "docs/engine-flags.md", "docs/serving.md")
_BLOCK = re.compile(r"(<!-- flags:(?P<spec>[\w:\- ]+) -->\n)(?P<body>.*?)(<!-- /flags -->)", re.S)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def _flag_cell(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return " / ".join(f"`{s}`" for s in action.option_strings)
    flag = action.option_strings[0]
    if action.choices:
        return f"`{flag} {{{','.join(map(str, action.choices))}}}`"
    if action.metavar:
        return f"`{flag} {action.metavar}" + (f" [{action.metavar} ...]`" if action.nargs == "+" else "`")
    return f"`{flag}`"


def _split_default(action: argparse.Action) -> tuple[str, str]:
    """(meaning, default) of an option: a help text's closing "(default: ...)" goes to the
    default column (its ``%(default)s`` filled in)."""
    text = (action.help or "").strip()
    start = text.rfind("(default: ")
    if start >= 0 and text.endswith(")"):
        shown, text = text[start + len("(default: "):-1], text[:start].rstrip()
    elif isinstance(action, argparse.BooleanOptionalAction):
        shown = "on" if action.default else "off"
    else:
        shown = "–" if action.default is None else "%(default)s"
    shown = shown.replace("%(default)s", f"`{action.default}`")
    return text.replace("%%", "%").replace("|", "\\|"), shown


def flag_table(command: str, group: str | None = None) -> str:
    """The markdown table of ``hyprefix COMMAND``'s options (only those of the argument
    group whose title starts with ``group``, when given), in the order ``--help`` prints."""
    from hyprefix.cli import build_parser

    sub = _subcommand(build_parser(), command)
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    groups = [g for g in sub._action_groups if group is None or g.title.startswith(group)]
    if not groups:
        raise ValueError(f"hyprefix {command} has no argument group starting with {group!r}")
    for g in groups:
        for action in g._group_actions:
            if action.help == argparse.SUPPRESS or not action.option_strings or action.dest == "help":
                continue
            meaning, default = _split_default(action)
            rows.append(f"| {_flag_cell(action)} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with each flags block's table rendered afresh."""
    def table(m: re.Match) -> str:
        command, _, group = m.group("spec").partition(":")
        return m.group(1) + flag_table(command, group or None) + m.group(4)

    return _BLOCK.sub(table, text)


def stale(root: Path) -> list[str]:
    """The documents under ``root`` whose flag tables differ from the command line's."""
    return [name for name in DOCUMENTS if (root / name).exists()
            and render(text := (root / name).read_text()) != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyprefix.flag_docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale tables (exit 1 if any)")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the source tree (default: here)")
    ns = parser.parse_args(argv)
    names = stale(ns.root)
    if ns.check:
        for name in names:
            print(f"{name}: its flag table differs from the command line; run python -m hyprefix.flag_docs")
        return 1 if names else 0
    for name in names:
        path = ns.root / name
        path.write_text(render(path.read_text()))
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
