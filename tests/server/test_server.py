"""The OpenAI-compatible server, end to end: ``hyprefix serve`` in a subprocess on a
free localhost port, driven with the official ``openai`` package (and httpx for
malformed requests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyprefix.demo import demo_model_path

API_KEY = "sk-hyprefix-test"
MODEL = "demo"
LONG_TEXT = ("Prefix caching keeps the keys and values of a shared prompt so that the next request "
             "with the same beginning skips straight to the new part of its prompt. ")


# ------------------------------------------------------------------ helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(log_path: Path, *extra: str, model_args: tuple[str, ...] | None = None) -> Iterator[
        tuple[str, subprocess.Popen]]:
    """Start ``hyprefix serve``, wait for /health, yield (base url, process), then SIGTERM it."""
    port = _free_port()
    if model_args is None:
        model_args = ("--model", "demo-dense-tiny", "--served-model-name", MODEL)
    cmd = [sys.executable, "-m", "hyprefix.cli", "serve", *model_args, "--port", str(port),
           "--num-kv-blocks", "1024", "--enforce-eager", "--log-stats-interval", "0", "--no-access-log", *extra]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not come up:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_idle(url: str, timeout: float = 30) -> None:
    """Wait until no request runs or waits and no KV block is referenced."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [metric(url, f"hyprefix:{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                         "kv_blocks_used")]
        if busy == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, f"still busy (running, waiting, blocks used) = {busy}"
        time.sleep(0.1)


