"""``kernels/quant_linear``: GGUF's Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and MXFP4 blocks packed into the
Q4, Q4K, Q6 and MX4 tiles hold the file's numbers (``gguf``'s own dequantization is the reference), and the
matmul equals the dequantized matrix times the activations rounded to int8 per 32 (what every
quantized matmul of the engine computes), for float32 and bfloat16 inputs, every batch size the
kernel blocks rows by, a row permutation applied while packing, and a matrix of parts in
different formats. The blocks are random bytes with sane float16 (MXFP4: E8M0) scales: every bit
pattern of the codes is a valid block."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hyprefix.kernels import quant_linear as kernel
from hyprefix.models.quant import (
    QuantTiles,
    int8_part,
    join_parts,
    part_format,
    quantize_activations,
    quantize_int8,
    quantize_mxfp4,
    quantize_q4,
    quantize_q4k,
    quantize_q6,
    requantize_like,
)

pytestmark = pytest.mark.skipif(not kernel.available(), reason="quant_linear does not build or run here")

TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
T = gguf.GGMLQuantizationType


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``type_name`` (uint8 [rows, bytes a row]) whose float16 scales are small
    positive numbers (and Q4_1's minimum a small negative one)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[T[type_name]]
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)

    def put(offset: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    offsets = {"Q4_0": [(0, 0.001, 0.02)], "Q5_0": [(0, 0.001, 0.02)], "Q4_1": [(0, 0.001, 0.02), (2, -0.1, 0.0)],
               "Q4_K": [(0, 1e-4, 2e-3), (2, 1e-4, 2e-3)], "Q5_K": [(0, 1e-4, 2e-3), (2, 1e-4, 2e-3)],
               "Q6_K": [(208, 1e-4, 2e-3)]}
    if type_name == "MXFP4":  # E8M0 scales 2^(e - 128) of 2^-13 to 2^-5
        blocks[:, :, 0] = rng.integers(115, 124, size=blocks.shape[:2], dtype=np.uint8)
        return raw
    for offset, low, high in offsets[type_name]:
        put(offset, low, high)
    return raw


def packed(type_name: str, rows: int, cols: int, order: torch.Tensor | None = None, seed: int = 0
           ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the parts, the file's values of the packed rows, float32 [rows, cols])."""
    raw = random_blocks(type_name, rows, cols, seed)
    order = torch.arange(rows) if order is None else order
    reference = torch.from_numpy(gguf.dequantize(raw, T[type_name]).astype(np.float32))[order]
    return list(kernel.pack_gguf(torch.from_numpy(raw), type_name, cols, order)), reference


