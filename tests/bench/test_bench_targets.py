"""tools/bench/bench_targets.py: the issue tracker's targets live outside the package and are
checked against a ``hyprefix bench --out`` file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench" / "bench_targets.py"


def _result(workload: str, ratios: dict[str, float], native_bf16: bool = False) -> dict:
    return {"workload": workload, "environment": {"device_caps": {"native_bf16": native_bf16}},
            "ratios": [{"name": k, "value": v} for k, v in ratios.items()]}


def _check(tmp_path: Path, result: dict, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    return subprocess.run([sys.executable, str(TOOL), str(path), *extra], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_throughput_targets_follow_the_cpu_kind(tmp_path: Path, native_bf16: bool) -> None:
    ratios = {"prefill hyprefix / transformers": 1.2, "decode hyprefix B=1 / transformers B=1": 1.25,
              "decode hyprefix B=16 / transformers B=16": 1.6, "decode hyprefix B=16 / transformers B=1": 9.0}
    done = _check(tmp_path, _result("throughput", ratios, native_bf16), "--strict")
    lines = done.stdout.splitlines()[1:]
    if native_bf16:  # prefill >= 1.3 fails, batch 1 >= 1.2 and batch 16 / batch 1 >= 4 pass; no same-batch target
        assert lines[:3] == ["  FAIL  prefill hyprefix / transformers: 1.20 (target >= 1.3)",
                             "  PASS  decode hyprefix B=16 / transformers B=1: 9.00 (target >= 4)",
                             "  PASS  decode hyprefix B=1 / transformers B=1: 1.25 (target >= 1.2)"]
    else:  # prefill >= 1.1 and the batch-16 targets pass, batch 1 >= 1.3 fails
        assert lines[:4] == ["  PASS  prefill hyprefix / transformers: 1.20 (target >= 1.1)",
                             "  PASS  decode hyprefix B=16 / transformers B=1: 9.00 (target >= 5)",
                             "  PASS  decode hyprefix B=16 / transformers B=16: 1.60 (target >= 1.5)",
                             "  FAIL  decode hyprefix B=1 / transformers B=1: 1.25 (target >= 1.3)"]
    assert lines[-1].startswith("  n/a   prefill hyprefix / fastest explicit dtype: n/a (target >= 0.9)")
    assert done.returncode == 1
    assert _check(tmp_path, _result("throughput", ratios, native_bf16)).returncode == 0  # without --strict


def test_request_workload_targets(tmp_path: Path) -> None:
    done = _check(tmp_path, _result("rl-burst", {"prefill computed / ideal (hyprefix)": 1.06,
                                                 "prefix hit rate model / compare-model": 0.8}), "--strict")
    lines = done.stdout.splitlines()[1:]
    assert [line.split("  (")[0] for line in lines] == [
        "  PASS  prefill computed / ideal (hyprefix): 1.06 (target <= 1.1)",
        "  n/a   prefill computed / ideal (compare-hyprefix): n/a (target <= 1.1)",
        "  FAIL  prefix hit rate model / compare-model: 0.80 (target >= 0.9)"]
    assert done.returncode == 1
    shared = _check(tmp_path, _result("shared-prefix", {"time hyprefix-nocache / hyprefix": 3.4}), "--strict")
    assert shared.returncode == 0 and "PASS  time hyprefix-nocache / hyprefix: 3.40 (target >= 3)" in shared.stdout


def test_the_package_prints_no_target() -> None:
    package = Path(__file__).resolve().parents[2] / "hyprefix" / "bench"
    text = "\n".join(p.read_text() for p in package.glob("*.py"))
    for word in ("PASS", "FAIL", "TARGET", "target >="):
        assert word not in text
