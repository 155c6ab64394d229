"""Sampling parameters beyond temperature / top-k / top-p, and logprobs, through ``LLM``:
each checked against transformers (greedy logprobs, repetition penalty) or against what
the parameter guarantees whatever the weights (bias, allowed ids, bad words, min tokens)."""

from __future__ import annotations

import pytest
import torch

from hyprefix.errors import RequestError
from hyprefix.llm import LLM
from hyprefix.sampling import SamplingParams
from tests.support.compare import hf_greedy, random_prompts

VOCAB = 4096


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    path, hf = tiny_models["qwen3"]
    return LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=16), hf


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_greedy_logprobs_are_transformers_log_softmax(qwen3):
    llm, hf = qwen3
    prompt = random_prompts((21,), seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert tokens == hf_greedy(hf, prompt, 6)
    reference = _hf_logprobs(hf, prompt + tokens)
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == len(tokens)
    for i, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
        row = reference[len(prompt) - 1 + i]
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the top token
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        top = row.topk(5)
        assert list(entry) == top.indices.tolist()
        assert [e.rank for e in entry.values()] == [1, 2, 3, 4, 5]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entry.values()]), top.values,
                                   atol=1e-4, rtol=0)
        assert all(isinstance(e.decoded_token, str) for e in entry.values())
    prompt_logprobs = out.prompt_logprobs
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, row = prompt_logprobs[p], reference[p - 1]
        token = prompt[p]
        assert next(iter(entry)) == token and len(entry) <= 4
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1


def test_prompt_logprobs_take_no_cache_hit_but_match_and_siblings_still_share(qwen3):
    llm, _ = qwen3
    prompt = random_prompts((70,), seed=12)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                         use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, n=3),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # sample 0 computed the whole prompt
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        (token, x), = a.items()
        assert abs(x.logprob - b[token].logprob) < 1e-4
    assert all(c.token_ids == first.outputs[0].token_ids for c in again.outputs)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None and plain.outputs[0].logprobs is None


def test_logprobs_for_a_bf16_model_are_float32_and_close(tiny_models):
    path, hf = tiny_models["llama"]
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, block_size=16, enforce_eager=True)
    prompt = random_prompts((17,), seed=13)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=0), use_tqdm=False)[0]
    (token, entry), = out.outputs[0].logprobs[0].items()
    assert abs(entry.logprob - _hf_logprobs(hf, prompt)[-1][token].item()) < 0.1


def _hf_generate(hf, prompt: list[int], n: int, **kwargs) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                      eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_greedy_is_transformers(qwen3, penalty):
    llm, hf = qwen3
    prompts = random_prompts((9, 30), seed=14, vocab=60)  # few distinct ids: repeats everywhere
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_generate(hf, prompt, 12, repetition_penalty=penalty)


@pytest.mark.parametrize("frequency,presence", [(-1.0, 0.0), (0.0, -1.0), (1.5, 0.5)])
def test_frequency_and_presence_penalties_follow_openai(qwen3, frequency, presence):
    """logit - frequency x count - presence x [count > 0] over output tokens, checked step by
    step against the unpenalised logits of the same text (negative values: tokens repeat, so
    counts above one tell the two apart)."""
    llm, hf = qwen3
    prompt = random_prompts((12,), seed=15)[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    for i, token in enumerate(tokens):
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=VOCAB).float()
        expected = logits[len(prompt) - 1 + i] - frequency * counts - presence * (counts > 0).float()
        assert expected[token] >= expected.max() - 1e-4, i
    if frequency > 0:
        assert len(set(tokens)) > 1  # the penalties moved it off a repeated token


def test_logit_bias_allowed_ids_bad_words_and_min_p_hold_whatever_the_weights(qwen3):
    llm, _ = qwen3
    prompts = random_prompts((8, 25, 40), seed=16)
    forced = llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                                                  logit_bias={777: 100.0}), use_tqdm=False)
    assert all(o.outputs[0].token_ids == [777] * 6 for o in forced)
    allowed = [5, 99, 1234, 4000]
    outs = llm.generate(prompts, SamplingParams(temperature=1.5, seed=2, max_tokens=20, ignore_eos=True,
                                                allowed_token_ids=allowed, logprobs=2), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    # logprobs stay the raw model's: the allowed token's rank is over the whole vocabulary
    assert any(e[t].rank > 4 for o in outs for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                            strict=True))
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    min_p = llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, min_p=1.0, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in min_p] == [o.outputs[0].token_ids for o in greedy]
    banned = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  bad_words=[llm.engine.tokenizer.decode([greedy[0].outputs[0]
                                                                                          .token_ids[0]])]),
                          use_tqdm=False)
    first = greedy[0].outputs[0].token_ids[0]
    assert first not in banned[0].outputs[0].token_ids


