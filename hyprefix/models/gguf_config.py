"""Transformers configs rebuilt from the metadata of GGUF files that llama.cpp's own
``convert_hf_to_gguf.py`` writes, for the dense families whose files transformers' GGUF reader
does not know (``smollm3``, ``granite``) or reads only in part (``phi3``: it drops the partial
rotary width, LongRoPE's factors and the sliding window).

Each family file has a builder (``GGUFMetadata`` -> its transformers config, ``architectures``
set so the registry picks the model class as for an HF checkpoint); this module holds what they
share: the metadata as plain values, the Llama-style keys every one of those files carries
(``llama_like``), and ``teach_transformers``: hyprefix reads a GGUF file's tokenizer
(``loader.load_tokenizer``) and tensor names (``gguf_weights.GGUFWeights``) through
transformers' own GGUF code, which this lets read these files too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_REQUIRED: Any = object()


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's metadata keys as plain values (``tokenizer.ggml.tokens`` as the vocabulary's
    length, as transformers' ``read_gguf_metadata`` gives it; the tokenizer's other arrays left
    out), its tensor names, and where read from a file (``read_metadata``) its small float
    tensors by name (LongRoPE's factors). Getters raise ValueError naming the file and the key."""

    name: str  # the file's name, for messages
    values: Mapping[str, Any]
    tensor_names: Collection[str]
    read_tensor: Callable[[str], np.ndarray] | None = None

    @property
    def arch(self) -> str:
        return str(self.values["general.architecture"])

    def error(self, problem: str) -> ValueError:
        return ValueError(f"GGUF file {self.name} ({self.arch}): {problem}")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """``{arch}.{key}``; without ``default`` a missing key is an error."""
        value = self.values.get(f"{self.arch}.{key}")
        if value is None:
            if default is _REQUIRED:
                raise self.error(f"no {self.arch}.{key} in its metadata")
            return default
        return value

    def real(self, key: str, default: Any = _REQUIRED) -> Any:
        """A float key as the HF config most likely wrote it: GGUF keeps float32, so the shortest
        decimal that rounds to that float32 (1e-06 for 9.99999997e-07, 0.22 for 0.21999999880).
        Either rounds to the same float32; the decimal also equals the config where a computation
        runs in float64 (a Python scalar)."""
        value = self.get(key, default)
        return value if value is default or value is None else float(str(np.float32(value)))

    def tensor(self, name: str) -> list[float]:
        """A float tensor's values (flattened); only from a file read by ``read_metadata``."""
        if self.read_tensor is None or name not in self.tensor_names:
            raise self.error(f"no tensor {name!r}")
        return [float(v) for v in self.read_tensor(name).reshape(-1)]


