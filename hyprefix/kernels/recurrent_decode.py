"""``torch.ops.hyprefix.gdn_decode``, ``kda_decode`` and ``mamba2_decode``: one decode token per
row through a Gated DeltaNet, Kimi Delta Attention or Mamba2 mixer in one call (conv window shift
and conv, state update and readout, gated RMSNorm), updating the rows' live states in place;
``recurrent_decode.cpp`` documents the arithmetic, which is the models' eager code
(``models/gated_deltanet.py``, ``models/kimi_delta.py``, ``models/mamba2.py``) fused.

``available()`` says whether they run here: an x86 CPU whose ATen ISA is AVX2 or AVX-512
(``hardware.DeviceCaps.vector_kernels``) and the build for it worked. Elsewhere (CUDA, other
CPUs) the mixers run their eager code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_vector_kernel

SOURCE = Path(__file__).with_suffix(".cpp")

_available: bool | None = None


def available() -> bool:
    """Whether the fused recurrent decode ops run on CPU in this process (builds and loads them
    the first time)."""
    global _available
    if _available is None:
        _available = device_caps("cpu").vector_kernels and load_vector_kernel(
            SOURCE, "recurrent layers decode op by op")
        if _available:
            torch.library.register_fake("hyprefix::gdn_decode")(_fake_gdn)
            torch.library.register_fake("hyprefix::kda_decode")(_fake_kda)
            torch.library.register_fake("hyprefix::mamba2_decode")(_fake_mamba2)
    return _available


def runs(proj: torch.Tensor, matrix: torch.Tensor) -> bool:
    """Whether a step with in_proj output ``proj`` and state ``matrix`` takes the fused op."""
    return (proj.device.type == "cpu" and matrix.device.type == "cpu"
            and matrix.dtype in (torch.float32, torch.bfloat16) and available())


def gdn_decode(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, matrix: torch.Tensor,
               slots: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
               k_heads: int, v_heads: int, k_dim: int, v_dim: int, eps: float) -> torch.Tensor:
    """Rows of in_proj output ``proj`` [m, conv_dim + value_dim + 2 v_heads] ([q k v | z | b | a])
    for live ``slots`` [m] -> [m, v_heads * v_dim] in proj's dtype (before out_proj); advances
    ``conv_state`` [slots, conv_dim, K-1] and ``matrix`` [slots, v_heads, k_dim, v_dim]."""
    return torch.ops.hyprefix.gdn_decode(proj, conv_state, conv_weight, matrix, slots, a_log, dt_bias, norm_weight,
                                         k_heads, v_heads, k_dim, v_dim, eps)


def kda_decode(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, matrix: torch.Tensor,
               slots: torch.Tensor, forget: torch.Tensor, gate: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_weight: torch.Tensor, heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """Rows of in_proj output ``proj`` [m, 3 heads head_dim + 2 head_dim + heads] ([q k v | f_a |
    g_a | b]) for live ``slots`` [m], with ``forget`` = f_b(f_a) and ``gate`` = g_b(g_a) [m, heads *
    head_dim] (contiguous, proj's dtype) -> [m, heads * head_dim] in proj's dtype (before o_proj);
    advances ``conv_state`` [slots, 3 heads head_dim, K-1] and ``matrix`` [slots, heads, head_dim,
    head_dim]."""
    return torch.ops.hyprefix.kda_decode(proj, conv_state, conv_weight, matrix, slots, forget, gate, a_log, dt_bias,
                                         norm_weight, heads, head_dim, eps)


def mamba2_decode(proj: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                  conv_bias: torch.Tensor | None, matrix: torch.Tensor, slots: torch.Tensor, a_log: torch.Tensor,
                  dt_bias: torch.Tensor, d_skip: torch.Tensor, norm_weight: torch.Tensor, heads: int, head_dim: int,
                  groups: int, state: int, dt_min: float, dt_max: float, eps: float) -> torch.Tensor:
    """Rows of in_proj output ``proj`` [m, inner + conv_dim + heads] ([z | x B C | dt]) for live
    ``slots`` -> [m, inner] in proj's dtype (before out_proj); advances ``conv_state`` and
    ``matrix`` [slots, heads, head_dim, state]."""
    return torch.ops.hyprefix.mamba2_decode(proj, conv_state, conv_weight, conv_bias, matrix, slots, a_log, dt_bias,
                                            d_skip, norm_weight, heads, head_dim, groups, state, dt_min, dt_max, eps)


def _fake_gdn(proj, conv_state, conv_weight, matrix, slots, a_log, dt_bias, norm_weight, k_heads, v_heads, k_dim,
              v_dim, eps):
    return proj.new_empty((proj.shape[0], v_heads * v_dim))


def _fake_kda(proj, conv_state, conv_weight, matrix, slots, forget, gate, a_log, dt_bias, norm_weight, heads, head_dim,
              eps):
    return proj.new_empty((proj.shape[0], heads * head_dim))


def _fake_mamba2(proj, conv_state, conv_weight, conv_bias, matrix, slots, a_log, dt_bias, d_skip, norm_weight, heads,
                 head_dim, groups, state, dt_min, dt_max, eps):
    return proj.new_empty((proj.shape[0], heads * head_dim))
