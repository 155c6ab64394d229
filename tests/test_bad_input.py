"""User errors raise ValueError at add_request / generate and leave the engine untouched."""

from __future__ import annotations

import pytest

from hyprefix import LLM, SamplingParams

VOCAB = 4096
MAX_MODEL_LEN = 64
OK = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=32, block_size=16, max_model_len=MAX_MODEL_LEN,
               log_stats_interval=0)


@pytest.fixture(scope="module")
def tiny_pool_llm(qwen3_dir) -> LLM:
    # 2 blocks x 8 tokens = 16 tokens of KV, although max_model_len allows 64
    return LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=2, block_size=8, max_model_len=MAX_MODEL_LEN,
               log_stats_interval=0)


def assert_untouched(llm: LLM) -> None:
    engine = llm.engine
    stats = llm.get_stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert not engine.has_unfinished()
    assert engine.scheduler.requests == {}
    assert engine.step() == []
    llm.check_invariants()


def rejects(llm: LLM, prompt, params: SamplingParams = OK, request_id: str = "bad") -> None:
    """Both entry points raise ValueError and queue / allocate nothing."""
    with pytest.raises(ValueError):
        llm.engine.add_request(request_id, prompt, params)
    assert_untouched(llm)
    with pytest.raises(ValueError):
        llm.generate([prompt], params, use_tqdm=False)
    assert_untouched(llm)


@pytest.mark.parametrize("prompt", ["", [], {"prompt": ""}, {"prompt_token_ids": []}],
                         ids=["str", "list", "dict-str", "dict-ids"])
def test_empty_prompt(llm, prompt):
    rejects(llm, prompt)


def test_empty_prompt_through_generate_forms(llm):
    with pytest.raises(ValueError):
        llm.generate("", OK, use_tqdm=False)
    assert_untouched(llm)
    with pytest.raises(ValueError):
        llm.generate([[]], OK, use_tqdm=False)
    assert_untouched(llm)


def test_prompt_longer_than_max_model_len(llm):
    rejects(llm, list(range(3, 3 + MAX_MODEL_LEN + 1)), SamplingParams(max_tokens=1))


def test_prompt_plus_max_tokens_over_max_model_len(llm):
    prompt = list(range(3, 3 + MAX_MODEL_LEN - 4))
    rejects(llm, prompt, SamplingParams(max_tokens=5))
    # exactly at the limit is fine
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_untouched(llm)


def test_prompt_that_can_never_fit_in_the_kv_pool(tiny_pool_llm):
    rejects(tiny_pool_llm, list(range(3, 20)), SamplingParams(max_tokens=1))  # 17 tokens of prompt
    rejects(tiny_pool_llm, list(range(3, 13)), SamplingParams(max_tokens=7))  # 10 + 7 > 16
    # 10 + 6 fits the pool exactly
    (out,) = tiny_pool_llm.generate([list(range(3, 13))], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                    use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    assert_untouched(tiny_pool_llm)


@pytest.mark.parametrize("prompt", [[-1], [5, -3, 6], [VOCAB], [5, VOCAB + 100], [10**12]],
                         ids=["neg", "neg-inside", "vocab", "above-vocab", "huge"])
def test_token_ids_outside_the_vocabulary(llm, prompt):
    rejects(llm, prompt)


@pytest.mark.parametrize("prompt", [[1.5, 2], [True, 5], ["a", 3], {"prompt_token_ids": [3, None]}],
                         ids=["float", "bool", "str", "none"])
def test_token_ids_of_the_wrong_type(llm, prompt):
    rejects(llm, prompt)


@pytest.mark.parametrize("prompt", [5, None, 3.5, b"abc"], ids=["int", "none", "float", "bytes"])
def test_prompt_of_the_wrong_type(llm, prompt):
    with pytest.raises(ValueError):
        llm.engine.add_request("bad", prompt, OK)
    assert_untouched(llm)
    with pytest.raises(ValueError):
        llm.generate(prompt, OK, use_tqdm=False)
    assert_untouched(llm)
    if not isinstance(prompt, int):  # [5] is a valid one-token prompt
        with pytest.raises(ValueError):
            llm.generate([prompt], OK, use_tqdm=False)
        assert_untouched(llm)


@pytest.mark.parametrize("prompt", [
    {"prompt": "hello", "extra": 1},
    {"prompt_token_ids": [5, 6], "max_tokens": 3},
    {"text": "hello"},
    {},
    {"prompt": "hello", "cache_salt": 5},
], ids=["extra-key", "misplaced-param", "wrong-key", "empty-dict", "salt-not-str"])
def test_bad_prompt_dicts(llm, prompt):
    rejects(llm, prompt)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature="1"),
    dict(top_p=0), dict(top_p=1.5), dict(top_p=-0.1),
    dict(top_k=0), dict(top_k=-2), dict(top_k=2.0),
    dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=1.0),
    dict(n=0), dict(n=-1), dict(n=True),
    dict(seed=1.5), dict(seed="7"),
    dict(stop=123), dict(stop=[1]), dict(stop=[""]), dict(stop=""), dict(stop=["ok", None]),
    dict(stop={"a": 1}),
    dict(stop_token_ids=5), dict(stop_token_ids=[-1]), dict(stop_token_ids=[1.5]), dict(stop_token_ids=["2"]),
], ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_valid_sampling_params_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1, n=1)
    SamplingParams(top_p=1e-9, top_k=1, seed=0, stop="x", stop_token_ids=[0])
    assert SamplingParams(stop=["a", "bc"]).stop_list == ("a", "bc")
    assert SamplingParams(stop="a").stop_list == ("a",)
    assert SamplingParams(stop=None).stop_list == ()


def test_params_of_the_wrong_type(llm):
    rejects(llm, [5, 6, 7], {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [7, 8]], [OK], use_tqdm=False)  # one params for two prompts
    assert_untouched(llm)


def test_one_bad_prompt_queues_none_of_the_batch(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], "fine", [VOCAB]], OK, use_tqdm=False)
    assert_untouched(llm)
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [8, 9]], [OK, SamplingParams(max_tokens=MAX_MODEL_LEN)], use_tqdm=False)
    assert_untouched(llm)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("dup", [5, 6, 7], OK)
    with pytest.raises(ValueError):
        engine.add_request("dup", [8, 9], OK)
    assert engine.get_stats()["num_requests_waiting"] == 1
    assert engine.get_stats()["kv_blocks_used"] == 0
    assert [r.prompt_token_ids for r in engine.scheduler.requests.values()] == [[5, 6, 7]]
    assert engine.abort("dup")
    engine.step()
    assert_untouched(llm)


def test_request_id_clashing_with_a_sample_of_another_request(llm):
    engine = llm.engine
    engine.add_request("c#1", [5, 6, 7], OK)
    with pytest.raises(ValueError):  # its samples would be "c#0" and "c#1"
        engine.add_request("c", [8, 9], SamplingParams(n=2, max_tokens=4))
    assert list(engine.scheduler.requests) == ["c#1"]
    assert engine.get_stats()["num_requests_waiting"] == 1
    engine.add_request("d", [8, 9], SamplingParams(n=2, max_tokens=4))
    with pytest.raises(ValueError):
        engine.add_request("d#0", [5, 6], OK)
    assert sorted(engine.scheduler.requests) == ["c#1", "d#0", "d#1"]
    assert engine.abort("c#1") and engine.abort("d")
    engine.step()
    assert_untouched(llm)
