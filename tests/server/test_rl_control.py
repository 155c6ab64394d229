"""What an RL trainer drives besides generation, through the app in process (SGLang's
endpoints): pause with abort returns partial outputs to every client, waiting ones included,
and requests arriving while paused wait; pause in place continues exactly; abort by the
client's request id and abort all; weight updates from disk (the new weights' tokens, no hit
on a prefix cached before, the version reported, bad checkpoints refused), finishing or
aborting the requests in flight."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from hyprefix import LLM, SamplingParams
from hyprefix.config import EngineArgs
from hyprefix.demo import demo_model_path
from hyprefix.engine import Engine
from hyprefix.server import build_app

MODEL = "demo"
LONG = 1500  # max_tokens of a request that runs until it is stopped
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    """The demo model's checkpoint with other weights: every tensor perturbed."""
    path = tmp_path_factory.mktemp("demo-v2")
    source = demo_model_path("dense")
    for file in source.iterdir():
        shutil.copy(file, path / file.name)
    generator = torch.Generator().manual_seed(0)
    tensors = {name: t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
               for name, t in load_file(source / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def app():
    """(engine, client, backend) of an app whose engine runs one sequence at a time, so
    a second request waits."""
    engine = Engine(EngineArgs(model=str(demo_model_path("dense")), num_kv_blocks=256, enforce_eager=True,
                               max_num_seqs=1, log_stats_interval=0))
    with TestClient(build_app(engine, [MODEL])) as http:
        yield engine, http, http.app.state.backend


def complete(http: TestClient, prompt=PROMPT, max_tokens: int = LONG, **fields) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def running_and_waiting(backend) -> tuple[int, int]:
    stats = backend.async_engine.stats
    return stats["num_requests_running"], stats["num_requests_waiting"]


def stream_tokens(http: TestClient, chunks: list, **fields) -> dict:
    """A streamed completion: each chunk with tokens goes to ``chunks``; returns the final
    (token ids, finish reason)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, **fields}
    ids, reason = [], None
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice.get("token_ids") or []
                chunks.append(time.monotonic())
                reason = choice.get("finish_reason") or reason
    return {"token_ids": ids, "finish_reason": reason}


def idle(engine: Engine, backend) -> None:
    wait_for(lambda: running_and_waiting(backend) == (0, 0), "the engine to go idle")
    assert backend.async_engine.stats["kv_blocks_used"] == 0


def test_pause_with_abort_returns_partial_outputs_to_every_client_and_new_requests_wait(app):
    engine, http, backend = app
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(complete, http, logprobs=1) for _ in range(3)]
        wait_for(lambda: running_and_waiting(backend) == (1, 2), "one running, two waiting")
        response = http.post("/pause_generation", json={"mode": "abort"})
        assert response.json() == {"success": True, "mode": "abort", "num_aborted_requests": 3}
        outs = [call.result(timeout=30)["choices"][0] for call in calls]
        assert [c["finish_reason"] for c in outs] == ["abort"] * 3
        lengths = sorted(len(c["token_ids"]) for c in outs)
        assert lengths[:2] == [0, 0] and 0 < lengths[2] < LONG  # the running one's partial output
        assert all(len(c["text"]) == 0 for c in outs if not c["token_ids"])
        assert all(len(c["logprobs"]["tokens"]) == len(c["token_ids"]) for c in outs)  # with their logprobs
        later = pool.submit(complete, http, max_tokens=4)
        time.sleep(0.5)
        assert not later.done() and running_and_waiting(backend) == (0, 1)  # paused: it waits
        assert http.post("/continue_generation").json() == {"success": True}
        assert later.result(timeout=30)["choices"][0]["finish_reason"] == "length"
    idle(engine, backend)


def test_pause_in_place_then_continue_gives_the_uninterrupted_output(app):
    engine, http, backend = app
    reference = complete(http, max_tokens=80)["choices"][0]["token_ids"]
    arrivals: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        call: Future = pool.submit(stream_tokens, http, arrivals, max_tokens=80)
        wait_for(lambda: len(arrivals) >= 5, "tokens to stream")
        assert http.post("/pause_generation", json={"mode": "in_place"}).json()["num_aborted_requests"] == 0
        time.sleep(0.2)
        seen = len(arrivals)
        time.sleep(0.5)
        assert len(arrivals) == seen and not call.done()  # nothing generated while paused
        http.post("/continue_generation")
        out = call.result(timeout=30)
    assert out == {"token_ids": reference, "finish_reason": "length"}
    idle(engine, backend)


def test_abort_a_request_by_its_id_and_all(app):
    engine, http, backend = app
    with ThreadPoolExecutor(2) as pool:
        mine = pool.submit(complete, http, request_id="rollout-7")
        other = pool.submit(complete, http)
        wait_for(lambda: sum(running_and_waiting(backend)) == 2, "both requests in")
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "request_id": "rollout-7"}
        clash = http.post("/v1/completions", json=body)  # that id is in flight
        assert clash.status_code == 400 and "in use" in clash.json()["error"]["message"], clash.text
        assert http.post("/abort_request", json={"rid": "rollout-7"}).json()["num_aborted_requests"] == 1
        out = mine.result(timeout=30)
        assert out["id"] == "cmpl-rollout-7" and out["choices"][0]["finish_reason"] == "abort"
        assert not other.done()
        assert http.post("/abort_request", json={"rid": "rollout-7"}).json()["num_aborted_requests"] == 0
        assert http.post("/abort_request", json={"abort_all": True}).json()["num_aborted_requests"] == 1
        assert other.result(timeout=30)["choices"][0]["finish_reason"] == "abort"
    for body in ({}, {"rid": "x", "abort_all": True}, {"rid": "x", "flush": True}):
        response = http.post("/abort_request", json=body)
        assert response.status_code == 400, body
    idle(engine, backend)


def test_update_weights_from_disk(app, new_weights):
    engine, http, backend = app
    before = complete(http, max_tokens=6)
    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    for body, param in (({"model_path": "/nonexistent"}, "model_path"),
                        ({"model_path": str(demo_model_path("hybrid"))}, "model_path"),
                        ({"model_path": str(new_weights), "flush_cache": True}, "flush_cache")):
        response = http.post("/update_weights_from_disk", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert complete(http, max_tokens=6)["choices"] == before["choices"]  # nothing changed
    result = http.post("/update_weights_from_disk", json={"model_path": str(new_weights), "weight_version": "v2"})
    assert result.status_code == 200 and result.json()["weight_version"] == "v2" and result.json()["success"]
    assert http.get("/get_weight_version").json() == {"weight_version": "v2"}
    after = complete(http, max_tokens=6)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prompt was cached before
    expected = LLM(str(new_weights), enforce_eager=True, log_stats_interval=0).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert after["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids) != before["choices"][0]["token_ids"]
    idle(engine, backend)


def test_an_update_lets_requests_in_flight_finish_or_aborts_them(app, new_weights):
    engine, http, backend = app
    old = complete(http, max_tokens=40)["choices"][0]["token_ids"]  # the current weights' output
    with ThreadPoolExecutor(1) as pool:
        arrivals: list[float] = []
        call = pool.submit(stream_tokens, http, arrivals, max_tokens=40)
        wait_for(lambda: len(arrivals) >= 2, "tokens to stream")
        result = http.post("/update_weights_from_disk", json={"model_path": str(new_weights)})
        assert result.status_code == 200
        assert call.done() and call.result() == {"token_ids": old, "finish_reason": "length"}  # under the old ones
        arrivals = []
        call = pool.submit(stream_tokens, http, arrivals)
        wait_for(lambda: len(arrivals) >= 2, "tokens to stream")
        result = http.post("/update_weights_from_disk", json={"model_path": str(new_weights),
                                                              "abort_all_requests": True})
        assert result.status_code == 200
        out = call.result(timeout=30)
        assert out["finish_reason"] == "abort" and 0 < len(out["token_ids"]) < LONG
    idle(engine, backend)
    engine.check_invariants()
