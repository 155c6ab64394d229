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

The config comes from ``gguf_hybrid_config`` (what a file does not state, and how it is filled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models.gguf_blocks import KEPT_TYPES, BlockMatrix, row_tags, tagged_rows
from hyprefix.models.gguf_check import check_sizes, check_types, listed
from hyprefix.models.gguf_hybrid_config import (  # noqa: F401 - load_config and ARCHITECTURES are this module's API
    ARCHITECTURES,
    FULL,
    LINEAR,
    MOE,
    QWEN_ARCHS,
    HybridFile,
    has_experts,
    load_config,
)


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


def _join_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's gate [I, H] and up [I, H] as one [2I, H] matrix, gate rows first."""
    return torch.cat([gate, up])


def _as_row(t: torch.Tensor) -> torch.Tensor:
    """The shared-expert gate as a [1, hidden] matrix (some files keep it as a vector)."""
    return t.reshape(1, -1)


@dataclass(frozen=True)
class _Tensor:
    """One transformers tensor, ``name``, built by ``build`` from the file's tensors ``sources``
    (their float32 values, in order), then ``columns`` (a reorder of its columns, which the
    blocks of a quantized matrix cannot take: ``gguf_blocks``)."""

    name: str
    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor] = _same
    columns: Callable[[torch.Tensor], torch.Tensor] | None = None

    def values(self, file: HybridFile) -> torch.Tensor:
        t = self.build(*(file.read(name) for name in self.sources))
        return t if self.columns is None else self.columns(t)

    def meta(self, file: HybridFile) -> torch.Tensor:
        """The tensor's shape, as a meta tensor: the transforms run on meta sources, reading nothing."""
        t = self.build(*(torch.empty(file.shapes[name], device="meta") for name in self.sources))
        return t if self.columns is None else self.columns(t)


