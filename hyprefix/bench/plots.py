"""PNG plots of a benchmark result (matplotlib, Agg backend): ``--plot DIR``. Request
workloads: ``<workload>-ttft.png`` (TTFT per request per arm: box plot and CDF),
``<workload>-throughput.png`` (output tokens/s and requests/s, median and min-max) and
``<workload>-prefill.png`` (prefill tokens computed vs skipped); throughput:
``throughput-throughput.png`` (tokens/s per case and arm)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyprefix.bench.env import require


def _pyplot() -> Any:
    require("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ttfts(result: dict[str, Any], arm: str) -> list[float]:
    return [rec["ttft"] for run in result["runs"][arm][result["workload"]] for rec in run["requests"]
            if rec["ttft"] is not None]


def _labels(result: dict[str, Any], arms: list[str]) -> list[str]:
    """Arm names, with the model under each when the arms run more than one model."""
    models = [next(iter(result["arms"][a].values()))["model"] for a in arms]
    if len(set(models)) <= 1:
        return list(arms)
    return [f"{a}\n({m})" for a, m in zip(arms, models, strict=True)]


def plot(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workload, arms = result["workload"], result["arm_order"]
    labels = _labels(result, arms)
    title = f"{workload}: {result['models']['model']}"
    if workload == "throughput":  # tokens/s per case (prefill: of the whole call; decode: after the first token)
        panels = [(case, case, "prompt_tokens_per_s" if case == "prefill" else "decode_tokens_per_s", "tokens/s")
                  for case in result["cases"]]
    else:
        panels = [("", workload, "output_tokens_per_s", "output tokens/s"), ("", workload, "requests_per_s",
                                                                             "requests/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(11, 4 * len(panels)), 4.2), squeeze=False)
    for ax, (name, case, key, unit) in zip(axes[0], panels, strict=True):
        _bars(ax, labels, [result["arms"][a][case][key] for a in arms])
        ax.set_title(name)
        ax.set_ylabel(unit)
    fig.suptitle(title + " (median, min-max over repeats)", fontsize=9)
    fig.tight_layout()
    paths = [_save(fig, out / f"{workload}-throughput.png", plt)]
    if workload == "throughput":
        return paths
    summary = {a: result["arms"][a][workload] for a in arms}

    fig, (box, cdf) = plt.subplots(1, 2, figsize=(11, 4.2))
    data = [_ttfts(result, a) for a in arms]
    box.boxplot(data, showfliers=True)
    box.set_xticks(range(1, len(arms) + 1), labels)
    box.set_ylabel("time to first token (s)")
    box.set_title("TTFT per request")
    for label, values in zip(labels, data, strict=True):
        xs = sorted(values)
        if xs:
            cdf.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label.replace("\n", " "))
    cdf.set_xlabel("time to first token (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF")
    cdf.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, out / f"{workload}-ttft.png", plt))

    counted = [(a, lab) for a, lab in zip(arms, labels, strict=True)
               if (summary[a].get("stats") or {}).get("prefill_computed_tokens") is not None]
    if counted:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        computed = [summary[a]["stats"]["prefill_computed_tokens"] for a, _ in counted]
        skipped = [summary[a]["stats"]["prefill_skipped_tokens"] for a, _ in counted]
        names = [lab for _, lab in counted]
        ax.bar(names, computed, label="computed")
        ax.bar(names, skipped, bottom=computed, label="skipped (prefix hit)")
        ax.set_ylabel("prefill tokens")
        ax.legend(loc="lower right")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(_save(fig, out / f"{workload}-prefill.png", plt))
    return paths


def _bars(ax: Any, labels: list[str], spreads: list[dict[str, float]]) -> None:
    """Median bars with min-max error bars."""
    med = [s["median"] for s in spreads]
    err = [[s["median"] - s["min"] for s in spreads], [s["max"] - s["median"] for s in spreads]]
    bars = ax.bar(labels, med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, fmt="%.3g", fontsize=8, label_type="center", color="white")


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
