"""The int8 kernel (kernels/int8_linear.cpp, its AVX512-VNNI or AVX2 build) against plain
torch: activations quantized per 32 times the dequantized weight, for every shape the
models give it (rows that fill no whole tile, odd group counts, one to nine activation
rows), float32 and bfloat16 inputs, per-row and per-group scales, and the extreme int8
values (no int16 pair of the AVX2 product may saturate). It runs exactly where
``DeviceCaps.int8_isa`` names a build (run the suite under ``ATEN_CPU_CAPABILITY=avx2`` for
the AVX2 one); elsewhere int8 weights keep the plain layout, and the same tests check that
layout's path against the same numbers."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import int8_linear as kernel
from hyprefix.models.quant import Int8Tiles, Int8Weight, quantize_activations, quantize_int8
from hyprefix.models.weights import MatrixForms

KERNEL = bool(device_caps("cpu").int8_isa)


def _for_this_cpu(w: Int8Weight) -> Int8Weight | Int8Tiles:
    """The layout int8 weights take here: the kernel's tiles where it runs, else the plain one."""
    return Int8Tiles.pack(w) if KERNEL else w


def _weight(n: int, k: int, per_group: bool, seed: int) -> Int8Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand((n, k // 32) if per_group else (n,), generator=g) + 0.01
    if per_group:  # Q8_0's scales are float16 values; the tiles keep them as float16
        scales = scales.half().float()
    return Int8Weight(q, scales)


def _expected(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return quantize_activations(x.float()).double() @ w.dequantize(torch.float64).T


def test_the_kernel_runs_where_the_cpu_has_a_build():
    assert kernel.available() == KERNEL
    forms = MatrixForms(20, 64)
    forms.use_int8(_weight(20, 64, True, 0))
    assert {"tiles", "scales"} <= set(forms._buffers) if KERNEL else {"qweight", "scales"} <= set(forms._buffers)
    assert isinstance(forms.int8, Int8Tiles if KERNEL else Int8Weight)


@pytest.mark.parametrize("per_group", [True, False])
def test_pack_and_unpack_are_inverse(per_group):
    w = _weight(37, 96, per_group, 1)
    tiles, scales = kernel.pack(w.qweight, w.scales)
    assert tiles.dtype == torch.uint8 and tiles.shape == (3, 24, 16, 4)
    assert scales.shape == ((3, 3, 16) if per_group else (48,))
    qweight, back = kernel.unpack(tiles, scales, 37)
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


@pytest.mark.parametrize("per_group", [True, False])
def test_extreme_values_do_not_saturate(per_group):
    """Weights of -128, -127 and 127 against activations at +-127 of the same sign: every pair
    of products at its largest magnitude (AVX2 sums pairs in int16 before widening). The
    AVX2 tiles hold a -128 as -127 (their sign flip would wrap); VNNI's keep it."""
    n, k = 32, 96
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[::2] = -128
    q[:, 1::7] = -127
    w = Int8Weight(q, torch.ones((n, k // 32) if per_group else (n,)))
    held = _for_this_cpu(w)
    clamped = KERNEL and kernel.signed_tiles()
    assert torch.equal(held.plain().qweight, q.clamp(min=-127) if clamped else q)
    x = torch.full((3, k), 2.5)
    x[1] = -2.5
    x[2, ::3] = -1.0
    out = held.matmul(x, None)
    assert torch.allclose(out.double(), _expected(x, held.plain()), rtol=1e-6)


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
