"""PNG plots of a benchmark result (matplotlib, Agg backend): ``--plot DIR``.

Prefix-cache workloads: ``<workload>-ttft.png`` (TTFT of every request of every repeat, per
arm: a box plot and the empirical CDF) and ``<workload>-throughput.png`` (output tokens/s
and requests/s per arm, median with the min-max range over repeats), plus
``<workload>-prefill.png`` (prefill tokens computed vs skipped per cache-counting arm).
Throughput workload: ``throughput-throughput.png`` (tokens/s per case and arm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ttfts(result: dict[str, Any], arm: str) -> list[float]:
    return [rec["ttft"] for run in result["runs"][arm] for rec in run.get("requests", []) if rec["ttft"] is not None]


def _labels(result: dict[str, Any], arms: list[str]) -> list[str]:
    """Arm names, with the model under each when the arms run more than one model."""
    models = [result["arms"][a].get("model") for a in arms]
    if len(set(models)) <= 1:
        return list(arms)
    return [f"{a}\n({m})" for a, m in zip(arms, models, strict=True)]


def plot_prefix(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workload, arms = result["workload"], result["arm_order"]
    labels = _labels(result, arms)
    title = f"{workload}: {result['models']['model']}"
    paths = []

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

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "output_tokens_per_s", "output tokens/s"),
                           (axes[1], "requests_per_s", "requests/s")):
        med = [result["arms"][a][key]["median"] for a in arms]
        lo = [m - result["arms"][a][key]["min"] for a, m in zip(arms, med, strict=True)]
        hi = [result["arms"][a][key]["max"] - m for a, m in zip(arms, med, strict=True)]
        bars = ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=[f"C{i}" for i in range(len(arms))])
        ax.bar_label(bars, fmt="%.2f", fontsize=8, label_type="center", color="white")
        ax.set_ylabel(label)
    fig.suptitle(title + " (median, min-max over repeats)", fontsize=9)
    fig.tight_layout()
    paths.append(_save(fig, out / f"{workload}-throughput.png", plt))

    counted = [(a, lab) for a, lab in zip(arms, labels, strict=True)
               if (result["arms"][a].get("stats") or {}).get("prefill_computed_tokens") is not None]
    if counted:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        computed = [result["arms"][a]["stats"]["prefill_computed_tokens"] for a, _ in counted]
        skipped = [result["arms"][a]["stats"]["prefill_skipped_tokens"] for a, _ in counted]
        names = [lab for _, lab in counted]
        ax.bar(names, computed, label="computed")
        ax.bar(names, skipped, bottom=computed, label="skipped (prefix hit)")
        ax.set_ylabel("prefill tokens")
        ax.legend(loc="lower right")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(_save(fig, out / f"{workload}-prefill.png", plt))
    return paths


def plot_throughput(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    medians, ranges = result["medians_tokens_per_s"], result["range_tokens_per_s"]
    arms = list(medians)
    cases = list(next(iter(medians.values())))
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4.2))
    axes = axes if len(cases) > 1 else [axes]
    for ax, case in zip(axes, cases, strict=True):
        med = [medians[a][case] for a in arms]
        err = [[m - ranges[a][case][0] for a, m in zip(arms, med, strict=True)],
               [ranges[a][case][1] - m for a, m in zip(arms, med, strict=True)]]
        bars = ax.bar(arms, med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(arms))])
        ax.bar_label(bars, fmt="%.1f", fontsize=8, label_type="center", color="white")
        ax.set_title(case)
        ax.set_ylabel("tokens/s")
    fig.suptitle(f"throughput: {result['model']} (median, min-max over repeats)", fontsize=9)
    fig.tight_layout()
    return [_save(fig, out / "throughput-throughput.png", plt)]


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
