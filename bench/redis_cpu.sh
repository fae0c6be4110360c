#!/usr/bin/env bash
# Where a Redis request's CPU goes: app (bench server) and redis-server CPU per request, the
# store (mode redis) against the raw anchor (mode redis-raw), miss and replay, read from
# /proc/<pid>/stat around each wrk run. Complements bench/redis.sh, which measures throughput.
#
#   bash bench/redis_cpu.sh            # builds the release bench server first
#
# Knobs: BENCH_SERVER_BIN (a bench_server binary; skips the build), BENCH_DURATION (s, 5),
# BENCH_RUNS (3). Starts its own redis-server on a free loopback port; kills everything after.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${BENCH_DURATION:-5}
RUNS=${BENCH_RUNS:-3}
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

if [ -n "${BENCH_SERVER_BIN:-}" ]; then
  SERVER=$BENCH_SERVER_BIN
else
  cargo build --release -q -p idempotency-actix --example bench_server --features redis
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  SERVER="$TARGET_DIR/release/examples/bench_server"
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --maxmemory-policy noeviction >/dev/null 2>&1 &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
for _ in $(seq 1 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done

declare -A PORT SERVER_PID
for mode in redis redis-raw; do
  PORT[$mode]=$(free_port)
  "$SERVER" serve --mode "$mode" --addr "127.0.0.1:${PORT[$mode]}" --workers 2 \
    --redis-url "redis://127.0.0.1:$REDIS_PORT" >/dev/null 2>&1 &
  SERVER_PID[$mode]=$!
  PIDS+=("$!")
  for _ in $(seq 1 100); do
    curl -s -o /dev/null -X POST -H 'content-type: application/json' -d '{}' "http://127.0.0.1:${PORT[$mode]}/payments" && break
    sleep 0.1
  done
  wrk -t2 -c64 -d2s -s bench/replay.lua "http://127.0.0.1:${PORT[$mode]}" >/dev/null
done

printf '%-5s %-7s %-10s %9s %13s %15s\n' round path mode requests 'app µs/req' 'redis µs/req'
for round in $(seq 1 "$RUNS"); do
  for script in miss replay; do
    for mode in redis-raw redis; do
      app0=$(ticks "${SERVER_PID[$mode]}"); redis0=$(ticks "$REDIS_PID")
      n=$(wrk -t2 -c64 -d"${DURATION}s" -s "bench/$script.lua" "http://127.0.0.1:${PORT[$mode]}" \
            -- "cpu-$$-$round-$mode" | grep '^JSON ' | cut -c6- \
          | python3 -c 'import json,sys; print(json.load(sys.stdin)["requests"])')
      app1=$(ticks "${SERVER_PID[$mode]}"); redis1=$(ticks "$REDIS_PID")
      python3 -c "
n, hz = $n, $HZ
print(f'{$round:<5} {\"$script\":<7} {\"$mode\":<10} {n:>9} {($app1-$app0)*1e6/hz/n:>13.1f} {($redis1-$redis0)*1e6/hz/n:>15.1f}')"
    done
  done
done
