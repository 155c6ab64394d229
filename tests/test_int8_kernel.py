"""The AVX512-VNNI int8 kernel (kernels/int8_linear.cpp) against plain torch: activations
quantized per 32 times the dequantized weight, for every shape the models give it (rows
that fill no whole tile, odd group counts, one to nine activation rows), float32 and
bfloat16 inputs, per-row and per-group scales. It runs exactly where the CPU has VNNI and
ATen may use AVX-512; elsewhere int8 weights keep the plain layout, and the same tests
check that layout's path against the same numbers."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import int8_linear as vnni
from hyprefix.models.quant import Int8Tiles, Int8Weight, quantize_activations, quantize_int8, set_int8_buffers

VNNI = device_caps("cpu").int8_vnni


def _for_this_cpu(w: Int8Weight) -> Int8Weight | Int8Tiles:
    """The layout int8 weights take here: the kernel's tiles with VNNI, else the plain one."""
    return Int8Tiles.pack(w) if VNNI else w


def _weight(n: int, k: int, per_group: bool, seed: int) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand((n, k // 32) if per_group else (n,), generator=g) + 0.01
    if per_group:  # Q8_0's scales are float16 values; the tiles keep them as float16
        scales = scales.half().float()
    return Int8Weight(q, scales)


def _expected(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return quantize_activations(x.float()).double() @ w.dequantize(torch.float64).T


def test_the_kernel_runs_where_the_cpu_has_vnni():
    assert vnni.available() == VNNI
    linear = torch.nn.Module()
    set_int8_buffers(linear, _weight(20, 64, True, 0))
    assert {"tiles", "scales"} <= set(linear._buffers) if VNNI else {"qweight", "scales"} <= set(linear._buffers)


@pytest.mark.parametrize("per_group", [True, False])
def test_pack_and_unpack_are_inverse(per_group):
    w = _weight(37, 96, per_group, 1)
    tiles, scales = vnni.pack(w.qweight, w.scales)
    assert tiles.dtype == torch.uint8 and tiles.shape == (3, 24, 16, 4)
    assert scales.shape == ((3, 3, 16) if per_group else (48,))
    qweight, back = vnni.unpack(tiles, scales, 37)
    assert torch.equal(qweight, w.qweight) and torch.equal(back, w.scales)


@pytest.mark.parametrize("n,k", [(16, 32), (37, 96), (577, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("per_group", [True, False])
def test_kernel_equals_quantized_activations_times_the_weight(n, k, rows, per_group):
    w = _weight(n, k, per_group, n * k + rows)
    tiled = _for_this_cpu(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0.0  # a group of zeros: scale 0
    out = tiled.matmul(x, None)
    expected = _expected(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    bias = torch.randn(n)
    assert torch.allclose(tiled.matmul(x, bias), out + bias, rtol=1e-5, atol=1e-5 * out.abs().max().item())
    bf16 = tiled.matmul(x.bfloat16(), None)
    expected_bf16 = _expected(x.bfloat16(), w)
    assert bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16.double(), expected_bf16, rtol=1e-2, atol=1e-2 * expected_bf16.abs().max().item())


def test_kernel_equals_the_plain_int8_path_and_runs_compiled():
    """This CPU's layout and the plain one compute the same numbers, eager and inside
    torch.compile (where the kernel is one extern call)."""
    w = quantize_int8(torch.randn(48, 128))
    tiled = _for_this_cpu(w)
    x = torch.randn(2, 3, 128)
    assert torch.allclose(tiled.matmul(x, None), w.matmul(x, None), atol=1e-4)
    compiled = torch.compile(lambda t: tiled.matmul(t, None) * 2, fullgraph=True)
    assert torch.allclose(compiled(x), 2 * tiled.matmul(x, None))
    assert torch.equal(tiled.plain().qweight, w.qweight)
