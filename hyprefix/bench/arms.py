"""The arms: one protocol (``Arm``) for every engine a workload runs on, and the timed runs.

``hyprefix`` / ``hyprefix-nocache`` / ``compare-hyprefix``: ``LLM`` with prefix caching on /
off / on with ``--compare-model``, stepped here (a token's time is the end of its step), its
KV pool sized for every token of the largest case, its cache emptied before every timed run.
``transformers``: ``generate`` on the same weights (a token's time is when its step calls our
``StoppingCriteria``), one request at a time like a CPU user without a serving engine (TTFT
includes the wait for the requests ahead; ``ttft_own`` does not), throughput a round as one
batch; an arm that cannot run the model is skipped. ``llama.cpp``: llama-cpp-python's ``Llama``
on the same GGUF file (it computes in the file's types: run an F32 or Q8_0 file for a like-for-like
decode), one request at a time with this process's thread count; skipped when llama_cpp is not
installed (``pip install llama-cpp-python``). ``server``: ``hyprefix.bench.online``.
A round's time runs from its first request sent to its last one's end. Timed workloads
(``timed.py``) run on the hyprefix arms and servers only (``run_timed``). Arm names:
``arm_names.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hyprefix.bench.arm_names import (  # noqa: F401 (ARM_BASES, check_arm_names: for the bench's callers)
    ARM_BASES,
    arm_engine_options,
    arm_kv_cache_dtype,
    check_arm_names,
    split_arm,
)
from hyprefix.bench.env import CpuMeter, RssPeak
from hyprefix.bench.workloads import BenchRequest, Workload

log = logging.getLogger("hyprefix.bench")

COMPARE_ARM = "compare-hyprefix"  # the hyprefix arm on --compare-model
SERVER_ARM = "server"
# Cumulative engine counters whose change over a run is reported; gauges as at the end of a run.
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prefill_computed_tokens", "prefill_skipped_tokens",
            "decode_tokens", "num_preemptions", "sibling_waits", "hybrid_hit_tokens_lost")
GAUGES = ("kv_blocks_total", "kv_blocks_cached", "mamba_checkpoints_used", "mamba_checkpoints_capacity",
          "mamba_checkpoint_bytes")


@dataclass
class RequestRecord:
    tag: str
    prompt_len: int
    output_ids: list[int] = field(repr=False)
    sent: float  # perf_counter when the request was submitted
    token_times: list[float] = field(repr=False)  # perf_counter when each output token was out
    end: float  # the request's call, step or stream ended
    round: int = -1
    cached_tokens: int | None = None  # prompt tokens the engine or server took from its cache
    call_start: float | None = None  # transformers, one at a time: its own generate call started
    answer_ids: list[int] | None = field(default=None, repr=False)  # what the next turn appends, if not output_ids
    retained_tokens: int | None = None  # prompt + output tokens its retention kept (None: none asked)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def ttft_own(self) -> float | None:
        return self.token_times[0] - self.call_start if self.token_times and self.call_start is not None else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None

    def to_dict(self) -> dict:
        return {"tag": self.tag, "round": self.round, "prompt_len": self.prompt_len,
                "output_len": len(self.output_ids), "ttft": self.ttft, "e2e": self.end - self.sent,
                "tpot": self.tpot, "cached_tokens": self.cached_tokens, "ttft_own": self.ttft_own,
                "retained_tokens": self.retained_tokens}


@dataclass
class WorkloadRun:
    arm: str
    case: str
    repeat: int  # -1: warm-up
    round_seconds: list[float]
    requests: list[RequestRecord]
    stats: dict[str, Any] | None = None  # counter deltas over the run, gauges at its end
    other_cores_avg: float | None = None
    rss_start_gib: float | None = None  # this process (every in-process arm), at the start of the run
    rss_peak_gib: float | None = None  # ... and its peak during the run
    read_gb_per_s: float | None = None  # memory read rate measured right before it (batch-1 decode runs)

    @property
    def seconds(self) -> float:
        return sum(self.round_seconds)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.requests)

    def decode_tokens_per_s(self) -> float | None:
        """Tokens out after every request of its round had its first token, per second of that span."""
        tokens, seconds = 0, 0.0
        for k in {r.round for r in self.requests}:
            times = [r.token_times for r in self.requests if r.round == k and r.token_times]
            if not times:
                continue
            start = max(t[0] for t in times)
            tokens += sum(x > start for t in times for x in t)
            seconds += max(t[-1] for t in times) - start
        return tokens / seconds if tokens and seconds > 0 else None

    def to_dict(self) -> dict:
        return {"arm": self.arm, "case": self.case, "repeat": self.repeat, "seconds": self.seconds,
                "round_seconds": self.round_seconds, "num_requests": len(self.requests),
                "output_tokens": self.output_tokens, "decode_tokens_per_s": self.decode_tokens_per_s(),
                "stats": self.stats, "other_cores_avg": self.other_cores_avg, "rss_start_gib": self.rss_start_gib,
                "rss_peak_gib": self.rss_peak_gib, "read_gb_per_s": self.read_gb_per_s,
                "requests": [r.to_dict() for r in self.requests]}


class Arm(Protocol):
    name: str
    model: str
    in_process: bool  # False: its memory and CPU are not this process's
    vocab_size: int | None  # token ids it takes, when known

    def info(self) -> dict: ...

    def reset(self) -> None: ...

    def stats(self) -> dict[str, Any] | None: ...

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]: ...


class EngineArm:
    """hyprefix's offline ``LLM`` (prefix caching on or off), stepped by the arm."""

    in_process = True

    def __init__(self, name: str, model: str, **kwargs: Any) -> None:
        from hyprefix import LLM

        self.name, self.model = name, model
        self.kwargs = {"log_stats_interval": 0, **kwargs}
        self.llm = LLM(model=model, **self.kwargs)
        self.facts = self.llm.engine.model_facts
        self.vocab_size: int | None = self.facts.vocab_size
        self._ids = itertools.count()

    def info(self) -> dict:
        import hyprefix

        engine, stats = self.llm.engine, self.llm.get_stats()
        return {"engine": "hyprefix", "version": hyprefix.__version__, "model": self.model, **self.kwargs,
                "dtype": self.facts.dtype, "block_size": engine.args.block_size,
                "max_num_batched_tokens": engine.args.max_num_batched_tokens,
                **{k: stats[k] for k in ("kv_blocks_total", "mamba_checkpoints_capacity", "mamba_checkpoint_bytes")},
                "memory_bytes": dict(engine.memory_bytes)}

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        return dict(self.llm.get_stats())

    def run_timed(self, workload: Any) -> list[RequestRecord]:
        """A timed workload's sessions in real time (``timed.run_engine_timed``)."""
        from hyprefix.bench.timed import run_engine_timed

        return run_engine_timed(self.llm.engine, workload, self._ids)

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        from hyprefix import SamplingParams

        engine = self.llm.engine
        ids = [f"bench-{next(self._ids)}" for _ in requests]
        params = [SamplingParams(temperature=r.temperature, top_p=1.0, top_k=-1, seed=r.seed, max_tokens=r.max_tokens,
                                 ignore_eos=True) for r in requests]
        times: dict[str, list[float]] = {i: [] for i in ids}
        done: dict[str, tuple[Any, float]] = {}
        sent = time.perf_counter()
        engine.add_requests([(i, list(r.prompt), p) for i, r, p in zip(ids, requests, params, strict=True)])
        while len(done) < len(ids):
            outputs = engine.step()
            now = time.perf_counter()
            if not outputs and not engine.has_unfinished_sequences():
                raise RuntimeError(f"engine went idle with {len(ids) - len(done)} benchmark requests unfinished")
            for out in outputs:
                if out.request_id in times:
                    got = times[out.request_id]
                    got.extend([now] * (len(out.outputs[0].token_ids) - len(got)))
                    if out.finished:
                        done[out.request_id] = (out, now)
        return [RequestRecord(r.tag, len(r.prompt), list(done[i][0].outputs[0].token_ids), sent, times[i], done[i][1],
                              cached_tokens=done[i][0].num_cached_tokens) for i, r in zip(ids, requests, strict=True)]


