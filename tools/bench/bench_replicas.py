"""Replicas vs one engine, through the HTTP API (the issue's must-shows), in one run:

    .venv/bin/python tools/bench/bench_replicas.py --model M [--replicas 2] [--repeats 3] [--out DIR]

For each server (one engine; ``--replicas N`` with the prefix router; the same with
Ray Serve's power-of-two router) it starts ``hyprefix serve``, times its start-up (spawn
to ``/v1/models`` answering), the latency of tiny requests (1-token prompt, 1 token out,
one at a time: the per-request overhead), runs ``hyprefix bench --url`` on the
shared-prefix and multi-turn workloads, reads which replicas served from ``/metrics``,
and stops it. Servers run one after the other, never together.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

WORKLOADS = ("shared-prefix", "multi-turn")


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the server did not start")


def tiny_latencies(url: str, n: int) -> list[float]:
    body = {"prompt": [100], "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    out = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(n + 3):
            t0 = time.perf_counter()
            response = client.post("/v1/completions", json=body)
            elapsed = time.perf_counter() - t0
            response.raise_for_status()
            if i >= 3:  # the first few warm the path
                out.append(elapsed)
    return out


def replica_prompt_tokens(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "hyprefix:prompt_tokens_total":
                key = s.labels.get("replica", "-")
                out[key] = out.get(key, 0.0) + s.value
    return out


def run_server(name: str, serve_args: list[str], args: argparse.Namespace, out: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    log = open(out / f"server-{name}.log", "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hyprefix.cli", "serve", "--model", args.model, "--port",
                             str(args.port), "--no-access-log", *serve_args], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        result: dict = {"startup_s": time.perf_counter() - t0}
        t1 = time.perf_counter()
        tiny_latencies(url, 0)
        result["first_requests_s"] = time.perf_counter() - t1  # the first three, cold (any lazy compile)
        lat = tiny_latencies(url, args.tiny_requests)
        result["tiny_request_ms"] = {"median": 1e3 * statistics.median(lat),
                                     "p90": 1e3 * statistics.quantiles(lat, n=10)[-1]}
        for workload in args.workloads:
            before = replica_prompt_tokens(url)
            path = out / f"{workload}-{name}.json"
            with open(out / f"{workload}-{name}.log", "w") as bench_log:
                subprocess.run([sys.executable, "-m", "hyprefix.cli", "bench", "--workload", workload, "--url", url,
                                "--repeats", str(args.repeats), "--out", str(path), *args.bench_args], check=True,
                               stdout=bench_log, stderr=subprocess.STDOUT)
            after = replica_prompt_tokens(url)
            summary = json.loads(path.read_text())
            runs = summary["runs"]["server"]
            rates = [run["stats"]["prefix_cache_hit_rate"] for case in runs.values() for run in case]
            seconds = [case["total_seconds"]["median"] for case in summary["arms"]["server"].values()]
            result[workload] = {"hit_rate": statistics.median(rates), "hit_rates": rates, "seconds": sum(seconds),
                                "prompt_tokens_by_replica": {r: after[r] - before.get(r, 0.0) for r in after}}
        return result
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS,
                        help="bench workloads to run on each server (none: start-up and overhead only)")
    parser.add_argument("--tiny-requests", type=int, default=40)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default="bench-out/replicas")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to every hyprefix bench (last on the line)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 1
    servers = {"single": [],
               "replicas-prefix": ["--replicas", str(args.replicas), "--replica-router", "prefix"],
               "replicas-pow2": ["--replicas", str(args.replicas), "--replica-router", "pow2"]}
    results = {"model": args.model, "cpus": cpus, "replicas": args.replicas}
    for name, serve_args in servers.items():
        print(f"== {name}", flush=True)
        results[name] = run_server(name, serve_args, args, out)
        print(json.dumps(results[name], indent=1), flush=True)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    single = results["single"]
    print(f"\n{'server':18} {'start-up':>9} {'tiny req':>9} " + " ".join(f"{w + ' hit':>22}" for w in args.workloads))
    for name in servers:
        r = results[name]
        hits = " ".join(f"{r[w]['hit_rate']:>7.3f} ({r[w]['hit_rate'] / max(single[w]['hit_rate'], 1e-9):.2f}x single)"
                        for w in args.workloads)
        print(f"{name:18} {r['startup_s']:>8.1f}s {r['tiny_request_ms']['median']:>7.1f}ms {hits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
