"""The online benchmark driver: its parsing helpers on synthetic data, whole workloads sent
to ``hyprefix serve`` on the tiny demo model (structure and hit rates, never timings), and
to fake servers with a small vocabulary or without token ids (llama.cpp's shape)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from hyprefix.bench.online import chunk_token_times, metrics_counters
from hyprefix.cli import main
from tests.server.test_server import MODEL, launch_server

EXPOSITION = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
# HELP hyprefix:prefill_computed_tokens Prompt tokens computed.
# TYPE hyprefix:prefill_computed_tokens counter
hyprefix:prefill_computed_tokens_total{model_name="demo"} 7.0
# HELP hyprefix:kv_blocks_cached Cached blocks.
# TYPE hyprefix:kv_blocks_cached gauge
hyprefix:kv_blocks_cached{model_name="demo"} 3.0
# HELP other_metric Not ours.
# TYPE other_metric counter
other_metric_total 5.0
"""


def test_metrics_counters_read_any_prefix_and_sum_label_sets():
    assert metrics_counters(EXPOSITION) == {"prefix_cache_queries": 150.0, "prefix_cache_hits": 64.0,
                                            "prefill_computed_tokens": 7.0, "kv_blocks_cached": 3.0}


def test_chunk_token_times_spread_a_chunk_over_the_gap_before_it():
    assert chunk_token_times([]) == [] and chunk_token_times([(1.0, 1)]) == [1.0]
    times = chunk_token_times([(1.0, 2), (1.5, 1), (2.1, 3)])
    assert times == pytest.approx([1.0, 1.0, 1.5, 1.7, 1.9, 2.1])


def test_online_flags_are_checked(capsys):
    nobody = "http://127.0.0.1:9"
    assert main(["bench", "--workload", "random", "--max-concurrency", "2"]) == 2
    assert "--url" in capsys.readouterr().err
    assert main(["bench", "--workload", "random", "--url", nobody, "--kv-cache-memory-gb", "1"]) == 2
    assert main(["bench", "--workload", "random", "--url", nobody]) == 2  # nobody listens there
    assert main(["bench", "--workload", "random", "--url", nobody, "--dtype", "float32"]) == 2
    assert "--dtype" in capsys.readouterr().err  # the server runs its own dtype
    assert main(["bench", "--workload", "throughput", "--url", nobody, "--max-concurrency", "2"]) == 2
    assert "does not take --max-concurrency" in capsys.readouterr().err  # batch sizes say how many at once
    assert main(["bench", "--workload", "random", "--url", nobody, "--arms", "server,hyprefix"]) == 2
    assert "--model" in capsys.readouterr().err  # an in-process arm beside a server names its model
    assert main(["bench", "--workload", "random", "--url", f"llama.cpp={nobody}"]) == 2
    assert "server arm names must" in capsys.readouterr().err  # the in-process llama.cpp arm's name
    assert main(["bench", "--workload", "random", "--url", nobody, "--url", f"other={nobody}", "--arms",
                 "server,other@float32", "--model", "demo-dense-tiny"]) == 2
    assert "arms must be distinct names" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with launch_server(tmp_path_factory.mktemp("bench-server") / "server.log") as (url, _):
        yield url