def test_min_tokens_holds_back_stop_ids_and_eos(qwen3):
    llm, _ = qwen3
    prompt = random_prompts((10,), seed=17)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    stop_id = first.outputs[0].token_ids[0]
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                         use_tqdm=False)[0].outputs[0]
    assert short.token_ids == [stop_id] and short.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id],
                                                 min_tokens=5, ignore_eos=False), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 5 and stop_id not in held.token_ids[:5]


def test_stop_strings_include_and_min_tokens_and_truncation(qwen3):
    llm, _ = qwen3
    prompt = random_prompts((10,), seed=18)[0]
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text.strip()[3:6]
    assert stop and stop in text
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == cut.text + stop and kept.stop_reason == stop
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                 min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) == 12 and late.finish_reason == "length"  # no stop string before min_tokens
    out = llm.generate([list(range(5, 45))], SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=7),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(38, 45))


def test_special_tokens_are_kept_in_the_text_when_asked(qwen3):
    llm, _ = qwen3
    tokenizer = llm.engine.tokenizer
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    prompt = random_prompts((6,), seed=19)[0]
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={special: 100.0})
    skipped = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    shown = llm.generate([prompt], SamplingParams(**params, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert skipped.token_ids == shown.token_ids == [special] * 3
    assert skipped.text == "" and shown.text == tokenizer.eos_token * 3


def test_the_stopping_token_keeps_its_text_only_with_skip_special_tokens_false(qwen3):
    """EOS (or a stop token id) that ends the request: in token_ids always; in the text with
    skip_special_tokens=False (so the text decodes every id), else left out (vLLM's rule)."""
    llm, _ = qwen3
    tokenizer = llm.engine.tokenizer
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    prompt = random_prompts((6,), seed=20)[0]
    forced = dict(temperature=0, max_tokens=4, logit_bias={eos: 100.0})
    kept, dropped, included = (llm.generate([prompt], SamplingParams(**forced, **extra), use_tqdm=False)[0].outputs[0]
                               for extra in ({"skip_special_tokens": False}, {}, {"include_stop_str_in_output": True}))
    assert kept.token_ids == dropped.token_ids == included.token_ids == [eos]
    assert kept.finish_reason == dropped.finish_reason == "stop"
    assert kept.text == tokenizer.decode([eos], skip_special_tokens=False) == tokenizer.eos_token
    assert dropped.text == "" and included.text == ""  # include_stop_str_in_output: EOS's text is special
    stop_id = tokenizer.encode(" hello", add_special_tokens=False)[0]  # an ordinary token as a stop token id
    params = dict(temperature=0, max_tokens=4, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id])
    kept = llm.generate([prompt], SamplingParams(**params, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    dropped = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == dropped.token_ids == [stop_id] and kept.stop_reason == stop_id
    assert kept.text == tokenizer.decode([stop_id]) != "" and dropped.text == ""


@pytest.mark.parametrize("kwargs,param", [
    (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"), (dict(allowed_token_ids=[1, VOCAB + 5]), "allowed_token_ids"),
])
def test_engine_limits_are_request_errors(qwen3, kwargs, param):
    llm, _ = qwen3
    with pytest.raises(RequestError) as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert info.value.param == param


@pytest.mark.parametrize("kwargs,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"5": 1}), "logit_bias"), (dict(bad_words=[" "]), "bad_words"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(logprobs=-2), "logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(skip_special_tokens=1), "skip_special_tokens"),
])
def test_bad_values_are_request_errors(kwargs, param):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_hybrid_models_give_logprobs_and_penalties(hybrid_models):
    path, hf = hybrid_models["qwen3_5"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16)
    prompt = random_prompts((19,), seed=20)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                prompt_logprobs=1), use_tqdm=False)[0]
    reference = _hf_logprobs(hf, prompt + out.outputs[0].token_ids)
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
        assert abs(entry[token].logprob - reference[len(prompt) - 1 + i][token].item()) < 1e-3
    assert abs(out.prompt_logprobs[5][prompt[5]].logprob - reference[4][prompt[5]].item()) < 1e-3
    penalized = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      repetition_penalty=1.5), use_tqdm=False)[0]
    assert penalized.outputs[0].token_ids == _hf_generate(hf, prompt, 6, repetition_penalty=1.5)
