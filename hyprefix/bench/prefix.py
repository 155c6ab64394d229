"""The prefix-cache workloads (``shared-prefix``, ``rl-burst``, ``multi-turn``): arms run
side by side, interleaved, and summarised.

Order of a run: load every arm (``hyprefix``, ``hyprefix-nocache``, ``transformers``, and
``compare-hyprefix``, the hyprefix arm on ``--compare-model``); warm each up on a copy of
the workload with another seed and 4 output tokens (engine arms: its first two rounds;
``transformers``: one request); then for every repeat, the arms run the whole workload back
to back in ``--arms`` order (the compare arm last), each starting from an empty cache
(``hyprefix.bench.offline``), so slow phases of a noisy machine hit them alike. Every arm
gets the same token ids in every repeat; multi-turn answers are each arm's own outputs
(with a fixed output length, so every arm sees the same prompt lengths).

Summary per arm: total time (median and min-max over repeats), requests/s and output
tokens/s from the median time, TTFT and time-per-output-token percentiles over every
request of every repeat (linear interpolation between order statistics), and the engine's
counters over the run (from the last repeat; ``stats_identical_across_repeats`` says
whether the repeats agreed). The ratios compare arms by median total time (which is the
inverse ratio of throughput: every arm produces the same tokens) and by TTFT p50 / p90.

Targets checked (PASS/FAIL):

* ``shared-prefix``: throughput hyprefix / hyprefix-nocache >= 3 (issue 3; its own
  configuration is 4 groups x 8 requests, 1024-token system prompt, 64-token questions, 16
  output tokens: ``--groups 4 --num-requests 8 --system-len 1024 --suffix-len 64
  --output-len 16``).
* ``rl-burst``: prefill tokens computed <= 1.1 x the ideal (each distinct prompt once), for
  every cache arm (issue 3; issue 4 asks the same of hybrid models).
* ``--compare-model``: prefix hit rate of ``--model`` / that of ``--compare-model`` >= 0.9
  (issue 4: a hybrid model's hit rate against a dense model's on the same conversations).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hyprefix.bench.offline import EngineArm, TransformersWorkloadArm, WorkloadArm, WorkloadRun, run_workload
from hyprefix.bench.online import SERVER_ARM
from hyprefix.bench.workloads import Workload
from hyprefix.config import EngineArgs

log = logging.getLogger("hyprefix.bench")

OFFLINE_ARMS = ("hyprefix", "hyprefix-nocache", "transformers")
PREFIX_ARMS = (*OFFLINE_ARMS, SERVER_ARM)  # the server arm only with --url
COMPARE_ARM = "compare-hyprefix"
CACHE_ARMS = ("hyprefix", COMPARE_ARM)
DISTURBED_CORES = 0.25  # a timed run is "disturbed" when other processes used more cores meanwhile
WARMUP_SEED_OFFSET = 7919
WARMUP_OUTPUT_LEN = 4
WARMUP_ROUNDS = 2
SHARED_PREFIX_SPEEDUP_TARGET = 3.0
RL_BURST_IDEAL_TARGET = 1.1
HIT_RATE_RATIO_TARGET = 0.9
# (numerator arm, denominator arm) of the reported ratios: time_num / time_den is how many
# times faster the denominator arm is.
RATIO_PAIRS = (("hyprefix-nocache", "hyprefix"), ("transformers", "hyprefix"), ("transformers", "hyprefix-nocache"))

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PrefixBenchConfig:
    arms: tuple[str, ...] = OFFLINE_ARMS
    repeats: int = 3
    dtype: str = "auto"
    seed: int = 0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # extra LLM arguments for the engine arms

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in PREFIX_ARMS]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct names from {', '.join(PREFIX_ARMS)}, got {','.join(self.arms)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


# ------------------------------------------------------------------------------ running
def load_arm(name: str, model: str, workload: Workload, cfg: PrefixBenchConfig) -> WorkloadArm:
    if name in ("hyprefix", COMPARE_ARM, "hyprefix-nocache"):
        kwargs = dict(cfg.engine_kwargs)
        if "kv_cache_memory_gb" not in kwargs and "num_kv_blocks" not in kwargs:
            kwargs["num_kv_blocks"] = workload_kv_blocks(workload, kwargs.get("block_size", EngineArgs.block_size))
        arm = EngineArm(name, model, cfg.dtype, enable_prefix_caching=name != "hyprefix-nocache",
                        max_num_seqs=workload.max_concurrency(), engine_kwargs=kwargs, seed=cfg.seed)
        _check_pool(arm, workload)
        return arm
    if name == "transformers":
        return TransformersWorkloadArm(model, cfg.dtype)
    raise ValueError(f"unknown arm {name!r}")


def workload_kv_blocks(workload: Workload, block_size: int) -> int:
    """KV blocks for every token of every request of the workload, so that no arm is
    slowed by preemption or loses cached blocks to eviction (the default pool of the
    engine arms; ``--kv-cache-memory-gb`` sets it instead)."""
    return sum(-(-(n + workload.output_len) // block_size) for lens in workload.prompt_lens() for n in lens)


def _check_pool(arm: EngineArm, workload: Workload) -> None:
    lens = workload.prompt_lens()
    live = max(sum(n + workload.output_len for n in round_lens) for round_lens in lens)
    capacity = arm.kv_capacity_tokens
    if capacity < live:
        log.warning("%s: the KV pool holds %d tokens, less than the %d one round needs at once: expect preemptions "
                    "(raise --kv-cache-memory-gb)", arm.name, capacity, live)
    elif capacity < sum(n + workload.output_len for round_lens in lens for n in round_lens):
        log.info("%s: the KV pool (%d tokens) is smaller than every token of the workload: cached blocks of finished "
                 "requests may be evicted", arm.name, capacity)


def warm_up(arm: WorkloadArm, workload: Workload) -> None:
    """Run a small copy of the workload with other token ids (the cache is reset before
    every timed run anyway)."""
    small = replace(workload, seed=workload.seed + WARMUP_SEED_OFFSET,
                    output_len=min(workload.output_len, WARMUP_OUTPUT_LEN))
    if isinstance(arm, EngineArm):
        run_workload(arm, small, repeat=-1, max_rounds=WARMUP_ROUNDS)
    else:
        arm.run_round(small.round_requests(0)[:1])


def run_prefix_bench(arms: dict[str, WorkloadArm], workload: Workload, repeats: int,
                     progress: Progress = lambda _: None) -> tuple[dict[str, list[WorkloadRun]], dict[str, str]]:
    """Warm up, then run the interleaved repeats. Returns the runs per arm and the arms that
    were skipped (``transformers`` failing on this architecture) with the reason."""
    skipped: dict[str, str] = {}
    for name in list(arms):
        progress(f"warm-up {name}")
        try:
            warm_up(arms[name], workload)
        except Exception as exc:  # any failure of the reference library skips its arm
            if name != "transformers":
                raise
            log.warning("skipping the transformers arm: warm-up failed: %s", exc)
            skipped[name] = f"warm-up failed: {type(exc).__name__}: {exc}"
            del arms[name]
    runs: dict[str, list[WorkloadRun]] = {name: [] for name in arms}
    for repeat in range(repeats):
        for name, arm in arms.items():
            progress(f"repeat {repeat + 1}/{repeats} {name}")
            runs[name].append(run_workload(arm, workload, repeat))
    return runs, skipped


# ---------------------------------------------------------------------------- summary
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics
    (numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    vals = [v for v in values if v is not None]
    return {"count": len(vals), "p50": percentile(vals, 50), "p90": percentile(vals, 90),
            "p99": percentile(vals, 99), "mean": statistics.fmean(vals) if vals else None,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None}


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def summarise_arm(runs: Sequence[WorkloadRun], workload: Workload) -> dict[str, Any]:
    if not runs:
        raise ValueError("no runs to summarise")
    times = [r.seconds for r in runs]
    median_s = statistics.median(times)
    requests, out_tokens = len(runs[0].requests), runs[0].output_tokens
    prompt_tokens = sum(rec.prompt_len for rec in runs[0].requests)
    summary: dict[str, Any] = {
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "repeats": len(runs),
        "total_seconds": {"median": median_s, "min": min(times), "max": max(times), "all": times},
        "requests_per_s": {"median": requests / median_s, "min": requests / max(times),
                           "max": requests / min(times)},
        "output_tokens_per_s": {"median": out_tokens / median_s, "min": out_tokens / max(times),
                                "max": out_tokens / min(times)},
        "ttft_seconds": distribution([rec.ttft for r in runs for rec in r.requests]),
        "tpot_seconds": distribution([rec.tpot for r in runs for rec in r.requests]),
        "e2e_seconds": distribution([rec.e2e for r in runs for rec in r.requests]),
        "itl_seconds": distribution([x for r in runs for rec in r.requests for x in rec.itl]),
        "other_cores_avg": [r.other_cores_avg for r in runs],
        "peak_rss_growth_gib": max((r.rss_peak_gib - r.rss_start_gib for r in runs
                                    if r.rss_peak_gib is not None and r.rss_start_gib is not None), default=None),
    }
    own = [rec.ttft_own for r in runs for rec in r.requests if rec.ttft_own is not None]
    if own:
        summary["ttft_own_call_seconds"] = distribution(own)
    if workload.num_rounds > 1:
        summary["ttft_p50_by_round"] = [
            percentile([rec.ttft for r in runs for rec in r.requests if rec.round == k and rec.ttft is not None], 50)
            for k in range(workload.num_rounds)]
    stats = runs[-1].stats
    if stats is not None:
        keys = [k for k in stats if k != "cache_at_start"]
        summary["stats"] = stats
        summary["stats_identical_across_repeats"] = all(
            r.stats is not None and all(r.stats.get(k) == stats.get(k) for k in keys) for r in runs)
        ideal = workload.ideal_prefill_tokens()
        summary["ideal_prefill_tokens"] = ideal
        summary["computed_vs_ideal"] = ratio(stats.get("prefill_computed_tokens"), ideal)
    return summary


def _agreement(runs: dict[str, list[WorkloadRun]], workload: Workload) -> list[dict[str, Any]]:
    """Outputs of the first repeat compared request by request: hyprefix with and without
    the cache must agree exactly (same seeds); transformers only when greedy (bf16 rounding
    can flip near-ties, and its sampling RNG differs)."""
    pairs = [("hyprefix", "hyprefix-nocache")]
    if workload.greedy:
        pairs += [("hyprefix", "transformers"), ("hyprefix-nocache", "transformers")]
    out = []
    for a, b in pairs:
        if not runs.get(a) or not runs.get(b):
            continue
        xs = {rec.tag: rec.output_ids for rec in runs[a][0].requests}
        ys = {rec.tag: rec.output_ids for rec in runs[b][0].requests}
        tags = [t for t in xs if t in ys]
        diverged = {t: _common_prefix(xs[t], ys[t]) for t in tags if xs[t] != ys[t]}
        out.append({"arms": [a, b], "of": len(tags), "identical": len(tags) - len(diverged),
                    "same_first_token": sum(xs[t][:1] == ys[t][:1] for t in tags),
                    "first_difference_at": diverged})
    return out


def _common_prefix(x: Sequence[int], y: Sequence[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def _target(value: float | None, op: str, target: float) -> dict[str, Any]:
    ok = None if value is None else (value >= target if op == ">=" else value <= target)
    return {"target": target, "op": op, "pass": ok}


def summarise(runs: dict[str, list[WorkloadRun]], workload: Workload, models: dict[str, str],
              skipped: dict[str, str] | None = None) -> dict[str, Any]:
    """Per-arm summaries, ratios between arms and the issue targets. ``models`` maps each
    arm to its model label."""
    arms = {name: summarise_arm(rs, workload) for name, rs in runs.items() if rs}
    for name, s in arms.items():
        s["model"] = models.get(name)

    ratios: list[dict[str, Any]] = []
    for num, den in RATIO_PAIRS:
        if num not in arms or den not in arms:
            continue
        a, b = arms[num], arms[den]
        entry = {"name": f"time {num} / {den}", "kind": "time",
                 "value": ratio(a["total_seconds"]["median"], b["total_seconds"]["median"]),
                 "target": None, "op": None, "pass": None}
        if workload.name == "shared-prefix" and (num, den) == ("hyprefix-nocache", "hyprefix"):
            entry.update(_target(entry["value"], ">=", SHARED_PREFIX_SPEEDUP_TARGET))
            entry["note"] = "= throughput hyprefix / hyprefix-nocache (issue 3 target)"
        ratios.append(entry)
        for q in ("p50", "p90"):
            ratios.append({"name": f"TTFT {q} {num} / {den}", "kind": "ttft",
                           "value": ratio(a["ttft_seconds"][q], b["ttft_seconds"][q]),
                           "target": None, "op": None, "pass": None})
    if workload.name == "rl-burst":
        for name in CACHE_ARMS:
            if name in arms and arms[name].get("computed_vs_ideal") is not None:
                ratios.append({"name": f"prefill computed / ideal ({name})", "kind": "prefill",
                               "value": arms[name]["computed_vs_ideal"],
                               **_target(arms[name]["computed_vs_ideal"], "<=", RL_BURST_IDEAL_TARGET),
                               "note": "ideal: each distinct prompt computed once (issue 3 target)"})
    hit_rate = None
    if "hyprefix" in arms and COMPARE_ARM in arms:
        ours = arms["hyprefix"]["stats"]["prefix_cache_hit_rate"]
        theirs = arms[COMPARE_ARM]["stats"]["prefix_cache_hit_rate"]
        value = ratio(ours, theirs)
        hit_rate = {"model": models.get("hyprefix"), "compare_model": models.get(COMPARE_ARM),
                    "hit_rate": ours, "compare_hit_rate": theirs, "ratio": value,
                    **_target(value, ">=", HIT_RATE_RATIO_TARGET)}
        ratios.append({"name": "prefix hit rate model / compare-model", "kind": "hit_rate", "value": value,
                       **_target(value, ">=", HIT_RATE_RATIO_TARGET),
                       "note": "issue 4: hybrid >= 0.9 x dense on the same conversations"})

    contention = [c for rs in runs.values() for r in rs for c in [r.other_cores_avg]]
    return {
        "workload": workload.name,
        "workload_config": workload.to_dict(),
        "description": workload.describe(),
        "arms": arms,
        "arm_order": list(arms),
        "skipped_arms": skipped or {},
        "ratios": ratios,
        "hit_rate_comparison": hit_rate,
        "output_agreement": _agreement(runs, workload),
        "disturbed_runs": {"count": sum(c is not None and c > DISTURBED_CORES for c in contention),
                           "of": len(contention), "threshold_other_cores": DISTURBED_CORES},
        "runs": {name: [r.to_dict() for r in rs] for name, rs in runs.items()},
    }
