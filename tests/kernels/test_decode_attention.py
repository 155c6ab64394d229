"""Decode attention through kernels/decode_attention.cpp against float64 attention over the
same blocks: head dims with a register path (64, 128, 256) and without (48, 80), GQA groups
of 1 to 7 (more than one pass of query heads), rows of different lengths and an empty one,
sliding windows, a first position (cascade tails, window pools), one thread and two, float32,
bfloat16 and float16. It runs where ``DeviceCaps.paged_decode`` says (an x86 CPU whose ATen
ISA is AVX2 or AVX-512); elsewhere the test asserts the model takes the gather + SDPA path."""

from __future__ import annotations

import pytest
import torch

from hyprefix.hardware import device_caps
from hyprefix.kernels import decode_attention as kernel

CAPS = device_caps("cpu")
BLOCK = 16


def _reference(q, k_cache, v_cache, tables, context_lens, first_pos, scale, window):
    """float64 attention of each row over its table's slots, the kernel's visibility rule."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for b in range(rows):
        k = k_cache[tables[b]].reshape(-1, kv_heads, dim).double()
        v = v_cache[tables[b]].reshape(-1, kv_heads, dim).double()
        pos = torch.arange(k.shape[0]) + (0 if first_pos is None else int(first_pos[b]))
        seen = pos < context_lens[b]
        if window:
            seen &= pos >= context_lens[b] - window
        if not seen.any():
            continue
        group = heads // kv_heads
        k = k[seen].repeat_interleave(group, 1)
        v = v[seen].repeat_interleave(group, 1)
        scores = torch.einsum("hd,jhd->hj", q[b].double(), k) * scale
        out[b] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v)
        lse[b] = scores.logsumexp(-1)
    return out, lse


# (heads, kv heads, head dim, context lengths, first positions or None, window)
CASES = [
    (9, 3, 64, [200], None, 0),  # SmolLM2's heads, one row
    (16, 8, 128, [1, 77, 300], None, 0),  # Qwen3-0.6B's heads; rows of different lengths
    (4, 1, 256, [40, 500], None, 0),  # Gemma 3's head dim, 4 query heads a KV head
    (7, 1, 64, [130], None, 0),  # 7 query heads a KV head: two passes (4 + 3)
    (10, 2, 128, [0, 33], None, 0),  # an empty row: zeros and a log-sum-exp of -inf
    (6, 2, 48, [5, 260], None, 0),  # a head dim without a register path
    (8, 1, 80, [99], None, 0),
    (4, 4, 64, [300, 18], None, 64),  # a sliding window that cuts the first row
    (9, 3, 64, [300, 45], [37, 0], 0),  # tails: the table starts at position 37 / 0
    (4, 2, 64, [400], [250], 100),  # a window pool: the table starts at 250, the window at 300
]


def _inputs(case, dtype, seed=0):
    heads, kv_heads, dim, lens, first, window = case
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-(n - (first[i] if first else 0)) // BLOCK) for i, n in enumerate(lens)) + 1)
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    first_pos = torch.tensor(first) if first else None
    return q, k_cache, v_cache, tables, torch.tensor(lens), first_pos, window


@pytest.mark.skipif(not CAPS.paged_decode(torch.float32), reason="no x86 AVX2/AVX-512 CPU: covered below")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_matches_float64(case, dtype, threads):
    assert kernel.available(dtype)
    q, k_cache, v_cache, tables, lens, first_pos, window = _inputs(case, dtype)
    scale = q.shape[-1] ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = kernel.decode_attention(q, k_cache, v_cache, tables, lens, scale, window, first_pos)
    finally:
        torch.set_num_threads(before)
    ref, ref_lse = _reference(q, k_cache, v_cache, tables, lens, first_pos, scale, window)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    tol = 2e-6 if dtype == torch.float32 else 2e-2  # 16-bit inputs, float32 arithmetic, 16-bit output
    assert (out.double() - ref).abs().max().item() < tol
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (lse.double()[~empty] - ref_lse[~empty]).abs().max().item() < 1e-4
    assert not out[empty[:, 0]].any()


@pytest.mark.skipif(not CAPS.paged_decode(torch.float32), reason="no x86 AVX2/AVX-512 CPU")
def test_a_long_context_splits_into_runs_that_merge_exactly():
    """Two threads split a 2,000-token row into runs merged by their log-sum-exp: the result
    equals one thread's single pass (float32, to rounding)."""
    q, k_cache, v_cache, tables, lens, _, _ = _inputs((16, 8, 128, [2000], None, 0), torch.float32, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
        torch.set_num_threads(2)
        split = kernel.decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    finally:
        torch.set_num_threads(before)
    assert (one[0] - split[0]).abs().max().item() < 1e-6
    assert (one[1] - split[1]).abs().max().item() < 1e-5


@pytest.mark.skipif(not CAPS.paged_decode(torch.float32), reason="no x86 AVX2/AVX-512 CPU")
def test_bad_inputs_raise_not_crash():
    q, k_cache, v_cache, tables, lens, _, _ = _inputs(CASES[0], torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.decode_attention(q.double(), k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.decode_attention(q, k_cache, v_cache, tables.int(), lens, 0.1)
    with pytest.raises(RuntimeError, match="head"):
        kernel.decode_attention(q[:, :, :32], k_cache, v_cache, tables, lens, 0.1)


@pytest.mark.skipif(CAPS.paged_decode(torch.float32), reason="the kernel runs here: covered above")
def test_without_the_kernel_decode_gathers_for_sdpa():
    assert not kernel.available(torch.float32)


@pytest.mark.skipif(not CAPS.paged_decode(torch.float32), reason="no x86 AVX2/AVX-512 CPU")
def test_a_model_step_reads_the_same_through_the_kernel_and_the_gather(tiny_models, monkeypatch):
    """An eager decode step of 4 rows (lengths 1 to 70, block 16) through the kernel and through
    the gathered SDPA path: the same logits."""
    from hyprefix import LLM
    from tests.kernels.test_decode_graph import _decode_batch
    from tests.support.compare import random_prompts

    llm = LLM(str(tiny_models["qwen3"][0]), dtype="float32", num_kv_blocks=64, block_size=BLOCK)
    runner = llm.engine.runner
    batch = _decode_batch(llm, random_prompts((1, 16, 33, 70), seed=3))
    for layer in runner.kv_caches:  # random K/V in place of a prefill's
        for cache in layer:
            cache.normal_()

    def logits(in_place: bool) -> torch.Tensor:
        monkeypatch.setitem(kernel._runs, torch.float32, in_place)
        caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        with torch.inference_mode():
            return runner.model.compute_logits(runner.model(batch, caches, None)[batch.logits_indices])

    assert (logits(True) - logits(False)).abs().max().item() < 1e-4
