"""One summary schema for every workload (``arms[arm][case]``), the ratios between arms and
their output agreement.

Per arm and case: run times (median, min-max over repeats) and rates, decode tokens/s,
latency percentiles over every request of every repeat, the engine's counters and prefill
tokens computed vs the ideal. Ratios are measured values only (the issues' targets live in
the source tree's ``tools/``); ``--url`` arms are set against the offline ``hyprefix`` arm and
against the first server (``server_pairs``). Outputs must agree exactly between hyprefix with and without
the cache; transformers is compared on greedy requests. Prefill FLOPs from
``Engine.model_facts``: ``2·P·L`` (every linear layer but the LM head) + ``2·V·H`` (the LM
head, last token) + ``4·layers·L²/2·width`` (causal attention); the Mamba scan is left out.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from hyprefix.bench.arms import COMPARE_ARM, WorkloadRun, split_arm
from hyprefix.bench.workloads import Workload
from hyprefix.text import common_prefix

DISTURBED_CORES = 0.25  # a timed run is "disturbed" when other processes used more cores meanwhile
# (numerator arm, denominator arm): time_num / time_den is how many times faster the denominator arm is.
RATIO_PAIRS = (("hyprefix-nocache", "hyprefix"), ("transformers", "hyprefix"), ("transformers", "hyprefix-nocache"))
AGREEMENT_PAIRS = (("hyprefix", "hyprefix-nocache"), ("hyprefix", "transformers"), ("hyprefix-nocache", "transformers"))
Runs = dict[str, dict[str, list[WorkloadRun]]]  # arm -> case -> repeats


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between order statistics (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float | None]) -> dict[str, float | int | None]:
    vals = [v for v in values if v is not None]
    return {"count": len(vals), "p50": percentile(vals, 50), "p90": percentile(vals, 90),
            "p99": percentile(vals, 99), "mean": statistics.fmean(vals) if vals else None,
            "min": min(vals, default=None), "max": max(vals, default=None)}


def spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    vals = [v for v in values if v is not None]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def prefill_flops(facts: Any, prompt_len: int) -> dict[str, float]:
    """FLOPs of one prefill of ``prompt_len`` tokens that samples one token (``facts``: ``ModelFacts``)."""
    linear = 2.0 * facts.matmul_params * prompt_len
    lm_head = 2.0 * facts.lm_head_params
    attention = 4.0 * facts.attention_layers * (prompt_len**2 / 2) * facts.attention_width
    return {"linear": linear, "lm_head": lm_head, "attention": attention, "total": linear + lm_head + attention}


def summarise_case(runs: Sequence[WorkloadRun], case: Workload) -> dict[str, Any]:
    if not runs:
        raise ValueError("no runs to summarise")
    records = [rec for r in runs for rec in r.requests]
    first = runs[0]
    prompt_tokens = sum(rec.prompt_len for rec in first.requests)
    times = [r.seconds for r in runs]
    summary: dict[str, Any] = {
        "requests": len(first.requests), "prompt_tokens": prompt_tokens, "output_tokens": first.output_tokens,
        "repeats": len(runs), "total_seconds": {**spread(times), "all": times},
        **{key: spread([n / t for t in times]) for key, n in (
            ("requests_per_s", len(first.requests)), ("prompt_tokens_per_s", prompt_tokens),
            ("output_tokens_per_s", first.output_tokens))},
        "decode_tokens_per_s": spread([r.decode_tokens_per_s() for r in runs]),
        "ttft_seconds": distribution([rec.ttft for rec in records]),
        "tpot_seconds": distribution([rec.tpot for rec in records]),
        "e2e_seconds": distribution([rec.end - rec.sent for rec in records]),
        "itl_seconds": distribution([b - a for rec in records for a, b in itertools.pairwise(rec.token_times)]),
        "other_cores_avg": [r.other_cores_avg for r in runs],
        "peak_rss_growth_gib": max((r.rss_peak_gib - r.rss_start_gib for r in runs
                                    if r.rss_peak_gib is not None and r.rss_start_gib is not None), default=None),
        "ideal_prefill_tokens": case.ideal_prefill_tokens(),
    }
    if any(rec.ttft_own is not None for rec in records):
        summary["ttft_own_call_seconds"] = distribution([rec.ttft_own for rec in records])
    if case.num_rounds > 1:
        summary["ttft_p50_by_round"] = [percentile([rec.ttft for rec in records if rec.round == k
                                                    and rec.ttft is not None], 50) for k in range(case.num_rounds)]
    if case.timed:  # the longest wait: a starved request shows here, not in the percentiles
        summary["longest_wait_seconds"] = summary["ttft_seconds"]["max"]
    classes = getattr(case, "request_classes", ())
    if classes:
        summary["by_class"] = {name: class_summary(runs, name) for name in classes}
    stats = runs[-1].stats
    if stats is not None:
        summary["stats"] = stats
        summary["stats_identical_across_repeats"] = all(
            r.stats is not None and all(r.stats.get(k) == v for k, v in stats.items() if k != "cache_at_start")
            for r in runs)
        summary["computed_vs_ideal"] = ratio(stats.get("prefill_computed_tokens"), case.ideal_prefill_tokens())
    return summary


def class_summary(runs: Sequence[WorkloadRun], name: str) -> dict[str, Any]:
    """The requests whose tag starts with ``name/`` ("hot/r3"): their latencies over every repeat,
    and their rates per repeat over their own span (first one's scheduled start to last one's end)."""
    mine = [[rec for rec in r.requests if rec.tag.split("/", 1)[0] == name] for r in runs]
    records = [rec for recs in mine for rec in recs]

    def rate(count: Any) -> dict[str, Any] | None:
        spans = [(count(recs), max(x.end for x in recs) - min(x.sent for x in recs)) for recs in mine if recs]
        return spread([n / t for n, t in spans if t > 0])

    return {"requests": len(mine[0]), "output_tokens": sum(len(rec.output_ids) for rec in mine[0]),
            "ttft_seconds": distribution([rec.ttft for rec in records]),
            "e2e_seconds": distribution([rec.end - rec.sent for rec in records]),
            "requests_per_s": rate(len), "output_tokens_per_s": rate(lambda recs: sum(len(x.output_ids) for x in recs))}


def server_pairs(arms: Sequence[str], servers: Sequence[str]) -> list[tuple[str, str]]:
    """(numerator, denominator) pairs of the ``--url`` arms: each server over the offline
    ``hyprefix`` arm (what serving costs), and each later server over the first (another
    engine's server against ours, when ours is named first)."""
    pairs = [(s, "hyprefix") for s in servers if "hyprefix" in arms]
    return pairs + [(s, servers[0]) for s in servers[1:]]


def _throughput_ratios(arms: dict[str, dict[str, Any]], workload: Any,
                       servers: Sequence[str] = ()) -> list[dict[str, Any]]:
    def rate(arm: str, case: str) -> float | None:
        key = "prompt_tokens_per_s" if case == "prefill" else "decode_tokens_per_s"
        s = arms.get(arm, {}).get(case, {}).get(key)
        return s["median"] if s else None

    pairs = [("prefill hyprefix / transformers", ("hyprefix", "prefill"), ("transformers", "prefill"))]
    for b in workload.batch_sizes:
        pairs.append((f"decode hyprefix B={b} / transformers B={b}", ("hyprefix", f"decode@{b}"),
                      ("transformers", f"decode@{b}")))
        if b != 1 and 1 in workload.batch_sizes:
            pairs.append((f"decode hyprefix B={b} / transformers B=1", ("hyprefix", f"decode@{b}"),
                          ("transformers", "decode@1")))
    for num, den in server_pairs(list(arms), servers):
        pairs.append((f"prefill {num} / {den}", (num, "prefill"), (den, "prefill")))
        pairs += [(f"decode {num} B={b} / {den} B={b}", (num, f"decode@{b}"), (den, f"decode@{b}"))
                  for b in workload.batch_sizes]
    explicit = [a for a in arms if split_arm(a)[0] == "hyprefix" and split_arm(a)[1] is not None]
    if explicit:
        fastest = max(explicit, key=lambda a: rate(a, "prefill") or 0.0)
        pairs.append(("prefill hyprefix / fastest explicit dtype", ("hyprefix", "prefill"), (fastest, "prefill")))
    return [{"name": name, "value": ratio(rate(*num), rate(*den)), "numerator": " ".join(num),
             "denominator": " ".join(den)} for name, num, den in pairs if rate(*num) and rate(*den)]


def _request_ratios(arms: dict[str, dict[str, Any]], case: str, servers: Sequence[str] = ()) -> list[dict[str, Any]]:
    s = {name: cases[case] for name, cases in arms.items()}
    out = []
    for num, den in [*RATIO_PAIRS, *server_pairs(list(arms), servers)]:
        if num in s and den in s:
            out.append({"name": f"time {num} / {den}", "value": ratio(s[num]["total_seconds"]["median"],
                                                                       s[den]["total_seconds"]["median"])})
            out += [{"name": f"TTFT {q} {num} / {den}",
                     "value": ratio(s[num]["ttft_seconds"][q], s[den]["ttft_seconds"][q])} for q in ("p50", "p90")]
            out.append({"name": f"TPOT p50 {num} / {den}",
                        "value": ratio(s[num]["tpot_seconds"]["p50"], s[den]["tpot_seconds"]["p50"])})
    for name in ("hyprefix", COMPARE_ARM):
        if s.get(name, {}).get("computed_vs_ideal") is not None:
            out.append({"name": f"prefill computed / ideal ({name})", "value": s[name]["computed_vs_ideal"]})
    if "stats" in s.get("hyprefix", {}) and "stats" in s.get(COMPARE_ARM, {}):
        out.append({"name": "prefix hit rate model / compare-model",
                    "value": ratio(s["hyprefix"]["stats"]["prefix_cache_hit_rate"],
                                   s[COMPARE_ARM]["stats"]["prefix_cache_hit_rate"])})
    return out


def agreement(runs: Runs, cases: dict[str, Workload]) -> list[dict[str, Any]]:
    out = []
    for case_name, case in cases.items():
        for a, b in AGREEMENT_PAIRS:
            if a not in runs or b not in runs or ("transformers" in (a, b) and not case.greedy):
                continue
            xs, ys = ({f"{r.repeat}/{rec.tag}": rec.output_ids for r in runs[arm][case_name] for rec in r.requests}
                      for arm in (a, b))
            tags = [t for t in xs if t in ys]
            diverged = {t: common_prefix(xs[t], ys[t]) for t in tags if xs[t] != ys[t]}
            out.append({"case": case_name, "arms": [a, b], "of": len(tags), "identical": len(tags) - len(diverged),
                        "same_first_token": sum(xs[t][:1] == ys[t][:1] for t in tags), "first_difference_at": diverged})
    return out


def summarise(runs: Runs, workload: Workload, models: dict[str, str], skipped: dict[str, str] | None = None,
              facts: Any = None, peak: Any = None, bandwidth: Any = None,
              decode_bytes: dict[str, int] | None = None, servers: Sequence[str] = ()) -> dict[str, Any]:
    """Per-arm, per-case summaries, ratios between arms, agreement and contention. ``models``
    maps each arm to its model label; ``facts`` (``ModelFacts``) and ``peak`` (``measure_matmul_peak``)
    give the throughput workload's prefill FLOP rate; with ``bandwidth`` (``env.read_bandwidth``)
    the hyprefix and llama.cpp arms' batch-1 time per output token is set against the memory
    roofline (``_decode_roofline``)."""
    cases = workload.cases()
    arms = {name: {c: {**summarise_case(rs, cases[c]), "model": models.get(name)} for c, rs in by_case.items() if rs}
            for name, by_case in runs.items()}
    contention = [r.other_cores_avg for by_case in runs.values() for rs in by_case.values() for r in rs]
    result: dict[str, Any] = {
        "workload": workload.name, "workload_config": workload.to_dict(), "description": workload.describe(),
        "cases": list(cases), "arms": arms, "arm_order": list(arms), "skipped_arms": skipped or {},
        "ratios": (_throughput_ratios(arms, workload, servers) if workload.name == "throughput"
                   else _request_ratios(arms, workload.name, servers)),
        "output_agreement": agreement(runs, cases),
        "disturbed_runs": {"count": sum(c is not None and c > DISTURBED_CORES for c in contention),
                           "of": len(contention), "threshold_other_cores": DISTURBED_CORES},
        "runs": {name: {c: [r.to_dict() for r in rs] for c, rs in by_case.items()} for name, by_case in runs.items()},
    }
    if facts is not None and "prefill" in cases:
        flops = prefill_flops(facts, cases["prefill"].prompt_lens()[0][0])
        gflops = {name: flops["total"] / by_case["prefill"]["total_seconds"]["median"] / 1e9
                  for name, by_case in arms.items() if "prefill" in by_case}
        result.update(prefill_flops=flops, prefill_peak={
            name: {"prefill_gflops": g, "fraction_of_peak": g / peak["gflops"] if peak else None}
            for name, g in gflops.items()})
    if facts is not None and bandwidth and "decode@1" in cases and facts.decode_weight_bytes:
        result["decode_roofline"] = _decode_roofline(runs, arms, facts, bandwidth, decode_bytes or {})
    return result


def _decode_roofline(runs: Runs, arms: dict[str, Any], facts: Any, bandwidth: dict[str, Any],
                     decode_bytes: dict[str, int]) -> dict[str, Any]:
    """Batch-1 time per output token over the memory roofline: the weight bytes a decode step
    reads (``facts``, or the arm's own in ``decode_bytes``) over the read rate. Where every
    decode run recorded the rate measured right before it (``run_arms``' ``read_rate``), the
    ratio is the median over repeats of each run's TPOT over its own moment's roofline (a
    shared machine's rate swings between runs); else the median TPOT over the median rate
    measured before and after the arms. Both rates are in the JSON."""
    paired = [r.read_gb_per_s for by_case in runs.values() for r in by_case.get("decode@1", [])]
    rate_gb = (sorted(paired)[len(paired) // 2] if paired and None not in paired
               else bandwidth["median_gb_per_s"])
    out: dict[str, Any] = {
        "weight_bytes": facts.decode_weight_bytes, "quantization": facts.quantization,
        "read_gb_per_s": rate_gb, "read_gb_per_s_around_arms": bandwidth["median_gb_per_s"],
        "best_read_gb_per_s": bandwidth["gb_per_s"], "roofline_seconds": facts.decode_weight_bytes / (rate_gb * 1e9),
        "arms": {}}
    for name, by_case in arms.items():
        decode = by_case.get("decode@1")
        if split_arm(name)[0] not in ("hyprefix", "llama.cpp") or not decode or not decode.get("decode_tokens_per_s"):
            continue
        nbytes = decode_bytes.get(name, facts.decode_weight_bytes)
        tpot = 1.0 / decode["decode_tokens_per_s"]["median"]
        entry: dict[str, Any] = {"tpot_seconds": tpot, "weight_bytes": nbytes}
        decode_runs = runs[name]["decode@1"]
        each = [(1.0 / r.decode_tokens_per_s()) / (nbytes / (r.read_gb_per_s * 1e9))
                for r in decode_runs if r.read_gb_per_s and r.decode_tokens_per_s()]
        if each and len(each) == len(decode_runs):
            entry.update(tpot_over_roofline=sorted(each)[len(each) // 2], tpot_over_roofline_per_repeat=each,
                         read_gb_per_s_per_repeat=[r.read_gb_per_s for r in decode_runs])
        else:
            entry["tpot_over_roofline"] = tpot / (nbytes / (bandwidth["median_gb_per_s"] * 1e9))
        out["arms"][name] = entry
    return out
