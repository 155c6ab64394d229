"""Online driver: ``ServerArm`` sends a workload to a running OpenAI-compatible server.

Requests go to ``POST /v1/completions`` (token-id prompts, ``stream``, ``ignore_eos``) all at
once, at most ``max_concurrency`` in flight, and/or Poisson arrivals at ``request_rate``.
Prompt ids stay below ``--vocab-size`` or the ``--tokenizer``'s size (else 4096); before any
work, a one-token completion with the highest id checks that the server takes it and whether
it returns ``token_ids``: multi-turn needs the answers' ids, else (llama.cpp) the answer text
re-tokenized by ``POST /tokenize``, else it stops. Counters come from ``/metrics``
(``<prefix>:<counter>[_total]``); ``POST /reset_prefix_cache`` empties the cache where it exists.
A timed workload (``timed.py``) runs one task per session, each turn sent at its time; a turn
that asks to keep its prefix sends ``"cache_control": {"type": "ephemeral", "ttl": seconds}``
(only then: a server without the field still takes the rest), and the response's
``cache_retention`` (what the server kept) becomes the record's ``retained_tokens``.
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

from prometheus_client.parser import text_string_to_metric_families

from hyprefix.bench.arms import COUNTERS, GAUGES, SERVER_ARM, RequestRecord
from hyprefix.bench.env import require
from hyprefix.bench.workloads import DEFAULT_VOCAB, TOKEN_LOW, BenchRequest

httpx = require("httpx")
log = logging.getLogger("hyprefix.bench")

UNKNOWN_TOKEN = -1


def tokenizer_vocab_size(name: str) -> int:
    """``len()`` of a tokenizer (a local directory or hub id), loaded with ``AutoTokenizer``."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(name))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer {name!r}: {exc}") from exc


