"""Load a checkpoint: an HF directory (config, safetensors, tokenizer), a hub id, a demo
alias, or a GGUF file (config, weights dequantized to the engine dtype, tokenizer and
chat template all from the file, read by transformers' GGUF support)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hyprefix.hardware import DTYPES, resolve_dtype
from hyprefix.models.quant import Int8Weight
from hyprefix.models.registry import model_class


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    hf_config: object
    path: Path  # the checkpoint directory, or the GGUF file
    identity: str  # names the checkpoint and its weights (for cache hashing)
    dtype: torch.dtype
    max_position_embeddings: int
    weight_bytes: int


# Every file a checkpoint's config, weights, tokenizer and chat template can live in
# (transformers 5 keeps a chat template only in chat_template.jinja).
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local checkpoint of ``model``: a demo alias (``hyprefix.demo.DEMO_ALIASES``),
    a directory, a GGUF file (or a directory whose only weights are one), or a hub id
    (downloaded)."""
    from hyprefix.demo import resolve_demo_alias

    demo = resolve_demo_alias(model)
    if demo is not None:
        return Path(demo)
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ValueError(f"model directory {model!r} holds several GGUF files "
                             f"({', '.join(g.name for g in ggufs)}): give the path of one")
        raise ValueError(f"model directory {model!r} has no config.json: it is neither a Hugging Face checkpoint "
                         "(config.json, *.safetensors and the tokenizer files) nor a directory holding a GGUF file")
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.exists():
        raise ValueError(f"model path {model!r} is a file of an unknown kind ({path.suffix or 'no extension'}); "
                         "give a GGUF file or a Hugging Face checkpoint directory (config.json, *.safetensors)")
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
    if path.suffix == ".gguf":  # the file holds config and weights
        files = [path]
    else:
        h.update((path / "config.json").read_bytes())
        files = sorted(path.glob("*.safetensors"))
    for file in files:
        st = file.stat()
        h.update(f"{file.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


# GGUF architectures (``general.architecture``) whose models hyprefix runs: Llama
# (SmolLM2, and Mistral, which llama.cpp writes as llama), Mistral, Qwen2, Qwen3, Gemma 3.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).get_field("general.architecture")
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from exc
    if field is None:
        raise ValueError(f"GGUF file {path.name} names no architecture (general.architecture)")
    return str(field.contents())


def pretrained_location(path: str | os.PathLike) -> dict[str, str]:
    """``from_pretrained``'s location arguments: a checkpoint directory or hub id as it is; a
    GGUF file as transformers reads one, its directory and ``gguf_file``."""
    path = Path(path)
    if path.suffix == ".gguf":
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return {"pretrained_model_name_or_path": str(path)}


def load_config(path: Path):
    from transformers import AutoConfig

    if path.suffix != ".gguf":
        return AutoConfig.from_pretrained(str(path))
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {path.name}: architecture {arch!r} is not supported; hyprefix loads GGUF "
                         f"files of {', '.join(GGUF_ARCHITECTURES)}")
    try:
        return AutoConfig.from_pretrained(**pretrained_location(path))
    except ValueError as exc:
        raise ValueError(f"cannot load the GGUF file {path.name}: {exc}") from exc