@pytest.mark.parametrize("type_name", TYPES)
def test_packed_blocks_hold_the_files_values(type_name):
    """Q4_0, Q4_1, Q4_K (in Q4K tiles, its two levels of scales kept) and Q6_K exactly; Q5_K
    rounded to 4 bits per group of 32 (at most half a 4-bit step from the file's value)."""
    rows, cols = 40, 512
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    parts, reference = packed(type_name, rows, cols, order)
    values = kernel.rows(parts, rows, cols, torch.arange(rows))
    assert part_format(parts) == {"Q4_K": "q4k", "Q6_K": "q6", "MXFP4": "mxfp4"}.get(type_name, "q4")
    if type_name != "Q5_K":
        assert torch.equal(values, reference)
    else:
        groups = reference.unflatten(1, (-1, 32))
        half_step = (groups.amax(-1) - groups.amin(-1)) / 15 / 2
        slack = 2e-3 * reference.abs().max()  # the new scale and offset are float16
        assert ((values - reference).unflatten(1, (-1, 32)).abs() <= half_step[..., None] + slack).all()
    picked = torch.tensor([[3, 0], [39, 17]])
    assert torch.equal(kernel.rows(parts, rows, cols, picked), values[picked])


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 6, 7, 9])
def test_matmul_equals_the_dequantized_matrix_times_int8_activations(type_name, batch):
    """Up to 4 rows take the streaming (decode) loop, more the cache-reuse (prefill) loop; batches 6,
    7 and 9 end on a block of 2, 3 and 1 rows."""
    rows, cols = 37, 768  # rows not a whole number of tiles
    parts, _ = packed(type_name, rows, cols)
    weight = kernel.rows(parts, rows, cols, torch.arange(rows))
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    expected = F.linear(quantize_activations(x), weight)
    out = kernel.quant_linear(x, parts, rows)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    out_bf16 = kernel.quant_linear(x.bfloat16(), parts, rows)
    expected_bf16 = F.linear(quantize_activations(x.bfloat16()).float(), weight)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.float(), expected_bf16, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_a_matrix_of_parts_in_three_formats():
    """q (Q4_K), k (Q6_K), o (Q4_0), v (Q8_0 as int8 tiles; the last part, not whole tiles): one
    matrix, each shard's own format, equal to the four multiplied apart; joining two parts of one
    format changes nothing."""
    cols = 512
    q, _q_ref = packed("Q4_K", 32, cols, seed=1)
    k, _k_ref = packed("Q6_K", 16, cols, seed=2)
    v_weight = quantize_int8(torch.randn(20, cols), 32)
    v_weight.scales = v_weight.scales.half().float()  # Q8_0's scales are float16
    o, _o_ref = packed("Q4_0", 16, cols, seed=4)
    parts = join_parts([q, k, o, int8_part(v_weight)])
    assert [part_format(parts[i:i + 3]) for i in range(0, len(parts), 3)] == ["q4k", "q6", "q4", "int8"]
    matrix = QuantTiles(parts, 84, cols)
    x = torch.randn(5, cols)
    expected = torch.cat([kernel.quant_linear(x, q, 32), kernel.quant_linear(x, k, 16), kernel.quant_linear(x, o, 16),
                          F.linear(quantize_activations(x), v_weight.dequantize(torch.float32))], dim=1)
    torch.testing.assert_close(matrix.matmul(x, None), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(matrix.dequantize(torch.float32)[64:], v_weight.dequantize(torch.float32))
    q2, _ = packed("Q4_K", 16, cols, seed=3)
    joined = join_parts([q, q2])
    assert len(joined) == 3 and joined[0].shape[0] == 3
    both = torch.cat([kernel.quant_linear(x, q, 32), kernel.quant_linear(x, q2, 16)], dim=1)
    torch.testing.assert_close(kernel.quant_linear(x, joined, 48), both)


def test_quantizers_round_trip_within_their_step():
    """``quantize_q4`` / ``quantize_q4k`` / ``quantize_q6`` (``--quantization int4``, and a weight
    update of a GGUF model) keep each value within about half a step of its group,
    ``quantize_mxfp4`` gives gguf-py's MXFP4 values exactly, and ``requantize_like`` keeps every
    part's format."""
    w = torch.randn(48, 512)
    q4 = QuantTiles(quantize_q4(w), 48, 512).dequantize(torch.float32)
    groups = w.unflatten(1, (-1, 32))
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert ((q4 - w).unflatten(1, (-1, 32)).abs() <= step[..., None] * 0.51 + 1e-3).all()
    q4k_parts = quantize_q4k(w)
    assert part_format(q4k_parts) == "q4k" and sum(t.nbytes for t in q4k_parts) * 8 / w.numel() == 4.625
    q4k = QuantTiles(q4k_parts, 48, 512).dequantize(torch.float32)
    # the codes of a group's step and min are rounded up on a grid of 1/255 of their row's largest per 256
    low = groups.amin(-1).clamp(max=0)
    wide = (groups.amax(-1) - low) / 15
    grid = wide.unflatten(1, (-1, 8)).amax(-1, keepdim=True) / 255
    lift = (-low).unflatten(1, (-1, 8)).amax(-1, keepdim=True) / 255
    bound = ((wide.unflatten(1, (-1, 8)) + grid) * 0.51 + lift + 1e-3).flatten(1)
    assert ((q4k - w).unflatten(1, (-1, 32)).abs() <= bound[..., None]).all()
    q6 = QuantTiles(quantize_q6(w), 48, 512).dequantize(torch.float32)
    assert (q6 - w).abs().max() < 0.05 * w.abs().max()
    mx_parts = quantize_mxfp4(w)
    assert part_format(mx_parts) == "mxfp4" and sum(t.nbytes for t in mx_parts) * 8 / w.numel() == 4.25
    mx = QuantTiles(mx_parts, 48, 512).dequantize(torch.float32)
    blocks = gguf.quants.quantize(w.numpy(), T.MXFP4)  # gguf-py's own MXFP4, the reference
    assert torch.equal(mx, torch.from_numpy(gguf.dequantize(blocks, T.MXFP4)))
    mixed = QuantTiles(join_parts([quantize_q4(w[:16]), quantize_q4k(w[16:32]), quantize_mxfp4(w[32:])]), 48, 512)
    again = requantize_like(w * 2, mixed)
    assert [(t.shape, t.dtype) for t in again] == [(t.shape, t.dtype) for t in mixed.tensors]
    torch.testing.assert_close(QuantTiles(again, 48, 512).dequantize(torch.float32),
                               2 * torch.cat([q4[:16], q4k[16:32], mx[32:]]), rtol=0, atol=0.05 * w.abs().max().item())
    assert (q6 - w).abs().max() < 0.05 * w.abs().max()


@pytest.mark.parametrize("fmt", ["Q4_K", "int8"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_heads_multiply_their_own_matrix_of_the_stack(fmt, tokens):
    """``quant_heads`` (MLA's W_UK / W_UV): head h of x times the h-th matrix of a stack of 16-row
    tiles, equal to that matrix's own ``quant_linear``, for low-bit and int8 (Q8_0, Q5_0) stacks."""
    heads, rows, cols = 3, 32, 256
    if fmt == "int8":
        weight = quantize_int8(torch.randn(heads * rows, cols), 32)
        weight.scales = weight.scales.half().float()  # Q8_0's scales are float16
        stack = int8_part(weight)
        matrices = weight.dequantize(torch.float32).view(heads, rows, cols)
    else:
        stack, reference = packed(fmt, heads * rows, cols)
        matrices = reference.view(heads, rows, cols)
    x = torch.randn(tokens, heads, cols, generator=torch.Generator().manual_seed(tokens))
    out = kernel.quant_heads(x, stack, rows)
    assert out.shape == (tokens, heads, rows)
    for h in range(heads):
        expected = F.linear(quantize_activations(x[:, h]), matrices[h])
        torch.testing.assert_close(out[:, h], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
