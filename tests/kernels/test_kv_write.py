"""The 8-bit K/V write ops (``kernels/kv_write.cpp``) against the reference arithmetic of
``models/kv_quant.py``, bit for bit: int8 and E4M3, float32 and bfloat16 rows, head dims with
whole vectors (64, 576) and a partial one (76), rows of zeros, outliers and values at half a
code step; ``kv_write_8bit_stored``'s read-back equal to ``kv_quant.as_stored``, for rows it
writes and rows ``index`` leaves out (whose slots stay untouched); one thread and two; refusals."""

from __future__ import annotations

import pytest
import torch

from hyprefix.kernels import kv_write
from hyprefix.models import kv_quant
from tests.support.compare import with_threads

pytestmark = pytest.mark.skipif(not kv_write.available(), reason="the 8-bit write op does not build here")

FORMATS = [torch.int8, torch.float8_e4m3fn]


def _rows(tokens: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens * 1000 + dim)
    x = torch.randn(tokens, heads, dim, generator=gen) * torch.rand(tokens, heads, 1, generator=gen) * 8
    x[0, 0] = 0.0  # a row of zeros: scale 0, codes 0
    x[1, 0, 3] = 900.0  # an outlier sets its row's scale
    x[2, 0, :] = torch.arange(dim) * 0.5 - dim / 4  # half steps: the rounding's ties
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 64), (torch.float32, 76), (torch.bfloat16, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_codes_and_read_back_match_the_reference_bit_for_bit(fmt, dtype, dim, threads):
    tokens, heads, block = 40, 3, 16
    rows = _rows(tokens, heads, dim, dtype)
    slots = torch.randperm(5 * block)[:tokens]
    expected = kv_quant.quantize_rows(rows, fmt).view(torch.uint8)
    cache, again = (torch.zeros(5, block, heads, dim + 2, dtype=fmt) for _ in range(2))
    with_threads(threads, lambda: kv_write.kv_write_8bit(rows, cache, slots))
    flat = cache.view(-1, heads, dim + 2).view(torch.uint8)
    assert torch.equal(flat[slots], expected)
    back = with_threads(threads, lambda: kv_write.kv_write_8bit_stored(rows, again, slots))
    assert torch.equal(again.view(torch.uint8), cache.view(torch.uint8))
    assert back.dtype == torch.float32
    assert torch.equal(back, kv_quant.as_stored(rows, fmt, torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_index_writes_its_rows_and_reads_back_every_row(fmt):
    tokens, heads, dim, block = 12, 2, 64, 8
    rows = _rows(tokens, heads, dim, torch.float32)
    index = torch.tensor([1, 4, 5, 11])
    slots = torch.tensor([3, 9, 10, 0])
    cache = torch.full((2, block, heads, dim + 2), 7, dtype=torch.uint8).view(fmt)
    back = kv_write.kv_write_8bit_stored(rows, cache, slots, index)
    assert torch.equal(back, kv_quant.as_stored(rows, fmt, torch.float32))
    flat = cache.view(-1, heads, dim + 2).view(torch.uint8)
    assert torch.equal(flat[slots], kv_quant.quantize_rows(rows[index], fmt).view(torch.uint8))
    untouched = torch.ones(2 * block, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[untouched] == 7).all()


def test_bad_inputs_raise_not_crash():
    rows, cache = torch.randn(4, 2, 64), torch.zeros(2, 8, 2, 66, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kv_write.kv_write_8bit(rows, cache, torch.tensor([0, 1, 2, 16]))
    with pytest.raises(RuntimeError, match="outside the rows"):
        kv_write.kv_write_8bit_stored(rows, cache, torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="one per row written"):
        kv_write.kv_write_8bit(rows, cache, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="D \\+ 2 wide"):
        kv_write.kv_write_8bit(rows, torch.zeros(2, 8, 2, 64, dtype=torch.int8), torch.arange(4))
