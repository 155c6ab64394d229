"""The server against hostile and careless clients: a fan-out request does not hold the
engine for everyone, limits answer 400/413, bad text answers 400 (never a 500), a client
that stops reading is dropped, and a load test with cancellations leaves nothing behind.
Loopback only; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest

from tests.server.test_server import API_KEY, MODEL, _assert_error, _post, launch_server, metric, wait_idle

MAX_SEQS = 256
MAX_TOKENS = 200_000
STALL_S = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    with launch_server(log, "--api-key", API_KEY, "--max-request-seqs", str(MAX_SEQS), "--max-request-tokens",
                       str(MAX_TOKENS), "--stream-stall-timeout", str(STALL_S)) as (url, _):
        yield url


def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


# -------------------------------------------------------------------- fan-out
def test_fan_out_over_the_limits_is_refused(server):
    prompts = [f"hello {i}" for i in range(128)]
    error = _assert_error(_post(server, "completions", json.dumps(
        {"model": MODEL, "prompt": prompts, "n": 128, "max_tokens": 1})), 400, "n")
    assert error["code"] == "request_too_large" and "16384" in error["message"]
    error = _assert_error(_post(server, "chat", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 100, "max_tokens": 2100})),
        400, "max_tokens")
    assert error["code"] == "request_too_large"
    wait_idle(server)


def test_a_small_request_is_served_while_a_fan_out_runs(server):
    """16 prompts x n=16 = 256 long sequences (every slot of the engine and a queue behind
    them), then a one-line request: it must finish while the fan-out has done little of its
    work, not after it (first come first served would run it in the fan-out's last wave)."""
    wait_idle(server)
    fan_tokens = 48

    async def run() -> tuple[int, int]:
        client = aclient(server)
        received = 0
        started = asyncio.Event()

        async def fan_out() -> None:
            nonlocal received
            stream = await client.completions.create(
                model=MODEL, prompt=[f"fan {i}" for i in range(16)], n=16, max_tokens=fan_tokens, stream=True,
                temperature=1.0, seed=3, extra_body={"ignore_eos": True})
            async for chunk in stream:
                received += sum(1 for c in chunk.choices if c.text)
                if received >= 64:
                    started.set()
            assert received > 0

        try:
            fan = asyncio.ensure_future(fan_out())
            await asyncio.wait_for(started.wait(), 120)
            small = await client.completions.create(model=MODEL, prompt="a small request", max_tokens=4,
                                                    temperature=0, extra_body={"ignore_eos": True})
            assert small.usage.completion_tokens == 4
            at_small = received
            await asyncio.wait_for(fan, 300)
            return at_small, received
        finally:
            await client.close()

    at_small, total = asyncio.run(run())
    assert total >= 256 * fan_tokens * 0.9  # chunks carry one token of one choice, a few carry more
    assert at_small < total / 2, (at_small, total)
    wait_idle(server)


def test_a_fan_out_whose_client_leaves_is_aborted_at_once(server):
    wait_idle(server)
    aborted = metric(server, "hyprefix:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": [f"gone {i}" for i in range(16)], "n": 16, "max_tokens": 500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        for _ in zip(range(20), response.iter_lines(), strict=False):
            pass
    # the client is gone: every sequence is aborted and freed, and the next request runs
    small = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert small.status_code == 200
    wait_idle(server)
    assert metric(server, "hyprefix:request_success_total", finished_reason="abort") == aborted + 256


# ------------------------------------------------------------------ bad text
SURROGATE = "\ud800"
BAD_TEXT = [
    # (endpoint, body, status, param)
    ("completions", {"prompt": SURROGATE}, 400, "prompt"),
    ("completions", {"prompt": "a\udfffb"}, 400, "prompt"),
    ("completions", {"prompt": ["fine", "a" + SURROGATE]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "stop": [SURROGATE]}, 400, "stop"),
    ("completions", {"prompt": "hi", "cache_salt": "salt" + SURROGATE}, 400, "cache_salt"),
    ("completions", {"prompt": "hi", "model": SURROGATE}, 404, "model"),
    ("chat", {"messages": [{"role": "user", "content": SURROGATE}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" + SURROGATE}]}]}, 400,
     "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "model": SURROGATE}, 404, "model"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), BAD_TEXT,
                         ids=[f"{e}-{i}" for i, (e, *_) in enumerate(BAD_TEXT)])
def test_lone_surrogates_get_a_4xx_not_a_500(server, endpoint, body, status, param):
    body = {"model": MODEL, "max_tokens": 2, **body}
    error = _assert_error(_post(server, endpoint, json.dumps(body)), status, param)  # json escapes them
    if status == 404:
        assert error["code"] == "model_not_found" and "\\ud800" in error["message"]
    else:
        assert "unicode" in error["message"].lower()


# ------------------------------------------------------- a client that stops reading
@pytest.mark.slow
def test_a_stream_nobody_reads_is_aborted_and_its_blocks_freed(server):
    wait_idle(server)
    aborted = metric(server, "hyprefix:request_success_total", finished_reason="abort")
    url = urlparse(server)
    body = json.dumps({"model": MODEL, "prompt": "never read", "n": 32, "max_tokens": 4000, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.hostname, url.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 120  # the socket stays open and unread all along
        while metric(server, "hyprefix:request_success_total", finished_reason="abort") < aborted + 1:
            assert time.monotonic() < deadline, "the unread stream was never aborted"
            time.sleep(0.2)
        wait_idle(server)
    finally:
        sock.close()


# --------------------------------------------------------------------- load
def test_load_64_streams_a_third_cancelled_and_a_fan_out(server):
    wait_idle(server)
    rng = random.Random(11)
    cancel_after = {i: rng.randint(1, 20) for i in rng.sample(range(64), 21)}

    async def run() -> None:
        client = aclient(server)

        async def one(i: int) -> None:
            stream = await client.completions.create(
                model=MODEL, prompt=f"Load test stream {i}: {'once upon a time ' * (i % 5)}", max_tokens=24,
                stream=True, temperature=0.7, seed=i, extra_body={"ignore_eos": True})
            chunks, reason = 0, None
            async for chunk in stream:
                chunks += 1
                reason = chunk.choices[0].finish_reason or reason
                if chunks == cancel_after.get(i):
                    await stream.close()
                    return
            assert reason == "length"

        async def fan_out() -> None:
            out = await client.completions.create(
                model=MODEL, prompt=[f"fan {i}" for i in range(8)], n=16, max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True})
            assert len(out.choices) == 128 and all(c.finish_reason == "length" for c in out.choices)
            assert out.usage.completion_tokens == 128 * 16

        try:
            await asyncio.wait_for(asyncio.gather(fan_out(), *(one(i) for i in range(64))), 300)
        finally:
            await client.close()

    asyncio.run(run())
    wait_idle(server)
    assert metric(server, "hyprefix:kv_blocks_used") == 0
    assert metric(server, "hyprefix:num_requests_running") == 0


# ---------------------------------------------------------------- tenants
def test_cache_per_key_keeps_tenants_apart(tmp_path):
    keys = ["sk-tenant-a", "sk-tenant-b"]
    with launch_server(tmp_path / "server.log", "--api-key", *keys, "--cache-per-key") as (url, _):
        def cached(key: str, salt: str | None = None) -> int:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
            extra = {"cache_salt": salt} if salt else {}
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                            extra_body=extra)
            return out.usage.prompt_tokens_details.cached_tokens

        prompt = "A system prompt both tenants happen to send, long enough for a few blocks. " * 3
        assert cached(keys[0], "shared-guess") == 0
        assert cached(keys[0], "shared-guess") >= 16  # a tenant hits its own cache
        assert cached(keys[1], "shared-guess") == 0  # the same salt from another key reaches nothing
        assert cached(keys[1]) == 0
        assert cached(keys[1]) >= 16
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                          headers={"Authorization": "Bearer sk-nobody"}).status_code == 401


# ------------------------------------------------------------------ our bugs
def test_an_internal_error_is_a_500_with_a_log_line_not_a_400(monkeypatch, caplog):
    """A ValueError that is no RequestError is a bug of ours: 500, logged, and the server
    goes on serving."""
    from fastapi.testclient import TestClient

    from hyprefix.config import EngineArgs
    from hyprefix.demo import demo_model_path
    from hyprefix.engine import Engine
    from hyprefix.server import build_app

    engine = Engine(EngineArgs(model=str(demo_model_path("dense")), num_kv_blocks=64, enforce_eager=True,
                               log_stats_interval=0))
    real = engine.encode_chat

    def broken(messages, add_generation_prompt=True):
        if messages.messages[0]["content"] == "boom":
            raise ValueError("an internal invariant broke")
        return real(messages, add_generation_prompt)

    monkeypatch.setattr(engine, "encode_chat", broken)
    with TestClient(build_app(engine, ["demo"]), raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "boom"}]})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "internal_server_error"
        assert "invariant" not in response.text  # internals stay in the log
        assert "internal error on POST /v1/chat/completions" in caplog.text
        fine = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2})
        assert fine.status_code == 200