class ServerArm:
    in_process = False

    def __init__(self, url: str, model: str | None = None, *, name: str = SERVER_ARM, vocab_size: int | None = None,
                 needs_answers: bool = False, max_concurrency: int | None = None, request_rate: float | None = None,
                 seed: int = 0, timeout: float = 3600.0) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.max_concurrency, self.request_rate, self.timeout, self.seed = max_concurrency, request_rate, timeout, seed
        self.vocab_size = vocab_size
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
        self.answers = self._probe(needs_answers)

    def _probe(self, needs_answers: bool) -> str:
        """One one-token completion, before any work: the highest prompt id must be in the
        server's vocabulary; returns how answers become the next turn's token ids."""
        high = self.vocab_size or DEFAULT_VOCAB
        body = {"model": self.model, "prompt": [TOKEN_LOW, high - 1], "max_tokens": 1, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        try:
            response = self._client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise ValueError(f"{self.url}: a one-token completion failed: {exc}") from exc
        detail = response.text[:300]
        if response.status_code == 400 and any(w in detail.lower() for w in ("vocab", "token id", "invalid token")):
            raise ValueError(f"{self.url} rejects prompt token id {high - 1} ({detail}). The driver draws prompt ids "
                             f"from [{TOKEN_LOW}, {high}): pass --vocab-size N (the served model's vocabulary size) "
                             "or --tokenizer NAME (its tokenizer) so that it uses only ids the model has")
        if response.status_code != 200:
            raise ValueError(f"{self.url} answered {response.status_code} to a one-token completion: {detail}")
        if (response.json().get("choices") or [{}])[0].get("token_ids"):
            return "token ids"
        if not needs_answers:
            return "not needed"
        if isinstance(self._json("POST", "/tokenize", json={"content": "a"}).get("tokens"), list):
            log.warning("%s returns no token ids: each answer's text is re-tokenized with its POST /tokenize, so the "
                        "next turn may differ from the tokens the model produced", self.url)
            return "answer text re-tokenized by POST /tokenize"
        raise ValueError(f"this workload appends each answer's token ids to the next turn, but {self.url} returns no "
                         "token ids (return_token_ids) and has no POST /tokenize to re-tokenize the answer text: it "
                         "cannot run against this server (the other workloads can)")

    def close(self) -> None:
        self._client.close()

    def _try(self, method: str, path: str, **kwargs: Any) -> Any:
        """The response to a request, or None when it fails or answers an error."""
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError:
            return None
        return response if response.status_code < 400 else None

    def _json(self, method: str, path: str, **kwargs: Any) -> dict:
        try:
            value = (self._try(method, path, **kwargs) or httpx.Response(200, json={})).json()
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def info(self) -> dict:
        version = self._json("GET", "/version").get("version")
        return {"engine": "server", "url": self.url, "served_model": self.model, "version": version,
                "max_concurrency": self.max_concurrency, "request_rate": self.request_rate,
                "vocab_size": self.vocab_size, "answers": self.answers, "cache_reset": self.cache_reset}

    def reset(self) -> None:
        """Before every run: the same Poisson arrivals, and an empty cache when the server
        can reset it (a warning once when it cannot: repeats then start warm)."""
        self._arrivals = random.Random(f"poisson/{self.seed}")
        if self.cache_reset and self._try("POST", "/reset_prefix_cache") is None:
            self.cache_reset = False
            log.warning("%s has no POST /reset_prefix_cache: every run after the first starts with a warm cache",
                        self.url)

    def stats(self) -> dict[str, Any] | None:
        response = self._try("GET", "/metrics")
        return None if response is None else metrics_counters(response.text)

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        records = asyncio.run(self._run_round(requests))
        if self.answers.startswith("answer text"):  # after the timed part: the record's end is already set
            for rec, text in records:
                rec.answer_ids = [int(t) for t in self._client.post(
                    "/tokenize", json={"content": text, "add_special": False}).json()["tokens"]]
        return [rec for rec, _ in records]

    async def _run_round(self, requests: Sequence[BenchRequest]) -> list[tuple[RequestRecord, str]]:
        start = time.perf_counter()
        gaps = [self._arrivals.expovariate(self.request_rate) if self.request_rate else 0.0 for _ in requests[1:]]
        offsets = list(itertools.accumulate(gaps, initial=0.0))
        limit = asyncio.Semaphore(self.max_concurrency or len(requests) or 1)
        limits = httpx.Limits(max_connections=self.max_concurrency or max(len(requests), 1))
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as client:

            async def one(req: BenchRequest, offset: float) -> tuple[RequestRecord, str]:
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
        return [r for r in results if not isinstance(r, BaseException)]

    def run_timed(self, workload: Any) -> list[RequestRecord]:
        """A timed workload's sessions, each turn sent at its scheduled time (its ``sent``)."""
        return asyncio.run(self._run_timed(workload))

    async def _run_timed(self, workload: Any) -> list[RequestRecord]:
        sessions = workload.sessions()
        start = time.perf_counter()
        limits = httpx.Limits(max_connections=max(1, len(sessions)))
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as client:

            async def session(s: Any) -> list[RequestRecord]:
                records: list[RequestRecord] = []
                previous, answer, due = None, [], start + s.start_s
                for k, turn in enumerate(s.turns):
                    if k:
                        due = time.perf_counter() + turn.pause_s
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    req = workload.request(s, k, previous, answer)
                    rec, text = await self._send(client, req)
                    rec.sent, rec.round = min(due, rec.sent), k
                    if k + 1 < len(s.turns):
                        answer = await self._answer(client, rec, text)
                    previous = req
                    records.append(rec)
                return records

            results = await asyncio.gather(*(session(s) for s in sessions), return_exceptions=True)
        failed = [x for x in results if isinstance(x, BaseException)]
        if failed:  # a run with failed requests measures something else: stop, after every session ended
            raise RuntimeError(f"{len(failed)} of {len(sessions)} sessions failed, e.g. {failed[0]}") from failed[0]
        return [rec for r in results if not isinstance(r, BaseException) for rec in r]

    async def _answer(self, client: Any, rec: RequestRecord, text: str) -> list[int]:
        """The token ids the next turn appends: the answer's own, else its text re-tokenized."""
        if not self.answers.startswith("answer text"):
            return rec.output_ids
        response = await client.post("/tokenize", json={"content": text, "add_special": False})
        rec.answer_ids = [int(t) for t in response.json()["tokens"]]
        return rec.answer_ids

    async def _send(self, client: Any, req: BenchRequest) -> tuple[RequestRecord, str]:
        body: dict[str, Any] = {"model": self.model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
                                "temperature": req.temperature, "top_p": 1.0, "stream": True, "ignore_eos": True,
                                "stream_options": {"include_usage": True}, "return_token_ids": True}
        if req.seed is not None:
            body["seed"] = req.seed
        if req.cache_ttl_s > 0:  # only when asked: a server without the field still takes the request
            body["cache_control"] = {"type": "ephemeral", "ttl": req.cache_ttl_s}
        retained: int | None = None
        sent = time.perf_counter()
        stamps: list[tuple[float, int]] = []  # (arrival time, tokens in the chunk)
        ids: list[int] = []
        text: list[str] = []
        usage: dict[str, Any] = {}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"{self.url} answered {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                payload = line[5:].strip() if line.startswith("data:") else ""
                if payload == "[DONE]":
                    break
                event = json.loads(payload) if payload else {}
                if "error" in event or event.get("object") == "error":
                    raise RuntimeError(f"{self.url} streamed an error: {event.get('error', event)}")
                usage = event.get("usage") or usage
                if isinstance(event.get("cache_retention"), dict):  # a choice's last chunk: what was kept
                    retained = event["cache_retention"].get("tokens")
                for choice in event.get("choices", []):
                    text.append(choice.get("text") or "")
                    if choice.get("token_ids") or choice.get("text"):
                        ids.extend(choice.get("token_ids") or [])
                        stamps.append((time.perf_counter(), len(choice.get("token_ids") or [1])))
        end = time.perf_counter()
        n_out = len(ids) or int(usage.get("completion_tokens") or sum(n for _, n in stamps))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return RequestRecord(req.tag, len(req.prompt), ids or [UNKNOWN_TOKEN] * n_out, sent,
                             chunk_token_times(stamps), end, cached_tokens=cached,
                             retained_tokens=retained), "".join(text)


def chunk_token_times(stamps: Sequence[tuple[float, int]]) -> list[float]:
    """When each token arrived: a chunk's tokens spread evenly over the gap since the
    previous chunk (the first chunk's tokens arrive together)."""
    times: list[float] = []
    for i, (t, n) in enumerate(stamps):
        last = stamps[i - 1][0] if i else t
        times.extend(last + (t - last) * (j + 1) / n for j in range(n))
    return times


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