def _meta_reference(hf_config) -> torch.nn.Module:
    """transformers' model on the meta device: it only names the tensors (GGUF names ->
    transformers names)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def iter_gguf(path: Path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under transformers' names, dequantized to float32."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                       model_to_load=_meta_reference(hf_config))["tensors"]
    except NotImplementedError as exc:  # a quantization type gguf cannot dequantize
        raise ValueError(f"cannot load the GGUF file {path.name}: {exc} ({_tensors_named_in(path, str(exc))})") \
            from exc
    yield from tensors.items()


def iter_gguf_q8_0(path: Path, hf_config) -> Iterator[tuple[str, Int8Weight]]:
    """The file's Q8_0 matrices as int8 weights with one scale per 32 values, the blocks'
    own numbers (no float detour), under transformers' names and with the row permutation
    transformers undoes on load (Llama's q/k) applied to values and scales. The float16
    scales are widened to float32 (exactly): a compiled step reads one per 32 weights, and
    Inductor's C++ (built without F16C) converts a float16 scalar in a slow software loop."""
    import gguf
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = gguf.GGUFReader(str(path))
    processor = TENSOR_PROCESSORS.get(gguf_architecture(path), TensorProcessor)(config=hf_config.to_dict())
    names = get_gguf_hf_weights_map(_meta_reference(hf_config), processor)
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][1]
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0 or tensor.data.ndim != 2 or tensor.name not in names:
            continue
        blocks = np.asarray(tensor.data).reshape(tensor.data.shape[0], -1, block_bytes)
        scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0]
        values = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(blocks.shape[0], -1)
        values = processor.process(weights=values, name=tensor.name).weights
        scales = processor.process(weights=scales, name=tensor.name).weights
        yield names[tensor.name], Int8Weight(torch.from_numpy(np.ascontiguousarray(values)),
                                             torch.from_numpy(np.ascontiguousarray(scales)).float())


def _tensors_named_in(path: Path, message: str) -> str:
    """The file's tensors whose quantization type the message names."""
    import re

    from gguf import GGUFReader

    names = [t.name for t in GGUFReader(str(path)).tensors
             if re.search(rf"\b{re.escape(t.tensor_type.name)}\b", message)]
    return f"tensors of that type: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}" if names else ""


def load_model(model: str, dtype: str, device: torch.device, max_positions: int | None,
               revision: str | None = None, quantization: str | None = None,
               compiled_decode: bool = False, lm_head_fp32: bool = False,
               batch_invariant: bool = False) -> LoadedModel:
    """``quantization`` "int8": int8 linears (``quant.py``). ``lm_head_fp32``: the final norm and
    the LM head in float32 (``CausalLM.use_fp32_head``). ``compiled_decode``:
    the runner will compile decode steps, which read the plain weights (or their bf16 tiles):
    keep them beside the prepacked copies (models without recurrent layers; those decode eagerly).
    ``batch_invariant``: the plain weights only, multiplied by the batch-invariant kernel
    (``CausalLM.use_batch_invariant``, which refuses what the mode does not support)."""
    path = resolve_model_dir(model, revision)
    hf_config = load_config(path)
    cls = model_class(hf_config)
    torch_dtype = resolve_dtype(dtype, checkpoint_dtype(hf_config), device)
    max_pos = int(getattr(hf_config.get_text_config(), "max_position_embeddings", 0) or 4096)
    # Built on the meta device so no time is spent initialising weights we overwrite.
    net = cls(hf_config, torch_dtype, torch.device("meta"), max_positions or max_pos)
    net.materialize(device)
    net.load_weights(iter_gguf(path, hf_config) if path.suffix == ".gguf" else iter_safetensors(path))
    net.eval()
    if lm_head_fp32:  # from the plain weight, before any other form replaces it
        net.use_fp32_head()
    if quantization == "int8":
        if path.suffix == ".gguf":  # Q8_0 matrices keep the file's int8 blocks
            net.load_int8_weights(iter_gguf_q8_0(path, hf_config))
        net.quantize_weights()  # the rest: per-channel int8 from the float weights
    if batch_invariant:
        net.use_batch_invariant()
    net.pack_weights(keep_plain=compiled_decode and net.decode_graph_capable)
    identity = checkpoint_identity(path) + (f"|{quantization}" if quantization else "")
    return LoadedModel(net, hf_config, path, identity, torch_dtype, max_pos, net.weight_memory_bytes())


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file's metadata on every read (config, weights,
    tokenizer), slow for a large vocabulary such as Gemma 3's; and while mapping tensor
    names it builds gguf's name table again for every submodule of the model.
    Inside this block one parse per file and one table per (architecture, layer count)
    serve every call (dropped at its end); the tables are only read."""
    import gguf

    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(originals[0])
    gguf.get_tensor_name_map = functools.cache(originals[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals


def load_tokenizer(path: str | os.PathLike):
    """From a checkpoint directory, a tokenizer name, or a GGUF file's metadata."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        return AutoTokenizer.from_pretrained(**pretrained_location(path))
    return AutoTokenizer.from_pretrained(str(path))
