"""``--kv-cache-dtype int8 | fp8_e4m3`` end to end on tiny models: the 8-bit cache holds about
twice the blocks of a bfloat16 one in the same budget, prefix hits and chunked prefills change its
greedy tokens only at near ties (every attention reads the K/V as stored), its logprobs stay
near the model-dtype cache's, its blocks carry their format in their
identity (memory and disk), and what cannot read it is refused at start."""

from __future__ import annotations

import pytest
import torch

from hyprefix import LLM, SamplingParams
from hyprefix.models import kv_quant
from tests.engine.test_prefix_cache_engine import mixed_prompts
from tests.support.compare import (
    assert_first_step_near,
    assert_same_up_to_a_near_tie,
    generate_in_waves,
    random_prompts,
)
from tests.support.models import TINY_CASCADE

FORMATS = ("int8", "fp8_e4m3")


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_blocks_per_gib_and_identity(qwen3_dir, kv_cache_dtype):
    """The same budget holds ~2x the blocks of bfloat16 (D + 2 bytes a row against 2D), the K/V
    tensors are the 8-bit format, and the identity every block hash chains from names it."""
    kwargs = dict(dtype="bfloat16", kv_cache_memory_gb=0.01, log_stats_interval=0)
    plain, packed = LLM(str(qwen3_dir), **kwargs), LLM(str(qwen3_dir), kv_cache_dtype=kv_cache_dtype, **kwargs)
    head_dim = plain.engine.runner.model.kv_layout.head_dim
    ratio = packed.engine.max_pool_tokens / plain.engine.max_pool_tokens
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 2), rel=0.02)
    k_cache = packed.engine.runner.kv_caches[0][0]
    assert k_cache.dtype == kv_quant.STORAGE[kv_cache_dtype] and k_cache.shape[-1] == head_dim + 2
    facts = packed.engine.model_facts
    assert facts.kv_cache_dtype == kv_cache_dtype
    assert facts.kv_bytes_per_token * head_dim * 2 == pytest.approx(plain.engine.model_facts.kv_bytes_per_token
                                                                    * (head_dim + 2))
    assert packed.engine.model_identity == f"{plain.engine.model_identity}|kv={kv_cache_dtype}/{kv_quant.FORMAT}"
    stats, plain_stats = packed.get_stats(), plain.get_stats()
    for key in ("kv_blocks_per_gib", "kv_tokens_per_gib"):
        assert stats[key] / plain_stats[key] == pytest.approx(2 * head_dim / (head_dim + 2))


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_hits_and_chunking_change_nothing_but_near_ties(qwen3_dir, kv_cache_dtype):
    """Prefix hits and chunked prefills read the same stored codes as one whole prefill, but a
    chunk's matmuls round differently in the last bit (as with any cache: the float32 K differs
    bitwise here too), and a code can then flip; so the greedy tokens are the cache-off
    engine's up to a near tie: where they first part, the reference's top two were within
    NEAR_TIE, and until then every chosen token's logprob is within NEAR_TIE of the reference's.
    A hit that read a wrong block, or a chunk a wrong row, is far outside that."""
    near_tie = 0.02
    prompts = mixed_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="float32", num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype, log_stats_interval=0,
                  **TINY_CASCADE)

    reference = generate_in_waves(LLM(str(qwen3_dir), enable_prefix_caching=False, **kwargs), prompts, params, 1)
    for waves, budget in ((3, 24), (1, 7), (3, 2048)):
        llm = LLM(str(qwen3_dir), max_num_batched_tokens=budget, **kwargs)
        for ref, got in zip(reference, generate_in_waves(llm, prompts, params, waves), strict=True):
            assert_same_up_to_a_near_tie(ref, got, near_tie)
        assert llm.get_stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_logprobs_near_the_model_dtype_cache(qwen3_dir, kv_cache_dtype):
    """Teacher-forced: each prompt's next-token distribution with the 8-bit cache against the
    float32 cache's, by KL divergence over the returned top logprobs (a bound loose enough for a
    random tiny model, tight enough to catch a wrong scale or a misread row)."""
    prompts = random_prompts([40, 70, 100], seed=5)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    outs = {}
    for fmt in ("auto", kv_cache_dtype):
        llm = LLM(str(qwen3_dir), dtype="float32", kv_cache_dtype=fmt, log_stats_interval=0)
        outs[fmt] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for ref, got in zip(outs["auto"], outs[kv_cache_dtype], strict=True):
        assert_first_step_near(ref, got)


@pytest.mark.batched_graphs
def test_8bit_decode_steps_run_compiled(qwen3_dir):
    """Batch-1 and batched decode steps with an 8-bit cache run as compiled graphs (the write op and
    the rotation inside them), none eagerly."""
    llm = LLM(str(qwen3_dir), dtype="float32", kv_cache_dtype="int8", log_stats_interval=0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(random_prompts([30], seed=8), params, use_tqdm=False)
    llm.generate(random_prompts([20, 35, 50], seed=9), params, use_tqdm=False)
    steps = llm.engine.runner.decode_steps
    assert steps["eager"] == 0 and steps["graph"] > 0, steps


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_rows_round_trip_within_half_a_step(kv_cache_dtype):
    """The reference arithmetic (what the write kernel reproduces bit for bit, tests/kernels):
    each value within half a code step of its row's scale (int8), or E4M3's relative spacing."""
    x = torch.randn(50, 4, 64) * torch.rand(50, 4, 1) * 10
    storage = kv_quant.STORAGE[kv_cache_dtype]
    back = kv_quant.dequantize_rows(kv_quant.quantize_rows(x, storage), torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / kv_quant.LARGEST[storage]
    bound = scale * 0.5 * 1.001 if storage == torch.int8 else x.abs() / 16 + scale * 2 ** -9
    assert ((back - x).abs() <= bound + 1e-6).all()
