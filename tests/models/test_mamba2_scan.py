"""Mamba2's chunked SSD scan (``models/mamba2.ssd_scan``) against a float64 token-by-token oracle."""

from __future__ import annotations

import pytest
import torch

from hyprefix.models.mamba2 import ssd_scan


def _ssd_oracle(x, dt, A, B, C, h0):
    """Mamba2's recurrence one token at a time, float64 (B, C per group)."""
    x, dt, A, B, C, h = (t.double() for t in (x, dt, A, B, C, h0))
    rep = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)
    ys, states = [], []
    for t in range(x.shape[0]):
        h = h * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]))
        states.append(h)
    return torch.stack(ys), states


@pytest.mark.parametrize(("n", "chunk", "cuts", "groups"), [
    (1, 64, [], 1), (5, 64, [2], 2), (70, 32, [1, 31, 32, 33, 64], 2), (130, 64, [100], 4)])
def test_ssd_scan_matches_token_by_token_oracle(n, chunk, cuts, groups):
    """Mamba2's chunked scan, heads sharing their group's B and C, taps ending chunks."""
    gen = torch.Generator().manual_seed(n)
    heads, p, size = 4, 6, 10
    x = torch.randn(n, heads, p, generator=gen)
    dt = torch.rand(n, heads, generator=gen) * 0.5
    A = -torch.tensor([0.05, 0.5, 2.0, 8.0])
    B, C = torch.randn(n, groups, size, generator=gen), torch.randn(n, groups, size, generator=gen)
    h0 = torch.randn(heads, p, size, generator=gen)
    y, h, tapped = ssd_scan(x, dt, A, B, C, h0, chunk, cuts)
    ref, states = _ssd_oracle(x, dt, A, B, C, h0)
    assert (y.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert (h.double() - states[-1]).abs().max().item() < 1e-4 * states[-1].abs().max().item()
    for cut, state in zip(cuts, tapped, strict=True):
        assert (state.double() - states[cut - 1]).abs().max().item() < 1e-4 * state.abs().max().item(), f"tap {cut}"
