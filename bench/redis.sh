#!/usr/bin/env bash
# The Redis load benchmark: RedisStore behind the middleware against a raw hand-written anchor
# (the least Redis commands an idempotent endpoint needs), miss and replay.
#
#   bash bench/redis.sh
#
# Starts its own redis-server on a free loopback port (no persistence), the bench server in modes
# redis, redis-raw (the anchor: one multiplexed ConnectionManager shared by the workers, as a
# hand-written endpoint keeps it) and redis-raw-local (the anchor with a connection per worker,
# as the store's connection_per_thread does), warms them, then runs BENCH_RUNS rounds; each
# round runs every case right after the anchor on the same wrk script, and the table reports the
# median ratio over the rounds (to each anchor) with its spread.
# BENCH_BASELINE_SERVER=<another build's bench_server> adds its redis mode as a third case
# ("before"), e.g. the last commit's build, so a change is measured against it in the same run
# (on its own prefix, so the two stores' records never meet).
# Knobs: BENCH_DURATION (s per run, 10), BENCH_RUNS (5), BENCH_THREADS (2), BENCH_CONNECTIONS (64),
# BENCH_WORKERS (2), BENCH_SERVER_BIN (a bench_server built beforehand with the feature redis:
# skips the build). Raw results: bench-results/redis-<time>.jsonl. bench/load.sh runs this too
# (BENCH_REDIS, on by default), with its own server binary and rounds.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${BENCH_DURATION:-10}
RUNS=${BENCH_RUNS:-5}
THREADS=${BENCH_THREADS:-2}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
WORKERS=${BENCH_WORKERS:-2}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=bench-results
mkdir -p "$OUT"
RESULTS="$OUT/redis-$STAMP.jsonl"
WORK=$(mktemp -d /tmp/idem-redis-bench.XXXXXX)
PIDS=()
log() { printf '[redis.sh %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
cleanup() {
  local status=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

command -v wrk >/dev/null || { apt-get update -qq >/dev/null && apt-get install -y -qq wrk >/dev/null; }
command -v redis-server >/dev/null || { apt-get update -qq >/dev/null && apt-get install -y -qq redis-server >/dev/null; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

if [ -n "${BENCH_SERVER_BIN:-}" ]; then
  # Built beforehand with the feature redis (bench/load.sh passes its own).
  SERVER="$BENCH_SERVER_BIN"
else
  log "building the bench server (release, feature redis)"
  cargo build --release -q -p idempotency-actix --example bench_server --features redis
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  SERVER="$TARGET_DIR/release/examples/bench_server"
fi

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --maxmemory-policy noeviction --daemonize no >"$WORK/redis.log" 2>&1 &
PIDS+=("$!")
for _ in $(seq 1 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
REDIS_URL="redis://127.0.0.1:$REDIS_PORT"

declare -A PORT
CASES=(redis redis-raw redis-raw-local)
[ -n "${BENCH_BASELINE_SERVER:-}" ] && CASES+=(before)
for mode in "${CASES[@]}"; do
  PORT[$mode]=$(free_port)
  if [ "$mode" = before ]; then
    # Another database number: the earlier build's records may have another format.
    "$BENCH_BASELINE_SERVER" serve --mode redis --addr "127.0.0.1:${PORT[$mode]}" \
      --workers "$WORKERS" --redis-url "$REDIS_URL/1" >"$WORK/$mode.log" 2>&1 &
  else
    "$SERVER" serve --mode "$mode" --addr "127.0.0.1:${PORT[$mode]}" --workers "$WORKERS" \
      --redis-url "$REDIS_URL" >"$WORK/$mode.log" 2>&1 &
  fi
  PIDS+=("$!")
  up=""
  for _ in $(seq 1 100); do
    curl -s -o /dev/null -X POST -H 'content-type: application/json' -d '{}' "http://127.0.0.1:${PORT[$mode]}/payments" && up=1 && break
    sleep 0.1
  done
  if [ -z "$up" ]; then
    echo "redis.sh: bench_server --mode $mode did not answer (a binary built without --features redis?); its log:" >&2
    cat "$WORK/$mode.log" >&2
    exit 1
  fi
done

run() { # mode script run-id
  wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency -s "bench/$2.lua" \
    "http://127.0.0.1:${PORT[$1]}" -- "$STAMP-$3" | grep '^JSON ' | cut -c6-
}

log "warm-up (stores the replay keys)"
for mode in "${CASES[@]}"; do
  wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s bench/replay.lua "http://127.0.0.1:${PORT[$mode]}" >/dev/null
done

log "load average $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
for round in $(seq 1 "$RUNS"); do
  for script in miss replay; do
    anchor=$(run redis-raw "$script" "$round-a")
    store=$(run redis "$script" "$round-s")
    before=null
    [ -n "${BENCH_BASELINE_SERVER:-}" ] && before=$(run before "$script" "$round-b")
    local_anchor=$(run redis-raw-local "$script" "$round-l")
    printf '{"round":%d,"path":"%s","anchor":%s,"store":%s,"before":%s,"anchor_local":%s}\n' "$round" "$script" "$anchor" "$store" "$before" "$local_anchor" | tee -a "$RESULTS" >&2
  done
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

python3 - "$RESULTS" "$LOAD_END" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"\nRedis store vs raw Redis anchor (load at end {sys.argv[2]}); ratio = store rps / anchor rps")
print("store: this build's store; before: BENCH_BASELINE_SERVER's, when given")
print("anchor: redis-raw (one shared connection); local: redis-raw-local (a connection per worker)")
print(f"{'path':8} {'store':6} {'anchor':7} {'anchor rps':>11} {'store rps':>10} {'ratio (median)':>15} {'min..max':>12} {'store p99 ms':>13}")
for path in ("miss", "replay"):
    r = [x for x in rows if x["path"] == path]
    for store in [s for s in ("store", "before") if r and r[0][s] is not None]:
        for anchor in ("anchor", "anchor_local"):
            ratios = [x[store]["rps"] / x[anchor]["rps"] for x in r]
            print(f"{path:8} {store:6} {anchor.replace('anchor_', '') if anchor != 'anchor' else 'shared':7} "
                  f"{statistics.median(x[anchor]['rps'] for x in r):>11.0f} "
                  f"{statistics.median(x[store]['rps'] for x in r):>10.0f} {statistics.median(ratios):>15.3f} "
                  f"{min(ratios):>5.3f}..{max(ratios):<5.3f} {statistics.median(x[store]['p99_ms'] for x in r):>13.2f}")
PY
