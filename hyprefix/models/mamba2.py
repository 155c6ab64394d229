"""Mamba2 mixer in plain PyTorch over per-request live state slots.

in_proj -> causal depthwise conv1d (with a conv state of the last K-1 inputs)
-> SiLU -> chunked SSD scan with an initial SSM state -> D skip -> gated grouped
RMSNorm -> out_proj.

State lives outside the module (``recurrent_state.py``): ``conv`` [slots, conv_dim,
K-1] in the model dtype and the SSM state ``matrix`` [slots, heads, head_dim,
state] in float32 whatever the model dtype. A tap inside a prefill splits the scan
there, so checkpoints never force a chunk boundary on the scheduler. Decode rows run in one
fused call per layer where ``kernels/recurrent_decode`` runs, else the eager ops below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyprefix.forward import ForwardBatch
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
class MambaDims:
    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    chunk: int
    eps: float
    dt_min: float
    dt_max: float
    use_bias: bool
    conv_bias: bool

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state

    @property
    def state_shape(self) -> LayerStateShape:
        return LayerStateShape(self.conv_dim, self.conv_kernel - 1, (self.heads, self.head_dim, self.state))




class Mamba2Mixer(nn.Module):
    def __init__(self, d: MambaDims, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d = d
        proj = d.inner + d.conv_dim + d.heads
        self.in_proj = Linear(d.hidden, proj, bias=d.use_bias, dtype=dtype, device=device)
        self.conv1d_weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel, dtype=dtype, device=device))
        self.conv1d_bias = nn.Parameter(torch.empty(d.conv_dim, dtype=dtype, device=device)) if d.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(d.heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(d.heads, dtype=dtype, device=device))
        self.D = nn.Parameter(torch.empty(d.heads, dtype=dtype, device=device))
        self.norm_weight = nn.Parameter(torch.empty(d.inner, dtype=dtype, device=device))
        self.out_proj = Linear(d.inner, d.hidden, bias=d.use_bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        d = self.d
        t = x.shape[0]
        proj = self.in_proj(x)
        n_dec = batch.num_decode
        fused = bool(n_dec) and recurrent_decode.runs(proj, state.matrix)
        if fused and n_dec == t:
            return self.out_proj(self._fused_decode(proj, batch, state))
        z, xbc, dt = proj.split([d.inner, d.conv_dim, d.heads], dim=-1)
        A = -torch.exp(self.A_log.float())
        y = torch.empty(t, d.heads, d.head_dim, dtype=torch.float32, device=x.device)
        xs = torch.empty(t, d.inner, dtype=torch.float32, device=x.device)  # conv outputs (for D skip)
        if fused:
            y[:n_dec], xs[:n_dec] = 0, 0  # the fused op's rows replace theirs below
        elif n_dec:
            y[:n_dec], xs[:n_dec] = self._decode(xbc[:n_dec], dt[:n_dec], A, batch, state)
        for span in batch.prefills:
            sl = span.token_slice
            y[sl], xs[sl].view(-1, d.heads, d.head_dim)[:] = self._prefill(xbc[sl], dt[sl], A, span.state_slot,
                                                                           span.state_taps, state)
        y = y + self.D.float()[:, None] * xs.view_as(y)
        out = self._gated_norm(y.view(t, d.inner), z).to(x.dtype)
        if fused:
            out[:n_dec] = self._fused_decode(proj[:n_dec], batch, state)
        return self.out_proj(out)

    def _fused_decode(self, proj: torch.Tensor, batch: ForwardBatch, state: RecurrentLayerState) -> torch.Tensor:
        """The decode rows in one call (``kernels/recurrent_decode``): [n_dec, inner] before out_proj."""
        d = self.d
        slots = batch.decode_state_slots
        assert slots is not None
        y = recurrent_decode.mamba2_decode(proj, state.conv, self.conv1d_weight, self.conv1d_bias, state.matrix, slots,
                                           self.A_log, self.dt_bias, self.D, self.norm_weight, d.heads, d.head_dim,
                                           d.groups, d.state, d.dt_min, d.dt_max, d.eps)
        tap_decode_rows(state, slots, batch.decode_state_taps)
        return y

    # ----------------------------------------------------------------- pieces
    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return dt.clamp(min=self.d.dt_min, max=self.d.dt_max)

    def _xbc_parts(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv inputs or outputs [n, conv_dim] -> views x [n, inner], B and C [n, groups * state]."""
        gn = self.d.groups * self.d.state
        return xbc.split([self.d.inner, gn, gn], dim=-1)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs -> x [n, inner], B and C [n, heads, state] (each head its group's), float32."""
        d = self.d
        xv, B, C = self._xbc_parts(xbc)
        rep = d.heads // d.groups
        B = B.float().view(-1, d.groups, d.state).repeat_interleave(rep, dim=1)
        C = C.float().view(-1, d.groups, d.state).repeat_interleave(rep, dim=1)
        return xv.float(), B, C

    def _decode(self, xbc, dt, A, batch: ForwardBatch, state: RecurrentLayerState):
        d = self.d
        slots, slot_range = batch.decode_state_slots, batch.decode_state_range
        assert slots is not None
        conv, conv_states = conv_decode(state, slots, xbc, self.conv1d_weight, self.conv1d_bias)
        xv, B, C = self._split_xbc(F.silu(conv))
        dt = self._dt(dt)  # [m, heads]
        m = dt.shape[0]
        h = state.decode_matrices(slots, slot_range)  # [m, heads, head_dim, state], updated in place
        flat = h.view(m * d.heads, d.head_dim, d.state)
        flat.mul_(torch.exp(dt * A).view(-1, 1, 1))
        flat.baddbmm_((dt[:, :, None] * xv.view(m, d.heads, d.head_dim)).reshape(-1, d.head_dim, 1),
                      B.reshape(-1, 1, d.state))
        state.store_decode_matrices(h, slots, slot_range)
        for row, ckpt in batch.decode_state_taps:
            state.tap(ckpt, conv_states[row], h[row])
        y = torch.bmm(flat, C.reshape(-1, d.state, 1)).view(m, d.heads, d.head_dim)
        return y, xv

    def _prefill(self, xbc, dt, A, slot: int, taps: list[tuple[int, int]], state: RecurrentLayerState):
        d = self.d
        k1 = d.conv_kernel - 1
        conv, inputs = conv_prefill(state, slot, xbc, self.conv1d_weight, self.conv1d_bias)
        xv, B, C = self._xbc_parts(conv)
        # Head-major ([heads, n, dim]) as the scan reads them: its transposes become views.
        xv = silu_heads(xv, d.heads).transpose(0, 1)
        B, C = silu_heads(B, d.groups).transpose(0, 1), silu_heads(C, d.groups).transpose(0, 1)
        y, h, tapped = ssd_scan(xv, self._dt(dt), A, B, C, state.prefill_matrix(slot), d.chunk,
                                [offset for offset, _ in taps])
        state.matrix[slot].copy_(h)
        for (offset, ckpt), h_at in zip(taps, tapped, strict=True):
            state.tap(ckpt, inputs[:, offset:offset + k1], h_at)
        return y, xv

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y * silu(z)) per group of channels, in float32."""
        d = self.d
        g = (y * F.silu(z.float())).view(y.shape[0], d.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + d.eps)
        return self.norm_weight * g.view(y.shape[0], d.inner).to(self.norm_weight.dtype)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             h0: torch.Tensor, chunk: int, cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Chunked state-space-dual scan of one sequence, float32.

    x [n, H, P], dt [n, H] (discretised, > 0), A [H] (< 0), B and C [n, G, N] per group
    (head h reads group h // (H // G)), h0 [H, P, N]. Recurrence:
    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``.
    Segments end every ``chunk`` tokens and at every offset in ``cuts``; returns
    (y [n, H, P], final state, states after each cut offset in order).

    The products with B and C run per group, not per head: C B^T once for the group's heads,
    and the state's readout and update as one matmul over the group's heads side by side.
    """
    n, heads, p = x.shape
    groups, size = B.shape[1:]
    rep = heads // groups
    xdt = (x * dt[:, :, None]).transpose(0, 1).contiguous()  # [H, n, P]
    a = (dt * A).t().contiguous()  # [H, n]
    b_all, c_all = B.transpose(0, 1).contiguous(), C.transpose(0, 1).contiguous()  # [G, n, N]
    y = torch.empty(heads, n, p, dtype=torch.float32, device=x.device)
    h = h0.float()
    cut_set = set(cuts)
    tapped: dict[int, torch.Tensor] = {}
    start = 0
    while start < n:
        end = min(start + chunk, n, *(c for c in cut_set if c > start))
        q = end - start
        cs = torch.cumsum(a[:, start:end], dim=-1)  # [H, Q]
        b, c, xs = b_all[:, start:end], c_all[:, start:end], xdt[:, start:end]
        scores = decay_scores(cs, c @ b.transpose(1, 2))  # exp(cs_t - cs_s) C_t . B_s, s <= t
        from_state = (c @ h.view(groups, rep * p, size).transpose(1, 2)).view(groups, q, rep, p)
        y[:, start:end] = (scores @ xs
                           + from_state.transpose(1, 2).reshape(heads, q, p) * torch.exp(cs)[:, :, None])
        to_end = (xs * torch.exp(cs[:, -1:] - cs)[:, :, None]).transpose(1, 2).reshape(groups, rep * p, q)
        h = h * torch.exp(cs[:, -1])[:, None, None] + (to_end @ b).view(heads, p, size)
        if end in cut_set:
            tapped[end] = h.clone()
        start = end
    return y.transpose(0, 1), h, [tapped[c] for c in cuts]
