"""Kimi Delta Attention (KDA), the linear-attention mixer of Kimi-Linear, in plain PyTorch over
per-request live state slots (``recurrent_state.py``), with the checkpoint taps Gated DeltaNet's
mixer has (``gated_deltanet.py``): the same conv window and matrix state, stored, restored and
tapped by the same code, so Kimi-Linear hits the prefix cache at block boundaries as Qwen3.5 does.

``in_proj`` -> [q k v | f_a | g_a | b] (transformers' q_proj, k_proj, v_proj, forget_gate.f_a_proj,
g_a_proj and b_proj stacked); a causal depthwise conv1d (no bias) over q k v with a conv state of
the last K-1 inputs -> SiLU -> L2-normalised q, k (q then scaled by 1/sqrt(head dim)) -> the gated
delta rule per head from an initial state -> RMSNorm(o) * sigmoid(g_b(g_a)) per head -> o_proj.

What differs from Gated DeltaNet is the decay: one per key channel, not one per head. Per head,
with state S [head dim (keys), head dim (values)] in float32:
``S = diag(exp(g_t)) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t``, with
``g_t = -exp(A_log[head]) softplus(f_b(f_a(x_t)) + dt_bias)`` [heads, head dim] and
``beta_t = sigmoid(b_t)``. Prefills run it chunked (``kda_scan``); a tap inside a prefill ends a
chunk there. Decodes run the one-token recurrence batched over rows: fused in one call per layer
(``kernels/recurrent_decode``'s ``kda_decode``, after f_b and g_b, the gates' second
projections) where that op runs, which also lets Kimi-Linear's decode steps run compiled; else
the eager ops below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.forward import ForwardBatch
from hyprefix.kernels import recurrent_decode
from hyprefix.models.gated_deltanet import delta_rows, delta_rule_step
from hyprefix.models.layers import Linear
from hyprefix.models.recurrent_state import (
    LayerStateShape,
    RecurrentLayerState,
    conv_decode,
    conv_prefill,
    silu_heads,
    tap_decode_rows,
)

L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon for q and k


@dataclass(frozen=True)
class KdaDims:
    hidden: int
    heads: int
    head_dim: int
    conv_kernel: int
    eps: float
    chunk: int = 32  # the pairwise decays of a chunk are [heads, chunk, chunk, head dim]

    @property
    def qkv_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv_dim

    @property
    def proj_sizes(self) -> list[int]:
        """Rows of ``in_proj``: q, k, v, f_a, g_a, b."""
        return [self.qkv_dim] * 3 + [self.head_dim, self.head_dim, self.heads]

    @property
    def state_shape(self) -> LayerStateShape:
        return LayerStateShape(self.conv_dim, self.conv_kernel - 1, (self.heads, self.head_dim, self.head_dim))

    @classmethod
    def from_config(cls, cfg) -> KdaDims:
        return cls(cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                   cfg.rms_norm_eps)


class KimiDeltaAttention(nn.Module):
    """One KDA layer (module docstring). Parameters: ``in_proj`` (six stacked projections),
    ``f_b`` and ``g_b`` (the low-rank gates' second halves), ``conv1d_weight`` [3 * heads * dim, 1,
    K] (q, k, v channels in that order), ``A_log`` [heads], ``dt_bias`` [heads * dim], ``norm_weight``
    [dim] (the gated output norm), ``o_proj``."""

    def __init__(self, d: KdaDims, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d = d
        self.in_proj = Linear(d.hidden, sum(d.proj_sizes), bias=False, dtype=dtype, device=device)
        self.f_b = Linear(d.head_dim, d.qkv_dim, bias=False, dtype=dtype, device=device)
        self.g_b = Linear(d.head_dim, d.qkv_dim, bias=False, dtype=dtype, device=device)
        self.conv1d_weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(d.heads, dtype=dtype, device=device))
        self.dt_bias = nn.Parameter(torch.empty(d.qkv_dim, dtype=dtype, device=device))
        self.norm_weight = nn.Parameter(torch.empty(d.head_dim, dtype=dtype, device=device))
        self.o_proj = Linear(d.qkv_dim, d.hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        d = self.d
        t = x.shape[0]
        proj = self.in_proj(x)
        qkv, f_a, g_a, b = proj.split([d.conv_dim, d.head_dim, d.head_dim, d.heads], dim=-1)
        forget, gate = self.f_b(f_a), self.g_b(g_a)
        n_dec = batch.num_decode
        fused = bool(n_dec) and recurrent_decode.runs(proj, state.matrix)
        if fused and n_dec == t:
            return self.o_proj(self._fused_decode(proj, forget, gate, batch, state))
        g = self.decay(forget)
        beta = torch.sigmoid(b.float())
        o = delta_rows(batch, (t, d.heads, d.head_dim), x.device, fused,
                       lambda n: self._decode(qkv[:n], g[:n], beta[:n], batch, state),
                       lambda sl, span: self._prefill(qkv[sl], g[sl], beta[sl], span.state_slot, span.state_taps,
                                                      state))
        y = self._gated_norm(o, gate).to(x.dtype)
        if fused:
            y[:n_dec] = self._fused_decode(proj[:n_dec], forget[:n_dec], gate[:n_dec], batch, state)
        return self.o_proj(y)

    def decay(self, forget: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay [T, heads, dim] (float32, <= 0) from the forget gate's second
        projection ``forget`` = f_b(f_a): ``-exp(A_log) softplus(forget + dt_bias)``."""
        d = self.d
        f = forget.float() + self.dt_bias.float()
        return -torch.exp(self.A_log.float())[:, None] * F.softplus(f).view(-1, d.heads, d.head_dim)

    def _fused_decode(self, proj: torch.Tensor, forget: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                      state: RecurrentLayerState) -> torch.Tensor:
        """The decode rows in one call (``kernels/recurrent_decode``): [n_dec, heads * dim] before
        o_proj; the tapped rows' states are copied after it."""
        d = self.d
        slots = batch.decode_state_slots
        assert slots is not None
        y = recurrent_decode.kda_decode(proj, state.conv, self.conv1d_weight, state.matrix, slots, forget, gate,
                                        self.A_log, self.dt_bias, self.norm_weight, d.heads, d.head_dim, d.eps)
        tap_decode_rows(state, slots, batch.decode_state_taps)
        return y

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [n, 3 * heads * dim] -> q, k, v head-major [heads, n, dim] float32, after
        SiLU; q and k L2-normalised as transformers does (divided by sqrt(sum + eps)), q scaled."""
        d = self.d
        q, k, v = (silu_heads(part, d.heads) for part in conv_out.split([d.qkv_dim] * 3, dim=-1))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * d.head_dim ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
        return q, k, v

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: ForwardBatch,
                state: RecurrentLayerState) -> torch.Tensor:
        """One token per decode row: [m, heads, dim]; advances the rows' live states and copies
        the tapped rows' states into their checkpoint slots."""
        slots, slot_range = batch.decode_state_slots, batch.decode_state_range
        assert slots is not None
        conv, conv_states = conv_decode(state, slots, qkv, self.conv1d_weight, None)
        q, k, v = (x.transpose(0, 1) for x in self._qkv(conv))  # [m, H, dim]
        h = state.decode_matrices(slots, slot_range)  # [m, H, K, V], updated in place
        out = delta_rule_step(h, q, k, v, torch.exp(g)[..., None], beta)
        state.store_decode_matrices(h, slots, slot_range)
        for row, ckpt in batch.decode_state_taps:
            state.tap(ckpt, conv_states[row], h[row])
        return out

    def _prefill(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int,
                 taps: list[tuple[int, int]], state: RecurrentLayerState) -> torch.Tensor:
        k1 = self.d.conv_kernel - 1
        conv, inputs = conv_prefill(state, slot, qkv, self.conv1d_weight, None)
        q, k, v = self._qkv(conv)
        o, h, tapped = kda_scan(q, k, v, g.transpose(0, 1).contiguous(), beta.t().contiguous(),
                                state.prefill_matrix(slot), self.d.chunk, [offset for offset, _ in taps])
        state.matrix[slot].copy_(h)
        for (offset, ckpt), h_at in zip(taps, tapped, strict=True):
            state.tap(ckpt, inputs[:, offset:offset + k1], h_at)
        return o.transpose(0, 1)

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) * w * sigmoid(gate) per head, float32 (transformers' KimiLinearRMSNormGated,
        whose activation is sigmoid): [T, H, V] -> [T, H*V]."""
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.d.eps)
        out = self.norm_weight.float() * normed * torch.sigmoid(gate.float().view_as(o))
        return out.view(o.shape[0], self.d.qkv_dim)


# Bytes of decays one batch of segments may take (float32 [S, H, Q, SUB, K] pairwise and
# [S, H, Q / SUB, Q, K] across sub-chunks, ``_pair_scores``): the segments of a batch share each
# op, so a prefill runs a few dozen ops a batch plus a few a segment.
PAIR_BYTES = 64 << 20
SUB = 8  # tokens of a sub-chunk, within which the decays are pairwise (``_pair_scores``)


def kda_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             h0: torch.Tensor, chunk: int,
             cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The KDA rule (per-channel decay) chunked over one sequence, float32, head-major.

    q, k, g (log decay, <= 0) [H, n, K], v [H, n, V], beta [H, n], h0 [H, K, V]. Segments end
    every ``chunk`` tokens and at every offset in ``cuts``; returns (o [H, n, V], final state,
    states after each cut offset in order).

    Within a segment, with cs_t = cumsum g (per channel) from its start and
    D[t, j] = exp(cs_t - cs_j) (a vector over channels, j <= t), the deltas u solve
    ``(I + L) u = beta v - beta (exp(cs) * k) h0`` with L[t, j] = beta_t k_t . (D[t, j] * k_j)
    for j < t (unit lower triangular): u = u0 - w h0 with u0 = (I + L)^-1 beta v and
    w = (I + L)^-1 beta (exp(cs) * k), which depend on the segment alone; ``o_t = (exp(cs_t) *
    q_t) h0 + sum_{j<=t} q_t . (D[t, j] * k_j) u_j``; the state after it is ``exp(cs_Q) * h0 +
    sum_j (exp(cs_Q - cs_j) * k_j) u_j^T``.

    Why pairwise: factoring D[t, j] as exp(cs_t) exp(-cs_j), as a per-head decay allows, fails
    with per-channel decays: one channel's cumulative decay over a chunk can pass float32's
    range (exp(-cs_j) overflows), while every factor used here is exp of a difference <= 0.
    The cost is O(Q^2 K) decays a segment, so segments stay short (``KdaDims.chunk``); within a
    segment, only sub-chunks of ``SUB`` tokens are pairwise (``_pair_scores``).

    Why batched: everything but the state's passage from segment to segment is computed for a
    batch of segments at once (``_segment_terms``, up to ``PAIR_BYTES`` of pairwise decays), and
    the sequential part is three small matmuls a segment. Token by token it was some twenty ops a
    segment, each a parallel region: on a busy CPU every region waits for its threads, and the
    per-segment ops of a long prefill dominated it.
    """
    heads, n, kd = k.shape
    segments = _segments(n, chunk, cuts)
    most = _padded(chunk)
    per_batch = max(1, PAIR_BYTES // (heads * kd * 4 * (most * SUB + most * most // SUB)))
    # one zero token past the end: the padding of short segments (no decay, no key, no value)
    q, k, v, g = (F.pad(x, (0, 0, 0, 1)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 1))
    o = v.new_empty(heads, n, v.shape[-1])
    h = h0.to(q.dtype)
    cut_set = set(cuts)
    tapped: dict[int, torch.Tensor] = {}
    for b0 in range(0, len(segments), per_batch):
        batch = segments[b0:b0 + per_batch]
        idx = torch.full((len(batch), _padded(max(end - start for start, end in batch))), n, dtype=torch.long)
        for row, (start, end) in enumerate(batch):  # [S, Q]: each segment's tokens, then the zero token
            idx[row, :end - start] = torch.arange(start, end)
        idx = idx.to(q.device)
        u0, w, qk, qg, to_end, decay_end = _segment_terms(*(x[:, idx] for x in (q, k, v, g, beta)))
        starts = torch.empty(len(batch), heads, kd, h.shape[-1], dtype=h.dtype, device=h.device)
        u = torch.empty_like(u0)
        for row, (_, end) in enumerate(batch):
            starts[row] = h
            torch.baddbmm(u0[row], w[row], h, alpha=-1, out=u[row])
            h = torch.baddbmm(h * decay_end[row][:, :, None], to_end[row], u[row])
            if end in cut_set:
                tapped[end] = h
        out = (qg @ starts + qk @ u).transpose(0, 1).reshape(heads, -1, o.shape[-1])  # [H, S * Q, V]
        valid = (idx < n).flatten().nonzero().squeeze(1)
        o.index_copy_(1, idx.flatten().index_select(0, valid), out.index_select(1, valid))
    return o, h, [tapped[c] for c in cuts]


def _padded(size: int) -> int:
    """A segment's length padded to whole sub-chunks."""
    return -(-size // SUB) * SUB


def _segments(n: int, chunk: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each segment: every ``chunk`` tokens, and ending at every cut."""
    out, start = [], 0
    while start < n:
        end = min(start + chunk, n, *(c for c in cuts if c > start))
        out.append((start, end))
        start = end
    return out


def _segment_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What ``kda_scan`` needs of a batch of S segments apart from the state: inputs [H, S, Q, *]
    (beta [H, S, Q]; short segments padded with zero tokens at the end, Q a multiple of ``SUB``)
    -> u0 [S, H, Q, V] and w [S, H, Q, K] (the deltas are u0 - w h), qk [S, H, Q, Q] (q_t .
    (D[t, j] * k_j), j <= t), qg = exp(cs) * q [S, H, Q, K], to_end = (exp(cs_Q - cs) * k)^T
    [S, H, K, Q] and decay_end = exp(cs_Q) [S, H, K]; segment-major, so each segment's terms are
    contiguous."""
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [S, H, Q, *]
    bs = beta.transpose(0, 1)[..., None]  # [S, H, Q, 1]
    cs = torch.cumsum(g, dim=2)
    kk, qk = _pair_scores(q, k, cs)
    lower = kk * bs  # the solve reads below the diagonal only
    grown = torch.exp(cs)
    rhs = torch.cat((bs * v, bs * (k * grown)), dim=-1)
    u0, w = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], dim=-1)
    last = cs[:, :, -1:, :]  # the padding decays nothing: the segment's own end
    to_end = (k * torch.exp(last - cs)).transpose(2, 3).contiguous()
    return u0.contiguous(), w.contiguous(), qk, q * grown, to_end, torch.exp(last).squeeze(2)


def _pair_scores(q: torch.Tensor, k: torch.Tensor, cs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_t . (D[t, j] * k_j) and q_t . (D[t, j] * k_j) for j <= t (0 above the diagonal; the
    diagonal of the first is not used), from q, k and cs [S, H, Q, K] -> [S, H, Q, Q] each.

    Q splits into sub-chunks of ``SUB`` tokens. Within one, D is formed pairwise; for j before
    sub-chunk A's first token r <= t, D[t, j] = exp(cs_t - cs_r) exp(cs_r - cs_j), both
    exponents <= 0 (cs falls), so those scores are matmuls of (x_t exp(cs_t - cs_r)) and (k_j
    exp(cs_r - cs_j)): pairwise decays a quarter the size at Q = 32, and most of the work GEMMs."""
    s, h, size, kd = k.shape
    n_sub = size // SUB
    sub_k, sub_q, sub_cs = (x.view(s, h, n_sub, SUB, kd) for x in (k, q, cs))
    ref = sub_cs[:, :, :, :1, :]  # [S, H, A, 1, K]: cs at each sub-chunk's first token
    inside = torch.exp(sub_cs - ref)
    first = torch.arange(n_sub, device=k.device)[:, None] * SUB
    before = torch.arange(size, device=k.device)[None, :] < first  # [A, Q]: j before sub-chunk A
    back = (ref - cs[:, :, None, :, :]).masked_fill_(~before[:, :, None], float("-inf")).exp_()
    right = back.mul_(k[:, :, None, :, :]).transpose(-1, -2)  # [S, H, A, K, Q]
    kk = ((sub_k * inside) @ right).view(s, h, size, size)
    qk = ((sub_q * inside) @ right).view(s, h, size, size)
    later = torch.ones(SUB, SUB, dtype=torch.bool, device=k.device).triu_(1)  # j > t
    pair = (sub_cs[..., :, None, :] - sub_cs[..., None, :, :]).masked_fill_(later[:, :, None], float("-inf")).exp_()
    weighted = pair.mul_(sub_k[..., None, :, :])  # [S, H, A, t, j, K]: D[t, j] * k_j within a sub-chunk
    for scores, x in ((kk, sub_k), (qk, sub_q)):
        blocks = scores.view(s, h, n_sub, SUB, n_sub, SUB).diagonal(dim1=2, dim2=4)  # [S, H, t, j, A]
        blocks += (weighted @ x[..., None]).squeeze(-1).permute(0, 1, 3, 4, 2)
    return kk, qk
