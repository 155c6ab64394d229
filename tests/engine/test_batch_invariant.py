"""The batch-invariant mode (``EngineArgs.batch_invariant``) end to end: one request's tokens
and top-5 logprobs, greedy and seeded, are bitwise equal (``==``) whether it runs alone, beside
15 other prompts of other lengths, while others prefill beside its decodes, with its prompt cut
into small chunks, and with its prefix (or its whole prompt) from the prefix cache; float32 and
bfloat16, on tiny Llama (untied head), Qwen3 (QK-norm, tied head), Mistral (every layer slides,
a window pool of its own) and Gemma 3 (sliding and full layers, tanh-GELU); so are its prompt
logprobs alone, in a batch and in chunks. Runs of the
attention kernel are shortened to two blocks so the contexts here split into several runs that
merge. What the mode refuses: recurrent layers, int8, a CPU where its kernels do not run."""

from __future__ import annotations

import pytest

from hyprefix import LLM, SamplingParams
from hyprefix.config import EngineArgs
from hyprefix.kernels import invariant_linear
from hyprefix.models import attention
from tests.support.compare import hf_greedy, random_prompts

needs_kernels = pytest.mark.skipif(not invariant_linear.available(),
                                   reason="the batch-invariant kernels need an x86 CPU with AVX2 or AVX-512")
BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, logprobs=5, ignore_eos=True)


@pytest.fixture(autouse=True)
def _short_runs(monkeypatch):
    """Attention runs of two blocks: a 100-token context is four runs merged in order."""
    monkeypatch.setattr(attention, "INVARIANT_RUN_TOKENS", 2 * BLOCK)


def _llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), dtype=dtype, batch_invariant=True, block_size=BLOCK, num_kv_blocks=256, **kwargs)


