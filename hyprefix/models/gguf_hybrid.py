"""GGUF files of hybrid (recurrent + attention) models as llama.cpp's converter
(``convert_hf_to_gguf.py``) writes them: Qwen3.5 dense and MoE (``qwen35``, ``qwen35moe``),
Qwen3-Next (``qwen3next``), NemotronH (``nemotron_h``) and pure Mamba2 (``mamba2``).

transformers' GGUF reader refuses most of these architectures, so this module rebuilds what the
HF checkpoint held: ``load_config`` a transformers config from the file's metadata (and, where
the metadata says nothing, from which tensors the file has), ``iter_tensors`` every tensor under
transformers' parameter name in float32 with the converter's transforms undone, and
``load_tokenizer`` the tokenizer and chat template from ``tokenizer.*`` metadata. The model
classes then load them exactly as they load an HF checkpoint.

The converter's transforms, each undone in ``iter_tensors``'s builders:

- every architecture: names (``blk.N.*``, ggml leaf names); ``A_log`` stored as
  ``ssm_a = -exp(A_log)`` (``_a_log``); the depthwise conv1d kernel squeezed to 2-D
  (``unsqueeze(1)``); ``dt_bias`` renamed ``ssm_dt.bias``.
- Qwen3.5 / Qwen3-Next: the zero-centred norms (decoder, final, attention q/k) stored as
  ``w + 1`` (``_minus_one``), but not the DeltaNet's gated ``ssm_norm``.
- Qwen3-Next: ``in_proj_qkvz`` (grouped by key head: q, k, v, z per head) split into
  ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z), re-interleaved (``qkvz``);
  ``in_proj_ba`` is kept as it is (``ssm_ba``).
- Qwen3.5 (dense and MoE), when there are more value heads than key heads: value heads moved
  from grouped order (each key head's value heads together) to tiled order, on every tensor
  with a row or column per value head or value channel: the v rows of ``in_proj_qkv`` and of
  the conv1d kernel, ``in_proj_z``, ``in_proj_a``/``in_proj_b``, ``A_log``, ``dt_bias`` rows and
  ``out_proj`` columns (``_grouped``).
- Mixture of experts: experts stacked into ``ffn_{gate,up,down}_exps`` [E, rows, cols];
  transformers fuses gate and up (``experts.gate_up_proj``, gate rows first).
- NemotronH: q/k rows permuted for ggml's RoPE layout (``LlamaModel.permute``) although the
  attention has no RoPE (``_unpermute``); Mamba2 and NemotronH: ``A`` and ``D`` reshaped to
  [heads, 1] and the gated norm to [groups, channels / groups] (flattened back).

What a file does not state, and how it is filled: Qwen3-Next's ``norm_topk_prob`` is True
(llama.cpp normalises the top-k weights of ``qwen3next`` unconditionally) unless the file
states ``expert_weights_norm``; dense layers of a Qwen3-Next (``mlp_only_layers``) and biases
are read off the tensors present; NemotronH's layer kinds come from the per-layer KV head
counts and the tensors present; Mamba time-step limits keep transformers' defaults (llama.cpp
clamps nothing either).

``nemotron_h_moe`` is loaded too when none of its layers has experts: the converter picks that
architecture for any NemotronH config that mentions ``num_experts_per_tok``, and transformers 5
writes that default into every NemotronH config it saves, so a dense NemotronH re-saved by
transformers 5 converts to ``nemotron_h_moe``. Expert layers themselves are refused (the engine
runs no NemotronH MoE).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next", "nemotron_h", "nemotron_h_moe", "mamba2")
_QWEN = ("qwen35", "qwen35moe", "qwen3next")
LINEAR, FULL, MLP = "linear_attention", "full_attention", "mlp"
_EXPERT_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                   "ffn_gate_up_exps.weight")
_REQUIRED: Any = object()


class _File:
    """A GGUF file's metadata and tensor table (the reader maps the file; tensor data is only
    read by ``read``). Metadata getters raise ValueError naming the file and the key."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path, self.arch = path, ""
        try:
            self.reader = gguf.GGUFReader(str(path))  # the module attribute: ``gguf_parsed_once`` caches it
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from exc
        self.arch = str(self.value("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"GGUF file {path.name}: architecture {self.arch!r} is not one of {ARCHITECTURES}")
        self.tensors = {t.name: t for t in self.reader.tensors}
        # ggml lists dimensions fastest-moving first; torch the other way round
        self.shapes = {name: tuple(int(n) for n in reversed(t.shape.tolist())) for name, t in self.tensors.items()}

    def error(self, problem: str) -> ValueError:
        return ValueError(f"GGUF file {self.path.name}{f' ({self.arch})' if self.arch else ''}: {problem}")

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise self.error(f"no {key!r} in its metadata")
            return default
        return field.contents()

    def arch_value(self, key: str, default: Any = _REQUIRED) -> Any:
        """``{arch}.{key}``."""
        return self.value(f"{self.arch}.{key}", default)

    def int_value(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.arch_value(key, default)
        return value if value is default else int(value)

    def float_value(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.arch_value(key, default)
        return value if value is default else float(value)

    def per_layer(self, key: str, layers: int) -> list[int]:
        """A count llama.cpp writes either once or once per layer."""
        value = self.arch_value(key)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
        if len(values) < layers:
            raise self.error(f"{self.arch}.{key} has {len(values)} entries for {layers} layers")
        return values[:layers]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def rows(self, name: str) -> int:
        if name not in self.shapes:
            raise self.error(f"no tensor {name!r}")
        return self.shapes[name][0]

    def read(self, name: str) -> torch.Tensor:
        """The tensor's values in float32 (dequantized where quantized), in torch's shape."""
        import gguf

        tensor = self.tensors[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise self.error(f"tensor {name} is stored as {tensor.tensor_type.name}, which the gguf package "
                             f"cannot dequantize ({exc})") from exc
        array = np.asarray(values, dtype=np.float32).reshape(self.shapes[name])
        if not array.flags.writeable:  # the file's own (mapped, read-only) bytes: copy
            array = array.copy()
        return torch.from_numpy(array)


# ---------------------------------------------------------------------------------------- config
def load_config(path: str | Path):
    """The transformers config of the HF model the file was converted from: the class of that
    model type (Qwen3_5TextConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig, NemotronHConfig,
    Mamba2Config) with ``architectures`` set, so the engine picks its model class as for an HF
    checkpoint. Raises ValueError for a file this module does not load or whose metadata lacks
    what the model needs."""
    file = _File(Path(path))
    if file.arch in _QWEN:
        return _qwen_config(file)
    if file.arch == "mamba2":
        return _mamba2_config(file)
    return _nemotron_config(file)


def _common(file: _File) -> dict[str, Any]:
    """Fields every architecture's config takes the same way."""
    embed = "token_embd.weight"
    if not file.has(embed):
        raise file.error(f"no tensor {embed!r}")
    ids = {name: file.value(f"tokenizer.ggml.{key}", None)
           for name, key in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id"),
                             ("pad_token_id", "padding_token_id"))}
    return {
        "vocab_size": file.rows("output.weight") if file.has("output.weight") else file.rows(embed),
        "hidden_size": file.int_value("embedding_length"),
        # llama.cpp's training context; the converter writes 2**20 for models without positions
        "max_position_embeddings": file.int_value("context_length"),
        **{name: int(value) if value is not None else None for name, value in ids.items()},
    }


def _layers(file: _File) -> int:
    """Decoder layers: the file counts a multi-token-prediction block as one more."""
    return file.int_value("block_count") - file.int_value("nextn_predict_layers", 0)


def _has_experts(file: _File, layer: int) -> bool:
    return any(file.has(f"blk.{layer}.{name}") for name in _EXPERT_TENSORS)


def _rope_parameters(file: _File, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": file.float_value("rope.freq_base", 10000.0)}
    rotary = file.int_value("rope.dimension_count", head_dim)
    if rotary != head_dim:  # a width in dimensions, where transformers takes a fraction of the head
        params["partial_rotary_factor"] = rotary / head_dim
    scaling = str(file.arch_value("rope.scaling.type", "none"))
    if scaling == "linear":
        params.update(rope_type="linear", factor=file.float_value("rope.scaling.factor"))
    elif scaling == "yarn":
        params.update(rope_type="yarn", factor=file.float_value("rope.scaling.factor"),
                      original_max_position_embeddings=file.int_value("rope.scaling.original_context_length"))
        for key, name in (("rope.scaling.yarn_attn_factor", "attention_factor"),
                          ("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if (value := file.float_value(key, None)) is not None:
                params[name] = value
    elif scaling != "none":
        raise file.error(f"RoPE scaling {scaling!r} is not supported")
    sections = [int(s) for s in file.arch_value("rope.dimension_sections", []) if int(s)]
    if sections:  # Qwen3.5's interleaved multimodal RoPE; with text positions it is plain RoPE
        params.update(mrope_section=sections, mrope_interleaved=True)
    return params


def _qwen_config(file: _File):
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    layers = _layers(file)
    recurrent = file.arch_value("attention.recurrent_layers", None)
    if recurrent is not None:
        if len(recurrent) < layers:
            raise file.error(f"attention.recurrent_layers has {len(recurrent)} entries for {layers} layers")
        layer_types = [LINEAR if r else FULL for r in recurrent[:layers]]
    else:
        interval = file.int_value("full_attention_interval", 4)
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if FULL not in layer_types:
        raise file.error("no full-attention layer")
    first_full = layer_types.index(FULL)
    head_dim = file.int_value("attention.key_length")
    value_heads = file.int_value("ssm.time_step_rank")
    fields = _common(file) | {
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": max(file.per_layer("attention.head_count", layers)),
        "num_key_value_heads": max(file.per_layer("attention.head_count_kv", layers)),
        "head_dim": head_dim,
        "rms_norm_eps": file.float_value("attention.layer_norm_rms_epsilon"),
        "rope_parameters": _rope_parameters(file, head_dim),
        "attention_bias": file.has(f"blk.{first_full}.attn_q.bias"),
        "linear_conv_kernel_dim": file.int_value("ssm.conv_kernel"),
        "linear_key_head_dim": file.int_value("ssm.state_size"),
        "linear_num_key_heads": file.int_value("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": file.int_value("ssm.inner_size") // value_heads,
        # llama.cpp writes the output projection only when it is not the embedding
        "tie_word_embeddings": not file.has("output.weight"),
    }
    moe = [i for i in range(layers) if _has_experts(file, i)]
    dense = [i for i in range(layers) if i not in moe]
    if file.arch == "qwen35":
        if moe:
            raise file.error(f"layers {moe} have experts, which a dense Qwen3.5 (qwen35) has not")
        return Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"],
                                 intermediate_size=file.int_value("feed_forward_length"), **fields)
    experts = {
        "num_experts": file.int_value("expert_count"),
        "num_experts_per_tok": file.int_value("expert_used_count"),
        "moe_intermediate_size": file.int_value("expert_feed_forward_length"),
        "shared_expert_intermediate_size": file.int_value("expert_shared_feed_forward_length", 0),
    }
    if file.arch == "qwen35moe":
        if dense:
            raise file.error(f"layers {dense} have no experts, which every Qwen3.5 MoE (qwen35moe) layer has")
        return Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"], **experts, **fields)
    intermediate = file.rows(f"blk.{dense[0]}.ffn_up.weight") if dense else file.int_value("feed_forward_length", None)
    return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **experts, **fields,
                           **({"intermediate_size": intermediate} if intermediate else {}),
                           norm_topk_prob=bool(file.arch_value("expert_weights_norm", True)),
                           decoder_sparse_step=1, mlp_only_layers=dense)


def _norm_eps(file: _File) -> float:
    eps = file.float_value("attention.layer_norm_rms_epsilon", None)
    return eps if eps is not None else file.float_value("attention.layer_norm_epsilon")


def _mamba_fields(file: _File, first_mamba: int | None) -> dict[str, Any]:
    """The Mamba2 mixer's shape, named as NemotronHConfig names it."""
    heads = file.int_value("ssm.time_step_rank")
    b = f"blk.{first_mamba}."
    return {
        "mamba_num_heads": heads,
        "mamba_head_dim": file.int_value("ssm.inner_size") // heads,
        "ssm_state_size": file.int_value("ssm.state_size"),
        "n_groups": file.int_value("ssm.group_count"),
        "conv_kernel": file.int_value("ssm.conv_kernel"),
        "use_bias": first_mamba is not None and file.has(b + "ssm_in.bias"),
        "use_conv_bias": first_mamba is not None and file.has(b + "ssm_conv1d.bias"),
        "layer_norm_epsilon": _norm_eps(file),
    }


def _mamba2_config(file: _File):
    from transformers import Mamba2Config

    layers, fields = _layers(file), _common(file)
    mamba = _mamba_fields(file, 0)
    return Mamba2Config(
        architectures=["Mamba2ForCausalLM"], num_hidden_layers=layers, num_heads=mamba["mamba_num_heads"],
        head_dim=mamba["mamba_head_dim"], state_size=mamba["ssm_state_size"], n_groups=mamba["n_groups"],
        conv_kernel=mamba["conv_kernel"], expand=file.int_value("ssm.inner_size") // fields["hidden_size"],
        use_bias=mamba["use_bias"], use_conv_bias=mamba["use_conv_bias"],
        layer_norm_epsilon=mamba["layer_norm_epsilon"], tie_word_embeddings=not file.has("output.weight"), **fields)


def _nemotron_kind(file: _File, layer: int, kv_heads: int) -> str:
    b = f"blk.{layer}."
    if _has_experts(file, layer):
        raise file.error(f"layer {layer} is a mixture-of-experts layer; hyprefix runs no NemotronH MoE")
    if kv_heads > 0 or file.has(b + "attn_q.weight"):
        return FULL
    if file.has(b + "ssm_in.weight"):
        return LINEAR
    if file.has(b + "ffn_up.weight"):
        return MLP
    raise file.error(f"layer {layer} is none of Mamba2 (ssm_in), attention (attn_q) or MLP (ffn_up)")


def _nemotron_config(file: _File):
    from transformers import NemotronHConfig

    layers = _layers(file)
    kinds = [_nemotron_kind(file, i, kv) for i, kv in enumerate(file.per_layer("attention.head_count_kv", layers))]
    fields = _common(file)
    first = {kind: kinds.index(kind) if kind in kinds else None for kind in (LINEAR, FULL, MLP)}
    heads = max(file.per_layer("attention.head_count", layers))
    extra: dict[str, Any] = {}
    if first[MLP] is not None:
        extra.update(intermediate_size=file.rows(f"blk.{first[MLP]}.ffn_up.weight"),
                     mlp_bias=file.has(f"blk.{first[MLP]}.ffn_up.bias"))
    mamba = _mamba_fields(file, first[LINEAR])
    return NemotronHConfig(
        architectures=["NemotronHForCausalLM"], layers_block_type=kinds, num_attention_heads=heads,
        num_key_value_heads=max(file.per_layer("attention.head_count_kv", layers)) or heads,
        head_dim=file.int_value("attention.key_length", fields["hidden_size"] // max(heads, 1)),
        attention_bias=first[FULL] is not None and file.has(f"blk.{first[FULL]}.attn_q.bias"),
        mamba_proj_bias=mamba["use_bias"], tie_word_embeddings=False, **mamba, **extra, **fields)


# --------------------------------------------------------------------------------------- tensors
def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _minus_one(t: torch.Tensor) -> torch.Tensor:
    """A zero-centred norm weight (the model scales by 1 + w), which the converter stored as w + 1."""
    return t - 1


def _a_log(a: torch.Tensor) -> torch.Tensor:
    """``ssm_a = -exp(A_log)`` (any shape) back to the flat ``A_log``."""
    return torch.log(-a).reshape(-1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _conv(t: torch.Tensor) -> torch.Tensor:
    """The squeezed [channels, kernel] conv1d weight back to [channels, 1, kernel]."""
    return t.unsqueeze(1)


def _grouped(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int, offset: int = 0) -> torch.Tensor:
    """Value heads from the converter's tiled order (value head j of every key head, then j + 1)
    back to transformers' grouped order (each key head's value heads together), along ``dim``
    (0 or 1) from ``offset`` on: the inverse of ``_LinearAttentionVReorderBase._reorder_v_heads``."""
    head, tail = t.narrow(dim, 0, offset), t.narrow(dim, offset, t.shape[dim] - offset)
    shape = list(tail.shape)
    tiled = tail.reshape(*shape[:dim], per_key, key_heads, head_dim, *shape[dim + 1:])
    return torch.cat([head, tiled.transpose(dim, dim + 1).reshape(shape)], dim=dim)


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k (weight or bias) back from ``LlamaModel.permute``'s RoPE order: per head,
    the converter moved row ``s * (head_dim / 2) + j`` to ``2 * j + s``."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _cat_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Stacked experts' gate [E, I, H] and up [E, I, H] as transformers' gate_up_proj [E, 2I, H]."""
    return torch.cat([gate, up], dim=1)


def _as_row(t: torch.Tensor) -> torch.Tensor:
    """The shared-expert gate as a [1, hidden] matrix (some files keep it as a vector)."""
    return t.reshape(1, -1)


@dataclass(frozen=True)
class _Tensor:
    """One transformers tensor, ``name``, built by ``build`` from the file's tensors ``sources``
    (their float32 values, in order)."""

    name: str
    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor] = _same


def iter_tensors(path: str | Path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file under transformers' parameter name (those of the model type
    ``load_config`` gives), float32, with the converter's transforms undone (module docstring).
    Before yielding anything, raises ValueError naming the file and the tensors when one the
    model needs is missing, or when the file holds one this loader does not place (weights are
    never dropped silently); blocks past the decoder's layers (the multi-token-prediction
    block) are skipped, as transformers skips ``mtp.*``."""
    file = _File(Path(path))
    cfg = hf_config.get_text_config()
    specs = _qwen_tensors(file, cfg) if file.arch in _QWEN else _mamba_tensors(file, cfg)
    needed = [name for spec in specs for name in spec.sources]
    missing = [name for name in needed if not file.has(name)]
    if missing:
        raise file.error(f"missing tensors the model needs: {_listed(missing)}")
    used = set(needed)
    unknown = [name for name in file.tensors if name not in used and not _past_layers(name, cfg.num_hidden_layers)]
    if unknown:
        raise file.error(f"tensors hyprefix does not know where to load: {_listed(unknown)}")
    for spec in specs:
        yield spec.name, spec.build(*(file.read(name) for name in spec.sources))


def _listed(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" ... ({len(names)} in all)" if len(names) > 8 else "")


def _past_layers(name: str, layers: int) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= layers


def _qwen_tensors(file: _File, cfg) -> list[_Tensor]:
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_key, key_dim, value_dim = v_heads // k_heads, k_heads * k_dim, v_heads * v_dim
    tiled = file.arch != "qwen3next" and k_heads != v_heads  # as the converter decides

    def grouped(dim: int, head_dim: int, offset: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
        if not tiled:
            return _same
        return lambda t: _grouped(t, dim, k_heads, per_key, head_dim, offset)

    per_head = grouped(0, 1)

    def qkvz(qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's in_proj_qkvz groups rows by key head: q, k, v (its value heads), z."""
        hidden = qkv.shape[-1]
        q, k, v = qkv.split([key_dim, key_dim, value_dim])
        parts = [q.reshape(k_heads, k_dim, hidden), k.reshape(k_heads, k_dim, hidden),
                 v.reshape(k_heads, per_key * v_dim, hidden), z.reshape(k_heads, per_key * v_dim, hidden)]
        return torch.cat(parts, dim=1).reshape(-1, hidden)

    out = [_Tensor("model.embed_tokens.weight", ("token_embd.weight",)),
           _Tensor("model.norm.weight", ("output_norm.weight",), _minus_one)]
    if not cfg.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", ("output.weight",)))
    for i, kind in enumerate(cfg.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [_Tensor(p + "input_layernorm.weight", (b + "attn_norm.weight",), _minus_one),
                _Tensor(p + "post_attention_layernorm.weight", (b + "post_attention_norm.weight",), _minus_one)]
        if kind == LINEAR:
            la = p + "linear_attn."
            out += [
                _Tensor(la + "A_log", (b + "ssm_a",), lambda a: per_head(_a_log(a))),
                _Tensor(la + "dt_bias", (b + "ssm_dt.bias",), per_head),
                _Tensor(la + "conv1d.weight", (b + "ssm_conv1d.weight",),
                        lambda t: _conv(grouped(0, v_dim, 2 * key_dim)(t))),
                _Tensor(la + "norm.weight", (b + "ssm_norm.weight",)),  # the one norm the converter leaves
                _Tensor(la + "out_proj.weight", (b + "ssm_out.weight",), grouped(1, v_dim)),
            ]
            if file.arch == "qwen3next":
                out += [_Tensor(la + "in_proj_qkvz.weight", (b + "attn_qkv.weight", b + "attn_gate.weight"), qkvz),
                        _Tensor(la + "in_proj_ba.weight", (b + "ssm_ba.weight",))]
            else:
                out += [_Tensor(la + "in_proj_qkv.weight", (b + "attn_qkv.weight",), grouped(0, v_dim, 2 * key_dim)),
                        _Tensor(la + "in_proj_z.weight", (b + "attn_gate.weight",), grouped(0, v_dim)),
                        _Tensor(la + "in_proj_b.weight", (b + "ssm_beta.weight",), per_head),
                        _Tensor(la + "in_proj_a.weight", (b + "ssm_alpha.weight",), per_head)]
        else:
            sa = p + "self_attn."
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                 ("o_proj", "attn_output")):
                out.append(_Tensor(f"{sa}{ours}.weight", (f"{b}{theirs}.weight",)))
                if cfg.attention_bias:
                    out.append(_Tensor(f"{sa}{ours}.bias", (f"{b}{theirs}.bias",)))
            out += [_Tensor(sa + "q_norm.weight", (b + "attn_q_norm.weight",), _minus_one),
                    _Tensor(sa + "k_norm.weight", (b + "attn_k_norm.weight",), _minus_one)]
        out += _qwen_mlp(file, cfg, i)
    return out


def _qwen_mlp(file: _File, cfg, i: int) -> list[_Tensor]:
    p, b = f"model.layers.{i}.mlp.", f"blk.{i}."
    if not _has_experts(file, i):
        return [_Tensor(f"{p}{proj}_proj.weight", (f"{b}ffn_{proj}.weight",)) for proj in ("gate", "up", "down")]
    fused = b + "ffn_gate_up_exps.weight"  # the converter's --fuse-gate-up-exps
    gate_up = (_Tensor(p + "experts.gate_up_proj", (fused,)) if file.has(fused) else
               _Tensor(p + "experts.gate_up_proj", (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"), _cat_rows))
    out = [_Tensor(p + "gate.weight", (b + "ffn_gate_inp.weight",)), gate_up,
           _Tensor(p + "experts.down_proj", (b + "ffn_down_exps.weight",))]
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        out += [_Tensor(f"{p}shared_expert.{proj}_proj.weight", (f"{b}ffn_{proj}_shexp.weight",))
                for proj in ("gate", "up", "down")]
        out.append(_Tensor(p + "shared_expert_gate.weight", (b + "ffn_gate_inp_shexp.weight",), _as_row))
    return out


def _mamba_tensors(file: _File, cfg) -> list[_Tensor]:
    nemotron = cfg.model_type == "nemotron_h"
    kinds = list(cfg.layers_block_type) if nemotron else [LINEAR] * cfg.num_hidden_layers
    base = "model." if nemotron else "backbone."  # transformers' NemotronH names its decoder ``model``
    out = [_Tensor(base + "embeddings.weight", ("token_embd.weight",)),
           _Tensor(base + "norm_f.weight", ("output_norm.weight",))]
    if not cfg.tie_word_embeddings:
        # NemotronH never ties its head: a file without one has it in the embedding
        out.append(_Tensor("lm_head.weight", ("output.weight" if file.has("output.weight") else "token_embd.weight",)))
    for i, kind in enumerate(kinds):
        p, b = f"{base}layers.{i}.", f"blk.{i}."
        m = p + "mixer."
        out.append(_Tensor(p + "norm.weight", (b + "attn_norm.weight",)))
        if kind == LINEAR:
            out += [_Tensor(m + "in_proj.weight", (b + "ssm_in.weight",)),
                    _Tensor(m + "conv1d.weight", (b + "ssm_conv1d.weight",), _conv),
                    _Tensor(m + "dt_bias", (b + "ssm_dt.bias",)),
                    _Tensor(m + "A_log", (b + "ssm_a",), _a_log),
                    _Tensor(m + "D", (b + "ssm_d",), _flat),
                    _Tensor(m + "norm.weight", (b + "ssm_norm.weight",), _flat),
                    _Tensor(m + "out_proj.weight", (b + "ssm_out.weight",))]
            if cfg.use_conv_bias:
                out.append(_Tensor(m + "conv1d.bias", (b + "ssm_conv1d.bias",)))
            if cfg.use_bias:
                out += [_Tensor(m + "in_proj.bias", (b + "ssm_in.bias",)),
                        _Tensor(m + "out_proj.bias", (b + "ssm_out.bias",))]
        elif kind == FULL:
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                                 ("o_proj", "attn_output")):
                build = _same if ours not in heads else (lambda t, n=heads[ours]: _unpermute(t, n))
                out.append(_Tensor(f"{m}{ours}.weight", (f"{b}{theirs}.weight",), build))
                if cfg.attention_bias:
                    out.append(_Tensor(f"{m}{ours}.bias", (f"{b}{theirs}.bias",), build))
        else:
            for proj in ("up", "down"):
                out.append(_Tensor(f"{m}{proj}_proj.weight", (f"{b}ffn_{proj}.weight",)))
                if cfg.mlp_bias:
                    out.append(_Tensor(f"{m}{proj}_proj.bias", (f"{b}ffn_{proj}.bias",)))
    return out


# ------------------------------------------------------------------------------------- tokenizer
def load_tokenizer(path: str | Path):
    """The tokenizer the file's ``tokenizer.ggml.*`` metadata describes (vocabulary, merges,
    pre-tokenizer, special and added tokens, BOS/EOS flags) with its ``tokenizer.chat_template``,
    built by transformers' GGUF tokenizer converters. transformers' ``AutoTokenizer`` would
    refuse most of these architectures: it reads the model config first, and has none for them."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    path = Path(path)
    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"cannot build the tokenizer of GGUF file {path.name}: {exc}") from exc
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
