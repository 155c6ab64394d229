"""``hyprefix::packed_linear`` / ``packed_gate_up`` (kernels/packed_linear.cpp): oneDNN's
prepacked matmuls as ops a compiled batched decode step calls, against the eager calls and
plain torch, eager and compiled with a symbolic row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyprefix.hardware import device_caps
from hyprefix.kernels import packed_linear as ops
from hyprefix.models.layers import ACTIVATIONS
from hyprefix.models.weights import pack_weight, packed_gate_up, packed_linear

pytestmark = pytest.mark.skipif(not ops.available(), reason="the packed-linear ops did not build here")

DTYPES = [d for d in (torch.float32, torch.bfloat16) if device_caps("cpu").prepack(d)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_equal_onednn_eager_calls(dtype):
    torch.manual_seed(0)
    x, w, up, b = (torch.randn(s).to(dtype) for s in ((7, 64), (48, 64), (48, 64), (48,)))
    pw, pu = pack_weight(w), pack_weight(up)
    for bias in (None, b):
        ours = torch.ops.hyprefix.packed_linear(x, pw, bias)
        assert ours.shape == (7, 48) and torch.equal(ours, packed_linear(x, pw, bias))
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(ours.float(), F.linear(x.float(), w.float(), None if bias is None else bias.float()),
                              atol=tol, rtol=tol)
    for name, (act, epilogue) in ACTIVATIONS.items():
        ours = torch.ops.hyprefix.packed_gate_up(x, pw, pu, b, None, epilogue[0], epilogue[2])
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
        compiled = torch.compile(mlp, fullgraph=True, options={"cpp_wrapper": cpp_wrapper})
        for rows in (2, 5, 9):
            x = torch.randn(rows, 16)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            assert torch.allclose(compiled(x), mlp(x), atol=1e-5)
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(mlp)) == 1
