"""Online driver: a workload sent to a running OpenAI-compatible server.

``ServerArm`` is one more workload arm (see ``offline.py``): each round's requests go
to ``POST /v1/completions`` with the prompt as token ids, ``stream: true``,
``max_tokens`` = the workload's output length and ``ignore_eos: true``, so every
request produces exactly that many tokens, as in the offline arms. Arrivals:

- all at once (the default), or at most ``max_concurrency`` in flight;
- ``request_rate`` requests/s with Poisson arrivals (exponential gaps drawn from the
  bench seed), optionally also capped by ``max_concurrency``.

TTFT runs from sending a request to its first streamed token; inter-token latencies
are the gaps between later chunks carrying tokens, spread evenly over the tokens of
a chunk. The token count comes from ``token_ids`` in the chunks when the server
returns them (``return_token_ids``, hyprefix and vLLM), else from the final
``usage`` (``stream_options.include_usage``); multi-turn rounds need the ids
(the next turn appends the previous answer), so they require a server that returns
them (without ids, a record's ``output_ids`` is ``UNKNOWN_TOKEN`` repeated). Cached
prompt tokens come from ``usage.prompt_tokens_details.cached_tokens``.

Server-side counters (prefix cache queries/hits, prefill tokens computed/skipped)
are read from ``/metrics`` before and after each run: any sample named
``<prefix>:<counter>`` with or without ``_total`` counts, summed over label sets
(``hyprefix:prefix_cache_hits_total``, ``vllm:prefix_cache_hits_total``); counters a
server does not export are left out. The
cache is reset before each run with ``POST /reset_prefix_cache`` when the server
has it (hyprefix; vLLM in dev mode); ``info()["cache_reset"]`` says whether it did.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hyprefix.bench.offline import COUNTERS, GAUGES, RequestRecord, _tpot
from hyprefix.bench.workloads import BenchRequest

log = logging.getLogger("hyprefix.bench")

SERVER_ARM = "server"
UNKNOWN_TOKEN = -1


class ServerArm:
    name = SERVER_ARM
    in_process = False  # memory and CPU of the server are not this process's

    def __init__(self, url: str, model: str | None = None, *, max_concurrency: int | None = None,
                 request_rate: float | None = None, seed: int = 0, timeout: float = 3600.0) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
        if request_rate is not None and not request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {request_rate}")
        self.url = url.rstrip("/")
        self.max_concurrency, self.request_rate = max_concurrency, request_rate
        self.timeout = timeout
        self.seed = seed
        self._arrivals = random.Random(f"poisson/{seed}")
        self._client = httpx.Client(base_url=self.url, timeout=timeout)
        try:
            models = self._client.get("/v1/models")
            models.raise_for_status()
        except httpx.HTTPError as exc:
            raise ValueError(f"no OpenAI-compatible server at {self.url}: {exc}") from exc
        served = [m["id"] for m in models.json().get("data", [])]
        if model is not None and model not in served:
            raise ValueError(f"the server at {self.url} serves {served}, not {model!r}")
        if not served and model is None:
            raise ValueError(f"the server at {self.url} lists no model")
        self.model = model or served[0]
        self.cache_reset = True
        self.needs_token_ids = False  # set for workloads whose next round appends the answers

    def close(self) -> None:
        self._client.close()

    def info(self) -> dict:
        version = None
        try:
            response = self._client.get("/version")
            if response.status_code == 200:
                version = response.json().get("version")
        except (httpx.HTTPError, json.JSONDecodeError):
            pass
        return {"engine": "server", "url": self.url, "served_model": self.model, "version": version,
                "max_concurrency": self.max_concurrency, "request_rate": self.request_rate,
                "cache_reset": self.cache_reset}

    def reset(self) -> None:
        """Before every run: the same Poisson arrivals, and an empty cache when the server
        can reset it (a warning once when it cannot: repeats then start warm)."""
        self._arrivals = random.Random(f"poisson/{self.seed}")
        if not self.cache_reset:
            return
        try:
            self.cache_reset = self._client.post("/reset_prefix_cache").status_code < 400
        except httpx.HTTPError:
            self.cache_reset = False
        if not self.cache_reset:
            log.warning("%s has no POST /reset_prefix_cache: every run after the first starts with a warm cache",
                        self.url)

    def stats(self) -> dict[str, Any] | None:
        try:
            response = self._client.get("/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return metrics_counters(response.text)

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        return asyncio.run(self._run_round(requests))

    async def _run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        start = time.perf_counter()
        offsets, t = [], 0.0
        for _ in requests:
            offsets.append(t)
            if self.request_rate is not None:
                t += self._arrivals.expovariate(self.request_rate)
        limit = asyncio.Semaphore(self.max_concurrency or len(requests) or 1)
        limits = httpx.Limits(max_connections=self.max_concurrency or max(len(requests), 1))
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as client:

            async def one(req: BenchRequest, offset: float) -> RequestRecord:
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with limit:
                    return await self._send(client, req)

            results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)),
                                           return_exceptions=True)
        failed = [(r.tag, x) for r, x in zip(requests, results, strict=True) if isinstance(x, BaseException)]
        if failed:  # a run with failed requests measures something else: stop, after every stream ended
            tag, first = failed[0]
            raise RuntimeError(f"{len(failed)} of {len(requests)} requests failed, e.g. {tag}: {first}") from first
        return [r for r in results if isinstance(r, RequestRecord)]

    async def _send(self, client: httpx.AsyncClient, req: BenchRequest) -> RequestRecord:
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
            "temperature": req.temperature, "top_p": 1.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
        if req.seed is not None:
            body["seed"] = req.seed
        t_send = time.perf_counter()
        stamps: list[tuple[float, int]] = []  # (arrival time, tokens in the chunk)
        ids: list[int] = []
        usage: dict[str, Any] = {}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"{self.url} answered {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event or event.get("object") == "error":
                    raise RuntimeError(f"{self.url} streamed an error: {event.get('error', event)}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    chunk_ids = choice.get("token_ids")
                    if chunk_ids:
                        ids.extend(chunk_ids)
                        stamps.append((time.perf_counter(), len(chunk_ids)))
                    elif choice.get("text"):
                        stamps.append((time.perf_counter(), 1))
        t_end = time.perf_counter()
        if not ids and self.needs_token_ids:
            raise RuntimeError(f"{self.url} does not return token ids (return_token_ids), which this workload "
                               "needs to build its next round")
        n_out = len(ids) or int(usage.get("completion_tokens") or sum(n for _, n in stamps))
        if n_out != req.max_tokens:
            raise RuntimeError(f"{self.url} returned {n_out} tokens for {req.tag}, not the {req.max_tokens} asked "
                               "for (does it honour ignore_eos?)")
        first = stamps[0][0] if stamps else None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return RequestRecord(tag=req.tag, round=-1, prompt_len=len(req.prompt),
                             output_ids=ids or [UNKNOWN_TOKEN] * n_out,
                             ttft=None if first is None else first - t_send, e2e=t_end - t_send,
                             tpot=_tpot(first, stamps[-1][0] if stamps else None, n_out),
                             cached_tokens=cached, itl=inter_token_latencies(stamps))


def inter_token_latencies(stamps: Sequence[tuple[float, int]]) -> list[float]:
    """Gaps between token-carrying chunks after the first, each spread evenly over the
    tokens the later chunk brought."""
    gaps = []
    for (t0, _), (t1, n) in itertools.pairwise(stamps):
        gaps.extend([(t1 - t0) / n] * n)
    return gaps


def metrics_counters(text: str) -> dict[str, float]:
    """The bench counters and gauges from a Prometheus exposition, summed over label sets
    (any name prefix: ``hyprefix:``, ``vllm:``; counters with or without ``_total``)."""
    wanted = set(COUNTERS) | set(GAUGES)
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base = sample.name.rsplit(":", 1)[-1].removesuffix("_total")
            if base in wanted:
                found[base] = found.get(base, 0.0) + sample.value
    return found
