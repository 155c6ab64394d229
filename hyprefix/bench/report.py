"""Plain-text table and JSON file of a benchmark result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    # First column left-aligned, numbers right-aligned.
    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_throughput(result: dict[str, Any]) -> str:
    cfg, env = result["config"], result["environment"]
    medians = result["medians_tokens_per_s"]
    arms = cfg["arms"]
    peak = result.get("peak")
    out = [
        f"hyprefix bench --workload throughput: {result['model']} ({result['dtype']})",
        f"{env['cpu_model']}, {env['torch_num_threads']} threads, torch {env['torch']}, "
        f"transformers {env['transformers']}; median (min-max) of {cfg['repeats']} repeats",
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
                       "and both arms are slowed (interleaving spreads the noise, it does not remove it)")
    return "\n".join(out)


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    if path.parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path
