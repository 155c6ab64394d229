"""gpt-oss's harmony format on the chat endpoint (``--reasoning-parser openai_gptoss``,
``--tool-call-parser openai``): the parser of a reply's text, whole and streamed a character
at a time, the rules that compose the two flags, and the server end to end on a tiny model
whose tokenizer has harmony's special tokens, its replies forced by a Lark grammar."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from hyprefix.config import EngineArgs
from hyprefix.engine import Engine
from hyprefix.server import build_app
from hyprefix.server.args import ServerArgs
from hyprefix.server.chat_output import ChatOptions, ChatOutputRules, ChatStreamer, final_message
from hyprefix.server.harmony import MARKERS, read_harmony
from hyprefix.structured.grammar import GrammarCompiler

WEATHER = '{"location":"Paris"}'
CALL_AFTER_CHANNEL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{WEATHER}<|call|>"
CALL_IN_ROLE = f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}<|call|>"
# name -> (reply text, reasoning, content, [(function, arguments)])
REPLIES = {
    "analysis and final": (
        "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The answer is 4.<|return|>", "Let me think.", "The answer is 4.", []),
    "final only": ("<|channel|>final<|message|>The answer is 4.<|return|>", None, "The answer is 4.", []),
    "analysis only, cut at max_tokens": ("<|channel|>analysis<|message|>Let me thi", "Let me thi", "", []),
    "two analysis messages": (
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", "One.\nTwo.", "Done.", []),
    "call, recipient after the channel": (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + CALL_AFTER_CHANNEL,
        "Need weather.", "", [("get_weather", WEATHER)]),
    "call, recipient in the role header": (
        "<|channel|>analysis<|message|>Need weather.<|end|>" + CALL_IN_ROLE, "Need weather.", "",
        [("get_weather", WEATHER)]),
    "call as the first message": (
        f" to=functions.get_weather<|channel|>commentary json<|message|>{WEATHER}<|call|>", None, "",
        [("get_weather", WEATHER)]),
    "preamble and a call": (
        "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking the weather.<|end|>" + CALL_IN_ROLE, "Plan.", "Checking the weather.", [("get_weather", WEATHER)]),
    "two calls": (
        CALL_AFTER_CHANNEL + '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
        '{"tz":"CET"}<|call|>', None, "", [("get_weather", WEATHER), ("get_time", '{"tz":"CET"}')]),
    "call cut at max_tokens": (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"loc', None, "",
        [("get_weather", '{"loc')]),
    "a built-in tool's message and a made-up tool reply": (
        "<|channel|>analysis to=python<|message|>print(1)<|call|><|start|>assistant<|channel|>commentary "
        "to=browser.search<|message|>{}<|end|><|start|>functions.get_weather to=assistant<|channel|>commentary"
        "<|message|>\"sunny\"<|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>", "print(1)", "Hi", []),
    "a continued final message (no header)": ("The answer is 4.<|return|>", None, "The answer is 4.", []),
}
AUTO = ChatOutputRules("openai_gptoss", "auto", None, "openai", ())


def _streamed(rules: ChatOutputRules, text: str) -> tuple[dict, str | None]:
    """The reply fed to a ChatStreamer a character at a time (then once more, final), its deltas
    joined: (reasoning, content, [(name, arguments)]) and the stream's finish reason."""
    streamer = ChatStreamer(rules)
    reasoning, content, calls = "", "", []
    for end, final in [*((end, False) for end in range(len(text) + 1)), (len(text), True)]:
        delta = streamer.deltas(text[:end], final)
        assert set(delta) <= {"reasoning_content", "content", "tool_calls"}
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", ()):
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["id"].startswith("call_")
                calls.append([piece["function"]["name"], ""])
            calls[piece["index"]][1] += piece["function"]["arguments"]
    joined = {"reasoning": reasoning, "content": content, "calls": [tuple(c) for c in calls]}
    return joined, streamer.finish_reason("stop")


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_harmony_replies_whole_and_streamed_a_character_at_a_time(name):
    text, reasoning, content, calls = REPLIES[name]
    reply = read_harmony(text, final=True)
    assert (reply.reasoning, reply.content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in reply.calls] == calls
    message, finish = final_message(AUTO, text, "stop")
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == (content or (None if calls else ""))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert finish == ("tool_calls" if calls else "stop")
    streamed, stream_finish = _streamed(AUTO, text)
    assert streamed == {"reasoning": reasoning or "", "content": content, "calls": calls}
    assert stream_finish == finish
    assert not any(marker in content + (reasoning or "") for marker in MARKERS)