def _step_clock() -> Any:
    """A ``StoppingCriteria`` that never stops and notes when each step's tokens are out."""
    import torch
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


class TransformersArm:
    """Plain ``transformers`` ``generate``: a round one request at a time, or as one batch."""

    in_process = True

    def __init__(self, name: str, model: str, dtype: str, *, batched: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        from hyprefix.hardware import DTYPES, device_caps
        from hyprefix.models.loader import pretrained_location

        self.name, self.model, self.batched = name, model, batched
        # a GGUF file: transformers dequantizes its weights on load
        self.hf = AutoModelForCausalLM.from_pretrained(**pretrained_location(model),
                                                       dtype="auto" if dtype == "auto" else DTYPES[dtype])
        if dtype == "auto":  # the engine's choice for this CPU given the checkpoint's dtype
            self.hf.to(device_caps("cpu").auto_dtype(self.hf.dtype)[0])
        self.hf.eval()
        self.vocab_size: int | None = getattr(self.hf.config.get_text_config(), "vocab_size", None)

    def info(self) -> dict:
        import transformers

        return {"engine": "transformers", "version": transformers.__version__, "model": self.model,
                "class": type(self.hf).__name__, "dtype": str(self.hf.dtype).replace("torch.", ""),
                "attn_implementation": getattr(self.hf.config, "_attn_implementation", None),
                "batching": "each round as one batch" if self.batched else "none, one request at a time",
                "memory_bytes": {"weights": sum(p.numel() * p.element_size() for p in self.hf.parameters())}}

    def reset(self) -> None:  # generate keeps nothing between calls
        return None

    def stats(self) -> None:
        return None

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        start = time.perf_counter()
        if self.batched:
            return self._generate(requests, start, own_call=False)
        return [rec for r in requests for rec in self._generate([r], start, own_call=True)]

    def _generate(self, requests: Sequence[BenchRequest], sent: float, own_call: bool) -> list[RequestRecord]:
        import torch
        from transformers import StoppingCriteriaList

        first = requests[0]
        if any((r.max_tokens, r.temperature) != (first.max_tokens, first.temperature) for r in requests):
            raise ValueError("a transformers batch needs one max_tokens and one temperature")
        width = max(len(r.prompt) for r in requests)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(requests):  # left padding with pad id 0
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt, dtype=torch.long)
            mask[row, width - len(r.prompt):] = 1
        sampling: dict[str, Any] = {"do_sample": False}
        if not first.greedy:
            sampling = {"do_sample": True, "temperature": first.temperature, "top_k": 0, "top_p": 1.0}
            if first.seed is not None:
                torch.manual_seed(first.seed)
        clock = _step_clock()
        call = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=first.max_tokens, pad_token_id=0,
                                   eos_token_id=None, stopping_criteria=StoppingCriteriaList([clock]), **sampling)
        end = time.perf_counter()
        return [RequestRecord(r.tag, len(r.prompt), row, sent, list(clock.stamps), end,
                              call_start=call if own_call else None)
                for r, row in zip(requests, out[:, width:].tolist(), strict=True)]


