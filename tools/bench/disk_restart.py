"""The prefix cache across a restart: TTFT of a long prompt on a cold disk cache, then after
the process restarted on the same ``--disk-cache-dir``, offline (``LLM``) or served
(``hyprefix serve``, the request streamed over HTTP).

Each run is a fresh process: the engine's warm-up (as the server's start-up runs it) and a
4-token request, then the long prompt (random token
ids) for ``--decode-tokens`` greedy tokens. The first run starts on an empty directory; the
process then exits (offline: the exit hook writes memory out; served: SIGTERM, the server's
shutdown does) and the next run starts on what it left. Reports TTFT, cached prompt tokens,
bytes read from disk and whether the greedy tokens match the cold run's, and those of the
cold run's process sending the prompt again (a memory hit: in bfloat16 a hit, which computes
the last prompt token alone, can round differently from the cold prefill's chunk).

    python tools/bench/disk_restart.py --model smol-q8.gguf --quantization int8
    python tools/bench/disk_restart.py --model smol-q8.gguf --quantization int8 --served
    python tools/bench/disk_restart.py --model demo-qwen3.5-0.8b --restarts 2
    python tools/bench/disk_restart.py --model smol-q8.gguf --quantization int8 --served --beside-stream 400
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

OFFLINE = r"""
import json, sys, time
from hyprefix import LLM, SamplingParams
args = json.loads(sys.argv[1])
llm = LLM(args["model"], dtype=args["dtype"], quantization=args["quantization"], log_stats_interval=0,
          disk_cache_dir=args["dir"])