def test_a_partial_special_token_is_held_back_while_the_text_grows():
    for tail in ("<", "<|", "<|ret"):
        assert read_harmony("<|channel|>final<|message|>Hi" + tail, final=False).content == "Hi"
    assert read_harmony("<|channel|>final<|message|>Hi <b", final=False).content == "Hi <b"  # not a marker
    for opening in ("", "<", "<|chan", " to"):  # may still open a header: nothing yet
        reply = read_harmony(opening, final=False)
        assert (reply.reasoning, reply.content, reply.calls) == (None, "", [])
    header = read_harmony("<|channel|>analysis<|mess", final=False)
    assert (header.reasoning, header.content) == (None, "")
    call = read_harmony(" to=functions.get_weather<|channel|>commentary json<|message|>{\"lo", final=False).calls
    assert [(c.name, c.arguments, c.complete) for c in call] == [("get_weather", '{"lo', False)]


def test_either_flag_reads_harmony_and_calls_go_only_where_the_tool_mode_reads_them():
    text = REPLIES["preamble and a call"][0]
    alone = ChatOutputRules(reasoning_parser="openai_gptoss")  # the reasoning parser alone: calls left out
    message, finish = final_message(alone, text, "stop")
    assert message == {"content": "Checking the weather.", "reasoning_content": "Plan.", "tool_calls": []}
    assert finish == "stop"
    assert _streamed(alone, text) == ({"reasoning": "Plan.", "content": "Checking the weather.", "calls": []}, "stop")
    tools_only = ChatOutputRules(None, "auto", None, "openai", ())  # the tool parser alone: reasoning kept apart
    message, finish = final_message(tools_only, text, "stop")
    assert message["reasoning_content"] == "Plan." and message["content"] == "Checking the weather."
    assert len(message["tool_calls"]) == 1 and finish == "tool_calls"
    message, finish = final_message(ChatOutputRules(None, "none", None, "openai", ()), text, "stop")
    assert message["tool_calls"] == [] and finish == "stop"
    two = REPLIES["two calls"][0]
    single = ChatOutputRules(None, "auto", None, "openai", (), parallel_tool_calls=False)
    assert len(final_message(single, two, "stop")[0]["tool_calls"]) == 1
    assert _streamed(single, two)[0]["calls"] == [("get_weather", WEATHER)]
    assert final_message(AUTO, text, "length")[1] == "length"  # cut short: not a finished call
    named = ChatOutputRules(None, "named", "get_weather", "openai", ())
    assert final_message(named, text, "stop")[1] == "stop"  # a named function finishes with stop, as OpenAI


