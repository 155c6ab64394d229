"""Fixtures every test folder sees: tiny random-weight HF checkpoints (built once per session
with transformers; the builders and the plain helpers live in ``tests/support``), and the
batched decode graph only where a test asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyprefix.models.base import CausalLM
from hyprefix.runner.decode_graph import DecodeGraphs
from tests.support.gguf_convert import extract_converter
from tests.support.models import ARCHS, HYBRID_ARCHS, build_tiny_model


@pytest.fixture(autouse=True)
def _batched_decode_graphs(request, monkeypatch):
    """Engines compile the batched decode graph only in tests marked ``batched_graphs``: its cold
    compile costs 12-16 s for each engine shape (the tests of the graph, and one stress run,
    cover it); every other test's batched decode steps run eagerly, as on devices without it."""
    if request.node.get_closest_marker("batched_graphs") is None:
        monkeypatch.setattr(DecodeGraphs, "batched_by_default", False)


@pytest.fixture(autouse=True)
def _hybrid_decode_graphs(request, monkeypatch):
    """Models with recurrent layers compile their decode steps only in tests marked
    ``hybrid_graphs`` (each hybrid shape costs a cold compile of its own); every other test's
    hybrids decode eagerly, as under ``--enforce-eager`` or on devices without the fused ops."""
    if request.node.get_closest_marker("hybrid_graphs") is None:
        monkeypatch.setattr(CausalLM, "recurrent_decode_graphs", False)


@pytest.fixture(autouse=True)
def _window_decode_graphs(request, monkeypatch):
    """Engines with a sliding-window pool (Gemma 3, gpt-oss, windowed Mistral) compile their decode
    steps only in tests marked ``window_graphs`` (each shape costs a cold compile of its own);
    every other test's window-pool engines decode eagerly, as with a pool before the graphs took one."""
    if request.node.get_closest_marker("window_graphs") is None:
        monkeypatch.setattr(DecodeGraphs, "window_pools", False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (checkpoint dir, HF reference model)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: (root / arch, build_tiny_model(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (checkpoint dir, HF reference model) for the hybrid architectures."""
    root = tmp_path_factory.mktemp("tiny-hybrids")
    return {arch: (root / arch, build_tiny_model(arch, root / arch)) for arch in HYBRID_ARCHS}


@pytest.fixture(scope="session")
def gemma3_model(tmp_path_factory) -> tuple[Path, object]:
    """(checkpoint dir, HF reference model) of a tiny Gemma3ForCausalLM."""
    path = tmp_path_factory.mktemp("tiny-gemma3") / "gemma3"
    return path, build_tiny_model("gemma3", path)


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models) -> Path:
    return tiny_models["qwen3"][0]


@pytest.fixture(scope="session")
def llama_converter() -> Path:
    """A directory holding llama.cpp's ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``
    (``tests/support/gguf_convert.py``), extracted once and kept for later runs."""
    return extract_converter()