params = SamplingParams(temperature=0, max_tokens=args["decode_tokens"], ignore_eos=True)
llm.engine.warmup()  # compile the kernels of large steps now, as the server does at start
llm.generate([args["prompt"][:4]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
t0 = time.perf_counter()
out = llm.generate([args["prompt"]], params, use_tqdm=False)[0]
m = out.metrics
total = time.perf_counter() - t0
stats = llm.get_stats()
again = llm.generate([args["prompt"]], params, use_tqdm=False)[0]  # a memory hit in this process
print(json.dumps({"ttft": m.first_token_time - m.arrival_time, "total": total,
                  "cached": out.num_cached_tokens, "tokens": out.outputs[0].token_ids,
                  "memory_hit_tokens": again.outputs[0].token_ids,
                  "bytes_read": stats["disk_cache_bytes_read"], "disk_hit_tokens": stats["disk_cache_hit_tokens"]}))
"""


def offline_run(args: argparse.Namespace, prompt: list[int], directory: str) -> dict:
    spec = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization, "dir": directory,
            "prompt": prompt, "decode_tokens": args.decode_tokens}
    proc = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _post_stream(url: str, body: dict, stamps: list[float] | None = None) -> tuple[float, list[int], int]:
    """(TTFT, token ids, cached prompt tokens) of one streamed completion; ``stamps`` gets the
    arrival time of every token-carrying chunk."""
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens, cached = None, [], 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    tokens += choice["token_ids"]
                    if stamps is not None:
                        stamps.append(time.perf_counter())
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return ttft or 0.0, tokens, cached


def _gaps(stamps: list[float], start: float, end: float) -> dict:
    """The other stream's gaps between tokens (ms): before ``start`` and while [start, end]."""
    gaps = [(b, (b - a) * 1e3) for a, b in itertools.pairwise(stamps)]
    before = sorted(g for t, g in gaps if t < start)
    during = sorted(g for t, g in gaps if start <= t <= end + 1e-3) or [0.0]
    return {"p50_before_ms": before[len(before) // 2] if before else 0.0, "max_before_ms": max(before, default=0.0),
            "max_during_ms": max(during), "tokens_during": len(during)}


def served_run(args: argparse.Namespace, prompt: list[int], directory: str) -> dict:
    port = args.port
    cmd = [sys.executable, "-m", "hyprefix.cli", "serve", "--model", args.model, "--dtype", args.dtype,
           "--port", str(port), "--disk-cache-dir", directory, "--log-stats-interval", "0", "--no-access-log"]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    log = open(Path(directory).parent / f"server-{port}.log", "a")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: see {log.name}") from None
                time.sleep(0.5)
        body = {"model": args.model, "prompt": prompt[:4], "max_tokens": 2, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        _post_stream(url, body)
        body.update(prompt=prompt, max_tokens=args.decode_tokens, ignore_eos=True)
        stream = None
        if args.beside_stream:  # another request decoding while the long prompt's hit loads
            stamps: list[float] = []
            other = dict(body, prompt=[t + 1 for t in prompt[:256]], max_tokens=args.beside_stream)
            stream = threading.Thread(target=_post_stream, args=(url, other, stamps))
            stream.start()
            while len(stamps) < 16:
                time.sleep(0.01)
        t0 = time.perf_counter()
        ttft, tokens, cached = _post_stream(url, body)
        total = time.perf_counter() - t0
        if stream is not None:
            stream.join()
            beside = _gaps(stamps, t0, t0 + ttft)
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        read = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("hyprefix:disk_cache_bytes_read"))
        _, again, _ = _post_stream(url, body)  # a memory hit in this process
        out = {"ttft": ttft, "total": total, "cached": cached, "tokens": tokens, "memory_hit_tokens": again,
               "bytes_read": int(read)}
        if stream is not None:
            out["beside_stream"] = beside
        return out
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=300)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model path or demo alias")
    parser.add_argument("--dtype", default="auto", help="--dtype of the engine")
    parser.add_argument("--quantization", default=None, help="--quantization of the engine")
    parser.add_argument("--prompt-len", type=int, default=4000, help="tokens of the long prompt")
    parser.add_argument("--decode-tokens", type=int, default=16, help="greedy tokens generated")
    parser.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=int, default=7, help="seed of the prompt's token ids")
    parser.add_argument("--restarts", type=int, default=1, help="runs after the cold one")
    parser.add_argument("--served", action="store_true", help="through hyprefix serve instead of LLM")
    parser.add_argument("--port", type=int, default=8123, help="the served runs' port")
    parser.add_argument("--beside-stream", type=int, default=0, metavar="N",
                        help="served: another request decodes N tokens while the long prompt is sent; reports its "
                             "gaps between tokens before and while the long prompt waits for its first token")
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args()
    prompt = random.Random(args.seed).choices(range(10, args.vocab), k=args.prompt_len)
    work = Path(tempfile.mkdtemp(prefix="hyprefix-disk-restart-"))
    directory = str(work / "cache")
    os.makedirs(directory)
    run = served_run if args.served else offline_run
    runs = []
    try:
        for i in range(1 + args.restarts):
            result = run(args, prompt, directory)
            result["run"] = "cold" if i == 0 else f"restart {i}"
            runs.append(result)
            same = "identical" if result["tokens"] == runs[0]["tokens"] else "differ"
            hit = "identical" if result["tokens"] == runs[0]["memory_hit_tokens"] else "differ"
            print(f"{result['run']:>10}: TTFT {result['ttft']:.3f} s ({result['ttft'] / runs[0]['ttft']:.1%} of cold), "
                  f"cached {result['cached']}/{len(prompt)}, disk read {result['bytes_read'] / 1e6:.0f} MB, "
                  f"greedy tokens vs the cold run's: {same}, vs its memory hit's: {hit}", flush=True)
            if "beside_stream" in result:
                g = result["beside_stream"]
                print(f"{'':>12}the other stream: gap p50 {g['p50_before_ms']:.1f} ms (max {g['max_before_ms']:.1f}) "
                      f"before, max {g['max_during_ms']:.1f} ms over {g['tokens_during']} tokens while the long "
                      f"prompt waited", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