def test_options_and_sampling_overrides():
    ChatOptions(True, "openai", "openai_gptoss")
    for tool_parser, reasoning in (("hermes", "openai_gptoss"), ("openai", "qwen3")):
        with pytest.raises(ValueError, match="harmony"):
            ChatOptions(True, tool_parser, reasoning)
    assert ServerArgs(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="openai_gptoss").chat
    assert ChatOutputRules("qwen3").sampling_overrides() == {}
    assert ChatOutputRules("openai_gptoss").sampling_overrides() == {"skip_special_tokens": False}
    tools = ({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
             {"type": "function", "function": {"name": "get_time"}})
    required = ChatOutputRules(None, "required", None, "openai", tools).sampling_overrides()
    grammar = required["structured_outputs"].grammar
    assert '" to=functions.get_weather"' in grammar and '" to=functions.get_time"' in grammar
    named = ChatOutputRules("openai_gptoss", "named", "get_time", None, tools).sampling_overrides()
    assert "get_weather" not in named["structured_outputs"].grammar


# ------------------------------------------------------------------ end to end
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
RETURN_ID, CALL_ID, END_ID = 4096 + 5, 4096 + 6, 4096 + 1
# A harmony-like template: tools in a developer message, the reply opened with <|start|>assistant.
TEMPLATE = ("{%- if tools %}<|start|>developer<|message|># Tools\n{%- for tool in tools %}\n{{ tool.function.name }}: "
            "{{ tool.function.parameters | tojson }}{%- endfor %}<|end|>{% endif %}"
            "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": {
             "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
             "required": ["hour"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
GREEDY = dict(model="harmony", temperature=0)


def build_harmony_model(out: Path) -> None:
    """A tiny random Qwen3 checkpoint whose tokenizer is the project's with harmony's special
    tokens added (ids 4096-4102); <|return|> and <|call|> end generation, <|end|> does not,
    as gpt-oss's configs say."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4104, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         initializer_range=0.2, eos_token_id=[RETURN_ID, CALL_ID], bos_token_id=0, pad_token_id=0,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(out)
    tokenizer = json.loads((Path(__file__).resolve().parents[2] / "hyprefix/assets/tokenizer.json").read_text())
    tokenizer["added_tokens"] += [{"id": 4096 + i, "content": token, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True}
                                  for i, token in enumerate(HARMONY_TOKENS)]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def harmony_app(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony-model")
    build_harmony_model(path)
    engine = Engine(EngineArgs(model=str(path), num_kv_blocks=256, enforce_eager=True, log_stats_interval=0))
    assert {RETURN_ID, CALL_ID} <= engine.eos_token_ids and END_ID not in engine.eos_token_ids
    with TestClient(build_app(engine, ["harmony"])) as http:
        yield engine, http


@contextlib.contextmanager
def _served(harmony_app, **chat_options):
    """An ``openai`` client of the app with these chat options (as ``serve`` flags set them)."""
    serving = harmony_app[1].app.state.backend.serving
    saved, serving.chat_options = serving.chat_options, ChatOptions(**chat_options)
    try:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=harmony_app[1],
                            max_retries=0)
    finally:
        serving.chat_options = saved


def _forced(reply: str) -> dict:
    """``extra_body`` forcing ``reply`` (harmony markup as special tokens) and, after its last
    token, any text: generation ends there only if that token ends it."""
    parts = [f"{p}" if p in HARMONY_TOKENS else json.dumps(p) for p in _markup_split(reply)]
    return {"guided_grammar": "start: " + " ".join(parts) + " REST\nREST: /(?s:.*)/", "return_token_ids": True}


def _markup_split(text: str) -> list[str]:
    import re

    return [p for p in re.split("(" + "|".join(re.escape(t) for t in HARMONY_TOKENS) + ")", text) if p]


def _stream(client: openai.OpenAI, **kwargs) -> tuple[dict, list]:
    reasoning, content, calls, reasons = "", "", [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.id:
                calls.append([piece.function.name, ""])
            calls[piece.index][1] += piece.function.arguments or ""
        reasons.append(choice.finish_reason)
    return {"reasoning": reasoning, "content": content, "calls": [tuple(c) for c in calls]}, reasons


def test_reasoning_and_final_answer_end_to_end(harmony_app):
    engine, _ = harmony_app
    text, reasoning, content, _ = REPLIES["analysis and final"]
    with _served(harmony_app, reasoning_parser="openai_gptoss") as client:
        # skip_special_tokens true (the default, sent here too) does not hide the markup from the parser
        body = {**_forced(text), "skip_special_tokens": True}
        out = client.chat.completions.create(messages=MESSAGES, max_tokens=60, extra_body=body, **GREEDY)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == content
        assert choice.message.model_extra["reasoning_content"] == reasoning
        token_ids = choice.model_extra["token_ids"]
        assert token_ids[-1] == RETURN_ID and out.usage.completion_tokens == len(token_ids)  # <|return|> ended it
        assert engine.tokenizer.decode(token_ids, skip_special_tokens=False) == text
        streamed, reasons = _stream(client, messages=MESSAGES, max_tokens=60, extra_body=body, **GREEDY)
        assert streamed == {"reasoning": reasoning, "content": content, "calls": []} and reasons[-1] == "stop"


def test_auto_tool_call_end_to_end_and_hidden_without_the_tool_parser(harmony_app):
    reply = "<|channel|>analysis<|message|>Need weather.<|end|>" + CALL_IN_ROLE.replace(WEATHER, '{"city":"Oslo"}')
    body = _forced(reply)
    with _served(harmony_app, enable_auto_tool_choice=True, tool_call_parser="openai") as client:
        out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, max_tokens=80, extra_body=body, **GREEDY)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == "Need weather."
        (call,) = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Oslo"}')
        assert choice.model_extra["token_ids"][-1] == CALL_ID  # <|call|> ended it, not the grammar
        streamed, reasons = _stream(client, messages=MESSAGES, tools=TOOLS, max_tokens=80, extra_body=body, **GREEDY)
        assert streamed == {"reasoning": "Need weather.", "content": "", "calls": [("get_weather", '{"city":"Oslo"}')]}
        assert reasons[-1] == "tool_calls"
    with _served(harmony_app, reasoning_parser="openai_gptoss") as client:  # no tool parser: the call is left out
        out = client.chat.completions.create(messages=MESSAGES, max_tokens=80, extra_body=body, **GREEDY)
        message = out.choices[0].message
        assert message.content == "" and not message.tool_calls and out.choices[0].finish_reason == "stop"
        assert message.model_extra["reasoning_content"] == "Need weather."


def test_required_and_named_tool_choice_write_a_harmony_call(harmony_app):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    # <|end|> favoured: an analysis message the grammar may open ends at once (a random model
    # might otherwise reason until max_tokens); the grammar masks it everywhere else
    body = {"logit_bias": {str(END_ID): 50}, "return_token_ids": True}
    with _served(harmony_app, enable_auto_tool_choice=True, tool_call_parser="openai",
                 reasoning_parser="openai_gptoss") as client:
        out = client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
                                             extra_body=body, **GREEDY)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert choice.model_extra["token_ids"][-1] == CALL_ID
        named = client.chat.completions.create(
            messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}},
            max_tokens=120, extra_body=body, **GREEDY).choices[0]
        assert named.finish_reason == "stop"
        (call,) = named.message.tool_calls
        assert call.function.name == "set_alarm"
        jsonschema.validate(json.loads(call.function.arguments), schemas["set_alarm"])
        streamed, reasons = _stream(client, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
                                    extra_body=body, **GREEDY)
        assert [name for name, _ in streamed["calls"]] == [c.function.name for c in choice.message.tool_calls]
        assert streamed["calls"][0][1] == choice.message.tool_calls[0].function.arguments
        assert reasons[-1] == "tool_calls"


def test_the_harmony_tool_grammar_compiles_for_the_tokenizer(harmony_app):
    engine, _ = harmony_app
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    tools = tuple(TOOLS)
    for mode, function in (("required", None), ("named", "get_weather")):
        spec = ChatOutputRules("openai_gptoss", mode, function, None, tools).sampling_overrides()["structured_outputs"]
        grammar = compiler.grammar(spec)
        call = CALL_IN_ROLE.removeprefix("<|start|>assistant").replace(WEATHER, '{"city":"Oslo"}')
        ids = engine.tokenizer.encode(call)
        assert all(grammar.accept(i) for i in ids) and grammar.is_stopped()


def test_an_earlier_turns_reasoning_reaches_the_template_as_thinking():
    """A replayed assistant turn's ``reasoning_content`` is the template's ``thinking`` (what
    gpt-oss's template renders as the analysis before a tool call) and stays
    ``reasoning_content`` (what Qwen's templates read)."""
    import jinja2

    from hyprefix.server.protocol import ChatMessage

    message = ChatMessage.model_validate({
        "role": "assistant", "content": None, "reasoning_content": "Need weather.",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]})
    rendered = message.template_dict()
    assert rendered["thinking"] == rendered["reasoning_content"] == "Need weather."
    gpt_oss_line = ('{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>'
                    '{{ message.thinking }}<|end|>{%- endif %}')  # gpt-oss's template, for a turn with a call
    text = jinja2.Template(gpt_oss_line).render(message=rendered)
    assert text == "<|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
