"""``hyprefix::packed_linear`` / ``packed_gate_up`` (kernels/packed_linear.cpp): oneDNN's
prepacked matmuls as ops a compiled batched decode step calls, against the eager calls and
plain torch, eager and compiled with a symbolic row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyprefix.hardware import device_caps
from hyprefix.kernels import bf16_linear as bf16_kernel
from hyprefix.kernels import packed_linear as ops
from hyprefix.models.layers import ACTIVATIONS
from hyprefix.models.linear_methods import packed_gate_up, packed_linear
from hyprefix.models.weights import pack_weight
from hyprefix.runner.decode_graph import _KERNEL_SOURCES_KEY

pytestmark = pytest.mark.skipif(not ops.available(), reason="the packed-linear ops did not build here")

# Inductor's on-disk cache keyed by the kernels' sources, as the engine's graphs are: a graph compiled
# against another build's op schema must not be loaded.
SOURCES_KEY = {"post_grad_custom_post_pass": _KERNEL_SOURCES_KEY}

DTYPES = [d for d in (torch.float32, torch.bfloat16) if device_caps("cpu").prepack(d)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_equal_onednn_eager_calls(dtype):
    torch.manual_seed(0)
    x, w, up, b = (torch.randn(s).to(dtype) for s in ((7, 64), (48, 64), (48, 64), (48,)))
    pw, pu = pack_weight(w), pack_weight(up)
    for bias in (None, b):
        ours = torch.ops.hyprefix.packed_linear(x, pw, bias, None, 0)
        assert ours.shape == (7, 48) and torch.equal(ours, packed_linear(x, pw, bias))
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(ours.float(), F.linear(x.float(), w.float(), None if bias is None else bias.float()),
                              atol=tol, rtol=tol)
    for name, (act, epilogue) in ACTIVATIONS.items():
        ours = torch.ops.hyprefix.packed_gate_up(x, pw, pu, b, None, epilogue[0], epilogue[2], None, 0)
        assert torch.equal(ours, packed_gate_up(x, pw, pu, b, None, epilogue)), name
        want = act(F.linear(x.float(), w.float(), b.float())) * F.linear(x.float(), up.float())
        assert torch.allclose(ours.float(), want, atol=1e-3 if dtype == torch.float32 else 0.1, rtol=2e-2), name


def test_compiled_with_a_symbolic_row_count():
    """Inside a compiled function the layers call the ops (extern kernels): one graph serves
    2, 5 and 9 rows, with the Python and the C++ wrapper."""
    torch.manual_seed(1)
    w, up = torch.randn(32, 16), torch.randn(32, 16)
    pw, pu = pack_weight(w), pack_weight(up)
    epilogue = ACTIVATIONS["silu"][1]

    def mlp(x):
        return packed_linear(packed_gate_up(x, pw, pu, None, None, epilogue), pack_weight_t, None) + 1

    pack_weight_t = pack_weight(torch.randn(16, 32))
    for cpp_wrapper in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(mlp, fullgraph=True, options={"cpp_wrapper": cpp_wrapper, **SOURCES_KEY})
        for rows in (2, 5, 9):
            x = torch.randn(rows, 16)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            assert torch.allclose(compiled(x), mlp(x), atol=1e-5)
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(mlp)) == 1


@pytest.mark.skipif(not (device_caps("cpu").prepack(torch.bfloat16) and bf16_kernel.available()),
                    reason="no prepacked bf16 or no bf16 tile kernel here")
def test_up_to_tile_rows_the_ops_multiply_the_tiles():
    """Given a bf16 matrix's tiles, a call of at most ``tile_rows`` rows is the tile kernel's
    (bit for bit), a larger one oneDNN's; compiled with a symbolic row count, each call picks
    by its own rows (the C++ wrapper passes every argument)."""
    torch.manual_seed(2)
    w, up, down = (torch.randn(s).to(torch.bfloat16) for s in ((40, 64), (40, 64), (64, 40)))
    b = torch.randn(40).to(torch.bfloat16)
    pw, pu, pd = pack_weight(w), pack_weight(up), pack_weight(down)
    tiles, gate_up_tiles, down_tiles = bf16_kernel.pack(w), bf16_kernel.pack(torch.cat([w, up])), bf16_kernel.pack(down)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        tiled = rows <= 4
        for bias in (None, b):
            ours = torch.ops.hyprefix.packed_linear(x, pw, bias, tiles, 4)
            want = bf16_kernel.bf16_linear(x, tiles, 40, bias) if tiled else packed_linear(x, pw, bias)
            assert torch.equal(ours, want), (rows, bias is None)
        for name, (act, epilogue) in ACTIVATIONS.items():
            ours = torch.ops.hyprefix.packed_gate_up(x, pw, pu, b, b, epilogue[0], epilogue[2], gate_up_tiles, 4)
            if tiled:
                gate, upped = bf16_kernel.bf16_linear(x, gate_up_tiles, 80, torch.cat([b, b])).split(40, dim=-1)
                want = act(gate) * upped
            else:
                want = packed_gate_up(x, pw, pu, b, b, epilogue)
            assert torch.equal(ours, want), (rows, name)

    def mlp(x):
        h = torch.ops.hyprefix.packed_gate_up(x, pw, pu, None, None, "swish", "", gate_up_tiles, 4)
        return torch.ops.hyprefix.packed_linear(h, pd, None, down_tiles, 4) + 1

    compiled = torch.compile(mlp, fullgraph=True, options={"cpp_wrapper": True, **SOURCES_KEY})
    torch._dynamo.reset()
    for rows in (2, 4, 5, 9):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        assert torch.equal(compiled(x), mlp(x)), rows
