"""The status page: ``GET /`` (one HTML file, no external assets, no build step) and the
JSON it reads, ``GET /status``.

``/status`` is what a person wants to see of a serving engine: the engine's counters and
pool gauges (``Engine.get_stats``), a few facts of its configuration, and the last
finished requests with their cached prompt tokens and time to first token. Like
``/metrics`` it needs no API key and carries no prompt or output text. With engine
replicas, ``merge_status`` sums the replicas' counters and gauges."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from hyprefix.outputs import RequestOutput

RECENT_REQUESTS = 20  # finished requests /status lists, newest first
# stats that are not sums over replicas: recomputed (the rate) or the same on each (bytes per checkpoint)
_NOT_SUMMED = {"prefix_cache_hit_rate": None, "mamba_checkpoint_bytes": max}


@dataclass(frozen=True)
class RequestSummary:
    """One finished request as the page lists it: numbers only, no text."""

    request_id: str
    finished_at: float  # unix time (``time.time()``, as the request's metrics)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    finish_reason: str

    @classmethod
    def of(cls, out: RequestOutput, now: float) -> RequestSummary:
        m = out.metrics
        ttft = None if m.first_token_time is None else max(0.0, m.first_token_time - m.arrival_time)
        e2e = None if m.finished_time is None else max(0.0, m.finished_time - m.arrival_time)
        reasons = sorted({c.finish_reason or "abort" for c in out.outputs})
        return cls(out.request_id, m.finished_time or now, len(out.prompt_token_ids), out.num_cached_tokens,
                   sum(len(c.token_ids) for c in out.outputs), ttft, e2e, ",".join(reasons))


class RecentRequests:
    """The last ``size`` finished requests; ``add`` on the engine thread, ``snapshot`` anywhere."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._items: deque[RequestSummary] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, out: RequestOutput) -> None:
        summary = RequestSummary.of(out, time.time())
        with self._lock:
            self._items.append(summary)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._items)
        return [asdict(item) for item in reversed(items)]


def engine_status(model_names: list[str], stats: Mapping[str, int | float], recent: list[dict[str, Any]],
                  config: Mapping[str, Any], started_at: float, replica: str | None = None) -> dict[str, Any]:
    """``/status`` of one engine (``replica``: its name among engine replicas)."""
    status = {"model": model_names[0], "model_names": list(model_names), "uptime_s": time.time() - started_at,
              "stats": dict(stats), "config": dict(config), "recent_requests": recent}
    return status if replica is None else {**status, "replica": replica}


def merge_status(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``/status`` of several replicas' (each part's ``replica`` names it): counters and
    gauges summed, the hit rate recomputed from the sums, the recent requests of all,
    newest first, each with its replica."""
    stats: dict[str, float] = {}
    for part in parts:
        for key, value in part["stats"].items():
            if key not in _NOT_SUMMED:
                stats[key] = stats.get(key, 0) + value
    stats["mamba_checkpoint_bytes"] = max((p["stats"].get("mamba_checkpoint_bytes", 0) for p in parts), default=0)
    stats["prefix_cache_hit_rate"] = stats.get("prefix_cache_hits", 0) / max(1, stats.get("prefix_cache_queries", 0))
    recent = [{**item, "replica": part.get("replica")} for part in parts for item in part["recent_requests"]]
    recent.sort(key=lambda item: item["finished_at"], reverse=True)
    config = dict(parts[0]["config"]) if parts else {}
    if parts:
        config["disk_cache_bytes_capacity"] = sum(p["config"].get("disk_cache_bytes_capacity", 0) for p in parts)
    first = parts[0] if parts else {"model": "", "model_names": [], "uptime_s": 0.0}
    return {"model": first["model"], "model_names": first["model_names"], "uptime_s": first["uptime_s"],
            "stats": stats, "config": config, "recent_requests": recent[:RECENT_REQUESTS], "replicas": len(parts)}


def status_page() -> str:
    """The page's HTML (``hyprefix/assets/status.html``)."""
    return resources.files("hyprefix").joinpath("assets/status.html").read_text(encoding="utf-8")
