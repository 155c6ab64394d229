#!/usr/bin/env bash
# llama-server, then hyprefix serve, on the same GGUF file, each alone on the machine, measured
# by the same `hyprefix bench` client arguments (same seed: the same prompts). Writes
# OUT/llama-server.json and OUT/hyprefix-serve.json (the bench's --out) and their logs.
#   LLAMA_SERVER=/path/to/llama-server bash tools/bench/served_alone.sh MODEL.gguf TOKENIZER_DIR OUT \
#       --workload throughput --batch-sizes 1,8 --prompt-len 512 --decode-tokens 64 --repeats 5
# llama-server runs with -t 2 -c 32768 -np 8 (LLAMA_ARGS overrides); hyprefix serve with its defaults.
set -euo pipefail
model=$1 tokenizer=$2 out=$3
shift 3
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
hyprefix="$repo/.venv/bin/hyprefix"
mkdir -p "$out"
port=8093

wait_ready() {  # until the server answers /health, or it exits
  until curl -sf --max-time 5 "http://127.0.0.1:$port/health" >/dev/null; do
    kill -0 "$1" 2>/dev/null || { echo "the server exited; see its log in $out"; exit 1; }
    sleep 1
  done
}

run_alone() {  # NAME COMMAND...: start it, bench it, stop it
  local name=$1
  shift
  setsid "$@" >"$out/$name.log" 2>&1 &
  local pid=$!
  trap 'kill -- -'"$pid"' 2>/dev/null || true' EXIT
  wait_ready "$pid"
  "$hyprefix" bench --url "$name=http://127.0.0.1:$port" --arms "" --tokenizer "$tokenizer" \
    --out "$out/$name.json" "${bench_args[@]}" 2>&1 | tee "$out/$name.bench.txt"
  kill -- -"$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  trap - EXIT
}

read -r -a llama_args <<<"${LLAMA_ARGS:--t 2 -c 32768 -np 8}"
bench_args=("$@")
run_alone llama-server "${LLAMA_SERVER:?set LLAMA_SERVER}" -m "$model" --port "$port" "${llama_args[@]}"
run_alone hyprefix-serve "$hyprefix" serve --model "$model" --port "$port" --log-stats-interval 0 --no-access-log
