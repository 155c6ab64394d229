"""Load an HF checkpoint (local directory, hub id or demo alias): config, safetensors weights, tokenizer."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hyprefix.hardware import DTYPES, resolve_dtype
from hyprefix.models.registry import model_class


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    hf_config: object
    path: Path
    identity: str  # names the checkpoint and its weights (for cache hashing)
    dtype: torch.dtype
    max_position_embeddings: int
    weight_bytes: int


# Every file a checkpoint's config, weights, tokenizer and chat template can live in
# (transformers 5 keeps a chat template only in chat_template.jinja).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local directory of ``model``: a demo alias (``hyprefix.demo.DEMO_ALIASES``),
    a directory, or a hub id (downloaded)."""
    from hyprefix.demo import resolve_demo_alias

    demo = resolve_demo_alias(model)
    if demo is not None:
        return Path(demo)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {model!r} has no config.json: it is not a Hugging Face checkpoint "
                             "(a directory with config.json, *.safetensors and the tokenizer files)")
        return path
    if path.exists():
        raise ValueError(f"model path {model!r} is a file ({path.suffix or 'no extension'}); give the Hugging "
                         "Face checkpoint directory that holds config.json and *.safetensors")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:  # a path, not a hub id "owner/name"
        raise ValueError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, allow_patterns=HUB_FILES))
    except Exception as exc:  # network off, unknown id, gated repo ...
        raise ValueError(f"cannot find model {model!r} locally or on the hub: {exc}") from exc


def checkpoint_dtype(hf_config) -> torch.dtype:
    """The dtype the checkpoint's config declares (float32 when it declares none)."""
    raw = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    if isinstance(raw, torch.dtype):
        return raw
    return DTYPES.get(str(raw).replace("torch.", ""), torch.float32)


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def checkpoint_identity(path: Path) -> str:
    """A digest of the config and the weight files' names, sizes and mtimes: a
    different checkpoint or weight version gets a different identity."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        st = file.stat()
        h.update(f"{file.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def load_model(model: str, dtype: str, device: torch.device, max_positions: int | None,
               revision: str | None = None) -> LoadedModel:
    from transformers import AutoConfig

    path = resolve_model_dir(model, revision)
    hf_config = AutoConfig.from_pretrained(str(path))
    cls = model_class(hf_config)
    torch_dtype = resolve_dtype(dtype, checkpoint_dtype(hf_config), device)
    max_pos = int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
    # Built on the meta device so no time is spent initialising weights we overwrite.
    net = cls(hf_config, torch_dtype, torch.device("meta"), max_positions or max_pos)
    net.materialize(device)
    net.load_weights(iter_safetensors(path))
    net.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    net.pack_weights()
    return LoadedModel(net, hf_config, path, checkpoint_identity(path), torch_dtype, max_pos, weight_bytes)


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
