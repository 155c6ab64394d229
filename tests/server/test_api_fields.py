"""The OpenAI and vLLM request fields agents and RL clients use, through the official
``openai`` client against the app in process: logprobs (completions, echo, chat, streams),
sampling fields, tool messages and tool definitions reaching the chat template, template
arguments, echo and continue_final_message, and the small API surface (models by id,
X-Request-Id, stop_reason in streams)."""

from __future__ import annotations

import contextlib
import json
import math

import openai
import pytest
from fastapi.testclient import TestClient

from hyprefix.config import EngineArgs
from hyprefix.demo import demo_model_path
from hyprefix.engine import Engine
from hyprefix.server import build_app
from hyprefix.server.protocol import ChatCompletionRequest

MODEL = "demo"
GREEDY = dict(model=MODEL, temperature=0)

# A Qwen3-style template: tools in the system turn, an assistant's tool calls as
# <tool_call> JSON, tool results as <tool_response>, and enable_thinking.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool.function.name }}: {{ tool.function.description }} {{ tool.function.parameters | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}
{%- if not (loop.last and continue_final_message) %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def app_client():
    engine = Engine(EngineArgs(model=str(demo_model_path("dense")), num_kv_blocks=256, enforce_eager=True,
                               log_stats_interval=0))
    with TestClient(build_app(engine, [MODEL])) as http:
        yield engine, http


@pytest.fixture(scope="module")
def client(app_client) -> openai.OpenAI:
    _, http = app_client
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def test_completion_logprobs_are_consistent_and_greedy_picks_the_top(client):
    out = client.completions.create(prompt="The cache keeps", max_tokens=6, logprobs=3,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 4
        assert math.isclose(value, max(top.values()), abs_tol=1e-6)  # greedy: the most likely token


def test_echo_with_logprobs_scores_the_prompt_too(client, app_client):
    engine, _ = app_client
    prompt = "Shared prefixes are cheap"
    n_prompt = len(engine.tokenizer.encode(prompt))
    out = client.completions.create(prompt=prompt, max_tokens=3, logprobs=1, echo=True,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])


def test_chat_logprobs_stream_like_the_whole_response(client):
    messages = [{"role": "user", "content": "Say something about caches."}]
    whole = client.chat.completions.create(messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True}, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content if "\ufffd" not in t.token)
    streamed = []
    for chunk in client.chat.completions.create(messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
                                                stream=True, extra_body={"ignore_eos": True}, **GREEDY):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]


def test_sampling_fields_reach_the_engine(client, app_client):
    engine, _ = app_client
    token = engine.tokenizer.encode(" cache")[0]
    forced = client.completions.create(prompt="Hello", max_tokens=4, temperature=1.0, seed=3,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True}, model=MODEL)
    assert forced.choices[0].text == engine.tokenizer.decode([token] * 4)
    held = client.completions.create(prompt="Hello", max_tokens=8, stop=["e"], model=MODEL, temperature=0,
                                     extra_body={"min_tokens": 8, "ignore_eos": True, "return_token_ids": True})
    assert len(held.choices[0].token_ids) == 8
    allowed = client.completions.create(prompt="Hello", max_tokens=6, temperature=1.3, seed=1, model=MODEL,
                                        extra_body={"allowed_token_ids": [token, 5], "ignore_eos": True,
                                                    "return_token_ids": True})
    assert set(allowed.choices[0].token_ids) <= {token, 5}


def _expected_prompt(engine, messages: list[dict], **kwargs) -> list[int]:
    import json

    rendered = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    rendered = [{**m, "content": m["content"] or ""} for m in rendered]
    return list(engine.tokenizer.apply_chat_template(rendered, chat_template=TOOL_TEMPLATE, tokenize=True,
                                                     return_dict=False, **kwargs))


def _prompt_ids(response) -> list[int]:
    return [int(next(iter(entry))) for entry in response.model_extra["prompt_logprobs"][1:]]


