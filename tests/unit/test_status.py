"""``server/status.py`` on plain data: the last requests kept, newest first, and the replicas'
``/status`` merged (sums, the hit rate from the sums, requests of all replicas by time)."""

from __future__ import annotations

import pytest

from hyprefix.outputs import CompletionOutput, RequestMetrics, RequestOutput
from hyprefix.server.status import RecentRequests, engine_status, merge_status


def finished(rid: str, prompt: int, cached: int, outputs: int = 3, ttft: float | None = 0.25) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=10.0, first_token_time=None if ttft is None else 10.0 + ttft,
                             finished_time=11.0)
    return RequestOutput(rid, None, list(range(prompt)), [CompletionOutput(0, "x", [1] * outputs, "length")],
                         True, cached, metrics)


def test_recent_requests_keeps_the_last_ones_newest_first():
    recent = RecentRequests(size=3)
    for i in range(5):
        recent.add(finished(f"r{i}", prompt=40 + i, cached=16 * (i % 2)))
    items = recent.snapshot()
    assert [item["request_id"] for item in items] == ["r4", "r3", "r2"]
    assert items[1] == {**items[1], "prompt_tokens": 43, "cached_tokens": 16, "completion_tokens": 3,
                        "ttft_s": 0.25, "e2e_s": 1.0, "finish_reason": "length"}
    recent.add(finished("aborted", prompt=5, cached=0, outputs=0, ttft=None))
    assert recent.snapshot()[0]["ttft_s"] is None


def test_replicas_status_sums_and_recomputes_the_hit_rate():
    def part(name: str, hits: int, queries: int, at: float) -> dict:
        stats = {"prefix_cache_hits": hits, "prefix_cache_queries": queries, "prefix_cache_hit_rate": hits / queries,
                 "kv_blocks_used": 3, "mamba_checkpoint_bytes": 1024}
        recent = [{"request_id": f"{name}-a", "finished_at": at}]
        config = {"block_size": 16, "disk_cache_bytes_capacity": 100}
        return engine_status(["m"], stats, recent, config, started_at=0.0, replica=name)

    merged = merge_status([part("one", 10, 100, at=5.0), part("two", 90, 300, at=7.0)])
    stats = merged["stats"]
    assert stats["prefix_cache_hits"] == 100 and stats["prefix_cache_queries"] == 400
    assert stats["prefix_cache_hit_rate"] == pytest.approx(0.25)  # of the sums, not the rates' mean (0.2)
    assert stats["kv_blocks_used"] == 6 and stats["mamba_checkpoint_bytes"] == 1024  # one checkpoint's bytes
    assert merged["config"] == {"block_size": 16, "disk_cache_bytes_capacity": 200}
    assert [(r["request_id"], r["replica"]) for r in merged["recent_requests"]] == [("two-a", "two"), ("one-a", "one")]
    assert merged["replicas"] == 2 and merged["model"] == "m"
    assert merge_status([])["stats"]["prefix_cache_hit_rate"] == 0.0