def _results(llm: LLM, prompts: list[list[int]], params) -> list[tuple[list[int], list]]:
    """(token ids, logprobs: token id -> Logprob per position) of each prompt's one sample."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _others(count: int, seed: int) -> list[list[int]]:
    lengths = [1 + (37 * i + 11) % 150 for i in range(count)]  # 1 to 150 tokens
    return random_prompts(lengths, seed=seed)


def _assert_invariant(path, dtype: str, **kwargs) -> None:
    target = random_prompts([6 * BLOCK], seed=5)[0]  # whole blocks: a repeat is a full hit
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # one engine of each kind serves both samplings (the chunked one's cache is emptied before each)
    plain = _llm(path, dtype, enable_prefix_caching=False, max_num_seqs=16, **kwargs)
    waves = _llm(path, dtype, enable_prefix_caching=False, max_num_seqs=4, **kwargs)
    chunked = _llm(path, dtype, max_num_batched_tokens=BLOCK, **kwargs)
    for params in (GREEDY, SEEDED):
        chunked.reset_prefix_cache()
        alone = _results(plain, [target], params)[0]
        assert len(alone[0]) == params.max_tokens and all(len(pos) >= 5 for pos in alone[1])
        # beside 15 others of other lengths, first and last in the batch (every row's matmuls and
        # attention share the calls)
        others = _others(15, seed=6)
        assert _results(plain, [target, *others], params)[0] == alone
        assert _results(plain, [*others, target], params)[-1] == alone
        # four running at a time: the others finish after one or two tokens and the waiting ones
        # prefill while the target decodes
        mixed = _results(waves, [target, *others[:11]], [params] + [short] * 11)
        assert mixed[0] == alone
        # its prompt in chunks of 16 tokens (beside the others' chunks), its prefix from the
        # cache (another prompt's first 64 tokens), and its whole prompt from the cache
        assert _results(chunked, [target, *others[:3]], params)[0] == alone
        chunked.reset_prefix_cache()
        chunked.generate([target[:64] + random_prompts([9], seed=7)[0]], short, use_tqdm=False)
        hit = chunked.generate([target], params, use_tqdm=False)[0]
        assert hit.num_cached_tokens == 64
        assert (list(hit.outputs[0].token_ids), hit.outputs[0].logprobs) == alone
        full = chunked.generate([target], params, use_tqdm=False)[0]
        assert full.num_cached_tokens == len(target) - 1  # all but the last token, recomputed
        assert (list(full.outputs[0].token_ids), full.outputs[0].logprobs) == alone
    # prompt logprobs (every prompt position's logits): alone, in a batch, in chunks
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    alone = plain.generate([target], scored, use_tqdm=False)[0].prompt_logprobs
    assert len(alone) == len(target) and alone[0] is None and all(len(pos) >= 3 for pos in alone[1:])
    assert plain.generate([*others[:7], target], scored, use_tqdm=False)[-1].prompt_logprobs == alone
    assert chunked.generate([target, others[0]], scored, use_tqdm=False)[0].prompt_logprobs == alone


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_request_is_bitwise_the_same_in_any_batch(tiny_models, arch, dtype):
    _assert_invariant(tiny_models[arch][0], dtype)


@needs_kernels
def test_8bit_caches_are_invariant_too(tiny_models, gemma3_model):
    """--kv-cache-dtype: the rows a batch-invariant step writes are the same bits in any batch, so
    their codes are, and the decode kernel reads them in its fixed runs (Qwen3 int8 in bfloat16;
    Gemma 3's window pool in E4M3)."""
    _assert_invariant(tiny_models["qwen3"][0], "bfloat16", kv_cache_dtype="int8")
    _assert_invariant(gemma3_model[0], "float32", kv_cache_dtype="fp8_e4m3")


@needs_kernels
def test_sliding_window_pools_are_invariant_too(tiny_models, gemma3_model):
    """Mistral (every layer in a window pool of its own, whose tables start where the window
    does) and Gemma 3 (sliding and full layers, tanh-GELU MLP)."""
    _assert_invariant(tiny_models["mistral"][0], "float32")
    _assert_invariant(gemma3_model[0], "bfloat16")


@needs_kernels
def test_a_float32_head_on_a_bf16_model_is_invariant_too(tiny_models):
    """``--lm-head-fp32``: the head's float32 copy goes through the invariant matmul."""
    _assert_invariant(tiny_models["llama"][0], "bfloat16", lm_head_fp32=True)


@needs_kernels
def test_the_mode_computes_the_model(tiny_models):
    """float32 greedy tokens as transformers computes them, and logprobs within rounding of the
    default mode's."""
    path, hf = tiny_models["qwen3"]
    prompts = random_prompts([30, 75], seed=8)
    invariant = _results(_llm(path, "float32"), prompts, GREEDY)
    default = _results(LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=256), prompts, GREEDY)
    for prompt, (tokens, logprobs), (want_tokens, want_logprobs) in zip(prompts, invariant, default, strict=True):
        assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens) == want_tokens
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert list(got) == list(want)
            assert max(abs(got[t].logprob - want[t].logprob) for t in got) < 1e-4


@needs_kernels
def test_the_mode_takes_no_compiled_or_cascade_path(tiny_models):
    llm = _llm(tiny_models["qwen3"][0], "float32")
    runner = llm.engine.runner
    assert runner.decode_graphs is None and not runner.model.decode_kernel
    assert not runner.model.kernels.compile_enabled
    shared = random_prompts([80], seed=9)[0]
    llm.generate([[*shared, i + 3] for i in range(4)], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["decode_steps_eager"] > 0 and stats["decode_steps_graph"] == stats["decode_steps_kernel"] == 0


def test_what_the_mode_refuses(tiny_models, monkeypatch):
    with pytest.raises(ValueError, match="int8"):
        EngineArgs(batch_invariant=True, quantization="int8")
    if invariant_linear.available():
        with pytest.raises(ValueError, match="recurrent layers"):
            LLM("demo-hybrid-tiny", batch_invariant=True)  # a Mamba2 hybrid
    monkeypatch.setattr(invariant_linear, "_available", False)  # as where the kernels do not build
    with pytest.raises(ValueError, match="C\\+\\+ kernels"):
        LLM(str(tiny_models["qwen3"][0]), dtype="float32", batch_invariant=True)
