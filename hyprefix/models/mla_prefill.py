"""MLA prefill chunks by cost: absorbed or up-projected, both exact.

``deepseek.LatentAttention`` attends absorbed by default: each head's query is carried into the
latent space (W_UK^T q_nope, then q_pe) and every head attends over the cached latents as one
576-wide key head whose first ``kv_lora_rank`` values are the values; W_UV follows. That is what a
decode wants: per head it reads each cached latent once and never makes per-head keys. A long
prefill chunk pays for it, though: its attention runs at the latent's width (576 + 512 multiply-
adds a query-key pair and head) where the model's own heads are 192 + 128 wide. vLLM and ATOM
prefill the other way, and so does this module where it costs less: the span's context latents
(the cached prefix, gathered through its block table, and its own tokens, written first) are
multiplied out into per-head keys [W_UK c, k_pe] and values W_UV c by one matmul with kv_b_proj
(``LatentAttention.up_matrix``), then ordinary causal attention runs with the model's head widths.

Cost, in multiply-adds a head, of a span of T new tokens over L context keys (its cached prefix
and itself), with r = kv_lora_rank, p = the rope width, n = the nope width, v = the value width:

- absorbed: T·r·(n + v) (the query's absorption and W_UV) + T·L·(r + p + r) (the attention);
- up-projected: L·r·(n + v) (the context's keys and values) + T·L·2·(n + p) (the attention; the
  flash kernel takes values as wide as the keys, so they are padded).

A span is up-projected where ``UP_PROJECTED_WEIGHT`` times its cost is below the absorbed cost.
The weight is measured, not derived (docs/benchmarks.md "DeepSeek on CPU"): the up-projection's
matmul and the gather run below the attention kernel's rate. So a fresh prompt's chunk (L = T)
or one over a short prefix is up-projected; a short chunk over a long cached prefix, where
making every prefix token's keys would cost more than the wider attention, stays absorbed, as
do decode rows and the batch-invariant mode (whose single arithmetic is the absorbed one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hyprefix.forward import ForwardBatch, PrefillSpan
from hyprefix.kernels import prefill_attention as prefill_kernel
from hyprefix.models import kv_quant

if TYPE_CHECKING:
    from hyprefix.models.deepseek import LatentAttention

# The up-projected path's cost is multiplied by this before the comparison (module docstring).
UP_PROJECTED_WEIGHT = 1.5


def absorbed_cost(attn: LatentAttention, tokens: int, keys: int) -> int:
    """Multiply-adds a head of an absorbed span of ``tokens`` new tokens over ``keys`` keys."""
    r, p, n, v = attn.rank, attn.rope_dim, attn.nope, attn.v_dim
    return tokens * r * (n + v) + tokens * keys * (2 * r + p)


def up_projected_cost(attn: LatentAttention, tokens: int, keys: int) -> int:
    """Multiply-adds a head of an up-projected span (the context's keys and values made, then
    attention with the values padded to the key width)."""
    r, p, n, v = attn.rank, attn.rope_dim, attn.nope, attn.v_dim
    return keys * r * (n + v) + tokens * keys * 2 * (n + p)


def up_projected_spans(attn: LatentAttention, batch: ForwardBatch) -> set[int]:
    """The prefill spans of ``batch`` that attend up-projected (module docstring)."""
    if batch.batch_invariant:
        return set()
    return {i for i, span in enumerate(batch.prefills)
            if UP_PROJECTED_WEIGHT * up_projected_cost(attn, span.num_tokens, span.context_len)
            < absorbed_cost(attn, span.num_tokens, span.context_len)}


def up_projected_attention(attn: LatentAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """One span's attention, up-projected: q_nope [T, H, n] and the rotated q_pe [T, H, p] of its
    tokens; ``latent`` [T, 1, r + p] its own latents as the attention reads them
    (``LatentAttention._write``); ``cache`` the layer's latent blocks, this step's already written
    (a cached prefix is gathered from them). An 8-bit cache's context is read as stored: the
    gathered rows dequantized, then, as the span's own, turned back from the cache's rotation
    (``LatentAttention.unrotated``) before the up-projection. Returns [T, H, v]."""
    if span.start_pos == 0:
        context = latent[:, 0]
    else:
        context = kv_quant.read_blocks(cache, span.block_table, latent.dtype).view(-1, attn.latent_dim)
        context = context[:span.context_len]
    if kv_quant.is_quantized(cache):
        context = attn.unrotated(context)
    keys, heads = context.shape[0], attn.num_heads
    c, k_pe = context.split([attn.rank, attn.rope_dim], dim=-1)
    kv = (c @ attn.up_matrix(c.dtype)).view(keys, heads, attn.nope + attn.v_dim)
    k = torch.cat([kv[..., :attn.nope], k_pe[:, None, :].expand(keys, heads, attn.rope_dim)], dim=-1)
    v = kv[..., attn.nope:]
    q = torch.cat([q_nope, q_pe], dim=-1)
    if q.device.type == "cpu" and prefill_kernel.available(q.dtype):  # values padded to the key width
        v = F.pad(v, (0, k.shape[-1] - attn.v_dim))
        out = prefill_kernel.prefill_attention(q.contiguous(), k, v.contiguous(), attn.scale, span.start_pos, 0, None,
                                               None, -1, None)
        return out[..., :attn.v_dim]
    mask = None
    if span.start_pos:
        mask = torch.ones(q.shape[0], keys, dtype=torch.bool, device=q.device).tril(span.start_pos)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=mask is None, scale=attn.scale)
    return out[0].transpose(0, 1)