def test_tools_and_tool_messages_reach_the_template(client, app_client):
    engine, _ = app_client
    out = client.chat.completions.create(messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=2,
                                         extra_body={"chat_template": TOOL_TEMPLATE, "prompt_logprobs": 0},
                                         **GREEDY)
    expected = _expected_prompt(engine, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    text = engine.tokenizer.decode(expected)
    assert "get_weather: Weather in a city." in text and '"arguments": {"city": "Oslo"}' in text
    assert 'tool_response id="call_7"' in text
    assert out.usage.prompt_tokens == len(expected) and _prompt_ids(out) == expected[1:]
    assert out.choices[0].message.tool_calls in (None, [])


def test_template_kwargs_continue_final_message_and_echo(client, app_client):
    engine, _ = app_client
    messages = [{"role": "user", "content": "Hi"}]
    thinking = client.chat.completions.create(messages=messages, max_tokens=1, extra_body={
        "chat_template": TOOL_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}, "prompt_logprobs": 0},
        **GREEDY)
    expected = _expected_prompt(engine, messages, add_generation_prompt=True, enable_thinking=False)
    assert "<think>" in engine.tokenizer.decode(expected) and _prompt_ids(thinking) == expected[1:]
    partial = [*messages, {"role": "assistant", "content": "The answer is"}]
    out = client.chat.completions.create(messages=partial, max_tokens=3, extra_body={
        "chat_template": TOOL_TEMPLATE, "continue_final_message": True, "add_generation_prompt": False,
        "echo": True, "prompt_logprobs": 0, "ignore_eos": True}, **GREEDY)
    expected = _expected_prompt(engine, partial, add_generation_prompt=False, continue_final_message=True)
    assert engine.tokenizer.decode(expected).endswith("The answer is")
    assert _prompt_ids(out) == expected[1:]
    assert out.choices[0].message.content.startswith("The answer is")


def test_models_by_id_request_id_header_and_stop_reason_in_streams(client, app_client):
    _, http = app_client
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                         headers={"X-Request-Id": "my-trace-1"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "my-trace-1"
    text = client.completions.create(prompt="Hello", max_tokens=12, extra_body={"ignore_eos": True},
                                     **GREEDY).choices[0].text
    stop = text.strip()[2:4]
    finals = [c.choices[0] for c in client.completions.create(prompt="Hello", max_tokens=12, stop=[stop],
                                                              stream=True, extra_body={"ignore_eos": True},
                                                              **GREEDY)
              if c.choices and c.choices[0].finish_reason]
    assert finals[0].finish_reason == "stop" and finals[0].model_extra["stop_reason"] == stop


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "sunny": {"type": "boolean"},
                                           "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
          "required": ["city", "sunny", "temp"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(client):
    import json

    import jsonschema

    messages = [{"role": "user", "content": "Weather report as JSON."}]
    out = client.chat.completions.create(messages=messages, max_tokens=80, temperature=1.0, seed=7, n=3, model=MODEL,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "report", "schema": SCHEMA, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(messages=messages, max_tokens=80, temperature=1.0, seed=8, n=2,
                                                model=MODEL, stream=True,
                                                response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "r", "schema": SCHEMA}}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert len(streamed) == 2 and all(jsonschema.validate(json.loads(t), SCHEMA) is None for t in streamed.values())
    obj = client.completions.create(prompt="{", max_tokens=60, temperature=1.0, seed=1, model=MODEL,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(obj.choices[0].text), SCHEMA)
    choice = client.completions.create(prompt="Answer:", max_tokens=5, model=MODEL,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}}, "response_format"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a+", "json": {"type": "object"}}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_constraints_are_400s_naming_the_field(app_client, extra, param):
    _, http = app_client
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _literal(text: str) -> str:
    """A regex (Rust syntax) matching exactly ``text``: forces a reply, to test the parsers."""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in r"\.+*?()|[]{}^$#&-~" else ch for ch in text)


FORCED = {
    "hermes": 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                   "</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
}


@contextlib.contextmanager
def _served(app_client, client: openai.OpenAI, **chat_options):
    """The module's app with these chat options (as ``serve`` flags would set them) while the
    block runs."""
    from hyprefix.server.chat_output import ChatOptions

    serving = app_client[1].app.state.backend.serving
    saved, serving.chat_options = serving.chat_options, ChatOptions(**chat_options)
    try:
        yield client
    finally:
        serving.chat_options = saved


