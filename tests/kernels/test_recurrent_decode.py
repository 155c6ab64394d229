"""The fused recurrent decode ops (``kernels/recurrent_decode``) against the mixers' eager decode
code: outputs, the live states they advance in place (conv windows and matrix states) and the
checkpoints tapped from them, over several steps, rows in any slot order, value heads sharing key
heads (Gated DeltaNet), a decay per key channel (Kimi Delta Attention), heads sharing groups
(Mamba2), dims that are not whole vectors, float32 and bfloat16 models, and bfloat16 matrix
states."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from hyprefix.kernels import recurrent_decode
from hyprefix.models.gated_deltanet import DeltaNetDims, GatedDeltaNet
from hyprefix.models.kimi_delta import KdaDims, KimiDeltaAttention
from hyprefix.models.mamba2 import Mamba2Mixer, MambaDims
from hyprefix.models.recurrent_state import RecurrentLayerState

pytestmark = pytest.mark.skipif(not recurrent_decode.available(), reason="the recurrent decode kernel runs on x86")

SLOTS = [4, 1, 3]  # live slots of the decode rows: not one ascending range
TAPS = [(1, 2), (2, 0)]  # (decode row, checkpoint slot)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = torch.randn(p.shape, generator=gen)
            if name == "A_log":
                values = torch.rand(p.shape, generator=gen) * 3 - 1  # decays from mild to strong
            elif name.startswith(("in_proj", "out_proj", "o_proj", "f_b", "g_b")):
                values = values * p.shape[-1] ** -0.5
            elif name == "conv1d_weight":
                values = values * 0.5
            p.copy_(values.to(p.dtype))


def _state(shape, dtype: torch.dtype, matrix_dtype: torch.dtype, seed: int) -> RecurrentLayerState:
    gen = torch.Generator().manual_seed(seed)
    state = RecurrentLayerState.allocate(shape, live=6, checkpoints=3, dtype=dtype, device=torch.device("cpu"))
    state.conv.copy_(torch.randn(state.conv.shape, generator=gen).to(dtype))
    state.matrix = (torch.randn(state.matrix.shape, generator=gen) * 0.3).to(matrix_dtype)
    state.ckpt_matrix = state.ckpt_matrix.to(matrix_dtype)
    return state


def _batch() -> SimpleNamespace:
    return SimpleNamespace(num_decode=len(SLOTS), prefills=[], decode_state_slots=torch.tensor(SLOTS),
                           decode_state_range=None, decode_state_taps=TAPS)


def _run(module, state, hidden: torch.Tensor, fused: bool, monkeypatch) -> list[torch.Tensor]:
    """Each step of ``hidden`` [steps, rows, hidden] through the mixer, by the fused op or the eager code."""
    calls = []
    with monkeypatch.context() as patch:
        if fused:
            for name in ("gdn_decode", "kda_decode", "mamba2_decode"):
                op = getattr(recurrent_decode, name)
                patch.setattr(recurrent_decode, name, lambda *a, op=op: calls.append(op) or op(*a))
        else:
            patch.setattr(recurrent_decode, "runs", lambda proj, matrix: False)
        with torch.inference_mode():
            out = [module(x, _batch(), state) for x in hidden]
    assert len(calls) == (len(hidden) if fused else 0)
    return out


def _mixers():
    gdn = DeltaNetDims(hidden=48, k_heads=2, v_heads=4, k_dim=24, v_dim=20, conv_kernel=4, eps=1e-6)
    mamba = MambaDims(hidden=48, heads=4, head_dim=12, groups=2, state=20, conv_kernel=4, chunk=64, eps=1e-5,
                      dt_min=0.001, dt_max=float("inf"), use_bias=False, conv_bias=True)
    kda = KdaDims(hidden=48, heads=3, head_dim=20, conv_kernel=4, eps=1e-5)
    return {
        "gdn": (lambda dtype: GatedDeltaNet(gdn, dtype, torch.device("cpu")), gdn.state_shape),
        "kda": (lambda dtype: KimiDeltaAttention(kda, dtype, torch.device("cpu")), kda.state_shape),
        "mamba2": (lambda dtype: Mamba2Mixer(mamba, dtype, torch.device("cpu")), mamba.state_shape),
        "mamba2-clamped-no-bias": (
            lambda dtype: Mamba2Mixer(MambaDims(**{**mamba.__dict__, "dt_max": 0.1, "conv_bias": False}), dtype,
                                      torch.device("cpu")), mamba.state_shape),
    }


@pytest.mark.parametrize("kind", list(_mixers()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_equals_the_eager_decode(kind, dtype, monkeypatch):
    make, shape = _mixers()[kind]
    module = make(dtype)
    _randomise(module, seed=1)
    hidden = torch.randn(3, len(SLOTS), module.d.hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    eager_state = _state(shape, dtype, torch.float32, seed=3)
    fused_state = copy.deepcopy(eager_state)
    untouched = fused_state.matrix[[0, 2, 5]].clone()
    expected = _run(module, eager_state, hidden, fused=False, monkeypatch=monkeypatch)
    got = _run(module, fused_state, hidden, fused=True, monkeypatch=monkeypatch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert g.dtype == dtype and g.shape == e.shape
        torch.testing.assert_close(g.float(), e.float(), rtol=tol, atol=tol * e.abs().max().item(),
                                   msg=lambda m, step=step: f"step {step}: {m}")
    torch.testing.assert_close(fused_state.conv, eager_state.conv, rtol=0, atol=0)  # the same inputs, shifted
    torch.testing.assert_close(fused_state.matrix, eager_state.matrix, rtol=tol, atol=tol)
    torch.testing.assert_close(fused_state.ckpt_matrix, eager_state.ckpt_matrix, rtol=tol, atol=tol)
    torch.testing.assert_close(fused_state.ckpt_conv, eager_state.ckpt_conv, rtol=0, atol=0)
    assert torch.equal(fused_state.matrix[[0, 2, 5]], untouched)  # slots no row decodes stay as they were


@pytest.mark.parametrize("kind", list(_mixers()))
def test_bfloat16_matrix_state_follows_the_float32_one(kind, monkeypatch):
    """A bfloat16 state is read as float32 and written back rounded: the same step as a float32
    state holding the same values, to bfloat16's precision."""
    make, shape = _mixers()[kind]
    module = make(torch.float32)
    _randomise(module, seed=4)
    hidden = torch.randn(1, len(SLOTS), module.d.hidden, generator=torch.Generator().manual_seed(5))
    bf16_state = _state(shape, torch.float32, torch.bfloat16, seed=6)
    f32_state = copy.deepcopy(bf16_state)
    f32_state.matrix = f32_state.matrix.float()
    got = _run(module, bf16_state, hidden, fused=True, monkeypatch=monkeypatch)[0]
    expected = _run(module, f32_state, hidden, fused=True, monkeypatch=monkeypatch)[0]
    assert bf16_state.matrix.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(bf16_state.matrix.float(), f32_state.matrix, rtol=1e-2, atol=1e-2)


