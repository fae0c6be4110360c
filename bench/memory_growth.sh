#!/usr/bin/env bash
# The memory store's pauses as it grows: one bench server (memory store, 10 M record bound)
# takes RUNS consecutive runs of misses; each run prints its throughput, p99 and slowest
# request. A table doubling or the periodic sweep (every 30 s) shows as a p99/max jump in the
# run it falls into. See docs/benchmarks.md, "Memory store and detached work".
#
#   bash bench/memory_growth.sh [bench_server binary]   # default: builds the release one
#
# Knobs (environment): GROWTH_RUNS (4), GROWTH_DURATION (s per run, 10), GROWTH_PORT (free port).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${GROWTH_RUNS:-4}
DURATION=${GROWTH_DURATION:-10}
PORT=${GROWTH_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
BIN=${1:-}
if [ -z "$BIN" ]; then
  cargo build --release -q -p idempotency-actix --example bench_server
  BIN="${CARGO_TARGET_DIR:-target}/release/examples/bench_server"
fi
command -v wrk >/dev/null || { echo "memory_growth.sh: wrk is missing (bench/load.sh installs it)" >&2; exit 1; }
"$BIN" serve --mode memory --max-entries 10000000 --addr "127.0.0.1:$PORT" --workers 2 >/dev/null 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 0.1
done
SUMMARY='import json, sys
d = json.loads(sys.stdin.read())
print("run %s: %.0f req/s, p99 %s ms, max %s ms, errors %s" % (sys.argv[1], d["rps"], d["p99_ms"], d["max_ms"], d["errors"]))'
for run in $(seq "$RUNS"); do
  wrk -t2 -c64 -d"${DURATION}s" --latency -s bench/miss.lua "http://127.0.0.1:$PORT" -- "growth-$run-$$" \
    | sed -n 's/^JSON //p' | python3 -c "$SUMMARY" "$run"
done