class HybridGGUF:
    """A hybrid GGUF file's tensors under transformers' names (``load_config``'s model type),
    with the converter's transforms undone (module docstring): its quantized matrices as
    ``gguf_blocks.BlockMatrix`` and every other tensor as float32. Raises ValueError naming the
    file and the tensors when one the model needs is missing, or when the file holds one this
    loader does not place (weights are never dropped silently); blocks past the decoder's layers
    (the multi-token-prediction block) are skipped, as transformers skips ``mtp.*``."""

    def __init__(self, path: str | Path, hf_config) -> None:
        self.file = file = HybridFile(Path(path))
        cfg = hf_config.get_text_config()
        builders = {"qwen3moe": _qwen3moe_tensors, "granitehybrid": _granite_tensors}
        self.specs = (_qwen_tensors(file, cfg) if file.arch in QWEN_ARCHS else
                      builders.get(file.arch, _mamba_tensors)(file, cfg))
        needed = [name for spec in self.specs for name in spec.sources]
        missing = [name for name in needed if not file.has(name)]
        if missing:
            raise file.error(f"missing tensors the model needs: {listed(missing, 8)}")
        used = set(needed)
        unknown = [n for n in file.tensors if n not in used and not _past_layers(n, cfg.num_hidden_layers)]
        if unknown:
            raise file.error(f"tensors hyprefix does not know where to load: {listed(unknown, 8)}")

    def check(self, net: torch.nn.Module) -> None:
        """Before anything is allocated (``gguf_check``): every type reads, every tensor the
        transforms make has its parameter's shape; the names were checked when this reader was made."""
        check_types(self.file.path.name, self.file.tensors)
        check_sizes(self.file.path.name, net, ((spec.name, self._meta(spec)) for spec in self.specs), exact=True,
                    sources={spec.name: " + ".join(spec.sources) for spec in self.specs})

    def _meta(self, spec: _Tensor) -> torch.Tensor:
        """``spec``'s tensor as a meta tensor; a source whose shape the transforms cannot take is
        named with its shape."""
        try:
            return spec.meta(self.file)
        except RuntimeError as exc:
            shapes = ", ".join(f"{name} {self.file.shapes[name]}" for name in spec.sources)
            raise self.file.error(f"tensor {spec.name!r} cannot be made of the file's {shapes}: {exc}") from exc

    def __len__(self) -> int:
        """How many transformers tensors this reader gives."""
        return len(self.specs)

    def floats(self, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor but those named in ``skip``, float32."""
        for spec in self.specs:
            if spec.name not in skip:
                yield spec.name, spec.values(self.file)

    def block_matrices(self) -> list[BlockMatrix]:
        """The matrices that can stay in their blocks: every source 2-D and of one type the
        kernels take (which run here), the build a move of whole rows (``gguf_blocks.row_tags``)."""
        if not quant_kernel.available():
            return []
        out = []
        for spec in self.specs:
            tensors = [self.file.tensors[name] for name in spec.sources]
            kinds = {t.tensor_type.name for t in tensors}
            dims = {t.data.ndim for t in tensors}
            if len(kinds) != 1 or not kinds <= set(KEPT_TYPES) or len(dims) != 1 or not dims <= {2, 3} \
                    or len({t.data.shape[-1] for t in tensors}) != 1:
                continue
            # Stacked experts [E, rows, bytes] are matrices of E * rows rows; the build sees [E, rows, 1] tags.
            stacked = dims == {3}
            experts = {int(t.data.shape[0]) for t in tensors} if stacked else {1}
            if len(experts) != 1:
                continue
            stack = experts.pop()
            counts = [int(t.data.shape[0]) * (int(t.data.shape[1]) if stacked else 1) for t in tensors]
            tags = [t.view(stack, -1, 1) if stacked else t for t in row_tags(counts)]
            try:
                built = spec.build(*tags)
                rows = tagged_rows(built.reshape(-1, 1) if stacked else built, sum(counts))
            except (RuntimeError, ValueError):  # a build that needs the real columns
                rows = None
            if rows is None:
                continue
            cols = int(tensors[0].shape[0])  # gguf lists dimensions innermost first
            order = None if spec.columns is None else spec.columns(torch.arange(cols).reshape(1, cols))[0]
            out.append(BlockMatrix(spec.name, kinds.pop(), len(rows), cols,
                                   lambda ts=tensors, r=rows: torch.cat([_raw(t) for t in ts])[r], order, stack))
        return out


def _raw(tensor) -> torch.Tensor:
    """A quantized tensor's blocks as uint8 [rows, bytes a row] (a copy of the mapped bytes;
    stacked experts' rows one expert after another)."""
    data = np.array(tensor.data, copy=True)
    return torch.from_numpy(data.reshape(-1, data.shape[-1]))


def iter_tensors(path: str | Path, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the file under transformers' parameter name, float32 (``HybridGGUF``)."""
    yield from HybridGGUF(path, hf_config).floats(set())


def _past_layers(name: str, layers: int) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= layers


def _qwen_tensors(file: HybridFile, cfg) -> list[_Tensor]:
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
                _Tensor(la + "out_proj.weight", (b + "ssm_out.weight",), columns=grouped(1, v_dim)),
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
            out += _qk_norm_attention(p + "self_attn.", b, cfg.attention_bias, _minus_one)
        out += _qwen_mlp(file, cfg, i)
    return out


def _qk_norm_attention(sa: str, b: str, bias: bool, norm: Callable[[torch.Tensor], torch.Tensor]) -> list[_Tensor]:
    """A Qwen attention layer's tensors (``sa``: its transformers prefix, ``b``: the file's
    ``blk.N.``): q/k/v/o as they are, QK-norm weights through ``norm``."""
    return [*_attention_projections(sa, b, bias), _Tensor(sa + "q_norm.weight", (b + "attn_q_norm.weight",), norm),
            _Tensor(sa + "k_norm.weight", (b + "attn_k_norm.weight",), norm)]


def _attention_projections(sa: str, b: str, bias: bool,
                           builds: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> list[_Tensor]:
    """q/k/v/o (weights, and biases where ``bias``) of the attention at transformers prefix ``sa``
    from the file's ``blk.N.`` tensors ``b``, each through its ``builds`` entry (default as it is)."""
    out = []
    for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        build = (builds or {}).get(ours, _same)
        out.append(_Tensor(f"{sa}{ours}.weight", (f"{b}{theirs}.weight",), build))
        if bias:
            out.append(_Tensor(f"{sa}{ours}.bias", (f"{b}{theirs}.bias",), build))
    return out


def _qwen3moe_tensors(file: HybridFile, cfg) -> list[_Tensor]:
    """Qwen3-MoE: Qwen3's attention layers (plain norms, q/k rows as transformers has them) and
    Qwen's MLPs; the post-attention norm is ``ffn_norm``."""
    out = [_Tensor("model.embed_tokens.weight", ("token_embd.weight",)),
           _Tensor("model.norm.weight", ("output_norm.weight",))]
    if not cfg.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", ("output.weight",)))
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [_Tensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                _Tensor(p + "post_attention_layernorm.weight", (b + "ffn_norm.weight",)),
                *_qk_norm_attention(p + "self_attn.", b, cfg.attention_bias, _same), *_qwen_mlp(file, cfg, i)]
    return out


def _qwen_mlp(file: HybridFile, cfg, i: int) -> list[_Tensor]:
    p, b = f"model.layers.{i}.mlp.", f"blk.{i}."
    if not has_experts(file, i):
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


def _mamba_tensors(file: HybridFile, cfg) -> list[_Tensor]:
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
            out += _mamba_mixer(m, b, cfg.use_conv_bias, cfg.use_bias)
        elif kind == FULL:
            out += _permuted_attention(m, b, cfg)
        elif kind == MOE:
            out += _nemotron_moe(file, m, b, cfg)
        else:
            for proj in ("up", "down"):
                out.append(_Tensor(f"{m}{proj}_proj.weight", (f"{b}ffn_{proj}.weight",)))
                if cfg.mlp_bias:
                    out.append(_Tensor(f"{m}{proj}_proj.bias", (f"{b}ffn_{proj}.bias",)))
    return out


def _nemotron_moe(file: HybridFile, m: str, b: str, cfg) -> list[_Tensor]:
    """A Nemotron 3 MoE mixer: router and its correction bias, ungated expert stacks, the shared
    expert, and the latent projections where the model has them."""
    out = [_Tensor(m + "gate.weight", (b + "ffn_gate_inp.weight",)),
           _Tensor(m + "gate.e_score_correction_bias", (b + "exp_probs_b.bias",)),
           _Tensor(m + "experts.up_proj", (b + "ffn_up_exps.weight",)),
           _Tensor(m + "experts.down_proj", (b + "ffn_down_exps.weight",))]
    for proj in ("up", "down"):
        out.append(_Tensor(f"{m}shared_experts.{proj}_proj.weight", (f"{b}ffn_{proj}_shexp.weight",)))
        if cfg.mlp_bias:
            out.append(_Tensor(f"{m}shared_experts.{proj}_proj.bias", (f"{b}ffn_{proj}_shexp.bias",)))
    if cfg.moe_latent_size:
        for ours, theirs in (("fc1_latent_proj", "ffn_latent_down"), ("fc2_latent_proj", "ffn_latent_up")):
            out.append(_Tensor(f"{m}{ours}.weight", (f"{b}{theirs}.weight",)))
            if cfg.mlp_bias:
                out.append(_Tensor(f"{m}{ours}.bias", (f"{b}{theirs}.bias",)))
    return out


def _mamba_mixer(m: str, b: str, conv_bias: bool, proj_bias: bool) -> list[_Tensor]:
    """A Mamba2 mixer's tensors (``m``: its transformers prefix, ``b``: the file's ``blk.N.``)."""
    out = [_Tensor(m + "in_proj.weight", (b + "ssm_in.weight",)),
           _Tensor(m + "conv1d.weight", (b + "ssm_conv1d.weight",), _conv),
           _Tensor(m + "dt_bias", (b + "ssm_dt.bias",)),
           _Tensor(m + "A_log", (b + "ssm_a",), _a_log),
           _Tensor(m + "D", (b + "ssm_d",), _flat),
           _Tensor(m + "norm.weight", (b + "ssm_norm.weight",), _flat),
           _Tensor(m + "out_proj.weight", (b + "ssm_out.weight",))]
    if conv_bias:
        out.append(_Tensor(m + "conv1d.bias", (b + "ssm_conv1d.bias",)))
    if proj_bias:
        out += [_Tensor(m + "in_proj.bias", (b + "ssm_in.bias",)), _Tensor(m + "out_proj.bias", (b + "ssm_out.bias",))]
    return out


def _permuted_attention(m: str, b: str, cfg) -> list[_Tensor]:
    """Attention whose q/k rows the converter permuted to ggml's RoPE order (``_unpermute``)."""
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    return _attention_projections(m, b, cfg.attention_bias,
                                  {ours: (lambda t, n=n: _unpermute(t, n)) for ours, n in heads.items()})


def _granite_tensors(file: HybridFile, cfg) -> list[_Tensor]:
    """Granite 4.0-H (``granitehybrid``): Mamba2 (``mamba.*``) or attention (``self_attn.*``, q/k
    permuted) layers, each with a feed-forward part: experts (``ffn_*_exps``, gate and up joined
    into transformers 5's ``experts.gate_up_proj``) plus the shared MLP (``ffn_*_shexp``), or the
    shared MLP alone (``ffn_gate`` / ``ffn_up`` / ``ffn_down``), gate rows first in
    ``shared_mlp.input_linear``."""
    out = [_Tensor("model.embed_tokens.weight", ("token_embd.weight",)),
           _Tensor("model.norm.weight", ("output_norm.weight",))]
    if not cfg.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", ("output.weight",)))
    for i, kind in enumerate(cfg.layers_block_type):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [_Tensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                _Tensor(p + "post_attention_layernorm.weight", (b + "ffn_norm.weight",))]
        out += (_mamba_mixer(p + "mamba.", b, cfg.mamba_conv_bias, cfg.mamba_proj_bias) if kind == LINEAR
                else _permuted_attention(p + "self_attn.", b, cfg))
        moe, shared = p + "block_sparse_moe.", p + "shared_mlp."
        suffix = "_shexp" if cfg.num_local_experts else ""
        out += [_Tensor(shared + "input_linear.weight", (f"{b}ffn_gate{suffix}.weight", f"{b}ffn_up{suffix}.weight"),
                        _join_rows),
                _Tensor(shared + "output_linear.weight", (f"{b}ffn_down{suffix}.weight",))]
        if cfg.num_local_experts:
            out += [_Tensor(moe + "router.weight", (b + "ffn_gate_inp.weight",)),
                    _Tensor(moe + "experts.gate_up_proj", (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"),
                            _cat_rows),
                    _Tensor(moe + "experts.down_proj", (b + "ffn_down_exps.weight",))]
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
