"""llama.cpp's own ``convert_hf_to_gguf.py`` for the tests that load the GGUF files it writes.

The converter (the script, its ``conversion`` package and its own ``gguf-py``, which knows
architectures the pip ``gguf`` may not) comes from the llama-cpp-python sdist on PyPI, as CI gets
it, and is kept under the test-model cache (``$HYPREFIX_TEST_MODELS``, by default
``~/.cache/hyprefix/models``); ``tests/conftest.py``'s ``llama_converter`` fixture extracts it
once. ``run_converter`` converts several checkpoints in one interpreter."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tools.models import llama_converter
from tools.models.fetch_test_models import models_dir

VERSION = "0.3.36"  # llama-cpp-python, as pyproject's llamacpp extra pins it
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
LOCAL_SDIST = Path("/tmp/llama") / SDIST  # a copy already on this machine: only saves the download
SDIST_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# What the converter needs from llama.cpp: the script, its model classes, its gguf package.
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")



def _sdist(into: Path) -> Path:
    if LOCAL_SDIST.is_file():
        return LOCAL_SDIST
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(into)], check=True)
    return into / SDIST


def extract_converter() -> Path:
    """A directory holding llama.cpp's ``convert_hf_to_gguf.py``, ``conversion/`` and
    ``gguf-py/``, extracted from the sdist the first time and kept for later runs."""
    out = models_dir() / f"llama-cpp-converter-{VERSION}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staging = Path(tmp) / "converter"
        with tarfile.open(_sdist(Path(tmp))) as tar:
            for member in tar:
                name = member.name.removeprefix(SDIST_ROOT)
                if member.isfile() and name != member.name and name.startswith(CONVERTER_FILES):
                    member.name = name
                    tar.extract(member, staging, filter="data")
        try:
            staging.rename(out)
        except OSError:  # another session extracted it meanwhile
            if not (out / "convert_hf_to_gguf.py").is_file():
                raise
    return out


def run_converter(converter: Path, jobs: list[tuple]) -> None:
    """Run the converter once per job (its arguments, config keys hidden from it and, optionally,
    config keys added) in one interpreter (``tools/models/llama_converter.py``); a failure fails
    the test with the end of its log."""
    import pytest

    proc = llama_converter.run_converter(converter, [(job[0], job[1], job[2] if len(job) > 2 else {}) for job in jobs])
    if proc.returncode:
        pytest.fail(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}")
