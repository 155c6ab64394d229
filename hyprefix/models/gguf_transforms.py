"""The converter's tensor transforms and their inverses, for the GGUF readers that rebuild an HF
checkpoint's tensors from a file (``gguf_hybrid``): ``FileTensor`` is one transformers tensor
made of the file's tensors, and the functions undo one step of ``convert_hf_to_gguf.py`` each
(``gguf_hybrid``'s docstring lists which architecture takes which)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hyprefix.models.gguf_hybrid_config import HybridFile


def same(t: torch.Tensor) -> torch.Tensor:
    return t


def minus_one(t: torch.Tensor) -> torch.Tensor:
    """A zero-centred norm weight (the model scales by 1 + w), which the converter stored as w + 1."""
    return t - 1


def a_log(a: torch.Tensor) -> torch.Tensor:
    """``ssm_a = -exp(A_log)`` (any shape) back to the flat ``A_log``."""
    return torch.log(-a).reshape(-1)


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def conv(t: torch.Tensor) -> torch.Tensor:
    """The squeezed [channels, kernel] conv1d weight back to [channels, 1, kernel]."""
    return t.unsqueeze(1)


def regroup_value_heads(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_dim: int,
                        offset: int = 0) -> torch.Tensor:
    """Value heads from the converter's tiled order (value head j of every key head, then j + 1)
    back to transformers' grouped order (each key head's value heads together), along ``dim``
    (0 or 1) from ``offset`` on: the inverse of ``_LinearAttentionVReorderBase._reorder_v_heads``."""
    head, tail = t.narrow(dim, 0, offset), t.narrow(dim, offset, t.shape[dim] - offset)
    shape = list(tail.shape)
    tiled = tail.reshape(*shape[:dim], per_key, key_heads, head_dim, *shape[dim + 1:])
    return torch.cat([head, tiled.transpose(dim, dim + 1).reshape(shape)], dim=dim)


def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of q or k (weight or bias) back from ``LlamaModel.permute``'s RoPE order: per head,
    the converter moved row ``s * (head_dim / 2) + j`` to ``2 * j + s``."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def cat_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Stacked experts' gate [E, I, H] and up [E, I, H] as transformers' gate_up_proj [E, 2I, H]."""
    return torch.cat([gate, up], dim=1)


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's stacked gate [E, I, ...] and up [E, I, ...] as the hub checkpoint's gate_up rows
    [E, 2I, ...]: gate row j at 2j, up row j at 2j + 1 (the converter took every other row)."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def join_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's gate [I, H] and up [I, H] as one [2I, H] matrix, gate rows first."""
    return torch.cat([gate, up])


def as_row(t: torch.Tensor) -> torch.Tensor:
    """The shared-expert gate as a [1, hidden] matrix (some files keep it as a vector)."""
    return t.reshape(1, -1)


@dataclass(frozen=True)
class FileTensor:
    """One transformers tensor, ``name``, built by ``build`` from the file's tensors ``sources``
    (their float32 values, in order), then ``columns`` (a reorder of its columns, which the
    blocks of a quantized matrix cannot take: ``gguf_blocks``)."""

    name: str
    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor] = same
    columns: Callable[[torch.Tensor], torch.Tensor] | None = None

    def values(self, file: HybridFile) -> torch.Tensor:
        t = self.build(*(file.read(name) for name in self.sources))
        return t if self.columns is None else self.columns(t)

    def meta(self, file: HybridFile) -> torch.Tensor:
        """The tensor's shape, as a meta tensor: the transforms run on meta sources, reading nothing."""
        t = self.build(*(torch.empty(file.shapes[name], device="meta") for name in self.sources))
        return t if self.columns is None else self.columns(t)


MLA_NAMES = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
             "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}


def mla_tensors(file: HybridFile, p: str, b: str) -> list[FileTensor]:
    """An MLA layer's tensors (``p``: its transformers prefix up to ``self_attn.``; ``b``: the
    file's ``blk.N.``): the projections the file has (q directly or through its bottleneck), and
    the converter's ``attn_k_b`` [H, rank, nope] (W_UK transposed a head, as llama.cpp's absorbed
    attention reads it) and ``attn_v_b`` [H, v, rank] as the per-head stacks ``w_uk`` / ``w_uv``
    that ``deepseek.LatentAttention`` multiplies (flattened by the model's ``converted``, as
    expert stacks are), so their blocks stay blocks."""
    out = [FileTensor(f"{p}{ours}.weight", (f"{b}{theirs}.weight",)) for ours, theirs in MLA_NAMES.items()
           if file.has(f"{b}{theirs}.weight")]
    return [*out, FileTensor(p + "w_uk.weight", (b + "attn_k_b.weight",)),
            FileTensor(p + "w_uv.weight", (b + "attn_v_b.weight",))]


def embed_and_head(cfg) -> list[FileTensor]:
    """The embedding, the final norm (as the file has it) and, unless tied, the LM head."""
    out = [FileTensor("model.embed_tokens.weight", ("token_embd.weight",)),
           FileTensor("model.norm.weight", ("output_norm.weight",))]
    if not cfg.tie_word_embeddings:
        out.append(FileTensor("lm_head.weight", ("output.weight",)))
    return out


def dense_mlp(m: str, b: str) -> list[FileTensor]:
    """A gated MLP's gate / up / down (``m``: its transformers prefix up to ``mlp.``)."""
    return [FileTensor(f"{m}{proj}_proj.weight", (f"{b}ffn_{proj}.weight",)) for proj in ("gate", "up", "down")]


def shared_moe(m: str, b: str, shared: bool, correction_bias: bool) -> list[FileTensor]:
    """A DeepSeek-style MoE block (DeepSeek-V2 / V3, Kimi-Linear; ``m``: its prefix up to ``mlp.``):
    the router, its correction bias where the model has one, the experts (the gate and up stacks
    joined) and, with ``shared``, the shared experts."""
    out = [FileTensor(m + "gate.weight", (b + "ffn_gate_inp.weight",)),
           FileTensor(m + "experts.gate_up_proj", (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"), cat_rows),
           FileTensor(m + "experts.down_proj", (b + "ffn_down_exps.weight",))]
    if correction_bias:
        out.append(FileTensor(m + "gate.e_score_correction_bias", (b + "exp_probs_b.bias",)))
    return out + ([FileTensor(f"{m}shared_experts.{proj}_proj.weight", (f"{b}ffn_{proj}_shexp.weight",))
                   for proj in ("gate", "up", "down")] if shared else [])