def unique_prompt(words: int = 1) -> str:
    return f"[{uuid.uuid4().hex}] " + LONG_TEXT * words


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with launch_server(tmp_path_factory.mktemp("server") / "server.log", "--api-key", API_KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """(text per choice, finish reason per choice, usage) of a completions or chat stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + delta
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "two final chunks for one choice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


# --------------------------------------------------------------- behaviour
def test_health_models_and_version(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/version").json()["version"]


def test_models_do_not_show_the_model_directory(server):
    response = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    (card,) = response.json()["data"]
    assert card["id"] == card["root"] == MODEL
    model_dir = str(demo_model_path("dense"))  # what --model demo-dense-tiny loads
    assert model_dir not in response.text and "demo-dense-tiny" not in response.text


def test_openapi_documents_the_errors_the_server_sends(server):
    schema = httpx.get(f"{server}/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413"):
            assert responses[status]["content"]["application/json"]["schema"] == error_ref, (path, status)
    assert set(schema["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}


def test_completion_stream_and_non_stream_agree(client):
    prompt = "The quick brown fox"
    full = client.completions.create(prompt=prompt, max_tokens=12, **GREEDY)
    assert full.object == "text_completion" and full.model == MODEL
    (choice,) = full.choices
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    stream = client.completions.create(prompt=prompt, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    texts, reasons, usage = stream_text(stream)
    assert texts == {0: choice.text} and reasons == {0: "length"}
    assert usage.completion_tokens == 12 and usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_and_non_stream_agree(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    full = client.chat.completions.create(messages=messages, max_tokens=10, **GREEDY)
    assert full.object == "chat.completion"
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(messages=messages, max_completion_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    texts, reasons, usage = stream_text(iter(chunks))
    assert texts == {0: choice.message.content} and reasons == {0: "length"}
    assert usage.completion_tokens == 10 and usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_n2_and_seeded_sampling_reproducible(client):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=1234, n=2,
                extra_body={"ignore_eos": True})
    first, second = client.completions.create(**args), client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 32
    texts, reasons, _ = stream_text(client.completions.create(stream=True, **args))
    assert texts == {c.index: c.text for c in first.choices} and reasons == {0: "length", 1: "length"}

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
                temperature=0.9, top_p=0.95, seed=7, n=2, extra_body={"top_k": 50})
    a, b = client.chat.completions.create(**chat), client.chat.completions.create(**chat)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    texts, _, _ = stream_text(client.chat.completions.create(stream=True, **chat))
    assert texts == {c.index: c.message.content for c in a.choices}


def test_stop_strings(client):
    prompt = "In the beginning"
    full = client.completions.create(prompt=prompt, max_tokens=24, **GREEDY).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.find(stop)]
    out = client.completions.create(prompt=prompt, max_tokens=24, stop=[stop, "never-matches-xyz"], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected
    texts, reasons, _ = stream_text(client.completions.create(prompt=prompt, max_tokens=24, stop=stop,
                                                              stream=True, **GREEDY))
    assert texts == {0: expected} and reasons == {0: "stop"}

    messages = [{"role": "user", "content": "Count with me."}]
    chat_full = client.chat.completions.create(messages=messages, max_tokens=24, **GREEDY).choices[0].message.content
    chat_stop = chat_full[len(chat_full) // 2:len(chat_full) // 2 + 3]
    out = client.chat.completions.create(messages=messages, max_tokens=24, stop=chat_stop, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == chat_full[:chat_full.find(chat_stop)]


@pytest.mark.parametrize("n_tokens", [1, 40])
def test_ignore_eos_returns_exactly_max_tokens(client, n_tokens):
    extra = {"ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=n_tokens, temperature=0.8, seed=3,
                                    extra_body=extra)
    assert out.usage.completion_tokens == n_tokens and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=n_tokens, temperature=0.8, seed=3, extra_body=extra)
    assert chat.usage.completion_tokens == n_tokens and chat.choices[0].finish_reason == "length"


def test_echo_and_several_prompts(client):
    out = client.completions.create(prompt="Echo me", echo=True, max_tokens=4, **GREEDY)
    assert out.choices[0].text.startswith("Echo me")
    texts, _, _ = stream_text(client.completions.create(prompt="Echo me", echo=True, max_tokens=4, stream=True,
                                                        **GREEDY))
    assert texts == {0: out.choices[0].text}
    singles = [client.completions.create(prompt=p, max_tokens=6, **GREEDY).choices[0].text for p in ("A cat", "A dog")]
    both = client.completions.create(prompt=["A cat", "A dog"], max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert both.usage.completion_tokens == 24
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9, 10]], max_tokens=3, **GREEDY)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 6


def test_repeated_prompt_hits_the_prefix_cache(server, client):
    prompt = unique_prompt(2)
    hits_before = metric(server, "hyprefix:prefix_cache_hits_total")
    first = client.completions.create(prompt=prompt, max_tokens=4, **GREEDY)
    assert first.usage.prompt_tokens >= 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(prompt=prompt, max_tokens=4, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    assert metric(server, "hyprefix:prefix_cache_hits_total") - hits_before >= cached
    assert metric(server, "hyprefix:prefill_skipped_tokens_total") >= cached

    messages = [{"role": "system", "content": unique_prompt(2)}, {"role": "user", "content": "Hi"}]
    client.chat.completions.create(messages=messages, max_tokens=2, **GREEDY)
    again = client.chat.completions.create(messages=messages, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_reset_prefix_cache(server, client):
    prompt = unique_prompt(2)
    client.completions.create(prompt=prompt, max_tokens=2, **GREEDY)
    wait_idle(server)
    assert httpx.post(f"{server}/reset_prefix_cache").status_code == 401
    reset = httpx.post(f"{server}/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert reset.status_code == 200 and reset.json()["dropped_blocks"] >= 2
    assert metric(server, "hyprefix:kv_blocks_cached") == 0
    again = client.completions.create(prompt=prompt, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_client_closing_a_stream_aborts_the_request(server, client):
    wait_idle(server)
    aborted = metric(server, "hyprefix:request_success_total", finished_reason="abort")
    stream = client.completions.create(prompt=unique_prompt(), max_tokens=3000, stream=True, **GREEDY)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert metric(server, "hyprefix:num_requests_running") == 1
    stream.close()
    wait_idle(server)
    assert metric(server, "hyprefix:request_success_total", finished_reason="abort") == aborted + 1


def test_client_leaving_a_non_streaming_request_aborts_it(server):
    wait_idle(server)
    aborted = metric(server, "hyprefix:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": unique_prompt(), "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.0),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_idle(server)
    assert metric(server, "hyprefix:request_success_total", finished_reason="abort") == aborted + 1


def test_64_concurrent_streams(server, client):
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    reference = [client.completions.create(prompt=p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]

    async def run() -> list[tuple[str, str | None, int]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, str | None, int]:
            stream = await aclient.completions.create(
                prompt=prompts[i % 8], max_tokens=12, stream=True, stream_options={"include_usage": True},
                **GREEDY)
            text, reason, tokens = "", None, -1
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return text, reason, tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert [r[0] for r in results] == [reference[i % 8] for i in range(64)]
    assert all(r[1] == "length" and r[2] == 12 for r in results)
    wait_idle(server)


# ------------------------------------------------------------------- errors
OK_MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (endpoint, body, status, param)
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "prompt"),
    ("completions", {"prompt": [5] * 4200, "max_tokens": 1}, 400, "prompt"),
    ("completions", {"prompt": 42}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [99999]}, 400, "prompt"),
    ("completions", {"prompt": [[5, 6], [7, 4096]]}, 400, "prompt"),  # a batch: one id outside the vocabulary
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": ["s"] * 20_000}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": ["ok", "x\ud800"]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop_token_ids": list(range(5000))}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # over --max-logprobs
    ("completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "guided_json": "{not json"}, 400, "guided_json"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "(a+"}}, 400, "structured_outputs"),
    ("completions", {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ("completions", {"prompt": "hi", "suffix": "tail"}, 400, "suffix"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("completions", {"prompt": "hi", "store": True}, 400, "store"),
    ("completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": "hello"}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("chat", {"messages": OK_MESSAGES, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("chat", {"messages": OK_MESSAGES, "max_tokens": 5000}, 400, "messages"),
    ("chat", {"messages": OK_MESSAGES, "top_k": -5}, 400, "top_k"),
    ("chat", {"messages": OK_MESSAGES, "ignore_eos": "true"}, 400, "ignore_eos"),
    ("chat", {"messages": OK_MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs
    ("chat", {"messages": OK_MESSAGES, "logprobs": True, "top_logprobs": 30}, 400, "logprobs"),
    ("chat", {"messages": OK_MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format"),
    # tools let the model choose (auto) by default: this server was started without a tool parser
    ("chat", {"messages": OK_MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("chat", {"messages": OK_MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"messages": OK_MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("chat", {"messages": OK_MESSAGES, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "extra": 1}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}, 400, "messages"),
    ("chat", {"messages": OK_MESSAGES, "stream_options": {"include_usage": 1}}, 400, "stream_options"),
    ("chat", {"messages": OK_MESSAGES, "model": "gpt-4"}, 404, "model"),
]


def _post(url: str, endpoint: str, content: bytes | str, key: str | None = API_KEY) -> httpx.Response:
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(url + path, content=content, headers=headers, timeout=30)


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{e}-{i}" for i, (e, *_) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, endpoint, body, status, param):
    error = _assert_error(_post(server, endpoint, json.dumps(body)), status, param)
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize(("content", "status"), [
    (b'{"prompt": "hi", ', 400),   # malformed JSON
    (b"[1, 2, 3]", 400),           # not an object
    (b"", 400),                    # no body
    (b"\xff\xfe", 400),            # not UTF-8
])
def test_malformed_bodies(server, content, status):
    _assert_error(_post(server, "completions", content), status)
    _assert_error(_post(server, "chat", content), status)


def test_request_body_over_the_limit_gets_413(server, client):
    """The server runs with the default --max-request-body-mb 16: a 17 MiB body is refused
    whether its Content-Length says so or it arrives chunked."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": MODEL, "prompt": "x" * (17 * 2**20), "max_tokens": 1}).encode()
    declared = httpx.post(f"{server}/v1/completions", content=body, headers=headers, timeout=30)
    assert _assert_error(declared, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 2**20):
            yield body[start:start + 2**20]

    chunked = httpx.post(f"{server}/v1/chat/completions", content=chunks(), headers=headers, timeout=30)
    assert "content-length" not in chunked.request.headers
    assert _assert_error(chunked, 413)["code"] == "request_too_large"
    assert client.completions.create(prompt="still fine", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_api_key(server, client):
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    for key in (None, "wrong-key"):
        error = _assert_error(_post(server, "completions", body, key=key), 401)
        assert error["code"] == "invalid_api_key"
    bad = httpx.post(f"{server}/v1/completions", content=body, headers={"Authorization": "Basic " + API_KEY})
    _assert_error(bad, 401)
    assert httpx.get(f"{server}/v1/models").status_code == 401
    for path, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(server + path, json=payload).status_code == 401
        authorized = httpx.post(server + path, json=payload, headers={"Authorization": f"Bearer {API_KEY}"})
        assert authorized.status_code == 200, authorized.text
    assert httpx.get(f"{server}/health").status_code == 200  # probes and scrapes need no key
    assert httpx.get(f"{server}/metrics").status_code == 200
    # the status page and its data too; the data tells the page's chat box to ask for the key
    assert httpx.get(f"{server}/").status_code == 200
    assert httpx.get(f"{server}/status").json()["api_key_required"] is True
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_errors_through_the_openai_client_and_nothing_leaks(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=OK_MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[list(range(3, 100)), [5] * 5000], max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert httpx.get(f"{server.rstrip('/')}/v1/nowhere", headers={"Authorization": f"Bearer {API_KEY}"}
                     ).status_code == 404
    assert httpx.get(f"{server}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 405
    wait_idle(server)  # the valid first prompt of the rejected pair was rolled back
    assert client.completions.create(prompt="still fine", max_tokens=3, **GREEDY).usage.completion_tokens == 3


# ----------------------------------------------------------------- shutdown
def readme_first_curl() -> tuple[str, dict]:
    """The path and JSON body of the first curl of README.md's quick start."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text[text.index("## Quick start"):].split("```sh\n", 1)[1].split("```", 1)[0]
    command = block.replace("\\\n", " ").splitlines()[0]
    assert command.startswith("curl http://127.0.0.1:8000/"), command
    path = command.split()[1].removeprefix("http://127.0.0.1:8000")
    return path, json.loads(command.split(" -d '", 1)[1].rsplit("'", 1)[0])


def test_sigterm_aborts_streams_and_stops_cleanly(tmp_path):
    """The default model (no --model: SmolLM2-135M-Instruct, which ``make test`` fetched) and
    its name; the README's first curl gets a real answer; SIGTERM mid-stream ends the stream
    with an ``abort`` choice and ``[DONE]``, and the engine thread stops."""
    log_path = tmp_path / "server.log"
    with launch_server(log_path, model_args=()) as (url, proc):
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["smollm2-135m-instruct"]
        path, readme_body = readme_first_curl()
        answer = httpx.post(url + path, json=readme_body, timeout=60).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]
        events: list[str] = []
        body = {"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    log = log_path.read_text()
    assert "shutting down: aborted 1 requests in flight" in log
    assert "engine loop stopped" in log
    assert "Traceback" not in log
