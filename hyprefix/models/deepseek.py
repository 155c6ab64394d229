"""DeepSeek-V2 / V2-Lite / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head
latent attention (MLA) over a latent cache, and MoE layers with shared experts.

MLA compresses each token's keys and values into one latent per layer: ``c`` (``kv_lora_rank``
values, after ``kv_a_layernorm``) and one rotary key ``k_pe`` (``qk_rope_head_dim`` values) shared
by every head. Head h's key is [W_UK[h] c, k_pe] and its value W_UV[h] c (``kv_b_proj`` holds
W_UK and W_UV). The cache holds the latent alone, [c, k_pe] (576 values a token for DeepSeek's
512 + 64), as one key head; V is that same tensor (``KVLayout.latent``), so a block costs the
latent's bytes once, and hashing, mid-flight publication, eviction and the disk tier treat it as
any block.

Attention runs absorbed, exactly: head h's query [q_nope, q_pe] becomes [W_UK[h]^T q_nope, q_pe]
(576 values), whose dot with the cached [c, k_pe] is q_nope . W_UK[h] c + q_pe . k_pe, the
score transformers computes; the heads then attend as multi-query attention with one 576-wide
key/value head (``paged_attention``: the paged decode kernel, the prefill kernel over a cached
prefix, the cascade), and each head's output over the latent, its first ``kv_lora_rank`` values,
is multiplied by W_UV[h]. Decode and chunked prefill over a cached prefix read the same latent
blocks. A prefill chunk long enough against its context attends up-projected instead (the
context's latents multiplied out into per-head keys and values, then the model's own head
widths: ``mla_prefill``, chosen by cost a span at a time; both exact). W_UK (held transposed, [rank, nope] a
head) and W_UV ([v, rank] a head) are stacks of per-head matrices (``fused_moe.Experts``): float,
or a GGUF file's ``attn_k_b`` / ``attn_v_b`` kept in their blocks, multiplied head by head by
``hyprefix::quant_heads`` (``--quantization`` quantizes them as it does experts).

An 8-bit cache (``--kv-cache-dtype int8 | fp8_e4m3``, ``kv_quant``'s rows: one scale a token's
latent) stores each latent rotated by blockdiag(R_r, R_p), the format's fixed rotation of the
latent c and, apart, of k_pe (``LatentAttention.rotated``): the queries turned alike keep their
scores, and the outputs over the first r values, rotated c alone, turn back with R_r^T before
W_UV. A rotation over all 576 values would mix k_pe into the values. The decode kernel reads the
packed rows in place, the prefill kernel through its table; the up-projected path dequantizes
what it gathers and turns it back; every attention reads the latents as stored (a prefill
chunk's own rounded through the format first).

DeepSeek rotates the rotary part in interleaved pairs (x0, x1), (x2, x3), ... (V2 always, V3
where ``rope_interleave``); ``converted`` permutes those rows of q and of ``kv_a_proj_with_mqa``
into the rotate-half order this engine's RoPE uses. q and k take the same permutation, so their
dot products, the only use of k_pe, are unchanged.

Routing: V2 softmax scores, top-k (``greedy``) or top-k within the ``topk_group`` groups of
``n_group`` whose best score is highest (``group_limited_greedy``), times
``routed_scaling_factor``; V3 sigmoid scores with a correction bias within groups ranked by
their two best (``moe.Routing``). The first ``first_k_dense_replace`` layers are dense MLPs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.kernels import quant_linear as quant_kernel
from hyprefix.models import kv_quant
from hyprefix.models.attention import attend, write_kv, write_kv_stored
from hyprefix.models.base import CausalLM, KVLayout, Target, last_layer_rows
from hyprefix.models.fused import Kernels
from hyprefix.models.fused_moe import Experts
from hyprefix.models.layers import GatedMLP, Linear, RMSNorm, RopeTables
from hyprefix.models.llama import DecoderLayer, map_attention_or_mlp
from hyprefix.models.mla_prefill import up_projected_attention, up_projected_spans
from hyprefix.models.moe import Routing, SparseMoE, map_gated_mlp, map_sparse_moe


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg) -> float:
    """1 / sqrt(qk head dim), times YaRN's mscale squared where ``mscale_all_dim`` is set (as
    transformers' DeepSeek attention)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= _mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(nn.Module):
    """MLA over the latent cache (module docstring). ``q_lora_rank`` None: q from one
    projection (V2-Lite); else through a rank-``q_lora_rank`` bottleneck with its norm."""

    def __init__(self, cfg, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.rank = cfg.num_attention_heads, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent_dim = self.rank + self.rope_dim
        self.q_size = self.num_heads * self.latent_dim  # the absorbed query's width (``model_facts``)
        self.scale = softmax_scale(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        q_width = self.num_heads * (self.nope + self.rope_dim)
        self.q_lora = cfg.q_lora_rank
        if self.q_lora:
            self.q_a = Linear(cfg.hidden_size, self.q_lora, bias=bias, dtype=dtype, device=device)
            self.q_a_norm = RMSNorm(self.q_lora, cfg.rms_norm_eps, dtype, device)
            self.q_b = Linear(self.q_lora, q_width, bias=False, dtype=dtype, device=device)
        else:
            self.q_proj = Linear(cfg.hidden_size, q_width, bias=False, dtype=dtype, device=device)
        self.kv_a = Linear(cfg.hidden_size, self.latent_dim, bias=bias, dtype=dtype, device=device)
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps, dtype, device)
        # kv_b_proj's rows per head are W_UK [nope, rank] then W_UV [v_dim, rank] (``absorb_stacks``)
        self.w_uk = Experts(self.num_heads, self.rank, self.nope, dtype, device)  # W_UK[h]^T
        self.w_uv = Experts(self.num_heads, self.v_dim, self.rank, dtype, device)
        self.o_proj = Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=bias, dtype=dtype, device=device)
        self._up: torch.Tensor | None = None  # ``up_matrix``

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: RopeTables | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], kernels: Kernels,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_b(self.q_a_norm(self.q_a(x), kernels)) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_norm(c, kernels)
        pe = torch.cat([q_pe, k_pe[:, None, :]], dim=1)
        if rope is not None:  # None: NoPE (Kimi-Linear's MLA uses its shared key part unrotated)
            pe = kernels.qk_norm_rope(pe, None, rope.cos, rope.sin, 0.0, rope.rotary_dim)
        latent = torch.cat([c, pe[:, -1]], dim=-1)[:, None, :]
        cache = kv_cache[0]  # V is K (``KVLayout.latent``)
        latent = self._write(latent, cache, batch)
        up = up_projected_spans(self, batch) if batch.prefills else set()
        if up:
            out = self._by_cost(q_nope, pe[:, :-1], latent, cache, batch, up)
            out = out if rows is None else out[rows]
        else:
            out = self._absorbed(q_nope, pe[:, :-1], latent, cache, batch, rows=rows)
            out = per_head(out, self.w_uv)  # the latent's first rank values (v_dim)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))

    def _by_cost(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                 batch: ForwardBatch, up: set[int]) -> torch.Tensor:
        """A step with prefill spans ``up`` up-projected (``mla_prefill``), the other rows
        absorbed: [T, H, v] after W_UV, in the batch's token order. ``latent``: as ``_write``
        returns it."""
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        kept = set(range(len(batch.prefills))) - up
        if batch.num_decode or kept:
            spans = [span for i, span in enumerate(batch.prefills) if i in kept]
            rows = torch.cat([torch.arange(batch.num_decode),
                              *(torch.arange(s.token_start, s.token_start + s.num_tokens) for s in spans)])
            rows = rows.to(out.device)
            part = self._absorbed(q_nope, q_pe, latent, cache, batch, spans=kept, used=rows)
            out.index_copy_(0, rows, per_head(part, self.w_uv))
        for i in up:
            sl = batch.prefills[i].token_slice
            out[sl] = up_projected_attention(self, q_nope[sl], q_pe[sl], latent[sl], cache, batch.prefills[i])
        return out

    def _write(self, latent: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """This step's latents [T, 1, r + p] into the cache; returns them as its attention reads
        them: as they are, or, in an 8-bit cache (``kv_quant``), rotated (``rotated``) and, where
        a prefill attends over its own rows, rounded through the format as they are stored."""
        if not kv_quant.is_quantized(cache):
            write_kv(latent, latent, cache, cache, batch, None)
            return latent
        rows = self.rotated(latent.float(), batch.batch_invariant)  # quantized from float32, rounded once
        if not batch.prefills:  # decode rows read the cache alone
            write_kv(rows, rows, cache, cache, batch, None)
            return rows.to(latent.dtype)
        return write_kv_stored(rows, rows, cache, cache, batch, None)[0].to(latent.dtype)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                  batch: ForwardBatch, spans: set[int] | None = None, rows: torch.Tensor | None = None,
                  used: torch.Tensor | None = None) -> torch.Tensor:
        """Absorbed attention over the written cache (``attend``; ``spans`` as there): [n, H, r],
        each head's output over the latent c in the model's axes, at ``rows`` of the result
        (None: all). ``used``: the token rows whose queries attend (None: all); an 8-bit cache's
        rotation is applied to those alone."""
        query = torch.cat([per_head(q_nope, self.w_uk), q_pe], dim=-1)
        packed = kv_quant.is_quantized(cache)
        if packed:  # queries meet the rotated latents (q . k unchanged)
            turned = self.rotated((query if used is None else query.index_select(0, used)).float(),
                                  batch.batch_invariant).to(query.dtype)
            query = turned if used is None else query.index_copy(0, used, turned)
        out = attend(query, latent, latent, cache, cache, batch, self.scale, None, spans=spans, v_dim=self.rank)
        if rows is not None:
            out = out[rows]
        return self.unrotated(out, batch.batch_invariant) if packed else out

    def rotated(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [..., r + p] (float32) as an 8-bit cache stores latents: x @ blockdiag(R_r, R_p), the
        format's fixed rotation (``kv_quant.rotation``) of the r latent values and, apart, of the
        p rope values, so a query rotated alike has the same dot product with it (c's and k_pe's
        parts each unchanged) and the first r values, those attention weighs as values, stay a
        rotation of c alone (no k_pe mixed in): ``unrotated`` takes them back with R_r^T. Made at
        start (``KVLayout.rotation_blocks``), so a compiled decode step finds them as constants.
        ``invariant``: as ``kv_quant.rotate``'s."""
        c, pe = x.split([self.rank, self.rope_dim], dim=-1)
        return torch.cat([kv_quant.rotate(c, invariant=invariant), kv_quant.rotate(pe, invariant=invariant)], dim=-1)

    def unrotated(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """``rotated`` undone, in x's dtype (computed in float32): x [..., r] (an attention output
        over the latent values) or [..., r + p] (latents)."""
        c = kv_quant.rotate(x[..., :self.rank].float(), inverse=True, invariant=invariant)
        if x.shape[-1] > self.rank:
            pe = kv_quant.rotate(x[..., self.rank:].float(), inverse=True, invariant=invariant)
            c = torch.cat([c, pe], dim=-1)
        return c.to(x.dtype)

    def up_matrix(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj transposed, [rank, H * (nope + v)] (each head's W_UK^T then W_UV^T columns):
        the up-projected prefill's one matmul (``mla_prefill``). Made from the stacks on first use
        (blocks dequantized) and kept until the weights change (``forget_derived``)."""
        if self._up is None or self._up.dtype != dtype:
            uk = self.w_uk.stacked(dtype)  # [H, rank, nope]
            uv = self.w_uv.stacked(dtype).transpose(1, 2)  # [H, rank, v]
            self._up = torch.cat([uk, uv], dim=2).transpose(0, 1).reshape(self.rank, -1).contiguous()
        return self._up

    def forget_derived(self) -> None:
        """Drop ``up_matrix``'s copy (``CausalLM.weights_changed``)."""
        self._up = None

    def absorb_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of W_UK and W_UV one decode step reads (every head's), as stored."""
        return self.w_uk.forms.decode_bytes(dtype) + self.w_uv.forms.decode_bytes(dtype)

    @property
    def absorb_params(self) -> int:
        return self.num_heads * (self.rank * self.nope + self.v_dim * self.rank)


def per_head(x: torch.Tensor, stack: Experts) -> torch.Tensor:
    """x [T, H, cols] times head h's matrix of ``stack`` ([rows, cols] each): [T, H, rows]."""
    quant = stack.forms.quant
    if quant is not None:
        return quant_kernel.quant_heads(x, quant.tensors, stack.rows)
    return torch.einsum("thc,hrc->thr", x, stack.stacked(x.dtype))


def absorb_stacks(name: str, t: torch.Tensor, attn: LatentAttention) -> Iterator[tuple[str, torch.Tensor]]:
    """The stacks ``LatentAttention`` multiplies, W_UK[h]^T [H * rank, nope] and W_UV [H * v, rank],
    from an HF ``kv_b_proj`` [H * (nope + v), rank], or from a GGUF file's per-head ``w_uk`` /
    ``w_uv`` [H, rows, cols] (``gguf_transforms.mla_tensors``; flattened: a row move, so the
    blocks stay); any other tensor as it is. ``converted`` of the MLA families."""
    if name.endswith("self_attn.kv_b_proj.weight"):
        per_head_rows = t.view(attn.num_heads, attn.nope + attn.v_dim, attn.rank)
        stem = name.removesuffix("kv_b_proj.weight")
        yield stem + "w_uk.weight", per_head_rows[:, :attn.nope].transpose(1, 2).reshape(-1, attn.nope)
        yield stem + "w_uv.weight", per_head_rows[:, attn.nope:].reshape(-1, attn.rank)
    elif name.endswith(("self_attn.w_uk.weight", "self_attn.w_uv.weight")):
        yield name, t.reshape(-1, t.shape[-1])
    else:
        yield name, t


class DeepseekDecoderLayer(DecoderLayer):
    """Pre-norm MLA, then a dense MLP (the first ``first_k_dense_replace`` layers) or the MoE block."""

    def __init__(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.attn = LatentAttention(cfg, dtype, device)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = self.build_mlp(cfg, layer_idx, dtype, device)

    def build_mlp(self, cfg, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        if layer_idx < cfg.first_k_dense_replace:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype, device)
        v3 = cfg.model_type == "deepseek_v3"
        groups = getattr(cfg, "n_group", None) or 1
        if v3:
            routing = Routing(cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), scoring="sigmoid", groups=groups,
                              groups_kept=cfg.topk_group, scale=cfg.routed_scaling_factor)
        else:  # greedy, or group_limited_greedy: the groups whose best softmax score is highest
            limited = getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
            routing = Routing(cfg.num_experts_per_tok, groups=groups if limited else 1,
                              groups_kept=cfg.topk_group if limited else 1, scale=cfg.routed_scaling_factor)
        shared_width = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
        shared = GatedMLP(cfg.hidden_size, shared_width, False, dtype, device) if shared_width else None
        return SparseMoE(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, routing, shared, False,
                         dtype, device, correction_bias=v3)

    def fits_decode_kernel(self) -> bool:
        return False


class DeepseekV2ForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (module docstring)."""

    selects_output_rows = True

    def __init__(self, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        super().__init__()
        cfg = hf_config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"DeepSeek config sets hidden_act={cfg.hidden_act!r}: only silu is supported")
        if cfg.model_type == "deepseek_v2" and getattr(cfg, "topk_method", "greedy") not in (
                "greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {cfg.topk_method!r} is not supported")
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        attn = self.layers[0].attn
        self.kv_layout = KVLayout(cfg.num_hidden_layers, 1, attn.latent_dim, latent=True,
                                  rotation_blocks=(attn.rank, attn.rope_dim))
        self.interleaved = cfg.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", True))
        self._init_head(cfg, dtype, device, max_positions, cfg.rms_norm_eps, attn.rope_dim)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                states=None) -> torch.Tensor:
        x, residual = self.embed(batch.input_ids), None
        rope = self.rotary.tables(batch.positions)
        for layer, kv, rows in zip(self.layers, kv_caches, last_layer_rows(batch, len(self.layers)), strict=True):
            x, residual = layer(x, residual, batch, rope, kv, self.kernels, rows)
        return x + residual

    def converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        attn = self.layers[0].attn
        heads, nope, rope, rank = attn.num_heads, attn.nope, attn.rope_dim, attn.rank
        for name, t in super().converted(weights):
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")) and self.interleaved:
                q_rows = t.view(heads, nope + rope, -1)
                t = torch.cat([q_rows[:, :nope], _deinterleave(q_rows[:, nope:], 1)], dim=1).reshape(t.shape)
            elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")) \
                    and self.interleaved:  # [rank + rope, ...]: the rope rows last
                t = torch.cat([t[:rank], _deinterleave(t[rank:], 0)])
            yield from absorb_stacks(name, t, attn)

    def map_layer(self, idx: int, rest: str) -> Target:
        prefix, layer = f"layers.{idx}", self.layers[idx]
        if rest.startswith("self_attn."):
            return map_latent_attention(f"{prefix}.attn", rest.removeprefix("self_attn."))
        if rest.startswith("mlp.") and isinstance(layer.mlp, SparseMoE):
            return map_shared_moe(f"{prefix}.mlp", layer.mlp, rest.removeprefix("mlp."))
        return map_attention_or_mlp(prefix, rest, None, self.config.intermediate_size)


# transformers' MLA modules -> ``LatentAttention``'s (``w_uk`` / ``w_uv`` keep their names)
_MLA_MODULES = {"q_a_proj": "q_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
                "kv_a_layernorm": "kv_a_norm"}


def map_latent_attention(prefix: str, inner: str) -> Target:
    """Our ``LatentAttention`` parameter (at ``prefix``) for a tensor under transformers' ``self_attn.``."""
    module, _, leaf = inner.rpartition(".")
    return f"{prefix}.{_MLA_MODULES.get(module, module)}.{leaf}", None, None


def map_shared_moe(prefix: str, mlp: SparseMoE, inner: str) -> Target:
    """Our parameter for a tensor of a DeepSeek-style MoE block (DeepSeek-V2 / V3, Kimi-Linear;
    ``inner``: its name under ``mlp.``): the shared experts, the router's correction bias, or the
    router and routed experts (``moe.map_sparse_moe``)."""
    if inner.startswith("shared_experts.") and mlp.shared is not None:
        return map_gated_mlp(f"{prefix}.shared", mlp.shared, inner.removeprefix("shared_experts."))
    if inner == "gate.e_score_correction_bias":
        return f"{prefix}.correction_bias", None, None
    return map_sparse_moe(prefix, mlp, inner)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Rotary rows along ``dim`` from interleaved pairs (x0, x1, x2, x3, ...) to rotate-half order
    (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([t.index_select(dim, torch.arange(0, t.shape[dim], 2)),
                      t.index_select(dim, torch.arange(1, t.shape[dim], 2))], dim=dim)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepseekV3ForCausalLM: V2's layers with sigmoid group routing and its correction bias."""