@pytest.mark.slow
def test_return_token_ids_streamed_and_not(server):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    assert len(whole) == 6
    streamed: list[int] = []
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice.get("token_ids") or []
    assert streamed == whole
    plain = httpx.post(f"{server}/v1/completions", json={**body, "return_token_ids": False}, timeout=60).json()
    assert plain["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("extra", [["--max-concurrency", "2"], ["--request-rate", "40"]])
def test_multi_turn_against_the_server(server, tmp_path: Path, capsys, extra):
    out = tmp_path / "online.json"
    args = ["--log-level", "WARNING", "bench", "--workload", "multi-turn", "--url", server, "--repeats", "1",
            "--conversations", "2", "--turns", "3", "--system-len", "32", "--message-len", "16",
            "--output-len", "4", "--out", str(out), *extra]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"hyprefix bench --workload multi-turn: demo at {server}\n")  # no dtype: unknown
    assert "ITL p50" in printed and "prefix hit rate" in printed
    assert "online driver: CPU use of other processes is not reported" in printed and "warning:" not in printed
    result = json.loads(out.read_text())
    assert result["arm_order"] == ["server"] and result["dtype"] is None
    info = result["arm_info"]["server"]
    assert info["cache_reset"] is True and info["served_model"] == "demo" and info["answers"] == "token ids"
    arm = result["arms"]["server"]["multi-turn"]
    assert arm["requests"] == 6 and arm["output_tokens"] == 6 * 4
    assert arm["ttft_seconds"]["count"] == 6 and arm["itl_seconds"]["count"] == 6 * 3
    assert arm["peak_rss_growth_gib"] is None  # the server's memory is not this process's
    stats = arm["stats"]
    # turns 2 and 3 extend turn 1 (system prompt + message + answer): they hit on the server
    assert stats["prefix_cache_queries"] == sum(sum(r) for r in [[48, 48], [68, 68], [88, 88]])
    # turns 2 and 3 find every full block of the finished turn before them (48 and 64 tokens of 52 and 72)
    assert stats["prefix_cache_hits"] >= 2 * 48 + 2 * 64
    assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits"] / stats["prefix_cache_queries"])
    assert stats["prefill_computed_tokens"] + stats["prefill_skipped_tokens"] == stats["prefix_cache_queries"]
    assert stats["cached_tokens_per_request_sum"] == stats["prefix_cache_hits"]  # usage agrees with /metrics
    assert stats["cache_at_start"]["kv_blocks_cached"] == 0  # reset before the run


@pytest.mark.slow
def test_served_and_offline_arms_in_one_run(server, tmp_path: Path, capsys, small_matmul_peak):
    """``--url`` beside an in-process arm on the same model: both run interleaved, and the
    report sets the server against the offline engine; throughput takes ``--url`` too."""
    out = tmp_path / "mixed.json"
    common = ["--log-level", "WARNING", "bench", "--url", server, "--arms", "server,hyprefix", "--model",
              "demo-dense-tiny", "--enforce-eager", "--repeats", "1", "--out", str(out)]
    assert main([*common, "--workload", "random", "--num-requests", "3", "--prompt-len", "20",
                 "--output-len", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"server = {MODEL} at {server}" in printed and "driver on" in printed
    result = json.loads(out.read_text())
    assert result["arm_order"] == ["server", "hyprefix"] and result["dtype"] == "auto -> float32"
    ratios = {r["name"] for r in result["ratios"]}
    assert {"time server / hyprefix", "TTFT p50 server / hyprefix", "TPOT p50 server / hyprefix"} <= ratios
    agreement = result["arms"]
    assert agreement["server"]["random"]["output_tokens"] == agreement["hyprefix"]["random"]["output_tokens"] == 9
    assert main([*common, "--workload", "throughput", "--prompt-len", "24", "--decode-prompt-len", "8",
                 "--decode-tokens", "4", "--batch-sizes", "1,3"]) == 0
    result = json.loads(out.read_text())
    assert set(result["arms"]["server"]) == {"prefill", "decode@1", "decode@3"}
    ratios = {r["name"]: r["value"] for r in result["ratios"]}
    assert {"prefill server / hyprefix", "decode server B=1 / hyprefix B=1",
            "decode server B=3 / hyprefix B=3"} <= set(ratios) and all(v > 0 for v in ratios.values())
    assert "prefill % of" in capsys.readouterr().out  # the in-process arm's dtype gives the peak


def test_random_workload_at_a_request_rate(server, tmp_path: Path):
    out = tmp_path / "random.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "random", "--url", server, "--repeats", "1",
                 "--num-requests", "5", "--prompt-len", "20", "--output-len", "3", "--request-rate", "20",
                 "--max-concurrency", "3", "--out", str(out)]) == 0
    arm = json.loads(out.read_text())["arms"]["server"]["random"]
    assert arm["requests"] == 5 and arm["output_tokens"] == 15 and arm["stats"]["prefix_cache_hits"] == 0


