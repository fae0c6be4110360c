#!/usr/bin/env bash
# The race a switch of generations opens, forced (docs/benchmarks.md, "Generations rotated by
# hand"), on rotation.sql's prototype or a variant of it given as the first argument:
#   A, in generation 1, reserves key K and keeps its transaction open for 0.5 s;
#   the generation switches to 2;
#   C, in generation 2, reads both tables (A's row is not committed: nothing), then, held for
#   1 s by a pause added before its scope's lock, writes after A has committed.
# C must answer in flight and K must have one row. Without the reads again under the scope's
# lock (or a lock that keeps writers out of a switch) C reserves K a second time.
#
#   bash bench/partitioned_records/straddle.sh [rotation.sql variant] [URL of a maintenance db]
#
# Makes the scratch database idem_straddle and drops it; exits 1 if K has more than one row.
set -euo pipefail
cd "$(dirname "$0")/../.."
SQL=${1:-bench/partitioned_records/rotation.sql}
SERVER=${2:-postgres://postgres@127.0.0.1:5432/postgres}
DB=idem_straddle
. bench/partitioned_records/scratch.sh
URL=$(url_of $DB)
trap 'drop_db $DB' EXIT
scratch_db $DB
psql -qAt "$URL" -v ON_ERROR_STOP=1 -v filler=10 -f "$SQL" 2>&1 | grep -v NOTICE || true
# The pause, for session C and key K only, just before the scope's lock.
psql -qAt "$URL" -v ON_ERROR_STOP=1 >/dev/null -c "$(
  psql -qAt "$URL" -c "SELECT pg_get_functiondef('idem_rot_reserve'::regproc)" |
    sed "s/IF NOT pg_try_advisory_xact_lock(/PERFORM pg_sleep(CASE WHEN p_key = 'K' AND current_setting('application_name') = 'C' THEN 1 ELSE 0 END); IF NOT pg_try_advisory_xact_lock(/")"
reserve="SELECT outcome FROM idem_rot_reserve('', 'POST', '/p', 'K', decode(repeat('42', 32), 'hex'), gen_random_uuid(), 60000000)"
PGAPPNAME=A psql -qAt "$URL" -c "SET idempotency.rot_gen = '1'" -c "BEGIN" -c "$reserve" \
  -c "SELECT pg_sleep(0.5)" -c "COMMIT" >/dev/null &
sleep 0.1
psql -qAt "$URL" -c "UPDATE idem_rot_state SET gen = 2" >/dev/null
c=$(PGAPPNAME=C psql -qAt "$URL" -c "$reserve")
wait
rows=$(psql -qAt "$URL" -c "SELECT (SELECT count(*) FROM idem_rot_1 WHERE idempotency_key = 'K') + (SELECT count(*) FROM idem_rot_2 WHERE idempotency_key = 'K')")
echo "C: $c; rows for K: $rows"
[ "$rows" = 1 ]
