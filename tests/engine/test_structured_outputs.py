"""Structured outputs (llguidance) through ``LLM``, on random-weight models whose text is
never valid by chance: only the constraint can make every output match."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from hyprefix.demo import demo_model_path
from hyprefix.errors import RequestError
from hyprefix.llm import LLM
from hyprefix.sampling import SamplingParams
from hyprefix.structured.spec import StructuredOutputs

# Every string and number bounded: a random model still finishes within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "member", "color", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def dense():
    return LLM(str(demo_model_path("dense")), num_kv_blocks=512, enforce_eager=True, log_stats_interval=0)


def test_json_schema_outputs_are_all_valid_sampled_with_n_and_a_shared_prefix(dense):
    system = "You write one JSON object per answer, nothing else. " * 6
    prompts = [system + "Describe a person as JSON:", system + "Another person:", "x"]
    params = SamplingParams(temperature=1.2, seed=3, max_tokens=160, n=4, structured_outputs=StructuredOutputs(
        json=PERSON))
    outs = dense.generate(prompts, params, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 12 and len(set(texts)) > 4  # sampled, not one answer
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)
    again = dense.generate(prompts[:1], params, use_tqdm=False)[0]  # a prefix-cache hit changes nothing
    assert again.num_cached_tokens > 0
    assert [c.text for c in again.outputs] == [c.text for c in outs[0].outputs]


def test_greedy_json_object_regex_choice_and_grammar(dense):
    obj = dense.generate(["{"], SamplingParams(temperature=0, max_tokens=120,
                                               structured_outputs={"json_object": True}), use_tqdm=False)[0].outputs[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # a greedy random model may fill a string until max_tokens: still a valid prefix of an object
        assert obj.text.startswith("{")
    pattern = r"[A-Z]{2}-[0-9]{3}(-[a-z]{1,4})?"  # \d would take any script's digits (Rust regex)
    for seed in range(5):
        out = dense.generate(["id:"], SamplingParams(temperature=1.0, seed=seed, max_tokens=30,
                                                     structured_outputs={"regex": pattern}), use_tqdm=False)[0]
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    choices = ["positive", "negative", "neutral"]
    outs = dense.generate(["a", "b", "c", "d"], SamplingParams(temperature=1.0, seed=9, max_tokens=10,
                                                               structured_outputs={"choice": choices}), use_tqdm=False)
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs)
    lark = 'start: "(" expr ")"\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/\n'
    out = dense.generate(["sum:"], SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                                                  structured_outputs={"grammar": lark}), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", out.text), out.text


def test_structured_rows_batch_with_free_ones_and_logprobs_stay_raw(dense):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    constrained = SamplingParams(temperature=0, max_tokens=8, logprobs=0, structured_outputs={"choice": ["yes", "no"]})
    alone = dense.generate(["Is it?"], free, use_tqdm=False)[0].outputs[0]
    both = dense.generate(["Is it?", "Is it?"], [free, constrained], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.token_ids  # the free row is untouched
    answer = both[1].outputs[0]
    assert answer.text in ("yes", "no")
    token = answer.token_ids[0]
    assert answer.logprobs[0][token].rank >= 1  # the model's own rank of the forced token


@pytest.mark.parametrize("fields,param", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs"),
    ({"regex": "(unclosed"}, "structured_outputs"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs"),
    ({"choice": []}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
])
def test_bad_constraints_are_request_errors_and_queue_nothing(dense, fields, param):
    with pytest.raises(RequestError) as info:
        dense.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=fields), use_tqdm=False)
    assert info.value.param == param
    assert not dense.engine.has_unfinished()


def test_hybrid_models_follow_the_schema(hybrid_models):
    path, _ = hybrid_models["qwen3_5"]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=16, enforce_eager=True)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    outs = llm.generate([[5, 6, 7, 8] * 5, [5, 6, 7, 8] * 5 + [9]],
                        SamplingParams(temperature=1.0, seed=4, max_tokens=40, n=3,
                                       structured_outputs={"json": schema}), use_tqdm=False)
    for o in outs:
        for c in o.outputs:
            jsonschema.validate(json.loads(c.text), schema)


def test_checking_the_greedy_pick_equals_masking_first(dense, monkeypatch):
    """A greedy grammar row picks unmasked and checks its pick; it must give exactly the
    tokens masking the logits first gives. (Random rows redraw instead: the same
    distribution, other draws; tests/unit/test_sampler.py checks their frequencies.)"""
    from hyprefix.structured.grammar import Grammar

    params = SamplingParams(temperature=0, max_tokens=100, n=1, structured_outputs={"json": PERSON}, logprobs=1)
    prompts = ["Person:", "Another person, please:"]
    checked = dense.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(Grammar, "masks_first", property(lambda self: True))
    masked = dense.generate(prompts, params, use_tqdm=False)
    for a, b in zip(checked, masked, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [[next(iter(e.values())).logprob for e in c.logprobs] for c in a.outputs] == \
            [[next(iter(e.values())).logprob for e in c.logprobs] for c in b.outputs]
