"""``hyprefix::decay_scores`` (the chunked scans' decay-weighted score matrix in one pass)
against its eager ops, where the fused op runs (x86, AVX2 or AVX-512)."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import decay_scores as kernel

pytestmark = pytest.mark.skipif(not device_caps("cpu").vector_kernels, reason="no AVX2 / AVX-512 on this CPU")


def test_the_fused_op_is_built_where_vector_kernels_run():
    assert kernel.available()


@pytest.mark.parametrize("heads,sources,q", [(48, 8, 128), (16, 16, 64), (6, 3, 37), (4, 4, 1), (4, 2, 17),
                                              (8, 1, 16), (2, 2, 33)])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_fused_scores_agree_with_the_eager_ops_and_are_zero_outside_the_mask(heads, sources, q, strict, scaled):
    gen = torch.Generator().manual_seed(heads * 1000 + q)
    cs = torch.cumsum(-torch.rand(heads, q, generator=gen) * 0.5, dim=-1)  # log decay: falls from 0
    scores = torch.randn(sources, q, q, generator=gen)
    scale = torch.rand(heads, q, generator=gen) if scaled else None
    got = torch.ops.hyprefix.decay_scores(cs, scores, scale, strict)
    want = kernel.eager_decay_scores(cs, scores, scale, strict)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    outside = ~torch.ones(q, q, dtype=torch.bool).tril(-1 if strict else 0)
    assert torch.count_nonzero(got[:, outside]) == 0
    head = heads - 1  # the last head reads the last source
    expect = scores[-1] * torch.exp(cs[head][:, None] - cs[head][None, :])
    if scaled:
        expect = scale[head][:, None] * expect
    torch.testing.assert_close(got[head][~outside], expect[~outside], rtol=2e-6, atol=1e-7)


def test_the_wrapper_takes_the_eager_ops_for_other_dtypes():
    cs = torch.cumsum(-torch.rand(2, 8, dtype=torch.float64), dim=-1)
    scores = torch.randn(2, 8, 8, dtype=torch.float64)
    got = kernel.decay_scores(cs, scores, strict=True)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, kernel.eager_decay_scores(cs, scores, strict=True))


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="Hs dividing H"):
        torch.ops.hyprefix.decay_scores(torch.zeros(6, 4), torch.zeros(4, 4, 4), None, False)
