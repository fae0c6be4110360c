#!/usr/bin/env bash
# The rotated generations (rotation.sql) under the store itself, through HTTP (docs/benchmarks.md,
# "Generations rotated by hand"): the release bench_server in mode postgres, unchanged, on two
# databases: one with the plain layout, one where rotation.sql's reserve and complete functions
# have taken the names the store calls (idempotency_reserve, idempotency_complete; same
# arguments, same result rows), so every reserve and complete goes to the three tables. Replays
# stay within the current generation (no switch during the run).
#
#   BENCH_SERVER_BIN=<release bench_server> bash bench/partitioned_records/http.sh [maintenance URL]
#
# Makes the scratch databases idem_http_plain and idem_http_rot (dropped on exit), serves each on
# a loopback port (2 workers, pool 16, synchronous_commit off as in compare.sh), stores the
# replay keys (bench/replay.lua's warm-up), then ROUNDS rounds (default 5) of DURATION seconds
# (default 8): replays, then misses, the two servers back to back in alternating order, wrk
# -t2 -c64 from the project root; one line per round with each server's req/s.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BENCH_SERVER_BIN:?set BENCH_SERVER_BIN to a release build of the bench_server example}
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-8}
. bench/partitioned_records/scratch.sh
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  drop_db idem_http_plain
  drop_db idem_http_rot
}
trap cleanup EXIT

for db in idem_http_plain idem_http_rot; do
  drop_db $db
  psql -qAt "$SERVER" -c "CREATE DATABASE $db" >/dev/null
  "$BIN" migrate --database-url "$(url_of $db)" >/dev/null
done
ROT=$(url_of idem_http_rot)
psql -qAt "$ROT" -v ON_ERROR_STOP=1 -v filler=0 -f bench/partitioned_records/rotation.sql 2>&1 |
  grep -v NOTICE || true
psql -qAt "$ROT" -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
-- The prototype's sample rows have another fingerprint than the load scripts' requests.
TRUNCATE idem_rot_0, idem_rot_1, idem_rot_2;
DROP FUNCTION idempotency_reserve(text, text, text, text, bytea, uuid, bigint);
ALTER FUNCTION idem_rot_reserve(text, text, text, text, bytea, uuid, bigint)
    RENAME TO idempotency_reserve;
DROP FUNCTION idempotency_complete(text, text, text, text, uuid, smallint, bytea, bytea, bigint);
ALTER FUNCTION idem_rot_complete(text, text, text, text, uuid, smallint, bytea, bytea, bigint)
    RENAME TO idempotency_complete;
SQL

declare -A PORT=([plain]=18201 [rot]=18202)
for name in plain rot; do
  "$BIN" serve --mode postgres --addr "127.0.0.1:${PORT[$name]}" --workers 2 --pool 16 \
    --sync-commit off --database-url "$(url_of idem_http_$name)" >/dev/null 2>&1 &
  pids+=($!)
done
for name in plain rot; do
  for _ in $(seq 1 50); do
    curl -s -o /dev/null "http://127.0.0.1:${PORT[$name]}/" && break
    sleep 0.2
  done
  wrk -t2 -c64 -d2s -s bench/replay.lua "http://127.0.0.1:${PORT[$name]}" >/dev/null
done
echo "records in the plain layout's table of the rotated database (must stay 0):" \
  "$(psql -qAt "$ROT" -c 'SELECT count(*) FROM idempotency_keys')"

for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="plain rot"; else order="rot plain"; fi
  line="round $r (req/s)"
  for script in replay miss; do
    for name in $order; do
      out=$(wrk -t2 -c64 -d"${DURATION}s" -s "bench/$script.lua" "http://127.0.0.1:${PORT[$name]}" 2>&1)
      rps=$(awk '/Requests\/sec/ {print int($2)}' <<<"$out")
      errors=$(grep -o '"status_errors":[0-9]*' <<<"$out" | cut -d: -f2)
      line="$line ${name}_$script=${rps:-failed}"
      [ "${errors:-0}" = 0 ] || line="$line(${errors} non-2xx)"
    done
  done
  echo "$line"
done
echo "records in the rotated tables: $(psql -qAt "$ROT" -c 'SELECT (SELECT count(*) FROM idem_rot_0) + (SELECT count(*) FROM idem_rot_1) + (SELECT count(*) FROM idem_rot_2)')," \
  "in its plain table: $(psql -qAt "$ROT" -c 'SELECT count(*) FROM idempotency_keys')"
