#!/usr/bin/env bash
# Issue 15's second design, measured before anything is built on it (docs/benchmarks.md,
# "The whole record partitioned, reserves serialised by scope"): the store's replay and miss
# on the prototype of schema.sql, with N partitions, against the plain layout and the
# partitioned layout the store ships (claims unpartitioned, responses partitioned by expiry),
# in the same rounds. SQL only, with pgbench, CPU-bound (synchronous_commit off, as
# bench/plain_statements/decompose.sh: this machine's flush would hide the CPU the 2-core load
# bench runs out of).
#
#   bash bench/partitioned_records/compare.sh [URL of a server's maintenance database]
#
# Makes two scratch databases on that server (default: the local one, user postgres) and drops
# them on exit: idem_records_plain (migrations/ with psql, plain layout, and schema.sql's
# prototype beside it) and idem_records_shipped (migrations/ with idempotency.layout =
# partitioned: today's partition, three ahead and the default one). Both hold the replay keys
# 'r-1'..'r-1000', stored through the store's own functions. For each N of PARTS (default
# "3 6 12 24 48"), schema.sql rebuilds the prototype with N range partitions (N - 2 past days
# of FILLER expired records each, default 20000) and the plain table gets the same number of
# expired rows; then ROUNDS rounds (default 3) of T seconds (default 5) each, 8 clients,
# prepared, scripts alternating; one line per round with each script's tps. The prototype runs
# twice: `records_*` reads every partition, `recent_*` only those of the last two days
# (records_recent_*.sql: the look-back window a TTL bound would allow). rotation.sql's three
# tables used in turn run beside them (`rotation_*`: a replay of a record in the current table,
# one in the older table, a miss), holding as many expired rows between them as the others.
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
PARTS=${PARTS:-3 6 12 24 48}
FILLER=${FILLER:-20000}
ROUNDS=${ROUNDS:-3}
T=${T:-5}
. bench/partitioned_records/scratch.sh
PLAIN=idem_records_plain
SHIPPED=idem_records_shipped
cleanup() { drop_db $PLAIN; drop_db $SHIPPED; }
trap cleanup EXIT

for db in $PLAIN $SHIPPED; do
  layout=plain
  [ "$db" = "$SHIPPED" ] && layout=partitioned
  scratch_db "$db" "$layout"
  store_replay_keys "$db"
done
PLAIN_URL=$(url_of $PLAIN)
SHIPPED_URL=$(url_of $SHIPPED)
echo "shipped partitioned layout, leaves of idempotency_responses:" \
  "$(psql -qAt "$SHIPPED_URL" -c "SELECT count(*) FROM pg_inherits WHERE inhparent = 'idempotency_responses'::regclass")"

WORK=$(mktemp -d)
trap 'cleanup; rm -rf "$WORK"' EXIT
cp bench/plain_statements/function_replay.sql "$WORK/plain_replay.sql"
cp bench/plain_statements/function_miss.sql "$WORK/plain_miss.sql"
cp bench/plain_statements/function_replay.sql "$WORK/shipped_replay.sql"
cp bench/plain_statements/function_miss.sql "$WORK/shipped_miss.sql"
cp bench/partitioned_records/records_replay.sql "$WORK/records_replay.sql"
cp bench/partitioned_records/records_miss.sql "$WORK/records_miss.sql"
cp bench/partitioned_records/records_recent_replay.sql "$WORK/recent_replay.sql"
cp bench/partitioned_records/records_recent_miss.sql "$WORK/recent_miss.sql"
for s in rotation_replay rotation_replay_older rotation_miss; do
  cp "bench/partitioned_records/$s.sql" "$WORK/$s.sql"
done
# A token per miss, as the store makes one: the shipped layout's response key is (token,
# expiry), and two misses of one constant token in the same microsecond would collide there.
sed -i "s/'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid/md5((:k)::text)::uuid/g" "$WORK"/*_miss.sql

export PGOPTIONS='-c synchronous_commit=off'
for parts in $PARTS; do
  psql -qAt "$PLAIN_URL" -v ON_ERROR_STOP=1 -v parts="$parts" -v filler="$FILLER" \
    -f bench/partitioned_records/schema.sql 2>&1 | grep -v NOTICE || true
  psql -qAt "$PLAIN_URL" -v ON_ERROR_STOP=1 -v filler=$(((parts - 2) * FILLER / 2)) \
    -f bench/partitioned_records/rotation.sql 2>&1 | grep -v NOTICE || true
  psql -qAt "$PLAIN_URL" -v ON_ERROR_STOP=1 >/dev/null <<SQL
DELETE FROM idempotency_keys WHERE idempotency_key NOT LIKE 'r-%';
INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint, state,
                              response_status, response_headers, response_body, created_at,
                              completed_at, expires_at)
SELECT '', 'POST', '/payments', 'x-' || g, decode(repeat('42', 32), 'hex'), 'completed', 201,
       '\x00'::bytea, convert_to(repeat('x', 60), 'UTF8'), now() - interval '2 days',
       now() - interval '2 days', now() - interval '1 day'
  FROM generate_series(1, ($parts - 2) * $FILLER) g;
VACUUM ANALYZE idempotency_keys;
CHECKPOINT;
SQL
  echo "$parts partitions ($((parts + 1)) leaves with the default), $(((parts - 2) * FILLER)) expired records in each layout:"
  for r in $(seq 1 "$ROUNDS"); do
    line="  round $r (tps)"
    for s in plain_replay shipped_replay records_replay recent_replay rotation_replay \
      rotation_replay_older plain_miss shipped_miss records_miss recent_miss rotation_miss; do
      case $s in shipped_*) url=$SHIPPED_URL ;; *) url=$PLAIN_URL ;; esac
      out=$(pgbench -n -M prepared -c 8 -j 2 -T "$T" -f "$WORK/$s.sql" "$url" 2>&1) ||
        echo "$s: pgbench failed: $(grep -m1 -i error <<<"$out")" >&2
      tps=$(sed -n 's/^tps = \([0-9]*\).*/\1/p' <<<"$out")
      line="$line $s=${tps:-failed}"
    done
    echo "$line"
  done
done