def read_metadata(path: Path) -> GGUFMetadata:
    """The metadata of the GGUF file at ``path`` (through ``gguf.GGUFReader``, the module
    attribute, which ``loader.gguf_parsed_once`` caches)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from exc
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key == "tokenizer.ggml.tokens":
            values[key] = len(field.data)
        elif not key.startswith(("tokenizer.ggml.", "GGUF.")) or key.endswith("_token_id"):
            values[key] = field.contents()
    tensors = {t.name: t for t in reader.tensors}

    def read(name: str) -> np.ndarray:
        tensor = tensors[name]
        return np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)

    return GGUFMetadata(path.name, values, frozenset(tensors), read)


def llama_like(meta: GGUFMetadata, partial_rotary: bool = False) -> dict[str, Any]:
    """The config keys of a Llama-style decoder under transformers' names, as llama.cpp's
    converter writes them: shapes, norm epsilon, RoPE base (with linear scaling where stated),
    vocabulary size (the token list's length, as llama.cpp counts it), tied head (the converter
    writes ``output.weight`` only when the head is not the embedding), special token ids.
    ``partial_rotary``: the caller reads a rotary width narrower than the head itself; otherwise
    one is refused, as are per-layer head counts, RoPE scaling other than linear and llama3-style
    frequency factors (``rope_freqs``), which these builders do not rebuild."""
    heads, kv_heads, hidden = meta.get("attention.head_count"), meta.get("attention.head_count_kv"), \
        meta.get("embedding_length")
    if isinstance(kv_heads, list) or isinstance(heads, list):
        raise meta.error("per-layer attention head counts are not supported")
    head_dim = meta.get("attention.key_length", None) or hidden // heads
    if meta.get("attention.value_length", head_dim) != head_dim:
        raise meta.error(f"{meta.arch}.attention.value_length differs from the key length: not supported")
    if not partial_rotary and meta.get("rope.dimension_count", head_dim) != head_dim:
        raise meta.error(f"{meta.arch}.rope.dimension_count {meta.get('rope.dimension_count')} differs from "
                         f"the head dim {head_dim}: partial rotary is not supported for this architecture")
    if "rope_freqs.weight" in meta.tensor_names:
        raise meta.error("rope_freqs (llama3-style RoPE frequency factors) is not supported for this architecture")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": meta.real("rope.freq_base", 10000.0)}
    scaling = meta.get("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=meta.real("rope.scaling.factor"))
    elif scaling != "none":
        raise meta.error(f"{meta.arch}.rope.scaling.type {scaling!r} is not supported (only none and linear)")
    config = {
        "num_hidden_layers": meta.get("block_count"),
        "max_position_embeddings": meta.get("context_length"),
        "hidden_size": hidden,
        "intermediate_size": meta.get("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": meta.real("attention.layer_norm_rms_epsilon"),
        "rope_parameters": rope,
        "vocab_size": meta.values["tokenizer.ggml.tokens"],
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
        "eos_token_id": meta.values.get("tokenizer.ggml.eos_token_id"),
        "bos_token_id": meta.values.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": meta.values.get("tokenizer.ggml.padding_token_id"),
    }
    if meta.get("attention.key_length", None) is not None:
        config["head_dim"] = head_dim
    return config


Builder = Callable[[GGUFMetadata], Any]  # metadata -> a transformers PretrainedConfig


def load_config(path: Path, builders: Mapping[str, Builder], llama_rows: Collection[str]):
    """The transformers config the builder of the file's architecture makes of its metadata;
    first ``teach_transformers`` (idempotent), whose tables the tokenizer and the weights read next."""
    teach_transformers(builders, llama_rows)
    meta = read_metadata(path)
    if meta.arch not in builders:
        raise meta.error(f"no config builder for this architecture (only {', '.join(builders)})")
    return builders[meta.arch](meta)


def teach_transformers(builders: Mapping[str, Builder], llama_rows: Collection[str]) -> None:
    """Let transformers' GGUF code read files of these architectures: its config reader
    (``GGUF_CONFIG_ARCHS``, which ``AutoTokenizer`` consults to pick a tokenizer class) gets the
    builder of each architecture it cannot read at all (it reads phi3, lossily but enough for the
    tokenizer), and its tensor processors (``TENSOR_PROCESSORS``, which ``GGUFWeights`` picks by
    the file's architecture) get Llama's, which undoes the q/k row order llama.cpp's converter
    writes, for those in ``llama_rows`` (files its ``LlamaModel`` subclasses write). Entries
    transformers has of its own are kept.

    This registers into transformers' module-level tables because the callers that read them
    (``loader.load_tokenizer``, ``gguf_weights.GGUFWeights``) hand the file's architecture
    straight to transformers. It runs when such a file's config is loaded (``load_config``,
    before the engine reads its weights and tokenizer), not at import: importing transformers'
    GGUF code costs most of a second."""
    from transformers.integrations.gguf import gguf_config_mapping
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_SUPPORTED_ARCHITECTURES,
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
    )

    for arch, builder in builders.items():
        if arch not in GGUF_SUPPORTED_ARCHITECTURES:
            gguf_config_mapping.GGUF_CONFIG_ARCHS.setdefault(arch, _as_transformers_builder(builder))
    for arch in llama_rows:
        TENSOR_PROCESSORS.setdefault(arch, LlamaTensorProcessor)


def _as_transformers_builder(builder: Builder) -> Callable[[dict, tuple[str, ...]], dict]:
    """``builder`` as transformers' ``GGUF_CONFIG_ARCHS`` calls it: (metadata, tensor names) ->
    config dict (with ``model_type``)."""
    def build(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
        return builder(GGUFMetadata("(read by transformers)", metadata, frozenset(tensor_names))).to_dict()

    return build
