"""Plain-text table and JSON file of a benchmark result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table(rows: list[list[str]], header: list[str], left: tuple[int, ...] = (0,)) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    # The ``left`` columns (the first: labels) left-aligned, numbers right-aligned.
    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _machine(env: dict[str, Any]) -> str:
    """The CPU (model and kind), threads and library versions of a run."""
    return (f"{env['cpu_model']} ({env.get('cpu_kind', 'kind not recorded')}), {env['torch_num_threads']} threads, "
            f"torch {env['torch']}, transformers {env['transformers']}")


def format_throughput(result: dict[str, Any]) -> str:
    cfg, env = result["config"], result["environment"]
    medians = result["medians_tokens_per_s"]
    arms = cfg["arms"]
    peak = result.get("peak")
    out = [
        f"hyprefix bench --workload throughput: {result['model']} ({result['dtype']})",
        f"{_machine(env)}; median (min-max) of {cfg['repeats']} repeats",
        "",
    ]
    ranges = result["range_tokens_per_s"]

    def cell(arm: str, case: str) -> str:
        lo, hi = ranges[arm][case]
        return f"{_fmt(medians[arm][case])} ({_fmt(lo)}-{_fmt(hi)})"

    rows = [["prefill tok/s (" + str(cfg["prompt_len"]) + "-token prompt)", *[cell(a, "prefill") for a in arms]]]
    for b in cfg["batch_sizes"]:
        rows.append([f"decode tok/s, batch {b} ({cfg['decode_prompt_len']}+{cfg['decode_tokens']} tokens)",
                     *[cell(a, f"decode@{b}") for a in arms]])
    if peak is not None:
        rows.append([f"prefill % of {peak['dtype']} matmul peak ({peak['gflops']:,.0f} GFLOP/s)",
                     *[_fmt(100 * result["prefill_peak"][a]["fraction_of_peak"]) + " %" for a in arms]])
    rows.append(["prefill GFLOP/s", *[_fmt(result["prefill_peak"][a]["prefill_gflops"]) for a in arms]])
    out += _table(rows, ["metric", *arms])

    ratio_rows = []
    for r in result["ratios"]:
        if r["target"] is None:
            mark, target = "(info)", "-"
        else:
            mark = "n/a" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
            target = f">= {r['target']:g}"
        ratio_rows.append([r["name"], _fmt(r["value"], 2), target, mark])
    out += ["", *_table(ratio_rows, ["ratio", "value", "target", "result"])]

    agreement = result.get("greedy_agreement")
    if agreement:
        parts = []
        for case, a in agreement.items():
            text = f"{case} first token {a['same_first_token']}/{a['of']}"
            if "identical_sequences" in a:
                text += f", identical {a['identical_sequences']}/{a['of']}"
            parts.append(text)
        out += ["", "greedy agreement hyprefix vs transformers: " + "; ".join(parts)]
    out += _contention_lines(result, env, "both arms are")
    return "\n".join(out)


def _contention_lines(result: dict[str, Any], env: dict[str, Any], who: str) -> list[str]:
    if "server" in result.get("arm_info", {}):
        # The online driver: a server on this machine is one of the "other processes".
        return ["(online driver: CPU use of other processes is not reported, the server is one of them)"]
    out = []
    cpu = result.get("cpu_contention")
    if cpu and cpu.get("other_cores_avg") is not None:
        out.append(f"other processes used {cpu['other_cores_avg']:.2f} of {env['usable_cores']} cores on average "
                   f"during the {cpu['wall_seconds']:.0f} s run (load average at start {env['load_average_at_start']})")
        disturbed = result.get("disturbed_runs")
        if disturbed:
            out.append(f"timed runs during which other processes used > {disturbed['threshold_other_cores']} cores: "
                       f"{disturbed['count']} of {disturbed['of']} (per-run values in the JSON)")
        if cpu["other_cores_avg"] > 0.25 or (disturbed and disturbed["count"]):
            out.append("warning: the machine was busy with other work while this ran; the numbers are noisy "
                       f"and {who} slowed (interleaving spreads the noise, it does not remove it)")
    return out


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _int(value: float | None) -> str:
    return "n/a" if value is None else f"{int(value):,}"


def _mark(entry: dict[str, Any]) -> tuple[str, str]:
    if entry.get("target") is None:
        return "-", "(info)"
    mark = "n/a" if entry["pass"] is None else ("PASS" if entry["pass"] else "FAIL")
    return f"{entry['op']} {entry['target']:g}", mark


def format_prefix(result: dict[str, Any]) -> str:
    """The table of a prefix-cache workload (``hyprefix.bench.prefix.summarise`` plus the
    run's model, dtype and environment)."""
    env, arms = result["environment"], result["arms"]
    names = result["arm_order"]
    models = result["models"]
    repeats = max((a["repeats"] for a in arms.values()), default=0)
    out = [f"hyprefix bench --workload {result['workload']}: {models['model']} ({result['dtype']})"]
    if models.get("compare_model"):
        out.append(f"compare-hyprefix = the hyprefix arm on {models['compare_model']}")
    out += [
        f"{_machine(env)}; times: median (min-max) of {repeats} repeat(s); "
        f"TTFT / TPOT percentiles over every request of every repeat",
        f"workload: {result['description']}",
        "",
    ]

    def per_arm(fn) -> list[str]:
        return [fn(arms[n]) for n in names]

    def stat(key: str, fmt=_int) -> Any:
        return lambda a: fmt(a["stats"][key]) if a.get("stats") and a["stats"].get(key) is not None else "-"

    info = result.get("arm_info", {})

    def own_memory(name: str) -> str:
        parts = info.get(name, {}).get("memory_bytes")
        return f"{sum(parts.values()) / 2**30:.2f}" if parts else "-"

    def rng(key: str, digits: int) -> Any:
        def cell(a: dict[str, Any]) -> str:
            v = a[key]
            return f"{_fmt(v['median'], digits)} ({_fmt(v['min'], digits)}-{_fmt(v['max'], digits)})"
        return cell

    def dist(key: str, qs: tuple[str, ...], scale: float, digits: int) -> Any:
        return lambda a: " / ".join(_fmt(None if a[key][q] is None else a[key][q] * scale, digits) for q in qs)

    rows = [
        ["requests", *per_arm(lambda a: _int(a["requests"]))],
        ["total time (s)", *per_arm(rng("total_seconds", 2))],
        ["requests/s", *per_arm(rng("requests_per_s", 2))],
        ["output tok/s", *per_arm(rng("output_tokens_per_s", 1))],
        ["TTFT p50 / p90 / p99 (s)", *per_arm(dist("ttft_seconds", ("p50", "p90", "p99"), 1.0, 3))],
        ["TPOT p50 / p90 (ms)", *per_arm(dist("tpot_seconds", ("p50", "p90"), 1000.0, 1))],
    ]
    if any(a.get("itl_seconds", {}).get("count") for a in arms.values()):
        rows.append(["ITL p50 / p90 / p99 (ms)", *per_arm(dist("itl_seconds", ("p50", "p90", "p99"), 1000.0, 1))])
    rows += [
        ["prefix hit rate", *per_arm(lambda a: _pct(a["stats"]["prefix_cache_hit_rate"]) if a.get("stats") else "-")],
        ["prefill tokens computed / skipped", *per_arm(
            lambda a: f"{_int(a['stats']['prefill_computed_tokens'])} / {_int(a['stats']['prefill_skipped_tokens'])}"
            if a.get("stats") and a["stats"].get("prefill_computed_tokens") is not None else "-")],
        ["memory: weights + pools (GiB)", *[own_memory(n) for n in names]],
        ["peak memory growth in a run (GiB)", *per_arm(lambda a: _fmt(a.get("peak_rss_growth_gib"), 2))],
    ]
    ideal = result["workload_config"].get("ideal_prefill_tokens")
    if ideal:
        rows.append([f"prefill computed / ideal ({ideal:,})",
                     *per_arm(lambda a: _fmt(a.get("computed_vs_ideal"), 2) if a.get("stats") else "-")])
    rows += [["sibling waits", *per_arm(stat("sibling_waits"))],
             ["preemptions", *per_arm(stat("num_preemptions"))]]
    if any(a.get("stats") and a["stats"].get("mamba_checkpoints_capacity") for a in arms.values()):
        rows += [["mamba checkpoints used / capacity", *per_arm(
                     lambda a: f"{_int(a['stats']['mamba_checkpoints_used'])} / "
                               f"{_int(a['stats']['mamba_checkpoints_capacity'])}" if a.get("stats") else "-")],
                 ["hybrid hit tokens lost", *per_arm(stat("hybrid_hit_tokens_lost"))]]
    out += _table(rows, ["metric", *names])
    if any(a.get("stats") and a["stats"].get("mamba_checkpoint_bytes") for a in arms.values()):
        sizes = sorted({a["stats"]["mamba_checkpoint_bytes"] for a in arms.values()
                        if a.get("stats") and a["stats"].get("mamba_checkpoint_bytes")})
        out.append("(a Mamba checkpoint: " + ", ".join(f"{b / 2**20:.1f} MiB" for b in sizes) + ")")

    if result["ratios"]:
        ratio_rows = []
        for r in result["ratios"]:
            target, mark = _mark(r)
            ratio_rows.append([r["name"], _fmt(r["value"], 2), target, mark, r.get("note", "")])
        out += ["", *_table(ratio_rows, ["ratio", "value", "target", "result", "note"], left=(0, 4))]
    hit = result.get("hit_rate_comparison")
    if hit:
        _, mark = _mark(hit)
        out += ["", f"prefix hit rate: {hit['model']} {_pct(hit['hit_rate'])}, {hit['compare_model']} "
                    f"{_pct(hit['compare_hit_rate'])}; ratio {_fmt(hit['ratio'], 3)} (target >= "
                    f"{hit['target']:g}): {mark}"]
    notes = []
    agreement = result.get("output_agreement")
    if agreement:
        notes.append("identical outputs (first repeat): " + "; ".join(
            f"{a['arms'][0]} vs {a['arms'][1]} {a['identical']}/{a['of']}" for a in agreement))
        for a in agreement:
            if a.get("first_difference_at"):
                notes.append(f"  {a['arms'][0]} vs {a['arms'][1]}: first different output token of "
                             + ", ".join(f"{t} at {n}" for t, n in a["first_difference_at"].items()))
    for name, reason in result.get("skipped_arms", {}).items():
        notes.append(f"{name} arm skipped: {reason}")
    if "transformers" in arms:
        notes.append("transformers runs one request at a time: its TTFT includes the wait for the requests ahead "
                     "of it (from its own call's start: p50 "
                     f"{_fmt(arms['transformers'].get('ttft_own_call_seconds', {}).get('p50'), 3)} s)")
    if result["workload"] == "rl-burst":
        notes.append("rl-burst samples are separate requests with the same prompt (not n > 1), each with its own seed")
    if result["workload"] == "multi-turn" and any("ttft_p50_by_round" in a for a in arms.values()):
        for n in names:
            by_round = arms[n].get("ttft_p50_by_round")
            if by_round:
                notes.append(f"{n} TTFT p50 by turn (s): " + ", ".join(_fmt(v, 3) for v in by_round))
    out += ["", *notes] if notes else []
    lines = _contention_lines(result, env, "all arms are")
    out += lines
    return "\n".join(out)


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    if path.parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path
