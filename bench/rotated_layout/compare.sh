#!/usr/bin/env bash
# The rotated layout as shipped (migration 000016) against the plain layout, SQL only, with
# pgbench on the store's own functions (docs/benchmarks.md, "Rotated layout, as shipped"): the
# same replay and miss scripts on both layouts, which share every function name.
#
#   bash bench/rotated_layout/compare.sh [URL of a server's maintenance database]
#
# Makes two scratch databases (dropped on exit), provisioned from migrations/ by psql in each
# layout, each holding the replay keys 'r-1'..'r-1000' stored through the store's functions and
# FILLER (default 100000) expired records; the rotated database after one rotation, so its
# reads probe the current table and, for a miss, the previous one too (where the filler is).
# Then ROUNDS rounds (default 5) of T seconds (default 5) each, 8 clients, prepared,
# synchronous_commit off (CPU-bound, as bench/partitioned_records/compare.sh), the layouts
# alternating within each round: one line per round with each case's calls per second.
#
# BASE_REV=<git revision>: also a third database, the rotated layout as that revision's
# migrations provision it, run third in each round (two more columns, base_replay and
# base_miss): a change to the rotated layout's functions against its parent, both paired with
# the same plain anchor in the same run, which is what separates a change from this machine's
# noise (docs/benchmarks.md, "One statement for a miss's second table").
#
# CPU=1: instead of throughput, the CPU one miss costs the database: per round and database,
# one pgbench client on the miss script, `perf record -e cpu-clock` on its backend for T
# seconds (software clock: no hardware counters needed), the misses in that window counted
# from pg_stat_database; one line per round and database with user and kernel µs per miss.
# Needs perf (Debian's linux-perf). One client, so no lock waits and no CPU queue inflate it.
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
FILLER=${FILLER:-100000}
ROUNDS=${ROUNDS:-5}
T=${T:-5}
. bench/partitioned_records/scratch.sh
PLAIN=idem_rotated_bench_plain
ROTATED=idem_rotated_bench_rotated
BASE=idem_rotated_bench_base
BASE_DIR=
cleanup() {
  drop_db $PLAIN; drop_db $ROTATED; drop_db $BASE
  if [ -n "$BASE_DIR" ]; then rm -rf "$BASE_DIR"; fi
}
trap cleanup EXIT
DATABASES=("$PLAIN" "$ROTATED")
if [ -n "${BASE_REV:-}" ]; then
  BASE_DIR=$(mktemp -d)
  git archive "$BASE_REV" migrations | tar -x -C "$BASE_DIR"
  DATABASES+=("$BASE")
fi

for db in "${DATABASES[@]}"; do
  layout=rotated
  migrations_from=.
  [ "$db" = "$PLAIN" ] && layout=plain
  [ "$db" = "$BASE" ] && migrations_from=$BASE_DIR
  (cd "$migrations_from" && scratch_db $db $layout)
  # Straight into the table (on the rotated layout, its current one: an insert through the
  # view takes the scope's lock per row).
  table=idempotency_keys
  if [ "$layout" = rotated ]; then table=idempotency_keys_0; fi
  psql -qAt "$(url_of $db)" -v ON_ERROR_STOP=1 -v filler="$FILLER" -v table="$table" >/dev/null <<'SQL'
INSERT INTO :"table" (tenant, method, path, idempotency_key, fingerprint, state, token,
                              response_status, response_headers, response_body, created_at,
                              completed_at, expires_at)
SELECT '', 'POST', '/payments', 'x-' || g, decode(repeat('42', 32), 'hex'), 'completed',
       md5('x-' || g)::uuid, 201, '\x00'::bytea, convert_to(repeat('x', 60), 'UTF8'),
       now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'
  FROM generate_series(1, :filler) g;
SQL
  if [ "$layout" = rotated ]; then
    # The filler (written through the view into table 0) becomes the previous table's.
    psql -qAt "$(url_of $db)" -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
UPDATE idempotency_generation SET period = interval '1 microsecond';
SELECT rotated FROM idempotency_rotate(5000, 0);
UPDATE idempotency_generation SET period = interval '2 days';
SQL
  fi
  store_replay_keys $db
  psql -qAt "$(url_of $db)" -c "VACUUM ANALYZE" >/dev/null
done

run() { # database script -> calls per second
  PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -c 8 -j 2 -T "$T" \
    -f "$2" "$(url_of "$1")" 2>/dev/null | sed -n 's/^tps = \([0-9.]*\).*/\1/p'
}

# CPU one miss (its reserve and complete: two transactions) costs database $1's backend,
# from perf samples taken every 1/HZ s of its CPU time.
HZ=4000
cpu_per_miss() {
  local url pid x1 x2 data
  url=$(url_of "$1")
  data=$(mktemp)
  PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -c 1 -T "$((T + 4))" \
    -f bench/plain_statements/function_miss.sql "$url" >/dev/null 2>&1 &
  sleep 1.5
  pid=$(psql -qAt "$url" -c "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgbench'")
  x1=$(psql -qAt "$url" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = '$1'")
  perf record -q -e cpu-clock -F "$HZ" -p "$pid" -o "$data" -- sleep "$T" >/dev/null 2>&1
  x2=$(psql -qAt "$url" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = '$1'")
  wait
  perf report -i "$data" --no-children -n --sort dso -g none --stdio 2>/dev/null |
    awk -v misses="$(( (x2 - x1) / 2 ))" -v us=$((1000000 / HZ)) -v db="$1" '
      /^#/ || NF < 3 { next }
      { if ($3 ~ /kernel/) k += $2; else u += $2 }
      END {
        if (u + k == 0 || misses <= 0) { print db ": no samples or no misses" > "/dev/stderr"; exit 1 }
        printf "%s user %.1f kernel %.1f us per miss\n", db, u * us / misses, k * us / misses
      }'
  rm -f "$data"
}
if [ "${CPU:-}" = 1 ]; then
  command -v perf >/dev/null || { echo "CPU=1 needs perf (apt-get install linux-perf)" >&2; exit 2; }
  for round in $(seq 1 "$ROUNDS"); do
    for db in "${DATABASES[@]}"; do
      line=$(cpu_per_miss "$db")
      echo "$round $line"
    done
  done
  exit 0
fi

echo "round plain_replay rotated_replay plain_miss rotated_miss${BASE_REV:+ base_replay base_miss}"
for round in $(seq 1 "$ROUNDS"); do
  pr=$(run $PLAIN bench/pgbench_store_replay.sql)
  rr=$(run $ROTATED bench/pgbench_store_replay.sql)
  br=
  [ -n "$BASE_DIR" ] && br=" $(run $BASE bench/pgbench_store_replay.sql)"
  pm=$(run $PLAIN bench/plain_statements/function_miss.sql)
  rm=$(run $ROTATED bench/plain_statements/function_miss.sql)
  bm=
  [ -n "$BASE_DIR" ] && bm=" $(run $BASE bench/plain_statements/function_miss.sql)"
  echo "$round $pr $rr $pm $rm$br$bm"
done
