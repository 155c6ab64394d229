#!/usr/bin/env bash
# Time from `make serve` in a fresh clone on a cold machine to the README's first curl answering:
# a new clone of this repository, no venv, pip's cache off, an empty home (so empty ~/.cache: no
# model, no built kernels, no compile cache). Run it with port 8000 free; it stops the server after.
#   bash tools/bench/cold_start.sh [WORKDIR]      # README.md's "Set-up" quotes its result
set -euo pipefail
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=${1:-$(mktemp -d)}
rm -rf "$work/clone" "$work/home"
git clone -q "$repo" "$work/clone"
mkdir -p "$work/home"
cd "$work/clone"
t0=$(date +%s.%N)
HOME="$work/home" PIP_NO_CACHE_DIR=1 TORCHINDUCTOR_CACHE_DIR="$work/home/inductor" \
  setsid make serve >"$work/serve.log" 2>&1 &
server=$!
trap 'kill -- -"$server" 2>/dev/null || true' EXIT
until answer=$(curl -sf --max-time 60 http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}'); do
  kill -0 "$server" 2>/dev/null || { echo "make serve exited; see $work/serve.log"; exit 1; }
  sleep 1
done
echo "first answer after $(python3 -c "import time; print(round(time.time() - $t0, 1))") s (log: $work/serve.log):"
echo "$answer"
grep -E "kernels built|loaded .* in|warmed up" "$work/serve.log" || true
