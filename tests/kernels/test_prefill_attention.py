"""Prefill attention through kernels/prefill_attention.cpp (oneDNN's brgemm micro-kernel)
against float64 attention on the same inputs: GQA groups of 1 to 8, head dims 32 to 256,
one query to several key blocks, a chunk after cached context, sliding windows, strided
views of a fused qkv. It runs exactly where ``DeviceCaps.flash_prefill`` says (float32 on
an x86 CPU with AVX2 or AVX-512, bfloat16 where it is native); elsewhere the test asserts
that the model path is torch's SDPA and checks that path against the same numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyprefix import LLM, SamplingParams
from hyprefix.hardware import device_caps
from hyprefix.kernels import prefill_attention as kernel

CAPS = device_caps("cpu")


def _visible(q, k, q_pos0, k_pos0, window):
    """The kernel's visibility rule as a bool [T, S] mask."""
    qp = torch.arange(q_pos0, q_pos0 + q.shape[0])[:, None]
    kp = torch.arange(k_pos0, k_pos0 + k.shape[0])[None, :]
    mask = kp <= qp
    if window:
        mask &= kp > qp - window
    return mask


def _reference(q, k, v, scale, q_pos0, k_pos0, window):
    """float64 softmax attention with the kernel's visibility rule."""
    mask = _visible(q, k, q_pos0, k_pos0, window)
    group = q.shape[1] // k.shape[1]
    kk = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vv = v.double().transpose(0, 1).repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), kk, vv, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


