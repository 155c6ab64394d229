"""The SmolLM2 and Gemma 3 GGUF files end to end through the official ``openai`` client:
their own chat templates, logprobs, a JSON schema and a required tool call."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from hyprefix.config import EngineArgs
from hyprefix.engine import Engine
from hyprefix.server import build_app

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "models"))
from fetch_test_models import GEMMA3, models_dir

pytestmark = pytest.mark.slow  # real GGUF models
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
                                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["capital", "population_millions"], "additionalProperties": False}
# Gemma 3's turn format (its GGUF file carries no chat template): sent as vLLM's chat_template field
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                  "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
                  "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module", params=[SMOLLM2, GEMMA3])
def client(request):
    path = models_dir() / request.param
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make test` or `python tools/models/fetch_test_models.py`")
    engine = Engine(EngineArgs(model=str(path), dtype="float32", enforce_eager=True, log_stats_interval=0,
                               max_model_len=1024, num_kv_blocks=256))
    extra = {"chat_template": GEMMA_TEMPLATE} if request.param == GEMMA3 else {}
    with TestClient(build_app(engine, ["m"])) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), extra


def test_chat_logprobs_json_schema_and_a_required_tool_call(client):
    client, extra = client
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="m", messages=question, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body=extra)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(t.top_logprobs[0].token == t.token and t.logprob == t.top_logprobs[0].logprob for t in content)
    structured = client.chat.completions.create(
        model="m", messages=question, max_tokens=60, temperature=0.7, seed=1, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}, extra_body=extra)
    for choice in structured.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(model="m", messages=weather, tools=TOOLS, tool_choice="required",
                                            max_tokens=60, temperature=0, extra_body=extra)
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    follow_up = [*weather, called.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model="m", messages=follow_up, tools=TOOLS, tool_choice="none",
                                           max_tokens=12, temperature=0, stream=True, extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
