# The scale curves: how the cost grows with the work. Sourced by bench/load.sh (BENCH_SCALE=1
# or only) after its setup, so it uses that script's cluster, database, server binary, knobs
# and cleanup; one run of each point (BENCH_DURATION s), not for CI. Up to 30 minutes and about
# 10 GB of disk (10 M rows in the store's table and in each of two scratch tables).
#
#   SCALE_ROWS   table sizes for the PostgreSQL curve (default "10000 1000000 10000000")
#   SCALE_BODIES response body sizes for the replay curve (default "1024 65536 1048576")
#   SCALE_LIVE   live records for the memory-store curve (default "10000 100000 1000000")
#   SCALE_SECTIONS which curves to run (default "rows bodies live tenants")
#
# Tables (in SCALE_JSON, printed by report.py and written to the .md):
# 1. PostgreSQL miss and replay through the store with N rows already in idempotency_keys, and
#    pgbench on two scratch tables of N rows each, today's four-text-column primary key
#    (scale_text) against a 32-byte SHA-256 digest primary key with the parts re-checked on
#    read (scale_hash): replay of a random existing key, insert of a new key, index sizes.
# 2. Replay of 1 KiB, 64 KiB and 1 MiB bodies, memory and PostgreSQL, against the bare handler
#    returning the same body.
# 3. Memory store with N live records: miss throughput and resident memory per record.
# 4. 10,000 tenants with the same key set against one tenant, memory and PostgreSQL.

SCALE_ROWS=${SCALE_ROWS:-"10000 1000000 10000000"}
SCALE_BODIES=${SCALE_BODIES:-"1024 65536 1048576"}
SCALE_LIVE=${SCALE_LIVE:-"10000 100000 1000000"}
SCALE_SECTIONS=" ${SCALE_SECTIONS:-rows bodies live tenants} "
SCALE_OUT="$WORK/scale.jsonl"
: >"$SCALE_OUT"

scale_server() { # name port args... ; sets SCALE_PID
  local name=$1 port=$2
  shift 2
  "$SERVER" serve --addr "127.0.0.1:$port" --workers "$WORKERS" --database-url "$DB_URL" \
    --pool "$POOL" "$@" >"$WORK/$name.log" 2>&1 &
  SCALE_PID=$!
  PIDS+=("$SCALE_PID")
  wait_up "$name" "$port" "$SCALE_PID"
}

scale_stop() { # pid
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

scale_wrk() { # table label pid port script args... : one measured wrk run, tagged
  local table=$1 label=$2 pid=$3 port=$4 script=$5
  shift 5
  python3 bench/measure.py --case "$label" --run 1 --pids "$pid" --psql "$PSQL_ARGS" \
    --postmaster "${POSTMASTER:-}" -- \
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency -s "bench/$script.lua" \
    "http://127.0.0.1:$port" -- "$@" |
    python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); r["table"]=sys.argv[1]; r.update(json.loads(sys.argv[2])); print(json.dumps(r))' \
      "$table" "${SCALE_TAGS:-{\}}" | tee -a "$SCALE_OUT" >&2
}

scale_pgbench() { # label script rows
  local label=$1 script=$2 rows=$3
  rm -f "$WORK"/pgb_scale_*
  python3 bench/measure.py --case "$label" --run 1 --psql "$PSQL_ARGS" --postmaster "${POSTMASTER:-}" \
    --pgbench-log "$WORK/pgb_scale_$label" -- \
    pgbench -n -M prepared -c "$POOL" -j "$THREADS" -T "$DURATION" -D rows="$rows" -l \
    --log-prefix "$WORK/pgb_scale_$label" -f "bench/pgbench_$script.sql" "$DB_URL" |
    python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); r["table"]="pg_rows"; r.update(json.loads(sys.argv[1])); print(json.dumps(r))' \
      "${SCALE_TAGS:-{\}}" | tee -a "$SCALE_OUT" >&2
}

