"""Elementwise chains around the matmuls: RMSNorm (with the residual add) and
QK-norm + rotary.

Each is written once, in the reference op order of transformers (statistics in
float32, scaled by the weight in the model dtype). Steps with many tokens run
them through ``torch.compile`` (one fused loop instead of ~8 memory passes: the
difference between matching and beating the reference on prefill); small steps
(decodes) run them eagerly, where a compiled call's guard overhead would cost
more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyprefix.hardware import separate_compile_cache

# Steps with at least this many tokens use the compiled kernels.
COMPILE_MIN_TOKENS = 32


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalize(x, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual)."""
    x = x + residual
    return weight * _normalize(x, eps), x


def qk_norm_rope(qk: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, rotary_dim: int) -> torch.Tensor:
    """qk: [T, heads, head_dim] (q heads then k heads); optional per-head RMSNorm
    (``weight`` [heads, head_dim]), then rotate-half RoPE on the first
    ``rotary_dim`` channels with half-width ``cos``/``sin`` [T, 1, rotary_dim/2]."""
    if weight is not None:
        qk = weight * _normalize(qk, eps)
    half = rotary_dim // 2
    x1, x2 = qk[..., :half], qk[..., half:rotary_dim]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < qk.shape[-1]:
        parts.append(qk[..., rotary_dim:])
    return torch.cat(parts, dim=-1)


class Kernels:
    """The functions above, eager or compiled per call by step size."""

    def __init__(self, compile_enabled: bool) -> None:
        self.compile_enabled = compile_enabled
        if compile_enabled:
            separate_compile_cache()
        self._compiled: dict[str, Callable] = {}

    def _pick(self, fn: Callable, num_tokens: int) -> Callable:
        if torch.compiler.is_compiling():  # inside a compiled decode step: traced into it
            return fn
        if not self.compile_enabled or num_tokens < COMPILE_MIN_TOKENS:
            return fn
        compiled = self._compiled.get(fn.__name__)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
            self._compiled[fn.__name__] = compiled
        return compiled

    def rms_norm(self, x, weight, eps):
        return self._pick(rms_norm, x.shape[0])(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._pick(add_rms_norm, x.shape[0])(x, residual, weight, eps)

    def qk_norm_rope(self, qk, weight, cos, sin, eps, rotary_dim):
        return self._pick(qk_norm_rope, qk.shape[0])(qk, weight, cos, sin, eps, rotary_dim)
