"""Plain-text report and JSON file of a benchmark result (``hyprefix.bench.summary``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_LISTED_DIFFERENCES = 8


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _int(value: float | None) -> str:
    return "n/a" if value is None else f"{int(value):,}"


def _range(v: dict[str, float] | None, digits: int) -> str:
    return "n/a" if v is None else f"{_fmt(v['median'], digits)} ({_fmt(v['min'], digits)}-{_fmt(v['max'], digits)})"


def _table(rows: list[list[str]], header: list[str], left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns in ``left`` (the labels) left-aligned, numbers right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _throughput_rows(result: dict[str, Any], names: list[str]) -> list[list[str]]:
    cfg, arms = result["workload_config"], result["arms"]

    def cell(name: str, case: str) -> str:
        key = "prompt_tokens_per_s" if case == "prefill" else "decode_tokens_per_s"
        return _range(arms[name][case][key], 1) if case in arms[name] else "-"

    rows = [[f"prefill tok/s ({cfg['prompt_len']}-token prompt)", *[cell(n, "prefill") for n in names]]]
    rows += [[f"decode tok/s, batch {b} ({cfg['decode_prompt_len']}+{cfg['decode_tokens']} tokens)",
              *[cell(n, f"decode@{b}") for n in names]] for b in cfg["batch_sizes"]]
    peak, flops = result.get("peak"), result.get("prefill_peak", {})
    if peak and flops:
        rows.append([f"prefill % of {peak['dtype']} matmul peak ({peak['gflops']:,.0f} GFLOP/s)",
                     *[_fmt(100 * flops[n]["fraction_of_peak"]) + " %" if n in flops else "-" for n in names]])
        rows.append(["prefill GFLOP/s", *[_fmt(flops[n]["prefill_gflops"]) if n in flops else "-" for n in names]])
    roof = result.get("decode_roofline")
    if roof:
        arms_roof = roof["arms"]
        weights = f"{roof['weight_bytes'] / 1e6:,.0f} MB{' ' + roof['quantization'] if roof['quantization'] else ''}"
        rows.append([f"batch-1 TPOT ms (roofline {1e3 * roof['roofline_seconds']:.1f}: {weights} at "
                     f"{roof['read_gb_per_s']:.1f} GB/s)",
                     *[_fmt(1e3 * arms_roof[n]["tpot_seconds"]) if n in arms_roof else "-" for n in names]])
        rows.append(["batch-1 decode reads MB (its weights)",
                     *[_fmt(arms_roof[n]["weight_bytes"] / 1e6) if n in arms_roof else "-" for n in names]])
        paired = any("tpot_over_roofline_per_repeat" in a for a in arms_roof.values())
        rows.append([f"batch-1 TPOT / memory roofline (its bytes{'; each run at its own read rate' if paired else ''})",
                     *[f"{arms_roof[n]['tpot_over_roofline']:.2f}x" if n in arms_roof else "-" for n in names]])
    return rows


def _request_rows(result: dict[str, Any], names: list[str]) -> list[list[str]]:
    arms = {n: result["arms"][n][result["workload"]] for n in names}
    info = result.get("arm_info", {})

    def per_arm(fn: Callable[[dict[str, Any]], str]) -> list[str]:
        return [fn(arms[n]) for n in names]

    def stat(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda a: _int(a["stats"][key]) if a.get("stats") and a["stats"].get(key) is not None else "-"

    def dist(key: str, qs: tuple[str, ...], scale: float, digits: int) -> Callable[[dict[str, Any]], str]:
        return lambda a: " / ".join(_fmt(None if a[key][q] is None else a[key][q] * scale, digits) for q in qs)

    def memory(name: str) -> str:
        parts = info.get(name, {}).get("memory_bytes")
        return f"{sum(parts.values()) / 2**30:.2f}" if parts else "-"

    rows = [
        ["requests", *per_arm(lambda a: _int(a["requests"]))],
        ["total time (s)", *per_arm(lambda a: _range(a["total_seconds"], 2))],
        ["requests/s", *per_arm(lambda a: _range(a["requests_per_s"], 2))],
        ["output tok/s", *per_arm(lambda a: _range(a["output_tokens_per_s"], 1))],
        ["TTFT p50 / p90 / p99 (s)", *per_arm(dist("ttft_seconds", ("p50", "p90", "p99"), 1.0, 3))],
        ["TPOT p50 / p90 (ms)", *per_arm(dist("tpot_seconds", ("p50", "p90"), 1000.0, 1))],
        ["ITL p50 / p90 / p99 (ms)", *per_arm(dist("itl_seconds", ("p50", "p90", "p99"), 1000.0, 1))],
        ["prefix hit rate", *per_arm(
            lambda a: f"{100 * a['stats']['prefix_cache_hit_rate']:.1f} %"
            if a.get("stats") and a["stats"]["prefix_cache_hit_rate"] is not None else "-")],
        ["prefill tokens computed / skipped", *per_arm(
            lambda a: f"{stat('prefill_computed_tokens')(a)} / {stat('prefill_skipped_tokens')(a)}")],
        ["memory: weights + pools (GiB)", *[memory(n) for n in names]],
        ["peak memory growth in a run (GiB)", *per_arm(lambda a: _fmt(a.get("peak_rss_growth_gib"), 2))],
        ["sibling waits", *per_arm(stat("sibling_waits"))],
        ["preemptions", *per_arm(stat("num_preemptions"))],
    ]
    rows[5:5] = _timed_rows(arms, names)
    if any((a.get("stats") or {}).get("mamba_checkpoints_capacity") for a in arms.values()):
        rows += [["mamba checkpoints used / capacity", *per_arm(
                     lambda a: f"{stat('mamba_checkpoints_used')(a)} / {stat('mamba_checkpoints_capacity')(a)}")],
                 ["hybrid hit tokens lost", *per_arm(stat("hybrid_hit_tokens_lost"))]]
        rows.append(["Mamba checkpoint (MiB)", *per_arm(  # a server's /metrics may not say
            lambda a: _fmt(a["stats"]["mamba_checkpoint_bytes"] / 2**20)
            if (a.get("stats") or {}).get("mamba_checkpoint_bytes") is not None else "-")])
    return rows


def _timed_rows(arms: dict[str, dict[str, Any]], names: list[str]) -> list[list[str]]:
    """Timed workloads: the longest wait, and latency and rate of each request class (hot, cold)."""
    if not any("longest_wait_seconds" in a for a in arms.values()):
        return []
    rows = [["longest wait: max TTFT (s)", *[_fmt(arms[n].get("longest_wait_seconds"), 3) for n in names]]]
    classes = dict.fromkeys(c for a in arms.values() for c in a.get("by_class", {}))
    for c in classes:
        by = {n: arms[n].get("by_class", {}).get(c) for n in names}
        rows += [
            [f"{c}: TTFT p50 / p99 / max (s)", *[
                " / ".join(_fmt(b["ttft_seconds"][q], 3) for q in ("p50", "p99", "max")) if b else "-"
                for b in by.values()]],
            [f"{c}: requests/s", *[_range(b["requests_per_s"], 2) if b else "-" for b in by.values()]],
            [f"{c}: output tok/s", *[_range(b["output_tokens_per_s"], 1) if b else "-" for b in by.values()]]]
    return rows


def format_result(result: dict[str, Any]) -> str:
    env, names, workload = result["environment"], result["arm_order"], result["workload"]
    models = result["models"]
    servers = {name: info for name, info in result.get("arm_info", {}).items() if info.get("engine") == "server"}
    online = bool(servers)
    dtype = f" ({result['dtype']})" if result.get("dtype") else ""
    repeats = max((s["repeats"] for cases in result["arms"].values() for s in cases.values()), default=0)
    out = [f"hyprefix bench --workload {workload}: {models['model']}{dtype}"]
    if models.get("compare_model"):
        out.append(f"compare-hyprefix = the hyprefix arm on {models['compare_model']}")
    if servers and (len(servers) > 1 or len(servers) < len(names)):
        out += [f"{name} = {info['served_model']} at {info['url']}" for name, info in servers.items()]
    out += [f"{'driver on ' if online else ''}{env['cpu_model']} ({env['cpu_kind']}), {env['torch_num_threads']} "
            f"threads, torch {env['torch']}, transformers {env['transformers']}; median (min-max) of {repeats} "
            f"repeat(s); latency percentiles over every request of every repeat",
            f"workload: {result['description']}", ""]
    rows = _throughput_rows(result, names) if workload == "throughput" else _request_rows(result, names)
    out += _table(rows, ["metric", *names])
    if result["ratios"]:
        out += ["", *_table([[r["name"], _fmt(r["value"], 2), r.get("denominator", "")] for r in result["ratios"]],
                            ["ratio", "value", "denominator"], left=(0, 2))]
    notes = []
    for a in result["output_agreement"]:
        notes.append(f"identical outputs {a['case']}, {a['arms'][0]} vs {a['arms'][1]}: {a['identical']}/{a['of']} "
                     f"(same first token {a['same_first_token']}/{a['of']})")
        listed = [f"{t} at {n}" for t, n in a["first_difference_at"].items()]
        if listed:
            more = " ..." if len(listed) > MAX_LISTED_DIFFERENCES else ""
            notes.append("  first different token of " + ", ".join(listed[:MAX_LISTED_DIFFERENCES]) + more)
    notes += [f"{name} arm skipped: {reason}" for name, reason in result["skipped_arms"].items()]
    for name in names:
        by_case = result["arms"][name]
        own = by_case.get(workload, {}).get("ttft_own_call_seconds")
        if own:
            notes.append(f"{name} runs one request at a time: its TTFT includes the wait for the requests ahead of "
                         f"it (from its own call's start: p50 {_fmt(own['p50'], 3)} s)")
        by_round = by_case.get(workload, {}).get("ttft_p50_by_round")
        if by_round:
            notes.append(f"{name} TTFT p50 by turn (s): " + ", ".join(_fmt(v, 3) for v in by_round))
    if workload == "rl-burst":
        notes.append("rl-burst samples are separate requests with the same prompt (not n > 1), each with its own seed")
    out += ["", *notes] if notes else []
    return "\n".join(out + _contention_lines(result, env, online))


def _contention_lines(result: dict[str, Any], env: dict[str, Any], online: bool) -> list[str]:
    if online:  # a server on this machine is one of the "other processes"
        return ["(online driver: CPU use of other processes is not reported, the server is one of them)"]
    cpu, disturbed = result.get("cpu_contention") or {}, result["disturbed_runs"]
    if cpu.get("other_cores_avg") is None:
        return []
    out = [f"other processes used {cpu['other_cores_avg']:.2f} of {env['usable_cores']} cores on average during the "
           f"{cpu['wall_seconds']:.0f} s run (load average at start {env['load_average_at_start']})",
           f"timed runs during which other processes used > {disturbed['threshold_other_cores']} cores: "
           f"{disturbed['count']} of {disturbed['of']} (per-run values in the JSON)"]
    if cpu["other_cores_avg"] > disturbed["threshold_other_cores"] or disturbed["count"]:
        out.append("warning: the machine was busy with other work while this ran; the numbers are noisy and every "
                   "arm is slowed (interleaving spreads the noise, it does not remove it)")
    return out


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
