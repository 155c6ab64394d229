"""``torch.ops.hyprefix.packed_linear`` / ``packed_gate_up``: oneDNN's matmuls over prepacked
weights as extern kernels of compiled batched decode steps (``packed_linear.cpp`` says why).

Built on first use (``build.load_kernel``, no ISA flags: the arithmetic is oneDNN's); where the
build fails, one warning, and batched decode steps stay eager (``runner/decode_graph.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.kernels.build import load_kernel

SOURCE = Path(__file__).with_suffix(".cpp")

_available: bool | None = None


def available() -> bool:
    """Whether the ops run in this process (builds and loads them the first time)."""
    global _available
    if _available is None:
        _available = _build()
    return _available


def _build() -> bool:
    if not load_kernel("hyprefix_packed_linear", SOURCE, [], "batched decode steps run eagerly"):
        return False
    torch.library.register_fake("hyprefix::packed_linear")(_fake_linear)
    torch.library.register_fake("hyprefix::packed_gate_up")(_fake_gate_up)
    return True


def _fake_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, tiles: torch.Tensor | None,
                 tile_rows: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _fake_gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor | None,
                  up_bias: torch.Tensor | None, activation: str, algorithm: str, tiles: torch.Tensor | None,
                  tile_rows: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], gate.shape[0]))
