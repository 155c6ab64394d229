"""Gated DeltaNet mixer (Qwen3.5, Qwen3-Next linear-attention layers) in plain
PyTorch over per-request live state slots (``recurrent_state.py``).

in_proj -> [q k v | z | b | a]; causal depthwise conv1d over q k v (with a conv
state of the last K-1 inputs) -> SiLU -> L2-normalised q, k (q scaled by
1/sqrt(key dim)), each key head serving ``v_heads / k_heads`` consecutive value
heads -> gated delta rule from an initial state -> RMSNorm(o) * SiLU(z) per value
head -> out_proj.

The gated delta rule, per value head with state S [key dim, value dim] (float32):
``S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t``, with
``g_t = -exp(A_log) softplus(a_t + dt_bias)`` and ``beta_t = sigmoid(b_t)``.
Prefills run it chunked (``gated_delta_scan``); a tap inside a prefill ends a chunk
there, so checkpoints never force a chunk boundary on the scheduler. Decodes run
the one-token recurrence batched over rows: fused in one call per layer where
``kernels/recurrent_decode`` runs, else the eager ops below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.forward import ForwardBatch, PrefillSpan
from hyprefix.kernels import recurrent_decode
from hyprefix.kernels.decay_scores import decay_scores
from hyprefix.models.layers import Linear
from hyprefix.models.recurrent_state import (
    LayerStateShape,
    RecurrentLayerState,
    conv_decode,
    conv_prefill,
    silu_heads,
    tap_decode_rows,
)


@dataclass(frozen=True)
class DeltaNetDims:
    hidden: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float
    chunk: int = 64

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shape(self) -> LayerStateShape:
        return LayerStateShape(self.conv_dim, self.conv_kernel - 1, (self.v_heads, self.k_dim, self.v_dim))

    @classmethod
    def from_config(cls, cfg) -> DeltaNetDims:
        return cls(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)


class GatedDeltaNet(nn.Module):
    """``in_proj`` holds Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a
    stacked in that order (Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba are
    reordered into it at load, ``models/qwen3_next.py``)."""

    def __init__(self, d: DeltaNetDims, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d = d
        self.in_proj = Linear(d.hidden, d.conv_dim + d.value_dim + 2 * d.v_heads, bias=False, dtype=dtype,
                              device=device)
        self.conv1d_weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel, dtype=dtype, device=device))
        self.dt_bias = nn.Parameter(torch.empty(d.v_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(d.v_heads, dtype=dtype, device=device))
        self.norm_weight = nn.Parameter(torch.empty(d.v_dim, dtype=dtype, device=device))
        self.out_proj = Linear(d.value_dim, d.hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        d = self.d
        t = x.shape[0]
        proj = self.in_proj(x)
        n_dec = batch.num_decode
        fused = bool(n_dec) and recurrent_decode.runs(proj, state.matrix)
        if fused and n_dec == t:
            return self.out_proj(self._fused_decode(proj, batch, state))
        qkv, z, b, a = proj.split([d.conv_dim, d.value_dim, d.v_heads, d.v_heads], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        o = delta_rows(batch, (t, d.v_heads, d.v_dim), x.device, fused,
                       lambda n: self._decode(qkv[:n], g[:n], beta[:n], batch, state),
                       lambda sl, span: self._prefill(qkv[sl], g[sl], beta[sl], span.state_slot, span.state_taps,
                                                      state))
        y = self._gated_norm(o, z).to(x.dtype)
        if fused:
            y[:n_dec] = self._fused_decode(proj[:n_dec], batch, state)
        return self.out_proj(y)

    def _fused_decode(self, proj: torch.Tensor, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        """The decode rows in one call (``kernels/recurrent_decode``): [n_dec, value_dim] before out_proj."""
        d = self.d
        slots = batch.decode_state_slots
        assert slots is not None
        y = recurrent_decode.gdn_decode(proj, state.conv, self.conv1d_weight, state.matrix, slots, self.A_log,
                                        self.dt_bias, self.norm_weight, d.k_heads, d.v_heads, d.k_dim, d.v_dim,
                                        d.eps)
        tap_decode_rows(state, slots, batch.decode_state_taps)
        return y

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [n, conv_dim] -> q, k [n, v_heads, k_dim] (normalised, q scaled)
        and v [n, v_heads, v_dim], float32: views of head-major [heads, n, dim] tensors, the
        layout the chunked scan reads (a prefill's conv output is channel-major, so this costs
        one pass per part, and the normalisation reduces over contiguous memory)."""
        d = self.d
        rep = d.v_heads // d.k_heads
        q, k, v = conv_out.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q = _l2norm(silu_heads(q, d.k_heads)) * d.k_dim ** -0.5
        k = _l2norm(silu_heads(k, d.k_heads))
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=0), k.repeat_interleave(rep, dim=0)
        return q.transpose(0, 1), k.transpose(0, 1), silu_heads(v, d.v_heads).transpose(0, 1)

    def _decode(self, qkv, g, beta, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        slots, slot_range = batch.decode_state_slots, batch.decode_state_range
        assert slots is not None
        conv, conv_states = conv_decode(state, slots, qkv, self.conv1d_weight, None)
        q, k, v = self._qkv(conv)
        h = state.decode_matrices(slots, slot_range)  # [m, H, K, V], updated in place
        out = delta_rule_step(h, q, k, v, torch.exp(g)[..., None, None], beta)
        state.store_decode_matrices(h, slots, slot_range)
        for row, ckpt in batch.decode_state_taps:
            state.tap(ckpt, conv_states[row], h[row])
        return out

    def _prefill(self, qkv, g, beta, slot: int, taps: list[tuple[int, int]],
                 state: RecurrentLayerState) -> torch.Tensor:
        k1 = self.d.conv_kernel - 1
        conv, inputs = conv_prefill(state, slot, qkv, self.conv1d_weight, None)
        q, k, v = self._qkv(conv)
        o, h, tapped = gated_delta_scan(q, k, v, g, beta, state.prefill_matrix(slot), self.d.chunk,
                                        [offset for offset, _ in taps])
        state.matrix[slot].copy_(h)
        for (offset, ckpt), h_at in zip(taps, tapped, strict=True):
            state.tap(ckpt, inputs[:, offset:offset + k1], h_at)
        return o

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) * w * SiLU(z) per value head, in float32: [T, H, V] -> [T, H*V]."""
        d = self.d
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + d.eps)
        out = self.norm_weight.float() * normed * F.silu(z.float().view_as(o))
        return out.view(o.shape[0], d.value_dim)


def delta_rows(batch: ForwardBatch, shape: tuple[int, int, int], device: torch.device, fused: bool,
               decode: Callable[[int], torch.Tensor],
               prefill: Callable[[slice, PrefillSpan], torch.Tensor]) -> torch.Tensor:
    """A delta-rule mixer's outputs before its gated norm, float32 ``shape`` [T, heads, dim]: the
    decode rows by ``decode(num_decode)`` (zeros where the fused op fills them after the norm),
    each prefill span's by ``prefill(its token slice, span)`` (Gated DeltaNet, KDA)."""
    o = torch.empty(shape, dtype=torch.float32, device=device)
    n_dec = batch.num_decode
    if fused:
        o[:n_dec] = 0
    elif n_dec:
        o[:n_dec] = decode(n_dec)
    for span in batch.prefills:
        o[span.token_slice] = prefill(span.token_slice, span)
    return o


