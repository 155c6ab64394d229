"""llama.cpp's own ``convert_hf_to_gguf.py`` run on random-weight checkpoints, for the tools
that write benchmark GGUF files (``make_hybrid_gguf.py``) and for the tests
(``tests/support/gguf_convert.py``, which also fetches the converter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Two stand-ins for what a random-weight model's tokenizer (the demo models', the tests') is not,
# run before the converter:
# * llama.cpp names a BPE pre-tokenizer by hashing how the tokenizer splits a test text, and
#   refuses one it does not know, as that tokenizer is. It splits as GPT-2 does (ByteLevel),
#   so it is named that.
# * Llama-style converters try a SentencePiece vocabulary first and import ``sentencepiece``
#   before they look for ``tokenizer.model``; without the package that import fails instead of
#   falling through to the BPE vocabulary. With no ``tokenizer.model`` the try fails as it would
#   with the package installed.
# The tensors and every other metadata key are the converter's. ``argv``: the script, then a JSON
# list of (converter arguments, config keys to hide from it, config keys to add).
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
for args, hidden, added in jobs:  # one interpreter for every checkpoint: importing torch and transformers is most of it
    def hparams(dir_model, is_mistral_format, hidden=hidden, added=added):
        config = load_hparams(dir_model, is_mistral_format)
        return {key: value for key, value in config.items() if key not in hidden} | added
    base.ModelBase.load_hparams = staticmethod(hparams)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
"""


Job = tuple[list[str], list[str], dict]  # converter arguments, config keys hidden from it, keys added


def run_converter(converter: Path, jobs: list[Job]) -> subprocess.CompletedProcess:
    """Run the converter (``converter``: llama.cpp's tree, or the extracted script with its
    ``conversion`` and ``gguf-py``) once per job in one interpreter (``RUN_CONVERTER``); the
    caller checks ``returncode`` (stderr holds its log)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(converter), str(converter / "gguf-py")])}
    return subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(converter / "convert_hf_to_gguf.py"),
                           json.dumps(jobs)], cwd=converter, env=env, capture_output=True, text=True)
