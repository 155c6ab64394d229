"""``torch.ops.hyprefix.invariant_linear`` and ``invariant_gated_act``: the matmul and the gated
MLP activation of the batch-invariant mode (``EngineArgs.batch_invariant``), whose result for a
row is the same bits whatever else is in the call (``invariant_linear.cpp`` has the arithmetic).

Built on first use, one build per ATen ISA (``build.load_vector_kernel``), on an x86 CPU whose
ATen ISA is AVX2 or AVX-512 (``hardware.DeviceCaps.vector_kernels``). ``available()`` says
whether it runs; where it does not, the mode is refused at start-up (``CausalLM.use_batch_invariant``).
(Where the bf16 tile kernel runs, ``kernels/bf16_linear.cpp``, whose arithmetic per row is
fixed as well, the mode multiplies bfloat16 matrices with it instead: ``MatrixForms.use_batch_invariant``.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels.build import load_vector_kernel

SOURCE = Path(__file__).with_suffix(".cpp")
# invariant_gated_act's activation codes, by GatedMLP activation name
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}

_available: bool | None = None


def available() -> bool:
    """Whether the two ops run in this process (builds and loads them the first time)."""
    global _available
    if _available is None:
        _available = device_caps("cpu").vector_kernels and _build()
    return _available


def _build() -> bool:
    if not load_vector_kernel(SOURCE, "--batch-invariant is refused"):
        return False
    torch.library.register_fake("hyprefix::invariant_linear")(_fake_linear)
    torch.library.register_fake("hyprefix::invariant_gated_act")(_fake_gated_act)
    return True


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype (float32, bfloat16 or
    float16, weight and bias the same), each row's values independent of the other rows.
    Call only where ``available()``."""
    return torch.ops.hyprefix.invariant_linear(x, weight, bias)


def invariant_gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of gate_up [..., 2I] = [gate | up] -> [..., I], ``activation`` a key of
    ``ACTIVATIONS``; every element by the same vector code. Call only where ``available()``."""
    return torch.ops.hyprefix.invariant_gated_act(gate_up, ACTIVATIONS[activation])


def _fake_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_gated_act(gate_up: torch.Tensor, activation: int) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
