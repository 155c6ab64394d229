"""Offline driver of the prefix-cache workloads: each arm runs a workload's rounds in-process.

Arms:

``hyprefix``
    ``LLM`` with prefix caching on (the engine's defaults otherwise: 16-token blocks,
    2048-token steps, 1 GiB Mamba checkpoint pool; ``--mamba-cache-memory-gb`` and
    ``--max-num-batched-tokens`` change them). The KV pool holds every token of the
    workload, so no arm is slowed by preemption or eviction; ``--kv-cache-memory-gb``
    sets it instead.
``hyprefix-nocache``
    The same with ``enable_prefix_caching=False``.
``transformers``
    ``AutoModelForCausalLM.generate``, one request at a time, in submission order, as a
    CPU user without a serving engine does today: no batching and no reuse between calls.
    Greedy (``do_sample=False``) when the workload is greedy; otherwise ``do_sample=True``
    with the request's temperature, ``top_k=0``, ``top_p=1`` and ``torch.manual_seed(seed)``
    before each call (its samples are not the engine's: the RNG streams differ).

Each arm's engine is built once per benchmark run and warmed up. Before every timed run
of a cache arm, ``LLM.reset_prefix_cache()`` drops every cached block (nothing is running
then, so that is all of them) and with them every Mamba checkpoint, so each run starts
with an empty cache; each run records what the cache held when it started
(``stats["cache_at_start"]``: ``kv_blocks_cached`` and ``mamba_checkpoints_used``, both 0).

Timing: a round's requests are submitted together (``LLM.generate`` with the whole list;
for ``transformers`` one ``generate`` after another) and the round's wall time runs from
the call to the last output; a run's time is the sum over rounds (rounds run back to back).
A request's TTFT is ``RequestOutput.metrics.first_token_time - arrival_time`` (hyprefix:
arrival is ``add_request``; transformers: the round's start, so a request's TTFT includes
the time it waited for the requests ahead of it, plus ``ttft_own`` from its own call's
start). Time per output token is ``(finished - first token) / (output tokens - 1)``.
Every request produces exactly ``max_tokens`` tokens (``ignore_eos``; transformers:
``eos_token_id=None``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from hyprefix.bench.env import CpuMeter, RssPeak
from hyprefix.bench.workloads import BenchRequest, Workload

# Cumulative engine counters whose change over a run is reported.
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefill_computed_tokens", "prefill_skipped_tokens",
            "decode_tokens", "num_preemptions", "sibling_waits", "hybrid_hit_tokens_lost")
# Gauges reported as they are at the end of a run.
GAUGES = ("kv_blocks_total", "kv_blocks_cached", "mamba_checkpoints_used", "mamba_checkpoints_capacity",
          "mamba_checkpoint_bytes")


@dataclass
class RequestRecord:
    tag: str
    round: int
    prompt_len: int
    output_ids: list[int] = field(repr=False)
    ttft: float | None  # seconds, arrival -> first token
    e2e: float | None  # seconds, arrival -> last token
    tpot: float | None  # seconds per output token after the first
    cached_tokens: int | None = None  # hyprefix: RequestOutput.num_cached_tokens
    ttft_own: float | None = None  # transformers: from the start of its own generate call
    itl: list[float] = field(default_factory=list, repr=False)  # server arm: inter-token latencies

    def to_dict(self) -> dict:
        d = asdict(self)
        d["output_len"] = len(d.pop("output_ids"))
        del d["itl"]
        return d


@dataclass
class WorkloadRun:
    arm: str
    repeat: int  # -1: warm-up
    seconds: float
    round_seconds: list[float]
    requests: list[RequestRecord]
    stats: dict[str, Any] | None = None  # counter deltas over the run, gauges at its end
    other_cores_avg: float | None = None
    rss_start_gib: float | None = None  # this process (every in-process arm), at the start of the run
    rss_peak_gib: float | None = None  # ... and its peak during the run

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.requests)

    def to_dict(self, with_requests: bool = True) -> dict:
        d = {"arm": self.arm, "repeat": self.repeat, "seconds": self.seconds, "round_seconds": self.round_seconds,
             "num_requests": len(self.requests), "output_tokens": self.output_tokens, "stats": self.stats,
             "other_cores_avg": self.other_cores_avg, "rss_start_gib": self.rss_start_gib,
             "rss_peak_gib": self.rss_peak_gib}
        if with_requests:
            d["requests"] = [r.to_dict() for r in self.requests]
        return d


class WorkloadArm(Protocol):
    name: str
    model: str

    def info(self) -> dict: ...

    def reset(self) -> None: ...

    def stats(self) -> dict[str, Any] | None: ...

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]: ...


def _tpot(first: float | None, last: float | None, n: int) -> float | None:
    if first is None or last is None or n < 2:
        return None
    return (last - first) / (n - 1)


class EngineArm:
    """hyprefix's offline ``LLM`` (prefix caching on or off)."""

    def __init__(self, name: str, model: str, dtype: str, *, enable_prefix_caching: bool, max_num_seqs: int = 64,
                 engine_kwargs: dict[str, Any] | None = None, seed: int = 0) -> None:
        from hyprefix import LLM

        self.name, self.model = name, model
        self.kwargs: dict[str, Any] = {"dtype": dtype, "enable_prefix_caching": enable_prefix_caching,
                                       "max_num_seqs": max(64, max_num_seqs), "seed": seed,
                                       "log_stats_interval": 0, **(engine_kwargs or {})}
        self.llm = LLM(model=model, **self.kwargs)

    def info(self) -> dict:
        import hyprefix

        stats = self.llm.get_stats()
        return {"engine": "hyprefix", "version": hyprefix.__version__, "model": self.model, **self.kwargs,
                "block_size": self.llm.engine.args.block_size,
                "max_num_batched_tokens": self.llm.engine.args.max_num_batched_tokens,
                "kv_blocks_total": stats["kv_blocks_total"],
                "mamba_checkpoints_capacity": stats["mamba_checkpoints_capacity"],
                "mamba_checkpoint_bytes": stats["mamba_checkpoint_bytes"],
                "memory_bytes": dict(self.llm.engine.memory_bytes)}

    @property
    def kv_capacity_tokens(self) -> int:
        return self.llm.engine.max_pool_tokens

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        return dict(self.llm.get_stats())

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        from hyprefix import SamplingParams

        params = [SamplingParams(temperature=r.temperature, top_p=1.0, top_k=-1, seed=r.seed,
                                 max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        outs = self.llm.generate([list(r.prompt) for r in requests], params, use_tqdm=False)
        records = []
        for req, out in zip(requests, outs, strict=True):
            m = out.metrics
            ids = list(out.outputs[0].token_ids)
            records.append(RequestRecord(
                tag=req.tag, round=-1, prompt_len=len(req.prompt), output_ids=ids,
                ttft=None if m.first_token_time is None else m.first_token_time - m.arrival_time,
                e2e=None if m.finished_time is None else m.finished_time - m.arrival_time,
                tpot=_tpot(m.first_token_time, m.finished_time, len(ids)), cached_tokens=out.num_cached_tokens))
        return records


class TransformersWorkloadArm:
    """Plain ``transformers`` ``generate``, one request at a time."""

    def __init__(self, model: str, dtype: str, name: str = "transformers") -> None:
        from transformers import AutoModelForCausalLM

        from hyprefix.bench.arms import run_dtype
        from hyprefix.hardware import DTYPES

        self.name, self.model = name, model
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[run_dtype(model, dtype)])
        self.hf.eval()

    def info(self) -> dict:
        import transformers

        return {"engine": "transformers", "version": transformers.__version__, "model": self.model,
                "class": type(self.hf).__name__,
                "attn_implementation": getattr(self.hf.config, "_attn_implementation", None),
                "dtype": str(self.hf.dtype).replace("torch.", ""), "batching": "none, one request at a time",
                "memory_bytes": {"weights": sum(p.numel() * p.element_size() for p in self.hf.parameters())}}

    def reset(self) -> None:  # generate keeps nothing between calls
        return None

    def stats(self) -> None:
        return None

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        import torch
        from transformers import StoppingCriteriaList

        from hyprefix.bench.arms import _StepClock

        t_round = time.perf_counter()
        records = []
        for req in requests:
            ids = torch.tensor([list(req.prompt)], dtype=torch.long)
            sampling: dict[str, Any] = {"do_sample": False}
            if not req.greedy:
                sampling = {"do_sample": True, "temperature": req.temperature, "top_k": 0, "top_p": 1.0}
                if req.seed is not None:
                    torch.manual_seed(req.seed)
            clock = _StepClock()
            t_call = time.perf_counter()
            with torch.inference_mode():
                out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_tokens,
                                       pad_token_id=0, eos_token_id=None,
                                       stopping_criteria=StoppingCriteriaList([clock]), **sampling)
            t_end = time.perf_counter()
            produced = out[0, ids.shape[1]:].tolist()
            if len(produced) != req.max_tokens:
                raise RuntimeError(f"transformers produced {len(produced)} tokens, expected {req.max_tokens}")
            first = clock.stamps[0] if clock.stamps else t_end
            records.append(RequestRecord(
                tag=req.tag, round=-1, prompt_len=len(req.prompt), output_ids=produced, ttft=first - t_round,
                e2e=t_end - t_round, tpot=_tpot(first, clock.stamps[-1] if clock.stamps else t_end, len(produced)),
                ttft_own=first - t_call))
        return records