def test_bad_inputs_are_refused():
    dims = DeltaNetDims(hidden=16, k_heads=1, v_heads=2, k_dim=8, v_dim=8, conv_kernel=4, eps=1e-6)
    module = GatedDeltaNet(dims, torch.float32, torch.device("cpu"))
    _randomise(module, seed=0)
    state = _state(dims.state_shape, torch.float32, torch.float32, seed=0)
    proj = torch.randn(2, dims.conv_dim + dims.value_dim + 2 * dims.v_heads)
    args = (module.conv1d_weight, state.matrix)
    params = (module.A_log, module.dt_bias, module.norm_weight, 1, 2, 8, 8, 1e-6)
    with pytest.raises(RuntimeError, match="out of range"):
        recurrent_decode.gdn_decode(proj, state.conv, args[0], args[1], torch.tensor([0, 6]), *params)
    with pytest.raises(RuntimeError, match="features"):
        recurrent_decode.gdn_decode(proj[:, 1:].contiguous(), state.conv, args[0], args[1], torch.tensor([0, 1]),
                                    *params)
    with pytest.raises(RuntimeError, match="conv_state"):
        recurrent_decode.gdn_decode(proj, state.conv.bfloat16(), args[0], args[1], torch.tensor([0, 1]), *params)
    kda = KdaDims(hidden=16, heads=2, head_dim=8, conv_kernel=4, eps=1e-6)
    mixer = KimiDeltaAttention(kda, torch.float32, torch.device("cpu"))
    _randomise(mixer, seed=0)
    kda_state = _state(kda.state_shape, torch.float32, torch.float32, seed=0)
    kda_proj, gates = torch.randn(2, sum(kda.proj_sizes)), torch.randn(2, kda.qkv_dim)
    with pytest.raises(RuntimeError, match="forget and gate"):  # one row short
        recurrent_decode.kda_decode(kda_proj, kda_state.conv, mixer.conv1d_weight, kda_state.matrix,
                                    torch.tensor([0, 1]), gates[:1], gates, mixer.A_log, mixer.dt_bias,
                                    mixer.norm_weight, 2, 8, 1e-6)