def _sdpa(q, k, v, scale, q_pos0, k_pos0, window):
    """The model's fallback: torch's SDPA in q's dtype, as models/attention.py calls it."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=_visible(q, k, q_pos0, k_pos0, window), scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


# (tokens, heads, kv heads, head dim, keys, first query position, first key position, window)
CASES = [
    (1024, 16, 8, 128, 1024, 0, 0, 0),  # the Qwen3-0.6B shape, a whole 1,024-token prompt
    (37, 9, 3, 64, 37, 0, 0, 0),  # SmolLM2's heads; fewer tokens than one block
    (1, 2, 1, 16, 5, 4, 0, 0),  # one query after four cached tokens
    (100, 4, 1, 256, 300, 200, 0, 0),  # Gemma 3's head dim; a chunk after 200 cached tokens
    (300, 4, 4, 64, 300, 0, 0, 128),  # a window cut inside the chunk
    (50, 6, 2, 32, 177, 500, 350, 150),  # a windowed gather that starts at position 350
    (600, 8, 1, 64, 857, 257, 0, 0),  # odd key count over several key blocks, 8 heads a group
]


def _inputs(case, dtype, seed=0):
    t, h, kvh, d, s = case[:5]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    # k and v as views of one fused row, the way the model's qkv projection hands them over
    kv = torch.randn(s, 2 * kvh * d + 8, generator=g).to(dtype)
    k = kv[:, : kvh * d].view(s, kvh, d)
    v = kv[:, kvh * d: 2 * kvh * d].view(s, kvh, d)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_kernel_runs_where_caps_say(dtype):
    assert kernel.available(dtype) == CAPS.flash_prefill(dtype)
    if dtype == torch.float16:
        assert not kernel.available(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_float64_attention(case, dtype):
    q, k, v = _inputs(case, dtype)
    scale = case[3] ** -0.5
    args = (scale, case[5], case[6], case[7])
    expected = _reference(q, k, v, *args)
    if not kernel.available(dtype):
        assert not CAPS.flash_prefill(dtype)
        got = _sdpa(q, k, v, *args)  # what the model runs here instead
    else:
        got = kernel.prefill_attention(q, k, v, scale, case[5], case[6], case[7] or None)
    assert got.shape == q.shape and got.dtype == dtype
    err = (got.double() - expected).abs().max().item()
    if dtype == torch.float32:
        assert err < 1e-5
    else:  # bfloat16: the probabilities meet V in bfloat16, as in torch's flash kernel
        sdpa_err = (_sdpa(q, k, v, *args).double() - expected).abs().max().item()
        assert err < max(2 * sdpa_err, 1e-2)


@pytest.mark.parametrize("case", [c for c in CASES if c[4] > 5], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keys_read_through_a_block_table_give_the_gathered_numbers(case, dtype):
    """Paged keys (the cached prefix of a prefill, read in place through its block table) give
    exactly the numbers of the same keys gathered into one tensor first: the same packed
    operands. Blocks in scrambled order, the last one partly filled."""
    if not kernel.available(dtype):
        pytest.skip("the kernel does not run this dtype here")
    q, k, v = _inputs(case, dtype)
    keys, kvh, d = k.shape
    block_size = 16
    num_blocks = -(-keys // block_size)
    table = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(1))[:num_blocks]
    k_cache = torch.randn(num_blocks + 3, block_size, kvh, d).to(dtype)  # garbage beyond the keys
    v_cache = torch.randn(num_blocks + 3, block_size, kvh, d).to(dtype)
    padded = num_blocks * block_size - keys
    k_cache[table] = torch.cat([k, k_cache[table[-1], block_size - padded:]]).view(num_blocks, block_size, kvh, d)
    v_cache[table] = torch.cat([v, v_cache[table[-1], block_size - padded:]]).view(num_blocks, block_size, kvh, d)
    scale, args = d ** -0.5, (case[5], case[6], case[7] or None)
    gathered = kernel.prefill_attention(q, k, v, scale, *args)
    paged = kernel.prefill_attention(q, k_cache, v_cache, scale, *args, block_table=table, keys=keys)
    assert torch.equal(paged, gathered)


def test_fully_masked_rows_of_a_block_add_nothing():
    """Queries whose window ends before a key block starts: rows of zeros in P, the running
    max untouched; the same numbers as the reference."""
    case = (64, 2, 2, 64, 1024, 960, 0, 16)
    q, k, v = _inputs(case, torch.float32, seed=3)
    expected = _reference(q, k, v, 0.125, 960, 0, 16)
    got = kernel.prefill_attention(q, k, v, 0.125, 960, 0, 16) if kernel.available(torch.float32) \
        else _sdpa(q, k, v, 0.125, 960, 0, 16)
    assert (got.double() - expected).abs().max().item() < 1e-5


def test_model_prefill_uses_the_kernel_where_it_runs(monkeypatch, qwen3_dir):
    """models/attention.py sends prefill spans to the kernel exactly where it runs, and a
    chunked prefill (a chunk after cached context) gives the unchunked tokens."""
    calls = []
    real = kernel.prefill_attention
    monkeypatch.setattr(kernel, "prefill_attention", lambda *a: calls.append(a[4]) or real(*a))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(5, 85))
    outs = {}
    for budget in (2048, 32):
        llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=64, block_size=16, log_stats_interval=0,
                  max_num_batched_tokens=budget, enforce_eager=True)
        outs[budget] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[32] == outs[2048]
    if kernel.available(torch.float32):
        assert 0 in calls and 32 in calls  # first positions of a whole prompt and of a later chunk
    else:
        assert not calls


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[5]], ids=lambda c: "x".join(map(str, c)))
def test_sinks_join_every_softmax_once(case):
    """gpt-oss's sinks: a logit per query head in each row's softmax denominator, with keys after
    cached context and a window: equal to float64 attention with the sink as one more column of
    scores whose value row is zero; the same through the block table."""
    if not kernel.available(torch.float32):
        pytest.skip("the prefill attention kernel does not run here")
    q, k, v = _inputs(case, torch.float32, seed=3)
    scale, (q_pos0, k_pos0, window) = case[3] ** -0.5, case[5:8]
    sinks = torch.linspace(-1.0, 3.0, q.shape[1])
    mask = _visible(q, k, q_pos0, k_pos0, window)
    group = q.shape[1] // k.shape[1]
    kk = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vv = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = (q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    expected = (torch.softmax(scores, dim=-1)[..., :-1] @ vv).transpose(0, 1)
    got = kernel.prefill_attention(q, k, v, scale, q_pos0, k_pos0, window or None, sinks=sinks)
    assert (got.double() - expected).abs().max().item() < 1e-5
    assert (got - kernel.prefill_attention(q, k, v, scale, q_pos0, k_pos0, window or None)).abs().max() > 1e-3
    blocks = (k.shape[0] + 15) // 16
    k_cache = torch.zeros(blocks + 3, 16, *k.shape[1:])
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(blocks + 3)[:blocks]
    k_cache.view(-1, *k.shape[1:])[(table[:, None] * 16 + torch.arange(16)).flatten()[:k.shape[0]]] = k
    v_cache.view(-1, *k.shape[1:])[(table[:, None] * 16 + torch.arange(16)).flatten()[:k.shape[0]]] = v
    paged = kernel.prefill_attention(q, k_cache, v_cache, scale, q_pos0, k_pos0, window or None, table, k.shape[0],
                                     sinks)
    torch.testing.assert_close(paged, got, rtol=0, atol=0)