@pytest.mark.parametrize("parser", sorted(FORCED))
def test_auto_tool_calls_are_parsed_whole_and_streamed(app_client, client, parser):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = {"guided_regex": _literal(FORCED[parser]), "chat_template": TOOL_TEMPLATE}
    with _served(app_client, client, enable_auto_tool_choice=True, tool_call_parser=parser) as client:
        out = client.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=80, extra_body=forced,
                                             **GREEDY)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
        assert call.id.startswith("call_")
        assert choice.message.content == ("Checking." if parser == "hermes" else None)
        content, names, arguments, ids, reasons = "", [], "", set(), []
        for chunk in client.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=80, stream=True,
                                                    extra_body=forced, **GREEDY):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                if piece.id:
                    ids.add(piece.id)
                    names.append(piece.function.name)
                arguments += piece.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
        assert names == ["get_weather"] and len(ids) == 1 and json.loads(arguments) == {"city": "Oslo"}
        assert content == ("Checking." if parser == "hermes" else "") and reasons[-1] == "tool_calls"
        text = client.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=5, **GREEDY,
                                              extra_body={"chat_template": TOOL_TEMPLATE}).choices[0]
        assert text.finish_reason == "length" and not text.message.tool_calls  # plain text stays text
        with pytest.raises(openai.BadRequestError, match="takes no tools") as refused:  # the demo template
            client.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=5, **GREEDY)
        assert refused.value.body["param"] == "tools"


def test_required_and_named_tool_choice_are_valid_for_the_schema_whatever_the_model(app_client, client):
    import jsonschema

    tools = [*TOOLS, {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm.",
        "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                        "label": {"type": "string", "maxLength": 8}},
                       "required": ["hour", "label"], "additionalProperties": False}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    schemas["get_weather"] = {**schemas["get_weather"], "properties": {"city": {"type": "string", "maxLength": 10}},
                              "additionalProperties": False}  # bounded: a random model finishes in max_tokens
    tools[0] = {"type": "function", "function": {**tools[0]["function"], "parameters": schemas["get_weather"]}}
    messages = [{"role": "user", "content": "Do something."}]
    with _served(app_client, client) as client:
        out = client.chat.completions.create(messages=messages, tools=tools, tool_choice="required", n=6,
                                             max_tokens=120, temperature=1.0, seed=5, model=MODEL,
                                             parallel_tool_calls=False)
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        named = client.chat.completions.create(
            messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "set_alarm"}},
            n=4, max_tokens=60, temperature=1.0, seed=6, model=MODEL)
        for choice in named.choices:
            assert choice.finish_reason == "stop"
            (call,) = choice.message.tool_calls
            assert call.function.name == "set_alarm"
            jsonschema.validate(json.loads(call.function.arguments), schemas["set_alarm"])
        arguments, names = "", []
        for chunk in client.chat.completions.create(messages=messages, tools=tools, tool_choice="required",
                                                    max_tokens=120, temperature=1.0, seed=7, model=MODEL,
                                                    stream=True):
            for piece in chunk.choices[0].delta.tool_calls or ():
                names += [piece.function.name] if piece.id else []
                arguments += piece.function.arguments or ""
        assert len(names) >= 1
        if len(names) == 1:
            jsonschema.validate(json.loads(arguments), schemas[names[0]])
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(messages=messages, tools=tools, max_tokens=4, model=MODEL)
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            client.chat.completions.create(messages=messages, tools=tools, max_tokens=4, model=MODEL,
                                           tool_choice={"type": "function", "function": {"name": "nope"}})


def test_reasoning_parser_splits_thinking_from_the_answer(app_client, client):
    reply = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
    messages = [{"role": "user", "content": "Weather?"}]
    forced = {"guided_regex": _literal(reply)}
    with _served(app_client, client, reasoning_parser="qwen3") as client:
        out = client.chat.completions.create(messages=messages, max_tokens=60, extra_body=forced, **GREEDY)
        message = out.choices[0].message
        assert message.content == "It is sunny."
        assert message.model_extra["reasoning_content"] == "The user wants weather.\n"
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(messages=messages, max_tokens=60, stream=True,
                                                    extra_body=forced, **GREEDY):
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
        assert reasoning == "The user wants weather.\n" and content == "It is sunny."


