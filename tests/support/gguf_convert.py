"""llama.cpp's own ``convert_hf_to_gguf.py`` for the tests that load the GGUF files it writes.

The converter (the script, its ``conversion`` package and its own ``gguf-py``, which knows
architectures the pip ``gguf`` may not) comes from the llama-cpp-python sdist on PyPI, as CI gets
it, and is kept under the test-model cache (``$HYPREFIX_TEST_MODELS``, by default
``~/.cache/hyprefix/models``); ``tests/conftest.py``'s ``llama_converter`` fixture extracts it
once. ``run_converter`` converts several checkpoints in one interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tools.models.fetch_test_models import models_dir

VERSION = "0.3.36"  # llama-cpp-python, as pyproject's llamacpp extra pins it
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
LOCAL_SDIST = Path("/tmp/llama") / SDIST  # a copy already on this machine: only saves the download
SDIST_ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# What the converter needs from llama.cpp: the script, its model classes, its gguf package.
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")

# Two stand-ins for what the tests' tiny tokenizer is not, run before the converter:
# * llama.cpp names a BPE pre-tokenizer by hashing how the tokenizer splits a test text, and
#   refuses one it does not know, as the tiny tokenizer is. It splits as GPT-2 does (ByteLevel),
#   so it is named that.
# * Llama-style converters try a SentencePiece vocabulary first and import ``sentencepiece``
#   before they look for ``tokenizer.model``; without the package that import fails instead of
#   falling through to the BPE vocabulary. With no ``tokenizer.model`` the try fails as it would
#   with the package installed.
# The tensors and every other metadata key are the converter's. ``argv``: the script, then a JSON
# list of (converter arguments, config keys to hide from it).
RUN_CONVERTER = """
import json, runpy, sys
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sentencepiece_vocab = base.TextModel._create_vocab_sentencepiece
def no_sentencepiece_model(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return sentencepiece_vocab(self)
base.TextModel._create_vocab_sentencepiece = no_sentencepiece_model
load_hparams = base.ModelBase.load_hparams
script, jobs = sys.argv[1], json.loads(sys.argv[2])
for args, hidden in jobs:  # one interpreter for every checkpoint: importing torch and transformers is most of it
    def hparams(dir_model, is_mistral_format, hidden=hidden):
        config = load_hparams(dir_model, is_mistral_format)
        return {key: value for key, value in config.items() if key not in hidden}
    base.ModelBase.load_hparams = staticmethod(hparams)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
"""


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


def run_converter(converter: Path, jobs: list[tuple[list[str], list[str]]]) -> None:
    """Run the converter once per job (its arguments, and config keys hidden from it) in one
    interpreter (``RUN_CONVERTER``); a failure fails the test with the end of its log."""
    import pytest

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(converter), str(converter / "gguf-py")])}
    proc = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(converter / "convert_hf_to_gguf.py"),
                           json.dumps(jobs)], cwd=converter, env=env, capture_output=True, text=True)
    if proc.returncode:
        pytest.fail(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}")
