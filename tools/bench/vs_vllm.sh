#!/usr/bin/env bash
# vLLM's CPU build, then hyprefix serve, on the same checkpoint, each alone on the machine, through
# the same `hyprefix bench --url` client: throughput (prefill of 512 tokens, decode at batch 1 and 8),
# shared-prefix, multi-turn, random and rl-burst. Writes OUT/{vllm,served}/WORKLOAD.json (the
# bench's --out) and the servers' logs, then prints the ratios (vLLM time / hyprefix time).
#   VLLM_PYTHON=/tmp/vllm-venv/bin/python bash tools/bench/vs_vllm.sh CHECKPOINT_DIR DTYPE OUT
# vLLM runs with the flags docs/benchmarks.md explains ("Against vLLM's CPU build"): both cores,
# none reserved, a 2 GiB KV space (hyprefix's default pool), the cache-reset endpoint on.
set -euo pipefail
model=$1 dtype=$2 out=$3
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
python="$repo/.venv/bin/python"
mkdir -p "$out"
port=8094

wait_ready() {  # until the server answers /v1/models, or it exits
  until curl -sf --max-time 5 "http://127.0.0.1:$port/v1/models" >/dev/null; do
    kill -0 "$1" 2>/dev/null || { echo "the server exited; see its log in $out"; exit 1; }
    sleep 1
  done
}

bench() {  # NAME WORKLOAD FLAGS...
  local name=$1 workload=$2
  shift 2
  "$python" -m hyprefix.cli bench --url "$name=http://127.0.0.1:$port" --served-model demo --arms "" \
    --tokenizer "$model" --workload "$workload" --out "$out/$name/$workload.json" "$@" 2>&1 \
    | tee "$out/$name/$workload.txt" | grep -E "prefill tok|decode tok|total time|hit rate" || true
}

run_alone() {  # NAME COMMAND...: start it, run every workload, stop it
  local name=$1
  shift
  mkdir -p "$out/$name"
  env "${server_env[@]}" setsid "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  trap 'kill -- -'"$pid"' 2>/dev/null || true' EXIT
  wait_ready "$pid"
  sleep 5  # hyprefix maps its K/V pool's pages while idle; vLLM wrote its pool at start-up
  echo "== $name"
  bench "$name" throughput --batch-sizes 1,8 --prompt-len 512 --repeats 3
  bench "$name" shared-prefix --repeats 2
  bench "$name" multi-turn --repeats 1 --seed 23
  bench "$name" random --repeats 1
  bench "$name" rl-burst --repeats 1
  kill -- -"$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  trap - EXIT
}

server_env=(VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_SERVER_DEV_MODE=1)
run_alone vllm "${VLLM_PYTHON:?set VLLM_PYTHON to the python of the vLLM venv}" -m vllm.entrypoints.openai.api_server \
  --model "$model" --dtype "$dtype" --max-model-len 4096 --served-model-name demo --port "$port"
server_env=()
run_alone served "$python" -m hyprefix.cli serve --model "$model" --dtype "$dtype" --served-model-name demo \
  --port "$port" --log-stats-interval 0 --no-access-log

"$python" - "$out" <<'EOF'
import json, statistics, sys
out = sys.argv[1]
def runs(name, workload):
    arm = next(iter(json.load(open(f"{out}/{name}/{workload}.json"))["runs"].values()))
    return arm
def rate(name, case):
    rs = runs(name, "throughput")[case]
    return statistics.median(512 / r["seconds"] if case == "prefill" else r["decode_tokens_per_s"] for r in rs)
for case in ("prefill", "decode@1", "decode@8"):
    ours, theirs = rate("served", case), rate("vllm", case)
    print(f"{case:14s} tok/s  hyprefix {ours:8.1f}  vLLM {theirs:8.1f}  ratio {ours / theirs:.2f}x")
for workload in ("shared-prefix", "multi-turn", "random", "rl-burst"):
    ours, theirs = (statistics.median(r["seconds"] for r in next(iter(runs(n, workload).values())))
                    for n in ("served", "vllm"))
    print(f"{workload:14s} s      hyprefix {ours:8.2f}  vLLM {theirs:8.2f}  ratio {theirs / ours:.2f}x")
EOF
