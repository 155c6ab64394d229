"""User errors raise ValueError at add_request / generate and leave the engine untouched."""

from __future__ import annotations

import pytest

from hyprefix import LLM, SamplingParams
from hyprefix.errors import RequestError
from hyprefix.sampling import MAX_SEED, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_SEED
from hyprefix.text import check_text

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


def rejects(llm: LLM, prompt, params: SamplingParams = OK, request_id: str = "bad",
            param: str | None = "prompt") -> None:
    """Both entry points raise RequestError (a ValueError naming the offending field) and
    queue / allocate nothing."""
    with pytest.raises(RequestError) as caught:
        llm.engine.add_request(request_id, prompt, params)
    assert caught.value.param == param
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
    rejects(llm, prompt, param="cache_salt" if "cache_salt" in prompt else "prompt")


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
    dict(seed=2**64), dict(seed=MIN_SEED - 1), dict(seed=MAX_SEED, n=2), dict(seed=MAX_SEED - 2, n=4),
    dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), dict(stop="x" * (MAX_STOP_STRING_CHARS + 1)),
    dict(stop=["ok", "bad\ud800"]), dict(stop="\udfff"),
    dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
], ids=lambda kw: "-".join(f"{k}={v!r}"[:40] for k, v in kw.items()))
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(seed=2**64), "seed must be in"),
    (dict(stop=["s"] * 20_000), f"limit of {MAX_STOP_STRINGS}"),
    (dict(stop=["ok", "x" * 5000]), f"stop string 1 has 5000 characters, more than the limit of "
                                     f"{MAX_STOP_STRING_CHARS}"),
    (dict(stop=["ok", "ab\ud800"]), "stop string 1 is not valid Unicode (lone surrogate U+D800 at position 2)"),
    (dict(stop_token_ids=[7] * 20_000), f"limit of {MAX_STOP_TOKEN_IDS}"),
])
def test_sampling_param_limits_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert len(str(info.value)) < 200  # the message does not echo a huge input


def test_seed_range_is_what_torch_accepts():
    import torch

    for seed in (MIN_SEED, -1, 0, 2**63, MAX_SEED):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    params = SamplingParams(seed=MAX_SEED - 3, n=4)
    for i in range(4):
        torch.Generator().manual_seed(params.for_sample(i).seed)
    for seed in (MIN_SEED - 1, MAX_SEED + 1):
        with pytest.raises((ValueError, RuntimeError)):
            torch.Generator().manual_seed(seed)


def test_check_text():
    check_text("plain, accentué, 漢字, 🙂", "x")
    with pytest.raises(ValueError, match=r"^prompt is not valid Unicode \(lone surrogate U\+DC80 at position 3\)$"):
        check_text("abc\udc80def", "prompt")


def test_valid_sampling_params_edges():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=1, n=1)
    SamplingParams(top_p=1e-9, top_k=1, seed=0, stop="x", stop_token_ids=[0])
    assert SamplingParams(stop=["a", "bc"]).stop_list == ("a", "bc")
    assert SamplingParams(stop="a").stop_list == ("a",)
    assert SamplingParams(stop=None).stop_list == ()
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(stop="x" * MAX_STOP_STRING_CHARS, seed=MAX_SEED - 1, n=2)
    assert SamplingParams(stop_token_ids=[5, 7, 5]).stop_token_set == frozenset({5, 7})


def test_params_of_the_wrong_type(llm):
    rejects(llm, [5, 6, 7], {"temperature": 0}, param=None)  # type: ignore[arg-type]
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


def test_many_stop_token_ids_still_stop_at_the_right_token(llm):
    prompt = [5, 6, 7, 8]
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    g = full.outputs[0].token_ids
    k = next(i for i in range(2, len(g)) if g[i] not in g[:i])
    others = [t for t in range(3, VOCAB) if t not in g[:k + 1]][:MAX_STOP_TOKEN_IDS - 1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[*others, g[k]])
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == g[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", g[k])
    assert_untouched(llm)


def test_errors_carry_the_field_and_the_code():
    with pytest.raises(RequestError) as caught:
        SamplingParams(top_p=0)
    assert (caught.value.param, caught.value.code) == ("top_p", None)
    with pytest.raises(RequestError) as caught:
        SamplingParams(stop=["ok", "a\ud800"])
    assert caught.value.param == "stop" and "Unicode" in str(caught.value)


def test_context_errors_say_context_length_exceeded(llm, tiny_pool_llm):
    for engine, params in ((llm.engine, SamplingParams(max_tokens=MAX_MODEL_LEN)),
                           (tiny_pool_llm.engine, SamplingParams(max_tokens=20))):
        with pytest.raises(RequestError) as caught:
            engine.validate([5, 6, 7], params)
        assert (caught.value.param, caught.value.code) == ("prompt", "context_length_exceeded")


def test_add_requests_adds_all_or_none(llm):
    engine = llm.engine
    with pytest.raises(RequestError, match="already in use"):
        engine.add_requests([("x", [5, 6], OK), ("x", [7, 8], OK)])
    assert_untouched(llm)
    with pytest.raises(RequestError) as caught:  # 2 x (2 prompt tokens + 4 max_tokens) = 12 tokens
        engine.add_requests([("x", [5, 6], OK), ("y", [7, 8], OK)], max_total_tokens=11)
    assert (caught.value.param, caught.value.code) == ("max_tokens", "request_too_large")
    assert_untouched(llm)
    added = engine.add_requests([("x", "hello", OK), ("y", [7, 8], OK)], group="call")
    assert added[1] == (None, [7, 8]) and added[0][0] == "hello"
    assert {r.group for r in engine.scheduler.requests.values()} == {"call"}
    for request_id in ("x", "y"):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert_untouched(llm)


def test_model_paths_that_are_not_checkpoints_say_what_is_wrong(tmp_path):
    from hyprefix.models.loader import HUB_FILES, resolve_model_dir

    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir("./no/such/dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model_dir(str(empty))
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"a file of an unknown kind \(\.bin\)"):
        resolve_model_dir(str(weights))
    assert "*.jinja" in HUB_FILES  # transformers 5 keeps chat templates only in chat_template.jinja
