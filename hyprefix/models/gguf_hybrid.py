"""GGUF files of hybrid (recurrent + attention) models as llama.cpp's converter
(``convert_hf_to_gguf.py``) writes them: Qwen3.5 dense and MoE (``qwen35``, ``qwen35moe``),
Qwen3-Next (``qwen3next``), NemotronH (``nemotron_h``, ``nemotron_h_moe``), Granite 4.0-H
(``granitehybrid``) and pure Mamba2 (``mamba2``); and two MoE families transformers' reader gets
wrong or does not read, Qwen3-MoE (``qwen3moe``) and gpt-oss (``gpt-oss``), DeepSeek-V2 / V3
(``deepseek2``) and Kimi-Linear (``kimi-linear``, whose tensor map is ``gguf_kimi``).

transformers' GGUF reader refuses most of these architectures, so this module rebuilds what the
HF checkpoint held: ``load_config`` a transformers config from the file's metadata (and, where
the metadata says nothing, from which tensors the file has), ``iter_tensors`` every tensor under
transformers' parameter name in float32 with the converter's transforms undone, and
``load_tokenizer`` the tokenizer and chat template from ``tokenizer.*`` metadata. The model
classes then load them exactly as they load an HF checkpoint.

The converter's transforms, each undone in ``iter_tensors``'s builders:

- every architecture: names (``blk.N.*``, ggml leaf names); ``A_log`` stored as
  ``ssm_a = -exp(A_log)`` (``a_log``); the depthwise conv1d kernel squeezed to 2-D
  (``unsqueeze(1)``); ``dt_bias`` renamed ``ssm_dt.bias``.
- Qwen3.5 / Qwen3-Next: the zero-centred norms (decoder, final, attention q/k) stored as
  ``w + 1`` (``minus_one``), but not the DeltaNet's gated ``ssm_norm``.
- Qwen3-Next: ``in_proj_qkvz`` (grouped by key head: q, k, v, z per head) split into
  ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z), re-interleaved (``qkvz``);
  ``in_proj_ba`` is kept as it is (``ssm_ba``).
- Qwen3.5 (dense and MoE), when there are more value heads than key heads: value heads moved
  from grouped order (each key head's value heads together) to tiled order, on every tensor
  with a row or column per value head or value channel: the v rows of ``in_proj_qkv`` and of
  the conv1d kernel, ``in_proj_z``, ``in_proj_a``/``in_proj_b``, ``A_log``, ``dt_bias`` rows and
  ``out_proj`` columns (``grouped``).
- Mixture of experts: experts stacked into ``ffn_{gate,up,down}_exps`` [E, rows, cols];
  transformers fuses gate and up (``experts.gate_up_proj``, gate rows first; gpt-oss's rows
  interleaved, ``interleave_rows``).
- NemotronH: q/k rows permuted for ggml's RoPE layout (``LlamaModel.permute``) although the
  attention has no RoPE (``unpermute``); Mamba2 and NemotronH: ``A`` and ``D`` reshaped to
  [heads, 1] and the gated norm to [groups, channels / groups] (flattened back).

The config comes from ``gguf_hybrid_config`` (what a file does not state, and how it is filled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from hyprefix.models.gguf_kimi import kimi_tensors
from hyprefix.models.gguf_transforms import (
    FileTensor,
    a_log,
    as_row,
    cat_rows,
    conv,
    dense_mlp,
    embed_and_head,
    flat,
    interleave_rows,
    join_rows,
    minus_one,
    mla_tensors,
    regroup_value_heads,
    same,
    shared_moe,
    unpermute,
)


# --------------------------------------------------------------------------------------- tensors
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
        builders = {"qwen3moe": _qwen3moe_tensors, "granitehybrid": _granite_tensors, "gpt-oss": _gpt_oss_tensors,
                    "deepseek2": _deepseek_tensors, "kimi-linear": kimi_tensors}
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

    def _meta(self, spec: FileTensor) -> torch.Tensor:
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


def _qwen_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    per_key, key_dim, value_dim = v_heads // k_heads, k_heads * k_dim, v_heads * v_dim
    tiled = file.arch != "qwen3next" and k_heads != v_heads  # as the converter decides

    def grouped(dim: int, head_dim: int, offset: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
        if not tiled:
            return same
        return lambda t: regroup_value_heads(t, dim, k_heads, per_key, head_dim, offset)

    per_head = grouped(0, 1)

    def qkvz(qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's in_proj_qkvz groups rows by key head: q, k, v (its value heads), z."""
        hidden = qkv.shape[-1]
        q, k, v = qkv.split([key_dim, key_dim, value_dim])
        parts = [q.reshape(k_heads, k_dim, hidden), k.reshape(k_heads, k_dim, hidden),
                 v.reshape(k_heads, per_key * v_dim, hidden), z.reshape(k_heads, per_key * v_dim, hidden)]
        return torch.cat(parts, dim=1).reshape(-1, hidden)

    out = [FileTensor("model.embed_tokens.weight", ("token_embd.weight",)),
           FileTensor("model.norm.weight", ("output_norm.weight",), minus_one)]
    if not cfg.tie_word_embeddings:
        out.append(FileTensor("lm_head.weight", ("output.weight",)))
    for i, kind in enumerate(cfg.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [FileTensor(p + "input_layernorm.weight", (b + "attn_norm.weight",), minus_one),
                FileTensor(p + "post_attention_layernorm.weight", (b + "post_attention_norm.weight",), minus_one)]
        if kind == LINEAR:
            la = p + "linear_attn."
            out += [
                FileTensor(la + "A_log", (b + "ssm_a",), lambda a: per_head(a_log(a))),
                FileTensor(la + "dt_bias", (b + "ssm_dt.bias",), per_head),
                FileTensor(la + "conv1d.weight", (b + "ssm_conv1d.weight",),
                        lambda t: conv(grouped(0, v_dim, 2 * key_dim)(t))),
                FileTensor(la + "norm.weight", (b + "ssm_norm.weight",)),  # the one norm the converter leaves
                FileTensor(la + "out_proj.weight", (b + "ssm_out.weight",), columns=grouped(1, v_dim)),
            ]
            if file.arch == "qwen3next":
                out += [FileTensor(la + "in_proj_qkvz.weight", (b + "attn_qkv.weight", b + "attn_gate.weight"), qkvz),
                        FileTensor(la + "in_proj_ba.weight", (b + "ssm_ba.weight",))]
            else:
                out += [FileTensor(la + "in_proj_qkv.weight", (b + "attn_qkv.weight",), grouped(0, v_dim, 2 * key_dim)),
                        FileTensor(la + "in_proj_z.weight", (b + "attn_gate.weight",), grouped(0, v_dim)),
                        FileTensor(la + "in_proj_b.weight", (b + "ssm_beta.weight",), per_head),
                        FileTensor(la + "in_proj_a.weight", (b + "ssm_alpha.weight",), per_head)]
        else:
            out += _qk_norm_attention(p + "self_attn.", b, cfg.attention_bias, minus_one)
        out += _qwen_mlp(file, cfg, i)
    return out


def _qk_norm_attention(sa: str, b: str, bias: bool, norm: Callable[[torch.Tensor], torch.Tensor]) -> list[FileTensor]:
    """A Qwen attention layer's tensors (``sa``: its transformers prefix, ``b``: the file's
    ``blk.N.``): q/k/v/o as they are, QK-norm weights through ``norm``."""
    return [*_attention_projections(sa, b, bias), FileTensor(sa + "q_norm.weight", (b + "attn_q_norm.weight",), norm),
            FileTensor(sa + "k_norm.weight", (b + "attn_k_norm.weight",), norm)]


def _attention_projections(sa: str, b: str, bias: bool,
                           builds: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> list[FileTensor]:
    """q/k/v/o (weights, and biases where ``bias``) of the attention at transformers prefix ``sa``
    from the file's ``blk.N.`` tensors ``b``, each through its ``builds`` entry (default as it is)."""
    out = []
    for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        build = (builds or {}).get(ours, same)
        out.append(FileTensor(f"{sa}{ours}.weight", (f"{b}{theirs}.weight",), build))
        if bias:
            out.append(FileTensor(f"{sa}{ours}.bias", (f"{b}{theirs}.bias",), build))
    return out


def _qwen3moe_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    """Qwen3-MoE: Qwen3's attention layers (plain norms, q/k rows as transformers has them) and
    Qwen's MLPs; the post-attention norm is ``ffn_norm``."""
    out = embed_and_head(cfg)
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [FileTensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                FileTensor(p + "post_attention_layernorm.weight", (b + "ffn_norm.weight",)),
                *_qk_norm_attention(p + "self_attn.", b, cfg.attention_bias, same), *_qwen_mlp(file, cfg, i)]
    return out


def _qwen_mlp(file: HybridFile, cfg, i: int) -> list[FileTensor]:
    p, b = f"model.layers.{i}.mlp.", f"blk.{i}."
    if not has_experts(file, i):
        return dense_mlp(p, b)
    fused = b + "ffn_gate_up_exps.weight"  # the converter's --fuse-gate-up-exps
    gate_up = (FileTensor(p + "experts.gate_up_proj", (fused,)) if file.has(fused) else
               FileTensor(p + "experts.gate_up_proj", (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"), cat_rows))
    out = [FileTensor(p + "gate.weight", (b + "ffn_gate_inp.weight",)), gate_up,
           FileTensor(p + "experts.down_proj", (b + "ffn_down_exps.weight",))]
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        out += [FileTensor(f"{p}shared_expert.{proj}_proj.weight", (f"{b}ffn_{proj}_shexp.weight",))
                for proj in ("gate", "up", "down")]
        out.append(FileTensor(p + "shared_expert_gate.weight", (b + "ffn_gate_inp_shexp.weight",), as_row))
    return out


def _mamba_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    nemotron = cfg.model_type == "nemotron_h"
    kinds = list(cfg.layers_block_type) if nemotron else [LINEAR] * cfg.num_hidden_layers
    base = "model." if nemotron else "backbone."  # transformers' NemotronH names its decoder ``model``
    out = [FileTensor(base + "embeddings.weight", ("token_embd.weight",)),
           FileTensor(base + "norm_f.weight", ("output_norm.weight",))]
    if not cfg.tie_word_embeddings:
        # NemotronH never ties its head: a file without one has it in the embedding
        head = "output.weight" if file.has("output.weight") else "token_embd.weight"
        out.append(FileTensor("lm_head.weight", (head,)))
    for i, kind in enumerate(kinds):
        p, b = f"{base}layers.{i}.", f"blk.{i}."
        m = p + "mixer."
        out.append(FileTensor(p + "norm.weight", (b + "attn_norm.weight",)))
        if kind == LINEAR:
            out += _mamba_mixer(m, b, cfg.use_conv_bias, cfg.use_bias)
        elif kind == FULL:
            out += _permuted_attention(m, b, cfg)
        elif kind == MOE:
            out += _nemotron_moe(file, m, b, cfg)
        else:
            for proj in ("up", "down"):
                out.append(FileTensor(f"{m}{proj}_proj.weight", (f"{b}ffn_{proj}.weight",)))
                if cfg.mlp_bias:
                    out.append(FileTensor(f"{m}{proj}_proj.bias", (f"{b}ffn_{proj}.bias",)))
    return out


def _nemotron_moe(file: HybridFile, m: str, b: str, cfg) -> list[FileTensor]:
    """A Nemotron 3 MoE mixer: router and its correction bias, ungated expert stacks, the shared
    expert, and the latent projections where the model has them."""
    out = [FileTensor(m + "gate.weight", (b + "ffn_gate_inp.weight",)),
           FileTensor(m + "gate.e_score_correction_bias", (b + "exp_probs_b.bias",)),
           FileTensor(m + "experts.up_proj", (b + "ffn_up_exps.weight",)),
           FileTensor(m + "experts.down_proj", (b + "ffn_down_exps.weight",))]
    for proj in ("up", "down"):
        out.append(FileTensor(f"{m}shared_experts.{proj}_proj.weight", (f"{b}ffn_{proj}_shexp.weight",)))
        if cfg.mlp_bias:
            out.append(FileTensor(f"{m}shared_experts.{proj}_proj.bias", (f"{b}ffn_{proj}_shexp.bias",)))
    if cfg.moe_latent_size:
        for ours, theirs in (("fc1_latent_proj", "ffn_latent_down"), ("fc2_latent_proj", "ffn_latent_up")):
            out.append(FileTensor(f"{m}{ours}.weight", (f"{b}{theirs}.weight",)))
            if cfg.mlp_bias:
                out.append(FileTensor(f"{m}{ours}.bias", (f"{b}{theirs}.bias",)))
    return out


def _mamba_mixer(m: str, b: str, conv_bias: bool, proj_bias: bool) -> list[FileTensor]:
    """A Mamba2 mixer's tensors (``m``: its transformers prefix, ``b``: the file's ``blk.N.``)."""
    out = [FileTensor(m + "in_proj.weight", (b + "ssm_in.weight",)),
           FileTensor(m + "conv1d.weight", (b + "ssm_conv1d.weight",), conv),
           FileTensor(m + "dt_bias", (b + "ssm_dt.bias",)),
           FileTensor(m + "A_log", (b + "ssm_a",), a_log),
           FileTensor(m + "D", (b + "ssm_d",), flat),
           FileTensor(m + "norm.weight", (b + "ssm_norm.weight",), flat),
           FileTensor(m + "out_proj.weight", (b + "ssm_out.weight",))]
    if conv_bias:
        out.append(FileTensor(m + "conv1d.bias", (b + "ssm_conv1d.bias",)))
    if proj_bias:
        out += [FileTensor(m + "in_proj.bias", (b + "ssm_in.bias",)),
                FileTensor(m + "out_proj.bias", (b + "ssm_out.bias",))]
    return out


def _permuted_attention(m: str, b: str, cfg) -> list[FileTensor]:
    """Attention whose q/k rows the converter permuted to ggml's RoPE order (``unpermute``)."""
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    return _attention_projections(m, b, cfg.attention_bias,
                                  {ours: (lambda t, n=n: unpermute(t, n)) for ours, n in heads.items()})


def _granite_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    """Granite 4.0-H (``granitehybrid``): Mamba2 (``mamba.*``) or attention (``self_attn.*``, q/k
    permuted) layers, each with a feed-forward part: experts (``ffn_*_exps``, gate and up joined
    into transformers 5's ``experts.gate_up_proj``) plus the shared MLP (``ffn_*_shexp``), or the
    shared MLP alone (``ffn_gate`` / ``ffn_up`` / ``ffn_down``), gate rows first in
    ``shared_mlp.input_linear``."""
    out = embed_and_head(cfg)
    for i, kind in enumerate(cfg.layers_block_type):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [FileTensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                FileTensor(p + "post_attention_layernorm.weight", (b + "ffn_norm.weight",))]
        out += (_mamba_mixer(p + "mamba.", b, cfg.mamba_conv_bias, cfg.mamba_proj_bias) if kind == LINEAR
                else _permuted_attention(p + "self_attn.", b, cfg))
        moe, shared = p + "block_sparse_moe.", p + "shared_mlp."
        suffix = "_shexp" if cfg.num_local_experts else ""
        out += [FileTensor(shared + "input_linear.weight", (f"{b}ffn_gate{suffix}.weight", f"{b}ffn_up{suffix}.weight"),
                        join_rows),
                FileTensor(shared + "output_linear.weight", (f"{b}ffn_down{suffix}.weight",))]
        if cfg.num_local_experts:
            out += [FileTensor(moe + "router.weight", (b + "ffn_gate_inp.weight",)),
                    FileTensor(moe + "experts.gate_up_proj", (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"),
                            cat_rows),
                    FileTensor(moe + "experts.down_proj", (b + "ffn_down_exps.weight",))]
    return out


def _gpt_oss_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    """gpt-oss: attention with biases and sinks (q/k rows as transformers has them), a biased
    router, experts with biases. The expert weights come in the hub checkpoint's rows-first form
    (``experts.gate_up_proj.weight`` [E, 2I, H], gate and up rows interleaved;
    ``experts.down_proj.weight`` [E, H, I]), which ``GptOssForCausalLM.converted`` takes, so that
    MXFP4 stacks stay in their blocks (rows can move, columns cannot)."""
    out = embed_and_head(cfg)
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        m = p + "mlp."
        out += [FileTensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                FileTensor(p + "post_attention_layernorm.weight", (b + "post_attention_norm.weight",)),
                *_attention_projections(p + "self_attn.", b, cfg.attention_bias),
                FileTensor(p + "self_attn.sinks", (b + "attn_sinks.weight",)),
                FileTensor(m + "router.weight", (b + "ffn_gate_inp.weight",)),
                FileTensor(m + "router.bias", (b + "ffn_gate_inp.bias",)),
                FileTensor(m + "experts.gate_up_proj.weight", (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"),
                           interleave_rows),
                FileTensor(m + "experts.gate_up_proj_bias", (b + "ffn_gate_exps.bias", b + "ffn_up_exps.bias"),
                           interleave_rows),
                FileTensor(m + "experts.down_proj.weight", (b + "ffn_down_exps.weight",)),
                FileTensor(m + "experts.down_proj_bias", (b + "ffn_down_exps.bias",))]
    return out


def _deepseek_tensors(file: HybridFile, cfg) -> list[FileTensor]:
    """DeepSeek-V2 / V3 (``deepseek2``): MLA (``mla_tensors``: ``kv_b_proj`` as the converter's
    per-head ``attn_k_b`` and ``attn_v_b``), the rotary rows in the checkpoint's interleaved order
    (the model's ``converted`` reorders them, as for an HF checkpoint); dense MLPs in the first
    ``first_k_dense_replace`` layers, then experts, shared experts and (V3) the correction bias."""
    out = embed_and_head(cfg)
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [FileTensor(p + "input_layernorm.weight", (b + "attn_norm.weight",)),
                FileTensor(p + "post_attention_layernorm.weight", (b + "ffn_norm.weight",)),
                *mla_tensors(file, p + "self_attn.", b)]
        m = p + "mlp."
        out += (dense_mlp(m, b) if i < cfg.first_k_dense_replace else
                shared_moe(m, b, bool(cfg.n_shared_experts), cfg.model_type == "deepseek_v3"))
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
