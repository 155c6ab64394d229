"""The online benchmark driver: its parsing helpers on synthetic data, and whole
workloads sent to ``hyprefix serve`` on the tiny demo model (structure and hit
rates, never timings)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from test_server import launch_server

from hyprefix.bench.online import inter_token_latencies, metrics_counters
from hyprefix.cli import main

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


def test_inter_token_latencies_spread_a_chunk_over_its_tokens():
    assert inter_token_latencies([]) == [] and inter_token_latencies([(1.0, 1)]) == []
    gaps = inter_token_latencies([(1.0, 2), (1.5, 1), (2.1, 3)])
    assert gaps == pytest.approx([0.5, 0.2, 0.2, 0.2])


def test_online_flags_are_checked(capsys):
    assert main(["bench", "--workload", "random", "--max-concurrency", "2"]) == 2
    assert "--url" in capsys.readouterr().err
    assert main(["bench", "--workload", "random", "--url", "http://127.0.0.1:9", "--kv-cache-memory-gb", "1"]) == 2
    assert main(["bench", "--workload", "throughput", "--url", "http://127.0.0.1:9"]) == 2
    assert main(["bench", "--workload", "random", "--url", "http://127.0.0.1:9"]) == 2  # nobody listens there


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with launch_server(tmp_path_factory.mktemp("bench-server") / "server.log") as (url, _):
        yield url


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
    assert "ITL p50" in printed and "prefix hit rate" in printed
    assert "online driver: CPU use of other processes is not reported" in printed and "warning:" not in printed
    result = json.loads(out.read_text())
    assert result["arm_order"] == ["server"]
    info = result["arm_info"]["server"]
    assert info["cache_reset"] is True and info["served_model"] == "demo"
    arm = result["arms"]["server"]
    assert arm["requests"] == 6 and arm["output_tokens"] == 6 * 4
    assert arm["ttft_seconds"]["count"] == 6 and arm["itl_seconds"]["count"] == 6 * 3
    assert arm["peak_rss_growth_gib"] is None  # the server's memory is not this process's
    stats = arm["stats"]
    # turns 2 and 3 extend turn 1 (system prompt + message + answer): they hit on the server
    assert stats["prefix_cache_queries"] == sum(sum(r) for r in [[48, 48], [68, 68], [88, 88]])
    assert 0.3 < stats["prefix_cache_hit_rate"] < 1.0
    assert stats["prefill_computed_tokens"] + stats["prefill_skipped_tokens"] == stats["prefix_cache_queries"]
    assert stats["cached_tokens_per_request_sum"] == stats["prefix_cache_hits"]  # usage agrees with /metrics
    assert stats["cache_at_start"]["kv_blocks_cached"] == 0  # reset before the run


def test_random_workload_at_a_request_rate(server, tmp_path: Path):
    out = tmp_path / "random.json"
    assert main(["--log-level", "WARNING", "bench", "--workload", "random", "--url", server, "--repeats", "1",
                 "--num-requests", "5", "--prompt-len", "20", "--output-len", "3", "--request-rate", "20",
                 "--max-concurrency", "3", "--out", str(out)]) == 0
    arm = json.loads(out.read_text())["arms"]["server"]
    assert arm["requests"] == 5 and arm["output_tokens"] == 15 and arm["stats"]["prefix_cache_hits"] == 0
