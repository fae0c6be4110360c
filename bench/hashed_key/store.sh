#!/usr/bin/env bash
# The hashed scope key with the digest computed in SQL, through the store's own functions
# (docs/benchmarks.md, "The hashed key, digest in SQL, through the store's functions"):
# draft_migration.sql applied to the plain layout, against the plain layout as shipped, at
# each table size. SQL only, with pgbench, CPU-bound (synchronous_commit off, as
# bench/partitioned_records/compare.sh).
#
#   bash bench/hashed_key/store.sh [URL of a server's maintenance database]
#
# For each N of ROWS (default "10000 1000000"): two scratch databases provisioned by
# migrations/ (plain layout), each given the same N expired completed records (random keys,
# as traffic leaves them), then draft_migration.sql applied to the second one (its time is
# printed: the migration's cost at that size, lock held throughout). Both then store the
# replay keys 'r-1'..'r-1000' through the store's functions; ROUNDS rounds (default 3) of T
# seconds (default 5), 8 clients, prepared, scripts alternating: a replay
# (bench/pgbench_store_replay.sql) and a miss (bench/plain_statements/function_miss.sql) in
# each database. One line per round with each script's tps, then the index sizes. The
# databases are dropped on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
ROWS=${ROWS:-10000 1000000}
ROUNDS=${ROUNDS:-3}
T=${T:-5}
. bench/partitioned_records/scratch.sh
TEXT=idem_hashed_text
DIGEST=idem_hashed_digest
cleanup() { drop_db $TEXT; drop_db $DIGEST; }
trap cleanup EXIT

for rows in $ROWS; do
  for db in $TEXT $DIGEST; do
    scratch_db "$db" plain
    psql -qAt "$(url_of "$db")" -v ON_ERROR_STOP=1 >/dev/null <<SQL
INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint, state,
                              response_status, response_headers, response_body, created_at,
                              completed_at, expires_at)
SELECT '', 'POST', '/payments', md5(g::text), decode(repeat('42', 32), 'hex'), 'completed', 201,
       '\x00'::bytea, convert_to(repeat('x', 60), 'UTF8'), now() - interval '2 days',
       now() - interval '2 days', now() - interval '1 day'
  FROM generate_series(1, $rows) g;
SQL
  done
  start=$(date +%s.%N)
  psql -qAt "$(url_of $DIGEST)" -v ON_ERROR_STOP=1 --single-transaction \
    -f bench/hashed_key/draft_migration.sql >/dev/null
  echo "$rows rows: draft migration $(python3 -c "print(f'{$(date +%s.%N) - $start:.2f}')") s"
  for db in $TEXT $DIGEST; do
    store_replay_keys "$db"
    psql -qAt "$(url_of "$db")" -v ON_ERROR_STOP=1 -c 'VACUUM ANALYZE idempotency_keys' \
      -c CHECKPOINT >/dev/null
  done
  for r in $(seq 1 "$ROUNDS"); do
    line="  round $r (tps)"
    for s in text_replay digest_replay text_miss digest_miss; do
      case $s in text_*) url=$(url_of $TEXT) ;; *) url=$(url_of $DIGEST) ;; esac
      case $s in *replay) script=bench/pgbench_store_replay.sql ;; *) script=bench/plain_statements/function_miss.sql ;; esac
      out=$(PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c 8 -j 2 -T "$T" -f "$script" "$url" 2>&1) ||
        echo "$s: pgbench failed: $(grep -m1 -i error <<<"$out")" >&2
      tps=$(sed -n 's/^tps = \([0-9]*\).*/\1/p' <<<"$out")
      line="$line $s=${tps:-failed}"
    done
    echo "$line"
  done
  echo "  index MB, text key / digest key (+ tenant index):" \
    "$(psql -qAt "$(url_of $TEXT)" -c "SELECT round(pg_relation_size('idempotency_keys_pkey') / 1048576.0, 1)")" / \
    "$(psql -qAt "$(url_of $DIGEST)" -F ' (+' -c "SELECT round(pg_relation_size('idempotency_keys_pkey') / 1048576.0, 1), round(pg_relation_size('idempotency_keys_tenant_idx') / 1048576.0, 1) || ')'")"
done