# --- 1. PostgreSQL with N rows ---------------------------------------------------------------
if [[ $SCALE_SECTIONS == *" rows "* ]]; then
log "scale: PostgreSQL table sizes $SCALE_ROWS"
# Two scratch tables of their own, not the store's (bench/scale_tables.sql); the store's table
# is filled through bench/rows.sh.
psql "$DB_URL" -XAtq -v ON_ERROR_STOP=1 -f bench/scale_tables.sql >/dev/null
scale_server scale-pg 18191 --mode postgres
SCALE_PG_PID=$SCALE_PID
wrk -t"$THREADS" -c"$CONNECTIONS" -d3s -s bench/replay.lua "http://127.0.0.1:18191" >/dev/null
have=0
for rows in $SCALE_ROWS; do
  log "scale: filling to $rows rows (store table and both scratch tables)"
  fill_start=$(date +%s.%N)
  rows_fill_completed "$DB_URL" "$((have + 1))" "$rows" "'fill-' || (g % 1000)" "md5(g::text)::uuid::text" \
    "decode(repeat('42', 32), 'hex')" "decode(repeat('ab', 54), 'hex')" "convert_to(repeat('x', 60), 'UTF8')" \
    "now()" "now() + interval '1 day'"
  psql "$DB_URL" -XAtq -v ON_ERROR_STOP=1 >/dev/null <<SQL
INSERT INTO scale_text SELECT 'tenant-' || (g % 1000), 'POST', '/v1/payments', md5(g::text)::uuid::text,
    decode(repeat('42', 32), 'hex'), 'completed', 201, decode(repeat('ab', 54), 'hex'),
    convert_to(repeat('x', 60), 'UTF8'), now(), now() + interval '1 day'
FROM generate_series($have + 1, $rows) g;
INSERT INTO scale_hash SELECT sha256(convert_to(length(t) || ':' || t || '4:POST12:/v1/payments36:' || k, 'UTF8')),
    t, 'POST', '/v1/payments', k, decode(repeat('42', 32), 'hex'), 'completed', 201,
    decode(repeat('ab', 54), 'hex'), convert_to(repeat('x', 60), 'UTF8'), now(), now() + interval '1 day'
FROM (SELECT 'tenant-' || (g % 1000) AS t, md5(g::text)::uuid::text AS k
      FROM generate_series($have + 1, $rows) g) v;
VACUUM ANALYZE idempotency_keys;
VACUUM ANALYZE scale_text;
VACUUM ANALYZE scale_hash;
CHECKPOINT;
SQL
  fill_s=$(python3 -c "import time,sys; print(round(time.time() - float(sys.argv[1]), 1))" "$fill_start")
  have=$rows
  sizes=$(psql "$DB_URL" -XAtq -F ' ' -c "SELECT pg_indexes_size('idempotency_keys'), pg_indexes_size('scale_text'), pg_relation_size('scale_hash_pkey'), pg_relation_size('scale_hash_tenant')")
  read -r idx_store idx_text idx_hash_pk idx_hash_tenant <<<"$sizes"
  SCALE_TAGS=$(printf '{"rows":%s,"fill_s":%s,"index_store_bytes":%s,"index_text_bytes":%s,"index_hash_pk_bytes":%s,"index_hash_tenant_bytes":%s}' \
    "$rows" "$fill_s" "$idx_store" "$idx_text" "$idx_hash_pk" "$idx_hash_tenant")
  scale_wrk pg_rows postgres-miss "$SCALE_PG_PID" 18191 miss "scale-$rows-$STAMP"
  scale_wrk pg_rows postgres-replay "$SCALE_PG_PID" 18191 replay
  scale_pgbench pgbench-text-replay scale_text_replay "$rows"
  scale_pgbench pgbench-hash-replay scale_hash_replay "$rows"
  scale_pgbench pgbench-text-miss scale_text_miss "$rows"
  scale_pgbench pgbench-hash-miss scale_hash_miss "$rows"
done
scale_stop "$SCALE_PG_PID"
SCALE_TAGS="{}"
psql "$DB_URL" -XAtq -c 'DROP TABLE scale_text, scale_hash' >/dev/null
fi