def delta_rule_step(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for m rows, in place on the states h [m, H, K, V]:
    ``h = decay h; h += k (beta (v - h^T k))^T``, then the readout h^T q [m, H, V]. q, k [m, H, K],
    v [m, H, V], beta [m, H]; ``decay`` broadcasts over h: [m, H, 1, 1] a head (Gated DeltaNet),
    [m, H, K, 1] a key channel (KDA)."""
    m, heads, kd, vd = h.shape
    h.mul_(decay)
    flat = h.view(m * heads, kd, vd)
    delta = (v - torch.bmm(k.reshape(-1, 1, kd), flat).view(m, heads, vd)) * beta[:, :, None]
    flat.baddbmm_(k.reshape(-1, kd, 1), delta.reshape(-1, 1, vd))
    return torch.bmm(q.reshape(-1, 1, kd), flat).view(m, heads, vd)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     h0: torch.Tensor, chunk: int,
                     cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Chunked gated delta rule over one sequence, float32.

    q, k [n, H, K], v [n, H, V], g (log decay, <= 0) and beta [n, H], h0 [H, K, V].
    Segments end every ``chunk`` tokens and at every offset in ``cuts``; returns
    (o [n, H, V], final state, states after each cut offset in order).

    Within a segment of length Q, with G_t = exp(cumsum g) from its start, the
    deltas u solve ``(I + L) u = beta v - beta G k h0`` with L[t, j] = beta_t
    (G_t / G_j) k_t . k_j for j < t (unit lower triangular: one triangular solve);
    then ``o_t = G_t q_t h0 + sum_{j<=t} (G_t / G_j)(q_t . k_j) u_j`` and the state
    after it is ``G_Q h0 + sum_j (G_Q / G_j) k_j u_j^T``.
    """
    n = q.shape[0]
    q_all, k_all, v_all = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # [H, n, *]: chunks are row runs
    beta_all, g_all = beta.t().contiguous(), g.t().contiguous()  # [H, n]
    o = torch.empty_like(v_all)
    h = h0.to(q.dtype)
    cut_set = set(cuts)
    tapped: dict[int, torch.Tensor] = {}
    start = 0
    while start < n:
        end = min(start + chunk, n, *(c for c in cut_set if c > start))
        qs, ks, vs = (x[:, start:end] for x in (q_all, k_all, v_all))  # [H, Q, *]
        bs = beta_all[:, start:end]  # [H, Q]
        cs = torch.cumsum(g_all[:, start:end], dim=-1)  # [H, Q]
        lower = decay_scores(cs, ks @ ks.transpose(1, 2), bs, strict=True)  # beta_t (G_t / G_j) k_t . k_j, j < t
        rhs = bs[:, :, None] * vs - ((bs * torch.exp(cs))[:, :, None] * ks) @ h
        u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # [H, Q, V]
        out = (qs * torch.exp(cs)[:, :, None]) @ h + decay_scores(cs, qs @ ks.transpose(1, 2)) @ u
        o[:, start:end] = out
        to_end = torch.exp(cs[:, -1:] - cs)  # [H, Q]
        h = h * torch.exp(cs[:, -1])[:, None, None] + (ks * to_end[:, :, None]).transpose(1, 2) @ u
        if end in cut_set:
            tapped[end] = h.clone()
        start = end
    return o.transpose(0, 1), h, [tapped[c] for c in cuts]
