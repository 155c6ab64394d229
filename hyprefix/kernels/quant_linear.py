"""``torch.ops.hyprefix.quant_linear`` and its packing: 4- and 6-bit weight tiles (GGUF's Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K and MXFP4 blocks) multiplied by activations quantized to int8 per 32, on
AVX512-VNNI or AVX2. ``quant_tiles.h`` has the formats and the arithmetic, ``quant_codes.h`` the
packing, ``quant_linear.cpp`` the ops.

Built on first use, one build per ISA of the int8 kernel (``int8_linear.FLAGS``); ``available()``
says whether it runs here (the int8 kernel's ISA check, and this build worked). Without it a
GGUF's low-bit matrices are dequantized at load (``models/gguf_weights.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import int8_linear
from hyprefix.kernels.build import VECTOR_FLAGS, load_kernel

SOURCE = Path(__file__).with_suffix(".cpp")

# ggml's type ids of the blocks ``pack_gguf`` takes (gguf.GGMLQuantizationType).
GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}

# MXFP4's E2M1 values doubled, as ggml keeps them (the E8M0 scale is halved to match).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_available: bool | None = None


def available() -> bool:
    """Whether the quant ops run in this process (builds and loads them the first time)."""
    global _available
    if _available is None:
        isa = device_caps("cpu").int8_isa
        _available = bool(isa) and int8_linear.available() and _build(isa)
    return _available


def _build(isa: str) -> bool:
    name = f"hyprefix_quant_linear_{isa.lower()}"
    # quant_moe.h's activation loops are ATen vector code: the matching vector ISA's flags too
    flags = [*dict.fromkeys([*int8_linear.FLAGS[isa], *VECTOR_FLAGS["AVX512" if isa == "AVX512_VNNI" else "AVX2"]])]
    if not load_kernel(name, SOURCE, flags, "GGUF low-bit weights are dequantized at load"):
        return False
    torch.library.register_fake("hyprefix::quant_linear")(_fake_linear)
    torch.library.register_fake("hyprefix::quant_rows")(_fake_rows)  # embedding lookups inside a compiled step
    torch.library.register_fake("hyprefix::quant_moe")(_fake_moe)
    torch.library.register_fake("hyprefix::quant_heads")(_fake_heads)
    return True


def quant_linear(x: torch.Tensor, parts: list[torch.Tensor], n: int) -> torch.Tensor:
    """x [..., K] (float32 / bfloat16) times the ``n``-row matrix of ``parts`` ([data, scales,
    extra] per part, as ``pack`` / ``pack_gguf`` return them), in x's dtype."""
    return torch.ops.hyprefix.quant_linear(x, parts, n)


def quant_moe(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: list[torch.Tensor],
              gate_up_rows: int, down: list[torch.Tensor], down_rows: int, activation: str = "silu",
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, alpha: float = 1.702,
              limit: float = 7.0) -> torch.Tensor:
    """A MoE block's experts on stacked tiles (one part each, every expert's rows whole tiles):
    x [T, H]; chosen, weights [T, k]; ``*_rows``: one expert's rows of each projection; biases
    [E, rows] or None. The sum over each token's chosen experts of weight * down(act(gate_up)),
    ``activation`` as ``models/fused_moe.py`` names it ("silu", "relu2", "swiglu_oai" with
    ``alpha`` and ``limit``), in x's dtype."""
    return torch.ops.hyprefix.quant_moe(x, chosen, weights, gate_up, gate_up_rows, down, down_rows, activation,
                                        gate_up_bias, down_bias, alpha, limit)


def quant_heads(x: torch.Tensor, stack: list[torch.Tensor], rows: int) -> torch.Tensor:
    """x [T, H, K] times a stack of H matrices (one part, ``rows`` rows of whole tiles each:
    [H * rows, K]), head by head: [T, H, rows] in x's dtype (MLA's per-head absorptions)."""
    return torch.ops.hyprefix.quant_heads(x, stack, rows)


def pack(q: torch.Tensor, scales: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Unpacked codes -> one part: Q4 from q uint8 [n, K] (< 16) with float16 scales and offsets
    [n, K/32] (value s * q + o); Q4K from q (< 16) with uint8 codes (sc, m) [n, K/32, 2] and float16
    (d, dmin) [n, K/256, 2] (value d * sc * q - dmin * m); Q6 from q (< 64) with int8 scales
    [n, K/16] and float16 d [n, K/256] (value d * scale * (q - 32)); MX4 from q (< 16, E2M1 codes)
    with uint8 E8M0 scales [n, K/32] and an empty extra (value ``MXFP4_VALUES[q] * 2^(e - 128)``).
    The scales' dtype (and for uint8 their rank) names the format."""
    return torch.ops.hyprefix.quant_pack(q, scales, extra)


def pack_gguf(raw: torch.Tensor, type_name: str, k: int, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A GGUF tensor's blocks (uint8 [rows in the file, bytes a row]) -> one part, row i being the
    file's row ``rows[i]``."""
    return torch.ops.hyprefix.quant_pack_gguf(raw, GGUF_TYPES[type_name], k, rows)


def rows(parts: list[torch.Tensor], n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the matrix dequantized: float32 [*ids.shape, K]."""
    return torch.ops.hyprefix.quant_rows(parts, n, k, ids)


def _fake_linear(x: torch.Tensor, parts: list[torch.Tensor], n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def _fake_rows(parts: list[torch.Tensor], n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    return ids.new_empty((*ids.shape, k), dtype=torch.float32)


def _fake_moe(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: list[torch.Tensor],
              gate_up_rows: int, down: list[torch.Tensor], down_rows: int, activation: str,
              gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, alpha: float,
              limit: float) -> torch.Tensor:
    return torch.empty_like(x)


def _fake_heads(x: torch.Tensor, stack: list[torch.Tensor], rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1], rows))