# ------------------------------------------------------------------ fake servers
def _app(vocab: int, token_ids: bool, tokenize: bool, seen: list[dict], metrics: str | None = None) -> FastAPI:
    """An OpenAI-like completions server over ``vocab`` token ids; answer token t reads " wt".
    Without ``token_ids`` it ignores return_token_ids, and it has no /reset_prefix_cache or
    /metrics (llama.cpp's shape); ``tokenize`` adds llama.cpp's POST /tokenize, ``metrics`` a
    /metrics page with that text."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        bad = [t for t in body["prompt"] if not 0 <= t < vocab]
        if bad:
            message = f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=400)
        ids = [(sum(body["prompt"]) + i) % vocab for i in range(body["max_tokens"])]
        choices = [{"index": 0, "text": f" w{t}", **({"token_ids": [t]} if token_ids else {})} for t in ids]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}
        if not body.get("stream"):
            text = "".join(c["text"] for c in choices)
            return {"choices": [{"index": 0, "text": text, **({"token_ids": ids} if token_ids else {})}],
                    "usage": usage}

        def events() -> Iterator[str]:
            for choice in choices:
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    if metrics is not None:
        @app.get("/metrics")
        async def metrics_page() -> PlainTextResponse:
            return PlainTextResponse(metrics)

    if tokenize:
        @app.post("/tokenize")
        async def tokenize_text(request: Request) -> dict:
            words = (await request.json())["content"].split()
            return {"tokens": [int(w[1:]) if w[1:].isdigit() else 0 for w in words]}
    return app


@contextlib.contextmanager
def fake_server(vocab: int = 4096, token_ids: bool = True, tokenize: bool = False,
                metrics: str | None = None) -> Iterator[tuple[str, list]]:
    seen: list[dict] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(vocab, token_ids, tokenize, seen, metrics), host="127.0.0.1",
                                           port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(10)


RANDOM = ["--log-level", "ERROR", "bench", "--workload", "random", "--repeats", "1", "--num-requests", "3",
          "--prompt-len", "12", "--output-len", "2"]
MULTI_TURN = ["--log-level", "ERROR", "bench", "--workload", "multi-turn", "--repeats", "1", "--conversations", "2",
              "--turns", "2", "--system-len", "8", "--message-len", "4", "--output-len", "3"]


def test_a_small_vocabulary_needs_vocab_size(tmp_path: Path, capsys):
    """A server whose model has fewer than 4096 token ids (issue 17)."""
    with fake_server(vocab=448) as (url, seen):
        assert main([*RANDOM, "--url", url]) == 2
        err = capsys.readouterr().err
        assert "rejects prompt token id 4095" in err and "outside the vocabulary [0, 448)" in err
        assert "pass --vocab-size N" in err and "--tokenizer NAME" in err
        assert [b["max_tokens"] for b in seen] == [1]  # the probe only: no work was sent
        seen.clear()
        out = tmp_path / "online.json"
        assert main([*RANDOM, "--url", url, "--vocab-size", "448", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"hyprefix bench --workload random: fake-model at {url}\n")  # nothing unknown
    prompt_ids = {t for body in seen for t in body["prompt"]}
    assert min(prompt_ids) >= 3 and max(prompt_ids) == 447  # the probe asks for the highest id
    result = json.loads(out.read_text())
    assert result["workload_config"]["token_range"] == [3, 448] and result["dtype"] is None
    arm = result["arms"]["server"]["random"]
    assert (arm["requests"], arm["output_tokens"], arm["itl_seconds"]["count"]) == (3, 6, 3)
    assert "stats" not in arm and result["arm_info"]["server"]["cache_reset"] is False  # no /metrics, no reset


def test_the_vocabulary_from_a_tokenizer(tmp_path: Path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    out = tmp_path / "online.json"
    with fake_server(vocab=448) as (url, seen):
        assert main([*RANDOM, "--url", url, "--tokenizer", str(tmp_path), "--out", str(out)]) == 0
    assert max(t for body in seen for t in body["prompt"]) == 99
    assert json.loads(out.read_text())["workload_config"]["token_range"] == [3, 100]


def test_multi_turn_without_token_ids_uses_the_server_tokenizer(tmp_path: Path):
    """llama.cpp: no return_token_ids, no /reset_prefix_cache, but POST /tokenize."""
    out = tmp_path / "online.json"
    with fake_server(token_ids=False, tokenize=True) as (url, seen):
        assert main([*MULTI_TURN, "--url", url, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["arm_info"]["server"]["answers"] == "answer text re-tokenized by POST /tokenize"
    turn0, turn1 = [b["prompt"] for b in seen[-4:-2]], [b["prompt"] for b in seen[-2:]]  # the timed run
    for prompt in turn1:  # the turn-0 prompt, the answer re-tokenized from its text, a 4-token message
        first = next(p for p in turn0 if prompt[:12] == p)
        assert prompt[12:15] == [(sum(first) + i) % 4096 for i in range(3)] and len(prompt) == 12 + 3 + 4
    assert result["arms"]["server"]["multi-turn"]["output_tokens"] == 4 * 3


def test_multi_turn_refuses_a_server_without_token_ids_or_tokenize(capsys):
    with fake_server(token_ids=False) as (url, seen):
        assert main([*MULTI_TURN, "--url", url]) == 2
        assert [b["max_tokens"] for b in seen] == [1]  # refused before any work
        assert main([*RANDOM, "--url", url]) == 0  # one-round workloads need no answers
    err = capsys.readouterr().err
    assert "returns no token ids (return_token_ids) and has no POST /tokenize" in err
    assert "cannot run against this server" in err


def test_a_server_without_prefix_cache_counters_has_no_hit_rate(tmp_path: Path, capsys):
    """/metrics that exports none of the prefix-cache counters (llama.cpp --metrics): the
    hit rate is unknown, not 0 %."""
    page = "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"
    out = tmp_path / "online.json"
    with fake_server(metrics=page) as (url, _):
        assert main([*RANDOM, "--url", url, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0.0 %" not in printed
    stats = json.loads(out.read_text())["arms"]["server"]["random"]["stats"]
    assert stats["prefix_cache_hit_rate"] is None


def test_a_hybrid_server_report(tmp_path: Path, capsys):
    """``bench --url`` against a server running a hybrid model prints its checkpoint rows and
    writes the JSON (it once failed on a counter only the in-process arm had); a server that
    exports no checkpoint size prints "-" there."""
    out = tmp_path / "hybrid.json"
    args = ["--log-level", "WARNING", "bench", "--workload", "multi-turn", "--repeats", "1", "--conversations", "2",
            "--turns", "2", "--system-len", "16", "--message-len", "8", "--output-len", "3", "--out", str(out)]
    with launch_server(tmp_path / "server.log", model_args=("--model", "demo-hybrid-tiny")) as (url, _):
        assert main([*args, "--url", url]) == 0
    printed = capsys.readouterr().out
    assert "mamba checkpoints used / capacity" in printed and "Mamba checkpoint (MiB)" in printed
    stats = json.loads(out.read_text())["arms"]["server"]["multi-turn"]["stats"]
    assert stats["mamba_checkpoints_capacity"] > 0 and stats["mamba_checkpoint_bytes"] > 0
    page = ("# TYPE vllm:mamba_checkpoints_capacity gauge\nvllm:mamba_checkpoints_capacity 8\n"
            "# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total 1\n")
    with fake_server(metrics=page) as (url, _):
        assert main([*RANDOM, "--url", url, "--out", str(out)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Mamba checkpoint (MiB)"))
    assert row.split()[-1] == "-"


def test_agent_against_the_server_sends_cache_control_only_when_asked(server, tmp_path: Path, capsys):
    """Timed sessions online: every turn's ``sent`` is its scheduled time, and the turns that ask
    to keep their prefix (all but the last) get the server's ``cache_retention`` back."""
    out = tmp_path / "agent.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "agent", "--url", server, "--repeats", "1",
                 "--num-sessions", "2", "--turns", "2", "--system-len", "32", "--message-len", "12",
                 "--tool-pause-s", "0.01", "--request-rate", "200", "--cache-ttl-s", "30", "--output-len", "3",
                 "--out", str(out)]) == 0
    assert "longest wait: max TTFT (s)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["arm_info"]["server"]["answers"] == "token ids"
    records = {r["tag"]: r for r in result["runs"]["server"]["agent"][0]["requests"]}
    assert set(records) == {f"s{s}/t{k}" for s in range(2) for k in range(2)}
    for s in range(2):
        first, last = records[f"s{s}/t0"], records[f"s{s}/t1"]
        assert first["retained_tokens"] > 0  # cache_control reached the server: it says what it kept
        assert last["retained_tokens"] is None  # not asked: no cache_control sent
        assert (first["round"], last["round"]) == (0, 1) and last["prompt_len"] > first["prompt_len"] + 3
        assert last["cached_tokens"] >= 32  # the kept prefix was hit
    assert all(r["ttft"] > 0 for r in records.values())
