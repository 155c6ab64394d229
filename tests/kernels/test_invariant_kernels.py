"""The batch-invariant mode's kernels on their own: ``invariant_linear`` and
``invariant_gated_act`` (kernels/invariant_linear.cpp), ``bf16_linear`` (which the mode uses for
bfloat16 where it runs), and ``decode_attention`` with fixed runs (``run_blocks``). A row computed
alone, in a batch, in another batch, on one thread or two gives the same bits (``torch.equal``),
and the values are close to float64 / torch's own. They run where ``DeviceCaps.vector_kernels``
says (an x86 CPU whose ATen ISA is AVX2 or AVX-512)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from hyprefix.hardware import device_caps
from hyprefix.kernels import bf16_linear, decode_attention
from hyprefix.kernels import invariant_linear as kernel
from tests.kernels.test_decode_attention import _reference

pytestmark = pytest.mark.skipif(not device_caps("cpu").vector_kernels,
                                reason="no x86 AVX2/AVX-512 CPU: the mode is refused there")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(37, 77), (64, 64), (300, 576)])  # K with and without a partial chunk
def test_linear_rows_alone_and_in_any_batch_are_the_same_bits(dtype, n, k):
    assert kernel.available()
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(70, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    with _threads(2):
        batch = kernel.invariant_linear(x, w, b)
        subset = kernel.invariant_linear(x[[69, 3, 40, 7, 12]], w, b)  # 5 rows: a partial register tile
    with _threads(1):
        alone = [kernel.invariant_linear(x[i:i + 1].clone(), w, b)[0] for i in range(x.shape[0])]
    assert batch.dtype == dtype and batch.shape == (70, n)
    assert all(torch.equal(row, batch[i]) for i, row in enumerate(alone))
    assert torch.equal(subset, batch[[69, 3, 40, 7, 12]])
    ref = F.linear(x.double(), w.double(), b.double())
    scale = ref.abs().max().item()
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # one rounding to 16 bits
    assert (batch.double() - ref).abs().max().item() < tol * scale
    assert torch.equal(kernel.invariant_linear(x.view(7, 10, k), w, None),  # leading dims, no bias
                       kernel.invariant_linear(x, w, None).view(7, 10, n))


@pytest.mark.skipif(not bf16_linear.available(), reason="the bf16 tile kernel needs native bf16 with AVX512-BF16")
def test_bf16_tiles_rows_are_the_same_bits_alone_and_in_a_batch():
    """The mode multiplies bfloat16 matrices with ``bf16_linear`` where it runs: its rows must be
    batch-invariant too (21 rows: passes of 8, 8 and 5 rows, against passes of 1; 5 rows: a
    partial pass; 4040 outputs, a partial tile: enough sums that a changed order shows after
    rounding to bf16; 1030 columns: an odd number of pairs)."""
    gen = torch.Generator().manual_seed(3)
    n = 4040
    x = torch.randn(21, 1030, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, 1030, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    tiles = bf16_linear.pack(w)
    with _threads(2):
        batch = bf16_linear.bf16_linear(x, tiles, n, b)
        subset = bf16_linear.bf16_linear(x[[20, 2, 9, 3, 11]], tiles, n, b)
    with _threads(1):
        alone = [bf16_linear.bf16_linear(x[i:i + 1].clone(), tiles, n, b)[0] for i in range(21)]
    assert all(torch.equal(row, batch[i]) for i, row in enumerate(alone))
    assert torch.equal(subset, batch[[20, 2, 9, 3, 11]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_is_per_element(dtype, activation):
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(40, 2 * 45, generator=gen) * 4).to(dtype)  # 45 columns: a partial vector a row
    out = kernel.invariant_gated_act(gate_up, activation)
    alone = [kernel.invariant_gated_act(gate_up[i:i + 1].clone(), activation)[0] for i in range(40)]
    assert all(torch.equal(row, out[i]) for i, row in enumerate(alone))
    gate, up = gate_up.double().split(45, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.double() - act * up).abs() / (1 + (act * up).abs())).max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 40])
def test_attention_with_fixed_runs_is_the_same_bits_per_row(dtype, window):
    """Rows of lengths 1 to 300 (block 16, runs of 2 blocks): each alone on one thread, in the
    batch on two (whole rows a task), in a batch of three (runs as tasks, merged after), and with
    its table starting a few blocks later (a window pool's table) gives the same bits, within
    float rounding of float64 attention."""
    assert decode_attention.available(dtype)
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, block, rows = 8, 2, 64, 16, 24
    lens = torch.randint(1, 300, (rows,), generator=gen)
    width = 300 // block + 1
    k_cache = torch.randn(rows * width, block, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(rows * width, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(rows * width, generator=gen).view(rows, width)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)

    def attend(idx, table=None, first=None):
        return decode_attention.decode_attention(q[idx], k_cache, v_cache, tables[idx] if table is None else table,
                                                 lens[idx], 0.125, window, first, run_blocks=2)

    with _threads(2):
        out, lse = attend(list(range(rows)))
        three = [attend([i, (i + 7) % rows, (i + 13) % rows])[0][0] for i in range(rows)]
    with _threads(1):
        alone = [attend([i]) for i in range(rows)]
    for i in range(rows):
        assert torch.equal(alone[i][0][0], out[i]) and torch.equal(alone[i][1][0], lse[i])
        assert torch.equal(three[i], out[i])
        if window:  # the blocks before the window left the table: it starts at `drop` blocks
            drop = max(0, int(lens[i]) - window) // block
            shifted, _ = attend([i], tables[i:i + 1, drop:].contiguous(), torch.tensor([drop * block]))
            assert torch.equal(shifted[0], out[i])
    ref, _ = _reference(q, k_cache, v_cache, tables, lens, None, 0.125, window)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max().item() < tol