# ------------------------------------------------- token ids in and out (RL clients)
def _tokenize(http, **body) -> dict:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_and_detokenize_are_the_tokenizers(app_client):
    engine, http = app_client
    tokenizer = engine.tokenizer
    text = "Prefix caches keep <|im_end|> shared blocks"
    ids = tokenizer.encode(text)
    assert _tokenize(http, prompt=text) == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                                            "token_strs": None}
    assert _tokenize(http, model=MODEL, prompt=text, add_special_tokens=False)["tokens"] == tokenizer.encode(
        text, add_special_tokens=False)
    named = _tokenize(http, prompt=text, return_token_strs=True)
    assert named["token_strs"] == tokenizer.convert_ids_to_tokens(ids) and "<|im_end|>" in named["token_strs"]
    for tokens in (ids, [*ids, tokenizer.eos_token_id, 7], []):
        response = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
        assert response.status_code == 200, response.text
        assert response.json() == {"prompt": tokenizer.decode(tokens, skip_special_tokens=False,
                                                              clean_up_tokenization_spaces=False)}
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
    # the ids /v1/completions feeds the engine for the same text
    out = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "return_token_ids": True}).json()
    assert out["choices"][0]["prompt_token_ids"] == ids and out["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("messages,extra", [
    (CONVERSATION, {"tools": TOOLS, "chat_template": TOOL_TEMPLATE}),
    ([{"role": "user", "content": "Hi"}], {"chat_template": TOOL_TEMPLATE,
                                           "chat_template_kwargs": {"enable_thinking": False}}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}],
     {"add_generation_prompt": False, "continue_final_message": True}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], {}),
])
def test_chat_tokenize_is_what_the_chat_endpoint_feeds_the_engine(app_client, messages, extra):
    engine, http = app_client
    tokens = _tokenize(http, model=MODEL, messages=messages, **extra)
    expected = engine.encode_chat(ChatCompletionRequest.model_validate({"messages": messages, **extra}).chat_prompt())
    assert tokens["tokens"] == expected and tokens["count"] == len(expected)
    chat = {"messages": messages, "max_tokens": 2, "return_token_ids": True, "tool_choice": "none", **extra,
            "temperature": 0}
    out = http.post("/v1/chat/completions", json=chat).json()
    assert out["prompt_token_ids"] == expected and out["usage"]["prompt_tokens"] == len(expected)
    assert all("prompt_token_ids" not in c for c in out["choices"])
    firsts = {}
    with http.stream("POST", "/v1/chat/completions", json={**chat, "n": 2, "stream": True}) as response:
        for chunk in _events(response):
            for choice in chunk["choices"]:
                if choice["index"] not in firsts:
                    firsts[choice["index"]] = chunk.get("prompt_token_ids")
                else:
                    assert "prompt_token_ids" not in chunk  # the first chunk of each choice only
    assert firsts == {0: expected, 1: expected}


def test_add_special_tokens_on_both_forms():
    """With a tokenizer that adds a BOS: the text form adds it by default, the chat form only
    when asked (its template writes its own markers), on top of the chat endpoint's ids."""
    import asyncio

    from transformers import AutoTokenizer

    from hyprefix.server.protocol import TokenizeChatRequest, TokenizeCompletionRequest
    from hyprefix.server.serving import Tokenization
    from hyprefix.text import chat_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path("dense")), bos_token="<|endoftext|>",
                                              add_bos_token=True)
    bos = tokenizer.bos_token_id
    tokenization = Tokenization(tokenizer, len(tokenizer), 512, [MODEL])

    def tokens(form, **body) -> list[int]:
        return asyncio.run(tokenization.tokenize(form.model_validate(body))).tokens

    plain = tokenizer.encode("Hi there", add_special_tokens=False)
    assert tokens(TokenizeCompletionRequest, prompt="Hi there") == [bos, *plain]
    assert tokens(TokenizeCompletionRequest, prompt="Hi there", add_special_tokens=False) == plain
    messages = [{"role": "user", "content": "Hi"}]
    chat = chat_token_ids(tokenizer, messages)
    assert bos not in chat
    assert tokens(TokenizeChatRequest, messages=messages) == chat
    assert tokens(TokenizeChatRequest, messages=messages, add_special_tokens=True) == [bos, *chat]


def _events(response) -> list[dict]:
    assert response.status_code == 200
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_completions_return_each_prompts_ids_whole_and_streamed(app_client):
    _, http = app_client
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "return_token_ids": True, "ignore_eos": True,
            "temperature": 0}
    out = http.post("/v1/completions", json=body).json()
    assert [c["prompt_token_ids"] for c in out["choices"]] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert out["usage"]["prompt_tokens"] == 7
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert all(c["prompt_token_ids"] is None and c["token_ids"] is None for c in plain["choices"])
    for echo in (False, True):
        firsts, token_ids = {}, {}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True, "echo": echo}) as response:
            for chunk in _events(response):
                for choice in chunk["choices"]:
                    if choice["index"] not in firsts:
                        firsts[choice["index"]] = choice.get("prompt_token_ids")
                    else:
                        assert "prompt_token_ids" not in choice
                    token_ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
        assert firsts == {0: prompts[0], 1: prompts[0], 2: prompts[1], 3: prompts[1]}
        assert token_ids == {i: c["token_ids"] for i, c in enumerate(out["choices"])}


