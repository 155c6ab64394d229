"""Request models and error mapping of the server, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hyprefix.errors import RequestError
from hyprefix.sampling import SamplingParams
from hyprefix.server.api import _validation_error
from hyprefix.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from hyprefix.server.serving import request_error

MESSAGES = [{"role": "user", "content": "hi"}]


def test_prompt_forms():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for bad in (5, [], [[]], [1, "a"], [True]):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=bad)


def test_strict_types():
    assert CompletionRequest(prompt="a", temperature=1).temperature == 1.0  # an int is a fine float
    for field, value in (("max_tokens", "5"), ("max_tokens", 2.0), ("n", True), ("stream", "true"),
                         ("temperature", "0.5"), ("seed", 1.5)):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="a", **{field: value})


def test_sampling_kwargs_and_defaults():
    req = CompletionRequest(prompt="a", top_k=0, stop="x", ignore_eos=True, seed=3)
    kwargs = req.sampling_kwargs()
    assert kwargs["top_k"] == -1 and kwargs["stop"] == "x" and kwargs["ignore_eos"] and kwargs["seed"] == 3
    assert "temperature" not in kwargs  # SamplingParams' default (1.0, as OpenAI)
    assert req.max_tokens == 16


def test_chat_max_tokens():
    assert ChatCompletionRequest(messages=MESSAGES).max_new_tokens(10, 100) == 90
    assert ChatCompletionRequest(messages=MESSAGES, max_tokens=5).max_new_tokens(10, 100) == 5
    assert ChatCompletionRequest(messages=MESSAGES, max_tokens=5,
                                 max_completion_tokens=7).max_new_tokens(10, 100) == 7


def test_chat_messages():
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert [m.template_dict() for m in req.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""}]
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_unsupported_fields_are_refused_not_ignored():
    assert CompletionRequest(prompt="a", logprobs=1, frequency_penalty=0.5).unsupported() == []
    assert CompletionRequest(prompt="a", best_of=2, n=2, presence_penalty=0.0).unsupported() == []
    assert CompletionRequest(prompt="a", guided_regex="a+", suffix="z", best_of=3).unsupported() == [
        "best_of", "suffix"]
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = ChatCompletionRequest(messages=MESSAGES, tools=tools, response_format={"type": "json_object"})
    assert chat.unsupported() == [] and chat.tool_mode() == ("auto", None)
    assert ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="none").tool_mode() == ("none", None)
    named = ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice={"type": "function",
                                                                                "function": {"name": "f"}})
    assert named.tool_mode() == ("named", "f")
    with pytest.raises(APIError, match="tool_choice"):  # a constraint from two fields
        ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="required",
                              response_format={"type": "json_object"}).structured()
    assert ChatCompletionRequest(messages=MESSAGES, response_format={"type": "text"}).unsupported() == []
    with pytest.raises(ValidationError, match=r"extra_forbidden|Extra inputs"):
        CompletionRequest.model_validate({"prompt": "a", "guided_decoding_backend": "x"})


def test_nulls_are_accepted_where_openai_accepts_them():
    body = {"prompt": "a", **dict.fromkeys(
        ("n", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "frequency_penalty",
         "presence_penalty", "logit_bias", "logprobs", "echo", "best_of", "suffix", "max_tokens", "top_k",
         "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output",
         "skip_special_tokens", "return_token_ids"))}
    params = CompletionRequest.model_validate(body).sampling_kwargs()
    assert SamplingParams(**params) == SamplingParams()  # every null is the default
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi", "name": None}],
                                                 **dict.fromkeys(("logprobs", "top_logprobs", "tools", "tool_choice",
                                                                  "response_format", "max_completion_tokens",
                                                                  "parallel_tool_calls", "chat_template_kwargs"))})
    assert chat.logprobs_wanted() is None and chat.unsupported() == []


def test_messages_keep_tool_calls_and_tool_results_for_the_template():
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    messages = chat.chat_prompt().messages
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get", "arguments": {"city": "Oslo"}}}]
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_error_mapping():
    too_long = RequestError("prompt + max_tokens exceeds max_model_len", param="prompt", code="context_length_exceeded")
    error = request_error(too_long, "messages")
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert request_error(RequestError("temperature must be >= 0", param="temperature"), "prompt").param == "temperature"
    assert request_error(RequestError("the prompt is empty", param="prompt"), "prompt").param == "prompt"
    try:
        CompletionRequest.model_validate({"prompt": "a", "max_tokens": -1})
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    error = _validation_error(errors)
    assert error.status == 400 and error.param == "max_tokens" and "max_tokens" in error.message
    assert _validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}]).param is None
