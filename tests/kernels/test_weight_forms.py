"""``MatrixForms`` (models/weights.py): each form of one matrix multiplies to the plain
matrix's product, the eager choice of form, the accounting, and the shape check."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.models.layers import Linear
from hyprefix.models.quant import Int8Tiles, quantize_activations, quantize_int8
from hyprefix.models.weights import MatrixForms


def _linear(dtype: torch.dtype, pack_halves: bool = False) -> Linear:
    torch.manual_seed(0)
    linear = Linear(64, 48, bias=True, dtype=dtype, device=torch.device("cpu"), pack_halves=pack_halves)
    linear.requires_grad_(False)
    linear.weight.normal_(0, 0.2)
    linear.bias.normal_(0, 0.2)
    return linear


def test_packed_form_multiplies_as_the_plain_weight_and_replaces_it_for_eager_steps():
    linear = _linear(torch.float32)
    x = torch.randn(5, 64)
    reference = torch.nn.functional.linear(x, linear.weight, linear.bias)
    linear.pack(keep_plain=False)
    packs = device_caps("cpu").prepack(torch.float32)
    assert (linear.forms.packed is not None) is packs
    assert (linear.weight.numel() == 0) is packs  # the packed copy replaces the plain weight
    assert linear.forms.batched_kernel == ("packed" if packs else None)
    torch.testing.assert_close(linear(x), reference, rtol=1e-5, atol=1e-5)
    expected_extra = 64 * 48 * 4 if packs else 0
    assert linear.forms.memory_bytes(torch.float32) == expected_extra


def test_keep_plain_keeps_the_float32_weight_beside_the_packed_copy():
    linear = _linear(torch.float32)
    linear.pack(keep_plain=True)
    assert linear.weight.numel() == 64 * 48 and linear.forms.bf16 is None
    assert linear.forms.graph_weight(linear.weight) is linear.weight


def test_halves_are_packed_for_their_owner_not_as_one_matrix():
    linear = _linear(torch.float32, pack_halves=True)
    linear.pack(keep_plain=True)
    assert linear.forms.packed is None
    assert (linear.forms.packed_halves is not None) is device_caps("cpu").prepack(torch.float32)


def test_int8_form_replaces_the_float_one_and_drops_a_packed_copy():
    linear = _linear(torch.float32)
    linear.pack(keep_plain=True)
    weight = quantize_int8(linear.weight)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(quantize_activations(x), weight.dequantize(torch.float32), linear.bias)
    linear.use_int8(weight)
    assert linear.forms.packed is None and linear.weight.numel() == 0
    assert linear.forms.decode_bytes(torch.float32) == linear.forms.int8.nbytes < 64 * 48 * 4
    assert (linear.forms.batched_kernel == "int8_tiles") is isinstance(linear.forms.int8, Int8Tiles)
    torch.testing.assert_close(linear(x), expected, rtol=1e-4, atol=1e-4)
    linear.pack(keep_plain=False)  # packing after int8 adds nothing
    assert linear.forms.packed is None


def test_an_int8_weight_of_another_shape_is_refused():
    forms = MatrixForms(48, 64)
    with pytest.raises(ValueError, match="48 x 64"):
        forms.use_int8(quantize_int8(torch.randn(64, 48)))


@pytest.mark.parametrize("form", ["packed", "halves", "int8", "int8 groups", "bf16 tiles", "fp32 head"])
def test_refresh_writes_new_values_into_the_same_tensors(form):
    """A weight update recomputes each form from the new matrix, into the tensors compiled
    steps and kernels already hold: the product is the new matrix's, the storage unchanged."""
    dtype = torch.bfloat16 if form in ("bf16 tiles", "fp32 head") else torch.float32
    linear = _linear(dtype, pack_halves=form == "halves")
    if form.startswith("int8"):
        linear.use_int8(quantize_int8(linear.weight, 32 if form == "int8 groups" else None))
    elif form == "fp32 head":
        linear.forms.use_fp32(linear.weight)
    else:
        linear.pack(keep_plain=form == "bf16 tiles")
    tensors = [*linear.forms._buffers.values(), linear.forms.packed, *(linear.forms.packed_halves or ())]
    tensors = [t for t in tensors if t is not None]
    fresh = torch.randn(48, 64, dtype=dtype) * 0.2
    linear.forms.refresh(fresh)
    if linear.weight.numel():
        linear.weight.copy_(fresh)
    now = [*linear.forms._buffers.values(), linear.forms.packed, *(linear.forms.packed_halves or ())]
    assert [id(t) for t in now if t is not None] == [id(t) for t in tensors]
    x = torch.randn(4, 64, dtype=dtype)
    if form.startswith("int8"):
        group = linear.forms.int8.group
        assert group == (32 if form == "int8 groups" else None)
        expected = torch.nn.functional.linear(quantize_activations(x),
                                              quantize_int8(fresh, group).dequantize(dtype), linear.bias)
    else:
        expected = torch.nn.functional.linear(x, fresh, linear.bias)
    if form == "halves" and linear.forms.packed_halves is not None:  # the owner multiplies the halves
        got = torch.cat([torch.ops.mkldnn._linear_pointwise(x, half, bias, "none", [], "")
                         for half, bias in zip(linear.forms.packed_halves, linear.bias.split(24), strict=True)], -1)
    elif form == "bf16 tiles" and linear.forms.bf16 is not None:  # where the bf16 kernel runs
        got = linear.forms.bf16.matmul(x, linear.bias)
    elif form == "fp32 head":
        got = torch.nn.functional.linear(x, linear.forms.fp32.to(dtype), linear.bias)
    else:
        got = linear(x)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3 if form.startswith("int8") else 1e-4
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="shape"):
        linear.forms.refresh(torch.zeros(3, 3, dtype=dtype))


def test_eager_tiles_serve_decode_sized_batches_and_the_packed_copy_the_rest(monkeypatch):
    """``eager_tiles`` (models that decode eagerly: hybrids): bf16 tiles beside the packed copy, no
    plain weight; an eager matmul of up to EAGER_TILE_ROWS rows multiplies the tiles (the bf16
    kernel), a larger one the packed copy; float32 matrices get no tiles."""
    from hyprefix.kernels import bf16_linear as bf16_kernel
    from hyprefix.models import weights

    linear = _linear(torch.bfloat16)
    plain = linear.weight.detach().clone()
    linear.pack(eager_tiles=True)
    if not (bf16_kernel.available() and device_caps("cpu").prepack(torch.bfloat16)):
        assert not linear.forms.eager_tiles
        return
    assert linear.forms.eager_tiles and linear.forms.bf16 is not None and linear.weight.numel() == 0
    assert linear.forms.memory_bytes(torch.bfloat16) == 2 * 64 * 48 * 2  # tiles + the packed copy
    kernel_rows = []
    real = bf16_kernel.bf16_linear
    monkeypatch.setattr(weights.bf16_kernel, "bf16_linear",
                        lambda x, *a: kernel_rows.append(x.shape[0]) or real(x, *a))
    for rows in (1, weights.EAGER_TILE_ROWS, weights.EAGER_TILE_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        expected = torch.nn.functional.linear(x.float(), plain.float(), linear.bias.float())
        torch.testing.assert_close(linear(x).float(), expected, rtol=2e-2, atol=2e-2)
    assert kernel_rows == [1, weights.EAGER_TILE_ROWS]
    f32 = _linear(torch.float32)
    f32.pack(eager_tiles=True)
    assert not f32.forms.eager_tiles and f32.forms.bf16 is None
