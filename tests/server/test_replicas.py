"""``hyprefix serve --replicas``: a local Ray cluster in the test (loopback only), two
engine replicas of a tiny Llama behind the OpenAI app, routed by prefix."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hyprefix import LLM, SamplingParams  # noqa: E402
from hyprefix.config import EngineArgs  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray cluster and two engine replicas

MODEL_NAME = "tiny"
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_models):
    import ray
    from ray import serve

    from hyprefix.replicas.app import ReplicasConfig, build_replicas_app
    from hyprefix.server.args import ServerArgs

    path = str(tiny_models["llama"][0])
    args = EngineArgs(model=path, dtype="float32", num_kv_blocks=256, enforce_eager=True)
    port = free_port()
    # Ray sends a request to the next replica of the router's ranking when the first does not
    # answer its queue-length probe within 0.1 s, which a loaded 2-core runner can miss: these
    # tests check the ranking, so the probe gets 1 s.
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=2**28, configure_logging=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        server = ServerArgs(replicas=2, replica_cpus=1, served_model_name=[MODEL_NAME])
        serve.run(build_replicas_app(ReplicasConfig(engine=args, server=server)),
                  name="hyprefix-test", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _until_the_router_uses_both_replicas(client)
            yield client, path
        serve.shutdown()
    finally:
        ray.shutdown()


def _until_the_router_uses_both_replicas(client) -> None:
    """``serve.run`` returns once both replicas run, but the ingress's router learns of them
    (and of their KV event endpoints) a moment later: send new prefixes until both have
    served one, so the tests see the routing they test. Under a loaded 2-core machine (the
    whole suite beside it) that moment has come after more than a minute, so it waits up to
    three."""
    deadline = time.monotonic() + 180
    for seed in range(1000, 2000):
        complete(client, prompt(seed, BLOCK))
        if sum(v > 0 for v in per_replica(samples(client), "hyprefix:prompt_tokens_total").values()) == 2:
            return
        assert time.monotonic() < deadline, "the router never used both replicas"
        time.sleep(0.1)


def complete(client, prompt, **kwargs) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kwargs}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def samples(client) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of the app's /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def per_replica(metrics: dict, name: str, **labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (sample, sample_labels), value in metrics.items():
        found = dict(sample_labels)
        if sample == name and all(found.get(k) == v for k, v in labels.items()):
            out[found["replica"]] = out.get(found["replica"], 0.0) + value
    return out


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 4000 + 10 for i in range(length)]


def test_repeats_of_a_prefix_land_where_it_is_cached_and_new_ones_spread(cluster):
    client, _ = cluster
    client.post("/reset_prefix_cache")
    before = samples(client)
    cached = []
    for seed in range(4):
        base = prompt(seed, 5 * BLOCK)
        first = complete(client, [*base, 1, 2, 3])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(0.2)  # the replica's BlockStored events reach the router (they left after its prefill)
        again = complete(client, [*base, 4, 5])
        cached.append(again["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [5 * BLOCK] * 4  # every repeat went to the replica holding its prefix
    after = samples(client)
    served = per_replica(after, "hyprefix:prompt_tokens_total")
    old = per_replica(before, "hyprefix:prompt_tokens_total")
    grown = {r for r in served if served[r] > old.get(r, 0.0)}
    assert len(grown) == 2  # the four new prefixes went to both replicas (ties rotate)
    routed = per_replica(after, "hyprefix:router_requests_total", reason="prefix")
    assert sum(routed.values()) - sum(per_replica(before, "hyprefix:router_requests_total", reason="prefix").values()) \
        == 4
    assert_the_router_counts_nothing_running(client)
    # the status page's data: both replicas' numbers, summed, and their requests
    status = client.get("/status").json()
    assert status["replicas"] == 2 and status["model"] == MODEL_NAME
    hits = per_replica(samples(client), "hyprefix:prefix_cache_hits_total")
    assert status["stats"]["prefix_cache_hits"] == sum(hits.values())
    assert {r["replica"] for r in status["recent_requests"]} == set(hits)
    assert status["recent_requests"][0]["cached_tokens"] == 5 * BLOCK  # the newest: the last repeat


def assert_the_router_counts_nothing_running(client) -> None:
    """Every request the router chose has ended, so no replica's load stays counted
    (a leaked count would keep the least-loaded rule off that replica for good). Ray
    reports an end on the ingress's event loop just after the response."""
    deadline = time.monotonic() + 10
    while any(per_replica(samples(client), "hyprefix:router_requests_running").values()):
        assert time.monotonic() < deadline, per_replica(samples(client), "hyprefix:router_requests_running")
        time.sleep(0.1)


