"""The RL rollout loop (``examples/rl_rollout.py``) with versioned block hashes against the
same loop flushing the prefix cache at every update, as engines without them must:

    .venv/bin/python tools/bench/rl_rollout.py [--model PATH] [--steps 4] [--repeats 2] [example flags]

Each run is its own process (the same model, prompts and seeds); the two variants alternate
for ``--repeats`` rounds. Reports each variant's rollout throughput (median over rounds), the
ratio within each round, and the example's update times.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_rollout.py"


def run(extra: list[str]) -> tuple[float, list[float], str]:
    """(rollout tok/s, update seconds per step, the step lines) of one example run."""
    out = subprocess.run([sys.executable, str(EXAMPLE), *extra], check=True, capture_output=True, text=True).stdout
    throughput = float(re.search(r"rollout throughput (\d+) tok/s", out).group(1))
    updates = [float(s) for s in re.findall(r"update (\d+\.\d+)s", out)]
    steps = "\n".join(line for line in out.splitlines() if line.startswith(("model", "step")))
    return throughput, updates, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args, extra = parser.parse_known_args()
    results: dict[str, list[float]] = {"versioned": [], "flushed": []}
    updates: list[float] = []
    for repeat in range(args.repeats):
        for name, flags in (("versioned", []), ("flushed", ["--flush-cache"])):
            throughput, seconds, steps = run([*extra, *flags])
            results[name].append(throughput)
            updates += seconds
            if repeat == 0:
                print(f"[{name}]\n{steps}")
    ratios = [v / f for v, f in zip(results["versioned"], results["flushed"], strict=True)]
    print(f"\nrollout throughput, median of {args.repeats}: versioned {statistics.median(results['versioned']):.0f} "
          f"tok/s, flushed {statistics.median(results['flushed']):.0f} tok/s; ratio per round "
          + ", ".join(f"{r:.2f}" for r in ratios))
    print(f"update time: median {statistics.median(updates):.2f}s, max {max(updates):.2f}s over {len(updates)} updates")


if __name__ == "__main__":
    main()
