#!/usr/bin/env bash
# Where a PostgreSQL miss's database time goes, part by part (docs/benchmarks.md, "A miss's
# database work, part by part"). SQL only, with pgbench, CPU-bound: synchronous_commit off, so
# the flush to disk (the same for the store and the anchor: one commit per statement) does not
# hide what each part costs in CPU, which is what the 2-core load bench runs out of.
#
#   bash bench/plain_statements/decompose.sh [URL of a server's maintenance database]
#
# Creates the scratch database idem_decompose on that server (default: the local one, user
# postgres), applies migrations/ with psql, adds the variants below, runs each script ROUNDS
# times (default 5) for T seconds (default 5) in alternating order, prints one line per round,
# and drops the database. Each step adds one part of the store's work to the one before:
#   anchor      bench/pgbench_miss.sql: the raw anchor's INSERT + UPDATE on bench_anchor
#   no_index    the store's own INSERT + UPDATE (plain_miss.sql) on a copy of idempotency_keys
#               with its primary key only: no expires_at index, no CHECK constraints
#   no_checks   the same with the expires_at index (purge needs it; the complete moves
#               expires_at, so its UPDATE is never HOT)
#   plain       the same on idempotency_keys itself: its four CHECK constraints as well
#   functions   the store's miss as it is: idempotency_reserve + idempotency_complete
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
DB=idem_decompose
URL=${SERVER%/*}/$DB
ROUNDS=${ROUNDS:-5}
T=${T:-5}
WORK=$(mktemp -d)
cleanup() {
  psql -qAt "$SERVER" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

psql -qAt "$SERVER" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null
psql -qAt "$SERVER" -c "CREATE DATABASE $DB" >/dev/null
for f in migrations/*/up.sql; do
  psql -qAt "$URL" -v ON_ERROR_STOP=1 --single-transaction -f "$f" >/dev/null
done
psql -qAt "$URL" -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
-- bench_server's anchor table (idempotency-actix/examples/bench_server.rs, BENCH_TABLES).
CREATE TABLE bench_anchor (
    key text PRIMARY KEY, fingerprint bytea NOT NULL, token uuid, status smallint,
    headers bytea, body bytea, created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
-- LIKE without INCLUDING CONSTRAINTS / INDEXES: the columns and defaults only.
CREATE TABLE keys_no_index (LIKE idempotency_keys INCLUDING DEFAULTS);
ALTER TABLE keys_no_index ADD PRIMARY KEY (tenant, method, path, idempotency_key);
CREATE TABLE keys_no_checks (LIKE idempotency_keys INCLUDING DEFAULTS);
ALTER TABLE keys_no_checks ADD PRIMARY KEY (tenant, method, path, idempotency_key);
CREATE INDEX ON keys_no_checks (expires_at);
SQL
cp bench/pgbench_miss.sql "$WORK/anchor.sql"
sed 's/idempotency_keys/keys_no_index/g' bench/plain_statements/plain_miss.sql >"$WORK/no_index.sql"
sed 's/idempotency_keys/keys_no_checks/g' bench/plain_statements/plain_miss.sql >"$WORK/no_checks.sql"
cp bench/plain_statements/plain_miss.sql "$WORK/plain.sql"
cp bench/plain_statements/function_miss.sql "$WORK/functions.sql"

export PGOPTIONS='-c synchronous_commit=off'
for r in $(seq 1 "$ROUNDS"); do
  line="round $r (tps)"
  for s in anchor no_index no_checks plain functions; do
    tps=$(pgbench -n -M prepared -c 8 -j 2 -T "$T" -f "$WORK/$s.sql" "$URL" 2>&1 |
      sed -n 's/^tps = \([0-9]*\).*/\1/p')
    line="$line $s=${tps:-failed}"
  done
  echo "$line"
done
