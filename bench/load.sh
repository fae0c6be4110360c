#!/usr/bin/env bash
# The load benchmark: the cost of idempotency, next to the floors it cannot beat.
#
#   bash bench/load.sh
#
# Builds the bench server (release), starts a throwaway PostgreSQL cluster with
# pg_stat_statements on a free loopback port (or uses BENCH_DATABASE_URL's server), creates and
# migrates the database idem_bench, starts one server per case on loopback, drives each with
# wrk (installed from Debian if missing) and pgbench, alternating the cases round by round,
# and prints one table. Raw results: bench-results/load-<time>.jsonl and .json. Everything it
# started is stopped by PID on exit. See docs/benchmarks.md for what each case means.
#
# Knobs (environment): BENCH_DURATION (s per run, 10), BENCH_RUNS (rounds, 5),
# BENCH_THREADS (wrk threads, 2), BENCH_CONNECTIONS (wrk connections, 64), BENCH_POOL
# (database connections per server and pgbench clients, 16), BENCH_WORKERS (actix workers, 2),
# BENCH_WAIT_QUIET (s to wait for a quiet machine, 120), BENCH_DATABASE_URL (an existing
# server's admin URL instead of the throwaway cluster; pg_stat_statements must be loaded
# there for the statement counts), BENCH_CASES (space-separated subset of the cases),
# BENCH_SERVER_BIN (a bench_server binary built beforehand, with `--features redis` unless
# BENCH_REDIS=0: skips the build), BENCH_SCALE (1: also run the scale curves of bench/scale.sh after the cases; only: run just
# the scale curves; they take up to 30 minutes and about 10 GB of disk, and are not for CI),
# BENCH_PARTITIONS (1: also compare the partitioned layout with the plain one, bench/partitions.sh;
# only: just that; 10 M expired rows per layout, 10-20 minutes, not for CI), BENCH_REDIS (auto,
# the default: a run without BENCH_CASES also runs the Redis store against its raw anchor,
# bench/redis.sh, last, with this run's server binary, rounds and durations, its table printed
# after the main one, about 5 minutes; 1: also with BENCH_CASES; 0 or empty: never).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/rows.sh
source bench/rows.sh

