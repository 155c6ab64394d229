"""Check a ``hyprefix bench --out`` result against the issue tracker's targets.

    python tools/bench/bench_targets.py RESULT.json [--targets tools/bench/bench_targets.json] [--strict]

The targets (``bench_targets.json`` next to this script) name a ratio of the result's
``ratios`` list, a comparison and a threshold, for a workload and, for ``throughput``, a CPU
kind (``native-bf16`` when the result's ``environment.device_caps.native_bf16``, else
``no-native-bf16``). One line per target that applies: the measured value, the target and
PASS, FAIL or n/a (the run did not measure that ratio). ``--strict`` exits 1 when any fails.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from pathlib import Path

DEFAULT_TARGETS = Path(__file__).with_name("bench_targets.json")
OPS = {">=": operator.ge, "<=": operator.le}


def cpu_kind(result: dict) -> str:
    return "native-bf16" if result["environment"]["device_caps"]["native_bf16"] else "no-native-bf16"


def check(result: dict, targets: list[dict]) -> list[dict]:
    """Every target that applies to ``result``, with its measured ``measured`` value and ``verdict``."""
    values = {r["name"]: r["value"] for r in result["ratios"]}
    out = []
    for t in targets:
        workload = result["workload"] if t["workload"] != "*" or result["workload"] == "throughput" else "*"
        if t["workload"] != workload or t.get("cpu", cpu_kind(result)) != cpu_kind(result):
            continue
        value = values.get(t["ratio"])
        verdict = "n/a" if value is None else "PASS" if OPS[t["op"]](value, t["value"]) else "FAIL"
        out.append({**t, "measured": value, "verdict": verdict})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a hyprefix bench --out JSON file")
    parser.add_argument("--targets", type=Path, default=DEFAULT_TARGETS)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    ns = parser.parse_args(argv)
    result = json.loads(ns.result.read_text())
    checked = check(result, json.loads(ns.targets.read_text())["targets"])
    kind = f", {cpu_kind(result)}" if result["workload"] == "throughput" else ""
    print(f"{ns.result} ({result['workload']}{kind}) against {ns.targets}:")
    for c in checked:
        value = "n/a" if c["measured"] is None else f"{c['measured']:.2f}"
        note = f"  ({c['note']})" if c.get("note") else ""
        print(f"  {c['verdict']:4}  {c['ratio']}: {value} (target {c['op']} {c['value']:g}){note}")
    if not checked:
        print("  no target applies")
    return 1 if ns.strict and any(c["verdict"] == "FAIL" for c in checked) else 0


if __name__ == "__main__":
    sys.exit(main())
