"""Retention at the server (``cache/retention.py``): the request's ``cache_control`` (Anthropic's
``{"type": "ephemeral", "ttl": ...}``) is accepted on both endpoints, the response's
``cache_retention`` says what was granted (capped by ``--max-retention-s``), invalid values are
a 400 naming ``cache_control``, and ``--tool-call-retention-s`` keeps a chat turn that ends in
tool calls while a turn that does not is let go."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from hyprefix.demo import demo_model_path
from hyprefix.llm import LLM
from hyprefix.server import build_app

MODEL = "demo"
PROMPT = " ".join(f"word{i}" for i in range(40))  # a few blocks of 16 tokens
TOOLS = [{"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def served():
    llm = LLM(str(demo_model_path("dense")), num_kv_blocks=64, enforce_eager=True, log_stats_interval=0,
              max_retention_s=120, tool_call_retention_s=30)
    with TestClient(build_app(llm.engine, [MODEL])) as http:
        yield llm, http


def _post(http: TestClient, endpoint: str, **fields):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, **fields}
    if endpoint == "chat/completions":
        body.setdefault("messages", [{"role": "user", "content": PROMPT}])
    else:
        body["prompt"] = PROMPT
    # json.dumps writes NaN and Infinity as Python's json module (the server's) reads them
    return http.post(f"/v1/{endpoint}", content=json.dumps(body), headers={"content-type": "application/json"})


def _retentions(http: TestClient):
    """The engine's live retentions (``/metrics``), read until the caller has seen enough."""
    for _ in range(50):  # a stream's release of a retention lands just after its last chunk
        metrics = http.get("/metrics").text
        value = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("hyprefix:kv_retentions{"))
        yield int(value)
        time.sleep(0.02)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_cache_control_is_granted_and_capped(served, endpoint):
    _, http = served
    plain = _post(http, endpoint)
    assert plain.status_code == 200 and plain.json()["cache_retention"] is None
    for ttl, granted in (("1m", 60.0), (45, 45.0), ("90s", 90.0), (None, 120.0), ("1h", 120.0), (0, 0.0)):
        # no ttl: Anthropic's default "5m"; over --max-retention-s 120: capped to it
        control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
        response = _post(http, endpoint, cache_control=control)
        assert response.status_code == 200, response.text
        retention = response.json()["cache_retention"]
        assert retention["ttl_s"] == granted
        assert retention["tokens"] >= 16 and retention["tokens"] % 16 == 0 if granted else retention["tokens"] == 0


@pytest.mark.parametrize("bad", [-1, "-5m", "soon", "5 minutes", True, [5], {"s": 5}, float("nan"), float("inf")])
def test_an_invalid_ttl_is_a_400_naming_cache_control(served, bad):
    _, http = served
    for endpoint in ("completions", "chat/completions"):
        response = _post(http, endpoint, cache_control={"type": "ephemeral", "ttl": bad})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "cache_control"
    assert _post(http, "completions", cache_control={"type": "persistent"}).status_code == 400
    assert _post(http, "completions", cache_control="5m").status_code == 400


def test_a_stream_reports_the_grant_in_each_choices_last_chunk(served):
    _, http = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True, "n": 2,
            "cache_control": {"type": "ephemeral", "ttl": "2m"}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 2 and all(c["cache_retention"]["ttl_s"] == 120.0 for c in finals)
    assert all("cache_retention" not in c for c in chunks if c not in finals)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_retention_keeps_only_turns_that_end_in_tool_calls(served, stream):
    _, http = served
    assert http.post("/reset_prefix_cache").status_code == 200  # every retention ends
    messages = [{"role": "user", "content": PROMPT}]
    called = _chat(http, stream, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120,
                   temperature=1.0, seed=5, parallel_tool_calls=False)
    assert called["finish_reason"] == "tool_calls"
    assert called["cache_retention"]["ttl_s"] == 30.0 and called["cache_retention"]["tokens"] >= 16
    cut = _chat(http, stream, messages=messages, tools=TOOLS, max_tokens=1,
                tool_choice={"type": "function", "function": {"name": "ping"}})  # one token: no whole call
    assert cut["finish_reason"] == "length" and cut["cache_retention"] is None
    assert 1 in _retentions(http)  # the cut turn's retention was let go, the tool call's is kept
    own = _chat(http, stream, messages=messages, tools=TOOLS, max_tokens=1, cache_control={"ttl": 5},
                tool_choice={"type": "function", "function": {"name": "ping"}})
    assert own["cache_retention"]["ttl_s"] == 5.0  # the request's own retention is not the server's to end
    no_tools = _chat(http, stream, messages=messages, max_tokens=2)
    assert no_tools["cache_retention"] is None


def _chat(http: TestClient, stream: bool, **fields) -> dict:
    """(finish reason, cache_retention) of a one-choice chat call, streamed or not."""
    body = {"model": MODEL, "temperature": 0, "stream": stream, **fields}
    if not stream:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        return {"finish_reason": out["choices"][0]["finish_reason"], "cache_retention": out["cache_retention"]}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    (final,) = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    return {"finish_reason": final["choices"][0]["finish_reason"], "cache_retention": final.get("cache_retention")}