def test_a_burst_on_a_new_prefix_follows_its_first_request(cluster):
    """Concurrent requests on one new prefix: the first one's blocks count as held where
    it went while it computes them, so the others go there too."""
    import concurrent.futures

    client, _ = cluster
    client.post("/reset_prefix_cache")
    base = prompt(99, 8 * BLOCK)
    before = per_replica(samples(client), "hyprefix:prompt_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda i: complete(client, [*base, i + 1], max_tokens=8), range(6)))
    assert len(outs) == 6
    after = per_replica(samples(client), "hyprefix:prompt_tokens_total")
    grown = {r: after[r] - before.get(r, 0.0) for r in after if after[r] > before.get(r, 0.0)}
    assert len(grown) == 1 and sum(grown.values()) == 6 * (8 * BLOCK + 1)
    assert_the_router_counts_nothing_running(client)


def test_greedy_tokens_and_streams_match_one_engine(cluster):
    client, path = cluster
    prompts = [prompt(s, 40 + s) for s in range(3)]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                                       use_tqdm=False)]
    got = [complete(client, p, max_tokens=6)["choices"][0]["token_ids"] for p in prompts]
    assert got == [list(w) for w in want]

    text, ids, done = "", [], False
    with client.stream("POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": prompts[0], "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True, "stream": True,
                                                        "return_token_ids": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                ids += choice.get("token_ids") or []
    assert done and ids == list(want[0])
    assert text == complete(client, prompts[0], max_tokens=6)["choices"][0]["text"]

    chat = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 3, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hello"}]})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3


def test_tokenize_at_the_ingress_is_what_a_replica_is_fed(cluster):
    from transformers import AutoTokenizer

    client, path = cluster
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "hello replicas"
    tokens = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": text, "return_token_strs": True}).json()
    assert tokens["tokens"] == tokenizer.encode(text)
    assert tokens["token_strs"] == tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert complete(client, text, max_tokens=1)["choices"][0]["prompt_token_ids"] == tokens["tokens"]
    messages = [{"role": "user", "content": "hello"}]
    chat = client.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    fed = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 1, "messages": messages,
                                                    "return_token_ids": True}).json()
    assert fed["prompt_token_ids"] == chat["tokens"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    detokenized = client.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]})
    assert detokenized.json() == {"prompt": text}
    outside = client.post("/detokenize", json={"tokens": [5, 10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404


def test_errors_are_the_single_server_errors(cluster):
    client, _ = cluster
    unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_long = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * 10, "max_tokens": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    bad_json = client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    empty = client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL_NAME]


def test_a_client_that_leaves_aborts_its_request_on_the_replica(cluster):
    client, _ = cluster

    def aborted_and_running() -> tuple[float, float]:
        metrics = samples(client)
        return (sum(per_replica(metrics, "hyprefix:request_success_total", finished_reason="abort").values()),
                sum(per_replica(metrics, "hyprefix:num_requests_running").values()))

    aborted, _ = aborted_and_running()
    body = {"model": MODEL_NAME, "prompt": prompt(7, 20), "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
    with pytest.raises(httpx.TimeoutException):  # and one without stream, left while it runs
        client.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
    deadline = time.monotonic() + 20
    while aborted_and_running() != (aborted + 2, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted_and_running() == (aborted + 2, 0)
    assert_the_router_counts_nothing_running(client)


def test_reset_reaches_every_replica_and_the_router(cluster):
    client, _ = cluster
    bases = [prompt(200 + s, 4 * BLOCK) for s in range(2)]
    for base in bases:
        complete(client, base)
    dropped = client.post("/reset_prefix_cache").json()["dropped_blocks"]
    assert dropped >= 8  # both prompts' blocks, on both replicas
    metrics = samples(client)
    assert set(per_replica(metrics, "hyprefix:kv_blocks_cached")) == set(per_replica(metrics,
                                                                                     "hyprefix:kv_blocks_used"))
    assert sum(per_replica(metrics, "hyprefix:kv_blocks_cached").values()) == 0
    assert len(per_replica(metrics, "hyprefix:kv_blocks_cached")) == 2  # one series per replica
    assert complete(client, bases[0])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _niceness_of_threads(cmdline_part: str) -> dict[int, set[int]]:
    """pid -> the niceness of each of its threads, for processes whose command line has ``cmdline_part``."""
    found: dict[int, set[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if cmdline_part.encode() not in f.read():
                    continue
            found[int(pid)] = {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
        except (OSError, ProcessLookupError):
            continue
    return found


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="raising a thread's priority needs root (CAP_SYS_NICE); test_renice covers the refusal")
def test_engine_replicas_run_at_normal_priority(cluster):
    """Ray starts its workers at niceness 15 (this test's cluster keeps that default): a
    replica's engine would lose its CPU to every ordinary process beside it."""
    client, _ = cluster
    complete(client, prompt(11, 8))  # the engine threads have started
    replicas = _niceness_of_threads("ServeReplica:hyprefix-test:EngineReplica")
    assert len(replicas) == 2
    assert all(nice == {0} for nice in replicas.values()), replicas


RENICE_CHILD = """
import logging, os, threading
logging.basicConfig(level=logging.WARNING)
os.nice(5)
from hyprefix.replicas.app import _renice_to_normal
_renice_to_normal()
seen = []
t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
t.start(); t.join()
print("NICE", os.getpriority(os.PRIO_PROCESS, 0), seen[0])
"""


def test_renice():
    """A replica process started nicer runs at niceness 0 (threads started after it
    inherit it), or, where raising priority is refused, says so in a warning."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RENICE_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if os.geteuid() == 0:
        assert "NICE 0 0" in done.stdout
    else:
        assert "NICE 5 5" in done.stdout
        assert "could not lower it" in done.stderr


def test_generation_control_reaches_every_replica(cluster, tmp_path):
    """Run last: it changes the replicas' weights. The update is broadcast (each replica
    answers the new version) and the ingress hashes with the new identity; pause, continue
    and abort go to every replica."""
    from tests.support.compare import hf_greedy
    from tests.support.models import build_tiny_model

    client, _ = cluster
    bases = [prompt(300 + s, 4 * BLOCK) for s in range(4)]
    for base in bases:
        complete(client, base)
    new_hf = build_tiny_model("llama", tmp_path / "llama-v2", seed=1)
    result = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "llama-v2"),
                                                            "weight_version": "v2"})
    assert result.status_code == 200 and result.json()["weight_version"] == "v2", result.text
    assert client.get("/get_weight_version").json() == {"weight_version": "v2"}
    for base in bases:  # every replica runs the new weights and hits nothing cached before
        out = complete(client, base)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["choices"][0]["token_ids"] == hf_greedy(new_hf, base, 4)
    bad = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    assert client.post("/continue_generation").json() == {"success": True}
    assert client.post("/abort_request", json={"abort_all": True}).json()["num_aborted_requests"] == 0
    assert complete(client, bases[0])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