def run_workload(arm: WorkloadArm, workload: Workload, repeat: int, max_rounds: int | None = None) -> WorkloadRun:
    """Reset the arm's cache, then run the rounds of ``workload`` (the first ``max_rounds``
    of them when given) and record them."""
    arm.reset()
    before = arm.stats()
    meter = CpuMeter()
    # A server elsewhere: this process's memory says nothing about it.
    rss = RssPeak() if getattr(arm, "in_process", True) else None
    meter.start()
    if rss is not None:
        rss.start()
    previous: list[BenchRequest] = []
    answers: list[list[int]] = []
    records: list[RequestRecord] = []
    round_seconds = []
    rounds = workload.num_rounds if max_rounds is None else min(max_rounds, workload.num_rounds)
    for k in range(rounds):
        requests = workload.round_requests(k, previous, answers)
        t0 = time.perf_counter()
        results = arm.run_round(requests)
        round_seconds.append(time.perf_counter() - t0)
        for r in results:
            r.round = k
        records.extend(results)
        previous, answers = requests, [r.output_ids for r in results]
    other = meter.stop()["other_cores_avg"]
    memory = rss.stop() if rss is not None else {"rss_start_gib": None, "rss_peak_gib": None}
    after = arm.stats()
    stats = None
    if before is not None and after is not None:
        stats = {k: after[k] - before[k] for k in COUNTERS if k in after}
        stats.update({k: after[k] for k in GAUGES if k in after})
        queries = stats.get("prefix_cache_queries", 0)
        stats["prefix_cache_hit_rate"] = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
        stats["cached_tokens_per_request_sum"] = sum(r.cached_tokens or 0 for r in records)
        stats["cache_at_start"] = {"kv_blocks_cached": before.get("kv_blocks_cached"),
                                   "mamba_checkpoints_used": before.get("mamba_checkpoints_used")}
    return WorkloadRun(arm=arm.name, repeat=repeat, seconds=sum(round_seconds), round_seconds=round_seconds,
                       requests=records, stats=stats, other_cores_avg=other, **memory)