DURATION=${BENCH_DURATION:-10}
RUNS=${BENCH_RUNS:-5}
SCALE=${BENCH_SCALE:-}
PARTITIONS=${BENCH_PARTITIONS:-}
# auto: a full run (no BENCH_CASES) runs the Redis cases; 1 always, 0 (or empty) never.
REDIS=${BENCH_REDIS-auto}
THREADS=${BENCH_THREADS:-2}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
POOL=${BENCH_POOL:-16}
WORKERS=${BENCH_WORKERS:-2}
WAIT_QUIET=${BENCH_WAIT_QUIET:-120}
# A free port, not a fixed one: a fixed port collides with test servers on this machine.
PGPORT=${BENCH_PGPORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=bench-results
mkdir -p "$OUT"
RESULTS="$OUT/load-$STAMP.jsonl"
: >"$RESULTS"
WORK=$(mktemp -d /tmp/idem-bench.XXXXXX)
PIDS=()
PGDATA_DIR=""
PGBIN=""
POSTMASTER=""

log() { printf '[load.sh %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

DB_CREATED=""
PART_DB_CREATED=""
cleanup() {
  local status=$?
  for pid in "${PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  if [ -n "$DB_CREATED" ]; then
    psql "$ADMIN_URL" -XAtq -c 'DROP DATABASE IF EXISTS idem_bench WITH (FORCE)' >/dev/null 2>&1 || true
  fi
  if [ -n "$PART_DB_CREATED" ]; then
    psql "$ADMIN_URL" -XAtq -c 'DROP DATABASE IF EXISTS idem_bench_part WITH (FORCE)' >/dev/null 2>&1 || true
  fi
  if [ -n "$POSTMASTER" ]; then
    # Fast shutdown of the cluster this script started (by its postmaster's PID).
    kill -INT "$POSTMASTER" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$POSTMASTER" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- tools -----------------------------------------------------------------------------------
if ! command -v wrk >/dev/null; then
  log "installing wrk (Debian package)"
  apt-get update -qq >/dev/null && apt-get install -y -qq wrk >/dev/null
fi
for tool in pgbench psql python3 curl; do
  command -v "$tool" >/dev/null || { echo "load.sh needs $tool on PATH" >&2; exit 1; }
done

# --- is the machine quiet? -------------------------------------------------------------------
CORES=$(nproc)
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
waited=0
while awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v c="$CORES" 'BEGIN { exit !(l > c / 2) }'; do
  if [ "$waited" -ge "$WAIT_QUIET" ]; then
    log "machine still busy after ${WAIT_QUIET}s (load $(cut -d' ' -f1-3 /proc/loadavg)); measuring anyway, see foreign_cpu_pct"
    break
  fi
  [ "$waited" -eq 0 ] && log "load average $(cut -d' ' -f1 /proc/loadavg) on $CORES cores; waiting up to ${WAIT_QUIET}s for it to drop below $((CORES / 2))"
  sleep 5
  waited=$((waited + 5))
done
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "load average at start: $LOAD_START; when measuring began: $LOAD_BEFORE"

# --- build -----------------------------------------------------------------------------------
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
if [ -n "${BENCH_SERVER_BIN:-}" ]; then
  # A server built beforehand from this checkout (a shared target directory can be locked by
  # other builds for minutes).
  cp "$BENCH_SERVER_BIN" "$WORK/bench_server"
else
  log "building the bench server (release)"
  # With the Redis store too, for bench/redis.sh's cases (BENCH_REDIS): the other modes do not
  # change with it.
  cargo build --release -q -p idempotency-actix --example bench_server --features redis
  # A private copy: the target directory is shared, and another checkout's build of the same
  # example would replace the binary under us.
  cp "$TARGET_DIR/release/examples/bench_server" "$WORK/bench_server"
fi
SERVER="$WORK/bench_server"

# --- PostgreSQL ------------------------------------------------------------------------------
as_postgres() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
if [ -n "${BENCH_DATABASE_URL:-}" ]; then
  ADMIN_URL=$BENCH_DATABASE_URL
else
  PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  [ -x "$PGBIN/initdb" ] || { echo "no initdb under /usr/lib/postgresql/*/bin; set BENCH_DATABASE_URL" >&2; exit 1; }
  PGDATA_DIR="$WORK/pgdata"
  mkdir -p "$PGDATA_DIR"
  [ "$(id -u)" = 0 ] && chown postgres "$WORK" "$PGDATA_DIR"
  log "starting a throwaway PostgreSQL cluster on 127.0.0.1:$PGPORT ($PGBIN)"
  as_postgres "$PGBIN/initdb" -D "$PGDATA_DIR" -U postgres -A trust --no-sync >/dev/null
  cat >>"$PGDATA_DIR/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PGPORT
unix_socket_directories = '$WORK'
shared_preload_libraries = 'pg_stat_statements'
# Nested statements too (a function's own), for the per-statement breakdown of each case.
pg_stat_statements.track = all
# Every server's pool opens at full size (min_idle): up to twice --pool per server (a pool
# per thread beside the shared one) for all the servers, plus pgbench's clients and psql.
# A fixed 200 was too few once the pool-per-thread servers were added: a full run died at
# its first pgbench case with "too many clients".
max_connections = $(( (2 * 16 + 1) * POOL + 20 ))
shared_buffers = 256MB
EOF
  as_postgres "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -l "$WORK/postgres.log" -w start >/dev/null || { tail -n 20 "$WORK/postgres.log" >&2; exit 1; }
  POSTMASTER=$(head -n1 "$PGDATA_DIR/postmaster.pid")
  ADMIN_URL="postgres://postgres@127.0.0.1:$PGPORT/postgres"
fi
DB_URL=$(python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/idem_bench")))' "$ADMIN_URL")
psql "$ADMIN_URL" -XAtq -c 'DROP DATABASE IF EXISTS idem_bench WITH (FORCE)' -c 'CREATE DATABASE idem_bench'
DB_CREATED=1
"$SERVER" migrate --database-url "$DB_URL"
psql "$DB_URL" -XAtq -c 'CREATE EXTENSION IF NOT EXISTS pg_stat_statements' >/dev/null 2>&1 || log "pg_stat_statements is not available: no statement counts"
SETTINGS=$(psql "$DB_URL" -XAtq -F ' ' -c "SELECT string_agg(name || '=' || setting, ', ') FROM pg_settings WHERE name IN ('synchronous_commit','fsync','shared_buffers','server_version')")
log "database: $SETTINGS"
PSQL_ARGS="psql $DB_URL"

# --- servers ---------------------------------------------------------------------------------
declare -A PORT MODE EXTRA
# memory: sized so that no request is refused during the run (10 M records, no byte bound:
# 5 rounds of the miss cases store about 4 M); memory-evicting: at the default 100,000-record
# bound with live-record eviction opted in; memory-metrics: memory with metrics-exporter-
# prometheus's recorder installed. postgres-fast: the store with the replay fast path.
PORT[bare]=18081;            MODE[bare]=bare
PORT[memory]=18082;          MODE[memory]=memory;          EXTRA[memory]="--max-entries 10000000"
PORT[postgres]=18083;        MODE[postgres]=postgres
PORT[postgres-cached]=18084; MODE[postgres-cached]=postgres-cached
PORT[postgres-async]=18085;  MODE[postgres-async]=postgres; EXTRA[postgres-async]="--sync-commit off"
PORT[raw]=18086;             MODE[raw]=raw
PORT[memory-evicting]=18087; MODE[memory-evicting]=memory-evicting; EXTRA[memory-evicting]="--max-entries 100000"
PORT[memory-metrics]=18088;  MODE[memory-metrics]=memory;  EXTRA[memory-metrics]="--max-entries 10000000 --metrics prometheus"
PORT[postgres-fast]=18089;   MODE[postgres-fast]=postgres; EXTRA[postgres-fast]="--replay-fast-path on"
# A handler that inserts one payments row: default mode (own connection), transactional mode,
# and the hand-written one-transaction anchor (docs/transactional.md, docs/benchmarks.md).
PORT[payments-today]=18090;  MODE[payments-today]=payments-today
PORT[payments-tx]=18091;     MODE[payments-tx]=payments-tx
PORT[payments-raw]=18092;    MODE[payments-raw]=payments-raw
# The same store and anchor with a pool per worker, its connections driven on the worker's own
# runtime (docs/benchmarks.md, "Where the connections are driven").
PORT[raw-local]=18093;       MODE[raw-local]=raw-local
PORT[postgres-local]=18094;  MODE[postgres-local]=postgres; EXTRA[postgres-local]="--pool-per-thread on"
PORT[postgres-fast-local]=18096; MODE[postgres-fast-local]=postgres; EXTRA[postgres-fast-local]="--pool-per-thread on --replay-fast-path on"
PORT[payments-tx-local]=18095; MODE[payments-tx-local]=payments-tx; EXTRA[payments-tx-local]="--pool-per-thread on"
SERVERS="bare memory memory-evicting memory-metrics postgres postgres-fast postgres-cached postgres-async raw payments-today payments-tx payments-raw raw-local postgres-local postgres-fast-local payments-tx-local"
declare -A SERVER_PID
if [ "$SCALE" = only ] || [ "$PARTITIONS" = only ]; then SERVERS=""; fi
# With BENCH_CASES, only the servers those cases use (fewer idle pools on the database).
if [ -n "${BENCH_CASES:-}" ] && [ -n "$SERVERS" ]; then
  SERVERS=$(for c in $BENCH_CASES; do
    for name in $SERVERS; do
      case $c in "$name"-miss|"$name"-replay) echo "$name";; esac
    done
  done | sort -u | tr '\n' ' ')
fi
# A port that already answers would be measured in place of our server (which then fails to
# bind and exits after wait_up has seen the port answer): refuse instead.
for name in $SERVERS; do
  if (exec 3<>"/dev/tcp/127.0.0.1/${PORT[$name]}") 2>/dev/null; then
    echo "load.sh: port ${PORT[$name]} ($name) is already in use (a leftover bench_server?); stop it first" >&2
    exit 1
  fi
done
for name in $SERVERS; do
  # shellcheck disable=SC2086
  "$SERVER" serve --mode "${MODE[$name]}" --addr "127.0.0.1:${PORT[$name]}" --workers "$WORKERS" \
    --database-url "$DB_URL" --pool "$POOL" ${EXTRA[$name]:-} >"$WORK/$name.log" 2>&1 &
  SERVER_PID[$name]=$!
  PIDS+=("$!")
done
wait_up() { # name port pid
  for _ in $(seq 1 100); do
    curl -s -o /dev/null -X POST -H 'content-type: application/json' -d '{}' "http://127.0.0.1:$2/payments" && return 0
    kill -0 "$3" 2>/dev/null || { cat "$WORK/$1.log" >&2; exit 1; }
    sleep 0.1
  done
}
for name in "${!SERVER_PID[@]}"; do
  wait_up "$name" "${PORT[$name]}" "${SERVER_PID[$name]}"
done
ALL_SERVER_PIDS="${PIDS[*]}"

# --- cases -----------------------------------------------------------------------------------
# name|server|script|uses the database
# Each case runs right after its anchor, so the two see the same load (the ratio is per round).
CASES_ALL="bare-miss|bare|miss memory-miss|memory|miss memory-metrics-miss|memory-metrics|miss \
memory-evicting-miss|memory-evicting|miss \
bare-replay|bare|replay memory-replay|memory|replay postgres-cached-replay|postgres-cached|replay \
raw-miss|raw|miss postgres-miss|postgres|miss postgres-local-miss|postgres-local|miss raw-local-miss|raw-local|miss \
postgres-fast-miss|postgres-fast|miss postgres-fast-local-miss|postgres-fast-local|miss \
postgres-async-miss|postgres-async|miss \
raw-replay|raw|replay postgres-replay|postgres|replay postgres-local-replay|postgres-local|replay raw-local-replay|raw-local|replay \
postgres-fast-replay|postgres-fast|replay postgres-fast-local-replay|postgres-fast-local|replay \
pgbench-replay|-|replay pgbench-store-replay|-|store_replay \
pgbench-miss|-|miss pgbench-tx-anchor-miss|-|tx_anchor_miss pgbench-tx-miss|-|tx_miss \
payments-raw-miss|payments-raw|miss payments-today-miss|payments-today|miss payments-tx-miss|payments-tx|miss \
payments-tx-local-miss|payments-tx-local|miss \
payments-tx-replay|payments-tx|replay"
SELECTED=${BENCH_CASES:-}

wrk_case() { # name server script run
  local name=$1 server=$2 script=$3 run=$4 psql_opt=()
  case $server in postgres*|raw*|payments*) psql_opt=(--psql "$PSQL_ARGS" --postmaster "${POSTMASTER:-}");; esac
  python3 bench/measure.py --case "$name" --run "$run" --pids "$ALL_SERVER_PIDS" "${psql_opt[@]}" -- \
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency -s "bench/$script.lua" \
    "http://127.0.0.1:${PORT[$server]}" -- "$STAMP-$run-$name"
}

pgbench_case() { # name script run
  local name=$1 script=$2 run=$3
  rm -f "$WORK"/pgb_*
  python3 bench/measure.py --case "$name" --run "$run" --pids "$ALL_SERVER_PIDS" \
    --psql "$PSQL_ARGS" --postmaster "${POSTMASTER:-}" --pgbench-log "$WORK/pgb_$name" -- \
    pgbench -n -M prepared -c "$POOL" -j "$THREADS" -T "$DURATION" -l --log-prefix "$WORK/pgb_$name" \
    -f "bench/pgbench_$script.sql" "$DB_URL"
}

log "warm-up: stores the replay keys, opens pools, prepares statements"
for name in $SERVERS; do
  wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s bench/replay.lua "http://127.0.0.1:${PORT[$name]}" >/dev/null
  wrk -t"$THREADS" -c"$CONNECTIONS" -d1s -s bench/miss.lua "http://127.0.0.1:${PORT[$name]}" -- "warm-$STAMP" >/dev/null
done

{ [ "$SCALE" = only ] || [ "$PARTITIONS" = only ]; } && RUNS=0
for run in $(seq 1 "$RUNS"); do
  log "round $run of $RUNS"
  for spec in $CASES_ALL; do
    IFS='|' read -r name server script <<<"$spec"
    if [ -n "$SELECTED" ] && [[ " $SELECTED " != *" $name "* ]]; then continue; fi
    if [ "$server" = "-" ]; then
      pgbench_case "$name" "$script" "$run" | tee -a "$RESULTS" >&2
    else
      wrk_case "$name" "$server" "$script" "$run" | tee -a "$RESULTS" >&2
    fi
  done
done

# --- purge -----------------------------------------------------------------------------------
# 1,000,000 expired completed rows, `idem-cli purge` with its defaults, while keyed traffic (the
# miss path, one wrk thread, 16 connections) runs against the PostgreSQL server. The same
# traffic without a purge first, as the baseline. BENCH_PURGE_ROWS (1000000), BENCH_PURGE=0 skips.
PURGE_JSON="{}"
if [ "${BENCH_PURGE:-1}" != 0 ] && [ -z "$SELECTED" ] && [ "$SCALE" != only ] && [ "$PARTITIONS" != only ]; then
  ROWS=${BENCH_PURGE_ROWS:-1000000}
  log "purge: building idem-cli (release)"
  cargo build --release -q -p idempotency-cli
  log "purge: inserting $ROWS expired rows"
  rows_fill_completed "$DB_URL" 1 "$ROWS" "'purge-bench'" "'old-' || g" "$ROWS_FINGERPRINT" "$ROWS_HEADERS" "$ROWS_BODY" \
    "now() - interval '2 days' + g * interval '1 millisecond'" "now() - interval '1 day' + g * interval '1 millisecond'"
  psql "$DB_URL" -XAtq -c "VACUUM ANALYZE idempotency_keys" >/dev/null
  TRAFFIC=(wrk -t1 -c16 --latency -s bench/miss.lua "http://127.0.0.1:${PORT[postgres]}")
  BASE=$("${TRAFFIC[@]}" -d"${DURATION}s" -- "purge-base-$STAMP" | grep '^JSON ' | cut -c6-)
  log "purge: baseline traffic $BASE"
  "${TRAFFIC[@]}" -d120s -- "purge-during-$STAMP" >"$WORK/purge-traffic.out" &
  WRK_PID=$!
  PIDS+=("$WRK_PID")
  sleep 1
  PURGE_OUT=$("$TARGET_DIR/release/idem-cli" --database-url "$DB_URL" --format json purge)
  kill -INT "$WRK_PID" 2>/dev/null || true
  wait "$WRK_PID" 2>/dev/null || true
  DURING=$(grep '^JSON ' "$WORK/purge-traffic.out" | cut -c6-)
  log "purge: $PURGE_OUT"
  log "purge: traffic during the purge $DURING"
  PURGE_JSON=$(python3 -c 'import json,sys; print(json.dumps({"rows_inserted": int(sys.argv[1]), "purge": json.loads(sys.argv[2]), "traffic_baseline": json.loads(sys.argv[3] or "{}"), "traffic_during_purge": json.loads(sys.argv[4] or "{}")}))' "$ROWS" "$PURGE_OUT" "$BASE" "$DURING")
fi

# --- memory ----------------------------------------------------------------------------------
HWM="{"
for name in $SERVERS; do
  kib=$(awk '/VmHWM/ {print $2}' "/proc/${SERVER_PID[$name]}/status")
  HWM="$HWM\"$name\":$kib,"
done
HWM="${HWM%,}}"
FOOTPRINT=$("$SERVER" footprint --records 100000)
SCALE_JSON="{}"
if [ -n "$SCALE" ] && [ "$PARTITIONS" != only ]; then
  # shellcheck source=bench/scale.sh
  source bench/scale.sh
fi
if [ -n "$PARTITIONS" ]; then
  # shellcheck source=bench/partitions.sh
  source bench/partitions.sh
  echo "$PART_JSON" >"$OUT/partitions-$STAMP.json"
  log "partitions: results in $OUT/partitions-$STAMP.json"
fi
STORE_LEN_NOTE="memory store bounded at 100000 records (MemoryStore default)"
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

python3 bench/report.py "$RESULTS" "$OUT/load-$STAMP.json" \
  --meta "$(python3 -c 'import json,sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
    stamp "$STAMP" duration_s "$DURATION" runs "$RUNS" wrk "-t$THREADS -c$CONNECTIONS" pool "$POOL" \
    workers "$WORKERS" cores "$CORES" load_at_start "$LOAD_START" load_measuring "$LOAD_BEFORE" \
    load_end "$LOAD_END" database "$SETTINGS" note "$STORE_LEN_NOTE")" \
  --hwm "$HWM" --footprint "$FOOTPRINT" --purge "$PURGE_JSON" --scale "$SCALE_JSON"

# The Redis cases last, after the main report is written (a failure here loses nothing above),
# with every server of this run stopped so that they measure alone, as bench/redis.sh does.
case $REDIS in
  1) run_redis=1 ;;
  auto) [ -z "${BENCH_CASES:-}" ] && [ "$SCALE" != only ] && [ "$PARTITIONS" != only ] && run_redis=1 ;;
esac
if [ -n "${run_redis:-}" ]; then
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
  if [ -n "$POSTMASTER" ]; then
    # The throwaway cluster too (its autovacuum may still be busy after the purge section).
    kill -INT "$POSTMASTER" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$POSTMASTER" 2>/dev/null || break; sleep 0.2; done
    POSTMASTER=""
    DB_CREATED=""
    PART_DB_CREATED=""
  fi
  log "the Redis cases (bench/redis.sh)"
  if ! BENCH_SERVER_BIN="$SERVER" BENCH_DURATION="$DURATION" BENCH_RUNS="$RUNS" \
    BENCH_THREADS="$THREADS" BENCH_CONNECTIONS="$CONNECTIONS" BENCH_WORKERS="$WORKERS" \
    bash bench/redis.sh; then
    echo "load.sh: the Redis cases failed (the report above is complete); see the lines above" >&2
    exit 1
  fi
fi