class LlamaCppArm:
    """llama.cpp through llama-cpp-python: one sequence at a time (its ``Llama`` has one
    slot; it keeps the previous request's K/V and reuses a common prefix, as llama.cpp
    does); a token's time is when ``generate`` yields it."""

    in_process = True

    def __init__(self, name: str, model: str) -> None:
        if not model.endswith(".gguf"):
            raise ValueError(f"the llama.cpp arm runs GGUF files, not {model!r}")
        import torch
        from llama_cpp import Llama

        self.name, self.model = name, model
        self.threads = torch.get_num_threads()
        self.llm = Llama(model_path=model, n_threads=self.threads, n_threads_batch=self.threads, n_ctx=4096,
                         n_batch=512, verbose=False)
        self.vocab_size: int | None = self.llm.n_vocab()
        self.weight_bytes, self.decode_weight_bytes, self.types = _gguf_weight_bytes(model)

    def info(self) -> dict:
        import llama_cpp

        return {"engine": "llama.cpp (llama-cpp-python)", "version": llama_cpp.__version__, "model": self.model,
                "dtype": "+".join(self.types), "threads": self.threads, "batching": "none, one request at a time",
                "memory_bytes": {"weights": self.weight_bytes}, "decode_weight_bytes": self.decode_weight_bytes}

    def reset(self) -> None:
        self.llm.reset()

    def stats(self) -> None:
        return None

    def run_round(self, requests: Sequence[BenchRequest]) -> list[RequestRecord]:
        sent = time.perf_counter()
        records = []
        for r in requests:
            sampling = {"top_k": 1, "temp": 0.0} if r.greedy else {"top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                                                    "temp": r.temperature}
            if r.seed is not None:
                self.llm.set_seed(r.seed)
            call, out, stamps = time.perf_counter(), [], []
            for token in self.llm.generate(list(r.prompt), reset=True, **sampling):
                out.append(token)
                stamps.append(time.perf_counter())
                if len(out) == r.max_tokens:
                    break
            records.append(RequestRecord(r.tag, len(r.prompt), out, sent, stamps, stamps[-1], call_start=call))
        return records


def _gguf_weight_bytes(path: str) -> tuple[int, int, list[str]]:
    """A GGUF file's tensor bytes, the bytes a decode step reads (all but the embedding
    table, which the lookup reads one row of, unless it is also the LM head: no
    ``output.weight``), and the storage types of its matrices."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    total = sum(int(t.n_bytes) for t in tensors)
    tied = all(t.name != "output.weight" for t in tensors)
    decode = sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
    return total, decode, sorted({t.tensor_type.name for t in tensors if len(t.shape) == 2})


def workload_kv_blocks(workload: Workload, block_size: int) -> int:
    """KV blocks for every token of every request of the workload (its largest case)."""
    return max(case.kv_blocks(block_size) for case in workload.cases().values())


def load_arm(name: str, model: str, workload: Workload, *, dtype: str, seed: int = 0,
             engine_kwargs: dict[str, Any] | None = None) -> Arm:
    """``dtype``: the run's ``--dtype``, used unless the name carries its own."""
    from hyprefix.config import EngineArgs

    base, own = split_arm(name)
    dtype = own or dtype
    if base == "transformers":
        return TransformersArm(name, model, dtype, batched=workload.hf_batched)
    if base == "llama.cpp":
        return LlamaCppArm(name, model)
    if base not in ("hyprefix", "hyprefix-nocache", COMPARE_ARM):
        raise ValueError(f"unknown arm {name!r}")
    # the arm's own options (its name's NAME=VALUE parts) over the bench's flags over the workload's needs
    kwargs = {**workload.engine_defaults(), **(engine_kwargs or {}), **arm_engine_options(name)}
    if arm_kv_cache_dtype(name) is not None:
        kwargs["kv_cache_dtype"] = arm_kv_cache_dtype(name)
    if "kv_cache_memory_gb" not in kwargs and "num_kv_blocks" not in kwargs:
        kwargs["num_kv_blocks"] = workload_kv_blocks(workload, kwargs.get("block_size", EngineArgs.block_size))
    rounds = [(c, lens) for c in workload.cases().values() for lens in c.prompt_lens()]
    kwargs.setdefault("max_num_seqs", max(64, *(len(lens) for _, lens in rounds)))
    arm = EngineArm(name, model, dtype=dtype, enable_prefix_caching=base != "hyprefix-nocache", seed=seed, **kwargs)
    live = max(sum(n + c.output_len for n in sorted(lens, reverse=True)[:kwargs["max_num_seqs"]])
               for c, lens in rounds)  # the longest requests that can run at once
    if arm.llm.engine.max_pool_tokens < live:
        log.warning("%s: the KV pool holds %d tokens, less than the %d one round needs at once: expect preemptions "
                    "(raise --kv-cache-memory-gb)", name, arm.llm.engine.max_pool_tokens, live)
    return arm


def run_workload(arm: Arm, workload: Workload, case: str, repeat: int, max_rounds: int | None = None) -> WorkloadRun:
    """Reset the arm's cache, then run the rounds of ``workload`` (the first ``max_rounds``)
    and record them."""
    arm.reset()
    before = arm.stats()
    meter, rss = CpuMeter(), RssPeak() if arm.in_process else None
    meter.start()
    if rss is not None:
        rss.start()
    records, round_seconds = (_run_timed(arm, workload) if workload.timed
                              else _run_rounds(arm, workload, max_rounds))
    other = meter.stop()["other_cores_avg"]
    memory = rss.stop() if rss is not None else {}
    after = arm.stats()
    stats = None
    if before is not None and after is not None:
        stats = {k: after[k] - before[k] for k in COUNTERS if k in after and k in before}
        stats.update({k: after[k] for k in GAUGES if k in after})
        queries = stats.get("prefix_cache_queries")  # None: a server that exports no such counter
        hits = stats.get("prefix_cache_hits", 0)
        stats["prefix_cache_hit_rate"] = None if queries is None else hits / max(1, queries)
        stats["cached_tokens_per_request_sum"] = sum(r.cached_tokens or 0 for r in records)
        stats["cache_at_start"] = {k: before.get(k) for k in ("kv_blocks_cached", "mamba_checkpoints_used")}
    return WorkloadRun(arm=arm.name, case=case, repeat=repeat, round_seconds=round_seconds, requests=records,
                       stats=stats, other_cores_avg=other, **memory)


def _run_rounds(arm: Arm, workload: Workload, max_rounds: int | None) -> tuple[list[RequestRecord], list[float]]:
    """The records and each round's time of the rounds of a round workload."""
    previous: list[BenchRequest] = []
    answers: list[list[int]] = []
    records: list[RequestRecord] = []
    round_seconds = []
    for k in range(min(max_rounds or workload.num_rounds, workload.num_rounds)):
        requests = workload.round_requests(k, previous, answers)
        results = arm.run_round(requests)
        for req, rec in zip(requests, results, strict=True):
            rec.round = k
            _check_length(arm, rec, req.max_tokens)
        round_seconds.append(max(r.end for r in results) - min(r.sent for r in results))
        records.extend(results)
        previous, answers = requests, [r.output_ids if r.answer_ids is None else r.answer_ids for r in results]
    return records, round_seconds


def _run_timed(arm: Arm, workload: Any) -> tuple[list[RequestRecord], list[float]]:
    """The records of a timed workload; its time runs from the first request's scheduled start
    to the last one's end (pauses included)."""
    if not hasattr(arm, "run_timed"):
        raise ValueError(f"the {arm.name} arm runs one request at a time: it does not take the timed workload "
                         f"{workload.name} (use hyprefix arms or --url)")
    records = arm.run_timed(workload)
    expected = sum(len(s.turns) for s in workload.sessions())
    if len(records) != expected:
        raise RuntimeError(f"{arm.name} finished {len(records)} of the {expected} requests of {workload.name}")
    for rec in records:
        _check_length(arm, rec, workload.output_len)
    return records, [max(r.end for r in records) - min(r.sent for r in records)]


def _check_length(arm: Arm, rec: RequestRecord, max_tokens: int) -> None:
    if len(rec.output_ids) != max_tokens:
        raise RuntimeError(f"{arm.name} produced {len(rec.output_ids)} tokens for {rec.tag}, not the "
                           f"{max_tokens} asked for (does it honour ignore_eos?)")


def warm_up(arm: Arm, workload: Workload, case: str) -> None:
    """A small copy of the case with other token ids: 4 output tokens, at most two rounds, and
    transformers one request at a time only one request."""
    if workload.timed:
        run_workload(arm, workload.warm_up_workload(), case, repeat=-1)
        return
    small = replace(workload, seed=workload.seed + 7919, output_len=min(workload.output_len, 4))
    if isinstance(arm, TransformersArm) and not arm.batched:
        arm.run_round(small.round_requests(0)[:1])
    else:
        run_workload(arm, small, case, repeat=-1, max_rounds=2)


def run_arms(arms: dict[str, Arm], workload: Workload, repeats: int, progress: Callable[[str], None] = lambda _: None,
             read_rate: Callable[[], float] | None = None,
             ) -> tuple[dict[str, dict[str, list[WorkloadRun]]], dict[str, str]]:
    """Warm every arm up on every case, then run the interleaved repeats. Returns the runs
    (arm -> case -> repeats) and the arms skipped (transformers failing) with the reason.
    With ``read_rate`` (GB/s), each batch-1 decode run records the rate measured right
    before it: a shared machine's read rate swings within one run, so a decode step is set
    against the rate of its own moment."""
    cases = workload.cases()
    skipped: dict[str, str] = {}
    for name in list(arms):
        try:
            for case_name, case in cases.items():
                progress(f"warm-up {name} {case_name}")
                warm_up(arms[name], case, case_name)
        except Exception as exc:  # any failure of the reference library skips its arm
            if split_arm(name)[0] != "transformers":
                raise
            log.warning("skipping the %s arm: warm-up failed: %s", name, exc)
            skipped[name] = f"warm-up failed: {type(exc).__name__}: {exc}"
            del arms[name]
    runs: dict[str, dict[str, list[WorkloadRun]]] = {name: {c: [] for c in cases} for name in arms}
    for repeat in range(repeats):
        for case_name, case in cases.items():
            for name, arm in arms.items():
                progress(f"repeat {repeat + 1}/{repeats} {name} {case_name}")
                rate = read_rate() if read_rate is not None and case_name == "decode@1" else None
                runs[name][case_name].append(run_workload(arm, case.for_repeat(repeat), case_name, repeat))
                runs[name][case_name][-1].read_gb_per_s = rate
    return runs, skipped