# --- 2. Response body sizes ------------------------------------------------------------------
[[ $SCALE_SECTIONS == *" bodies "* ]] || SCALE_BODIES=""
for bytes in $SCALE_BODIES; do
  log "scale: replay of $bytes-byte bodies"
  SCALE_TAGS="{\"body_bytes\":$bytes}"
  for mode in bare memory postgres; do
    scale_server "scale-body-$mode" 18192 --mode "$mode" --body-bytes "$bytes" --max-entries 1000000
    # 100 keys per size (keys of another size are other records: the args make them distinct).
    wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s bench/replay.lua "http://127.0.0.1:18192" -- 100 >/dev/null
    rows_delete_replays_not_of_size "$DB_URL" "$bytes"
    wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s bench/replay.lua "http://127.0.0.1:18192" -- 100 >/dev/null
    scale_wrk bodies "$mode-replay" "$SCALE_PID" 18192 replay 100
    scale_stop "$SCALE_PID"
  done
done
SCALE_TAGS="{}"

# --- 3. Memory store with N live records -----------------------------------------------------
[[ $SCALE_SECTIONS == *" live "* ]] || SCALE_LIVE=""
for live in $SCALE_LIVE; do
  log "scale: memory store with $live live records"
  scale_server "scale-live-$live" 18193 --mode memory --max-entries 20000000 --prefill "$live"
  prefill=$(grep '^PREFILL ' "$WORK/scale-live-$live.log" | cut -c9-)
  SCALE_TAGS=$(python3 -c 'import json,sys; p=json.loads(sys.argv[1]); print(json.dumps({"live_records": int(sys.argv[2]), "rss_bytes_per_record": p["bytes_per_record"]}))' "$prefill" "$live")
  scale_wrk memory_live memory-miss "$SCALE_PID" 18193 miss "live-$live-$STAMP"
  scale_stop "$SCALE_PID"
done
SCALE_TAGS="{}"

# --- 4. Many tenants -------------------------------------------------------------------------
SCALE_TENANT_MODES="memory postgres"
[[ $SCALE_SECTIONS == *" tenants "* ]] || SCALE_TENANT_MODES=""
for mode in $SCALE_TENANT_MODES; do
  log "scale: 10,000 tenants with the same 5 keys against one tenant ($mode)"
  for tenants in 1 10000; do
    SCALE_TAGS="{\"tenants\":$tenants,\"keys_per_tenant\":5}"
    scale_server "scale-tenants-$mode" 18194 --mode "$mode" --tenant-header x-tenant --max-entries 10000000
    # Warm-up: stores every tenant's keys (50,000 records for 10,000 tenants).
    warm=$([ "$mode" = postgres ] && echo 30 || echo 5)
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${warm}s" -s bench/tenants.lua "http://127.0.0.1:18194" -- "$tenants" 5 replay >/dev/null
    scale_wrk tenants "$mode-replay" "$SCALE_PID" 18194 tenants "$tenants" 5 replay
    scale_wrk tenants "$mode-miss" "$SCALE_PID" 18194 tenants "$tenants" 5 miss "tenants-$tenants-$STAMP"
    scale_stop "$SCALE_PID"
  done
done
SCALE_TAGS="{}"

SCALE_JSON=$(python3 - "$SCALE_OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def pick(r, keys):
    return {k: r.get(k) for k in keys}
common = ["case", "rps", "p50_ms", "p99_ms", "server_cpu_us_per_request", "db_cpu_us_per_request",
          "statements_per_request", "foreign_cpu_pct", "errors"]
out = {
    "PostgreSQL with N rows (store through the app; pgbench on the scratch tables, random keys)":
        [pick(r, ["rows", "fill_s", "index_store_bytes", "index_text_bytes", "index_hash_pk_bytes",
                  "index_hash_tenant_bytes"] + common) for r in rows if r["table"] == "pg_rows"],
    "Replay by response body size (bare: the handler returning the same body)":
        [pick(r, ["body_bytes"] + common) for r in rows if r["table"] == "bodies"],
    "Memory store with N live records (miss)":
        [pick(r, ["live_records", "rss_bytes_per_record"] + common) for r in rows if r["table"] == "memory_live"],
    "Many tenants (same 5 keys in each)":
        [pick(r, ["tenants", "keys_per_tenant"] + common) for r in rows if r["table"] == "tenants"],
}
print(json.dumps(out))
PY
)
