"""``decay_scores``: the decay-weighted causal score matrix of a chunked recurrent scan
(Mamba2's SSD scan, the chunked gated delta rule) in one pass on CPU (``decay_scores.cpp``),
the eager ops elsewhere. The two agree to float32 rounding: the kernel keeps the eager code's
order of products, but its exp is ATen's vectorised one where torch.exp may take MKL's.

The fused op runs on an x86 CPU whose ATen ISA is AVX2 or AVX-512
(``hardware.DeviceCaps.vector_kernels``) where its build worked.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_vector_op

SOURCE = Path(__file__).with_suffix(".cpp")


def available() -> bool:
    """Whether the fused op runs on CPU in this process (builds and loads it the first time)."""
    return device_caps("cpu").vector_kernels and load_vector_op(
        SOURCE, "hyprefix::decay_scores", _fake, "chunked scans weight their scores op by op")


def decay_scores(cs: torch.Tensor, scores: torch.Tensor, row_scale: torch.Tensor | None = None,
                 strict: bool = False) -> torch.Tensor:
    """``cs`` [H, Q] (cumulative log decay of each head), ``scores`` [Hs, Q, Q] with Hs dividing H
    (head h reads ``scores[h // (H // Hs)]``), ``row_scale`` [H, Q] or None -> [H, Q, Q]:
    ``row_scale[h, t] * scores[h // (H // Hs), t, s] * exp(cs[h, t] - cs[h, s])`` where s <= t
    (s < t if ``strict``), 0 elsewhere. All float32."""
    fused = cs.device.type == "cpu" and cs.dtype == scores.dtype == torch.float32 and (
        row_scale is None or row_scale.dtype == torch.float32)
    if fused and available():
        return torch.ops.hyprefix.decay_scores(cs.contiguous(), scores.contiguous(),
                                               None if row_scale is None else row_scale.contiguous(), strict)
    return eager_decay_scores(cs, scores, row_scale, strict)


def eager_decay_scores(cs: torch.Tensor, scores: torch.Tensor, row_scale: torch.Tensor | None = None,
                       strict: bool = False) -> torch.Tensor:
    """``decay_scores`` in torch ops (any device)."""
    heads, q = cs.shape
    sources = scores.shape[0]
    mask = torch.ones(q, q, dtype=torch.bool, device=cs.device).tril(-1 if strict else 0)
    decay = torch.exp((cs[:, :, None] - cs[:, None, :]).masked_fill(~mask, float("-inf")))
    weighted = scores[:, None]  # [Hs, 1, Q, Q]
    if row_scale is not None:
        weighted = row_scale.view(sources, -1, q, 1) * weighted
    return (weighted * decay.view(sources, -1, q, q)).view(heads, q, q)


def _fake(cs, scores, row_scale, strict):
    return cs.new_empty((cs.shape[0], cs.shape[1], cs.shape[1]))
