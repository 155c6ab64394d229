"""README.md's supported-models table is true to the code: it names every architecture the
registry serves, and its GGUF column every GGUF architecture the loader reads, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from hyprefix.models import gguf_hybrid
from hyprefix.models.loader import GGUF_ARCHITECTURES
from hyprefix.models.registry import MODEL_CLASSES

README = Path(__file__).resolve().parents[2] / "README.md"


def model_table() -> list[list[str]]:
    text = README.read_text()
    section = text[text.index("## Supported models"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]  # less the header


def test_every_registered_architecture_is_listed():
    listed = {name for row in model_table() for name in re.findall(r"`(\w+)`", row[0])}
    assert listed == set(MODEL_CLASSES)


def test_the_gguf_column_names_what_the_loader_reads():
    gguf_cells = [row[3] for row in model_table()]
    named = {name for cell in gguf_cells for name in re.findall(r"`([\w-]+)`", cell)}
    assert named == set(GGUF_ARCHITECTURES) | set(gguf_hybrid.ARCHITECTURES)
    for cell in gguf_cells:
        assert cell.startswith("yes") == bool(re.findall(r"`([\w-]+)`", cell)), cell