def test_the_stop_token_keeps_its_text_with_skip_special_tokens_false(app_client):
    """EOS forced as the first token: the text is the EOS token's text when special tokens
    are not skipped (text = decode(token_ids)), empty otherwise (vLLM's rule), whole and
    streamed, on both endpoints."""
    engine, http = app_client
    eos = engine.tokenizer.eos_token_id
    assert eos in engine.eos_token_ids
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text == "<|im_end|>"
    forced = {"max_tokens": 5, "logit_bias": {str(eos): 100}, "temperature": 0, "return_token_ids": True}
    for skip, text in ((False, eos_text), (True, ""), (None, "")):
        fields = {**forced, **({} if skip is None else {"skip_special_tokens": skip})}
        out = http.post("/v1/completions", json={"prompt": "Hello", **fields}).json()["choices"][0]
        assert (out["text"], out["token_ids"], out["finish_reason"], out["stop_reason"]) == (text, [eos], "stop", None)
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       **fields}).json()["choices"][0]
        assert (chat["message"]["content"], chat["token_ids"], chat["finish_reason"]) == (text, [eos], "stop")
        with http.stream("POST", "/v1/completions", json={"prompt": "Hello", "stream": True, **fields}) as response:
            assert "".join(c["choices"][0]["text"] for c in _events(response) if c["choices"]) == text
    stop_id = engine.tokenizer.encode(" cache")[0]  # an ordinary token as a stop token id
    stop_text = engine.tokenizer.decode([stop_id])
    assert stop_text
    for skip, text in ((False, stop_text), (True, "")):
        out = http.post("/v1/completions", json={"prompt": "Hello", **forced, "logit_bias": {str(stop_id): 100},
                                                 "stop_token_ids": [stop_id], "skip_special_tokens": skip}).json()
        choice = out["choices"][0]
        assert (choice["text"], choice["token_ids"], choice["stop_reason"]) == (text, [stop_id], stop_id)


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [5], "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [5, 4096]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "5"}, 400, "tokens"),
    ("/detokenize", {"tokens": [5], "skip_special_tokens": True}, 400, "skip_special_tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, 400, "max_tokens"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% if %}"}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", [1, 2], 400, None),
])
def test_tokenize_errors(app_client, path, body, status, param):
    _, http = app_client
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    if status == 404:
        assert error["code"] == "model_not_found"


def test_tokenize_refuses_text_that_is_not_unicode_and_bad_json(app_client):
    _, http = app_client
    headers = {"Content-Type": "application/json"}
    surrogate = http.post("/tokenize", content=b'{"prompt": "a\\ud800"}', headers=headers)
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "prompt", surrogate.text
    broken = http.post("/tokenize", content=b'{"prompt": "hi", ', headers=headers)
    assert broken.status_code == 400 and broken.json()["error"]["message"].startswith("The request body is not valid")


def test_tokenize_needs_no_engine_thread_and_sits_behind_the_api_key(app_client):
    engine, _ = app_client
    app = build_app(engine, [MODEL], api_key="k3y")
    http = TestClient(app)  # no lifespan: this app's engine thread never starts
    assert not app.state.async_engine.is_running
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert http.post(path, json=body).status_code == 401
        response = http.post(path, json=body, headers={"Authorization": "Bearer k3y"})
        assert response.status_code == 200, response.text


EFFORT_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                   "<|im_start|>assistant\nReasoning: {{ reasoning_effort | default('medium') }}\n")


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_a_400_elsewhere(app_client):
    """OpenAI's ``reasoning_effort`` is the template's ``reasoning_effort`` (gpt-oss's template reads
    it); where the template does not read it, or it is also given in chat_template_kwargs, or it is
    not low / medium / high, the request is a 400 naming the field."""
    engine, http = app_client
    messages = [{"role": "user", "content": "Hi"}]
    tokens = _tokenize(http, model=MODEL, messages=messages, chat_template=EFFORT_TEMPLATE, reasoning_effort="high")
    assert engine.tokenizer.decode(tokens["tokens"]).rstrip().endswith("Reasoning: high")
    out = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                                  "chat_template": EFFORT_TEMPLATE, "reasoning_effort": "high"})
    assert out.status_code == 200 and out.json()["prompt_token_ids"] == tokens["tokens"]
    for extra in ({"reasoning_effort": "low"},  # the demo model's template takes none
                  {"reasoning_effort": "low", "chat_template": EFFORT_TEMPLATE,
                   "chat_template_kwargs": {"reasoning_effort": "high"}},
                  {"reasoning_effort": "extreme", "chat_template": EFFORT_TEMPLATE}):
        response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "reasoning_effort"
