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
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
FILLER=${FILLER:-100000}
ROUNDS=${ROUNDS:-5}
T=${T:-5}
. bench/partitioned_records/scratch.sh
PLAIN=idem_rotated_bench_plain
ROTATED=idem_rotated_bench_rotated
cleanup() { drop_db $PLAIN; drop_db $ROTATED; }
trap cleanup EXIT

for db in $PLAIN $ROTATED; do
  layout=plain
  [ "$db" = "$ROTATED" ] && layout=rotated
  scratch_db $db $layout
  # Straight into the table (on the rotated layout, its current one: an insert through the
  # view takes the scope's lock per row).
  table=idempotency_keys
  [ "$layout" = rotated ] && table=idempotency_keys_0
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

echo "round plain_replay rotated_replay plain_miss rotated_miss"
for round in $(seq 1 "$ROUNDS"); do
  pr=$(run $PLAIN bench/pgbench_store_replay.sql)
  rr=$(run $ROTATED bench/pgbench_store_replay.sql)
  pm=$(run $PLAIN bench/plain_statements/function_miss.sql)
  rm=$(run $ROTATED bench/plain_statements/function_miss.sql)
  echo "$round $pr $rr $pm $rm"
done
