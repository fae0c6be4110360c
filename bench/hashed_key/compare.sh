#!/usr/bin/env bash
# Today's four-text-column record key against a 32-byte digest key that the app computes and
# sends as a parameter (docs/benchmarks.md, "Scale curves", "The hashed key with the digest
# from the app"). SQL only, with pgbench, on the two scratch tables bench/scale.sh
# compares (bench/scale_tables.sql); there the digest was computed in SQL (`sha256()` in every
# statement), which is what a store sending today's parameters would have to do.
#
#   bash bench/hashed_key/compare.sh [URL of a server's maintenance database]
#
# Creates the scratch database idem_hashed_key on that server (default: the local one, user
# postgres), fills both tables to each size of ROWS (default "10000 1000000 10000000") in turn,
# and at each size runs the two scripts of this directory and the scale curve's two for
# today's key ROUNDS times (default 3) for T seconds (default 6) each, alternating, 8 clients, prepared; prints one line per round with
# each script's tps; drops the database on exit. The digest stands in for the app's SHA-256
# of the scope: `int8send(n)` padded to 32 bytes, formed in SQL at a cost of nanoseconds, as a
# bound parameter would be; the replay re-checks the four parts (a digest match alone is not
# identity), as a store would.
set -euo pipefail
cd "$(dirname "$0")"
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
DB=idem_hashed_key
URL=$(python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$SERVER" "$DB")
ROWS=${ROWS:-10000 1000000 10000000}
ROUNDS=${ROUNDS:-3}
T=${T:-6}
cleanup() { psql -qAt "$SERVER" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true; }
trap cleanup EXIT

psql -qAt "$SERVER" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1
psql -qAt "$SERVER" -c "CREATE DATABASE $DB" >/dev/null
psql -qAt "$URL" -v ON_ERROR_STOP=1 -f ../scale_tables.sql >/dev/null

have=0
for rows in $ROWS; do
  psql -qAt "$URL" -v ON_ERROR_STOP=1 >/dev/null <<SQL
INSERT INTO scale_text SELECT 'tenant-' || (g % 1000), 'POST', '/v1/payments', md5(g::text)::uuid::text,
    decode(repeat('42', 32), 'hex'), 'completed', 201, decode(repeat('ab', 54), 'hex'),
    convert_to(repeat('x', 60), 'UTF8'), now(), now() + interval '1 day'
FROM generate_series($((have + 1)), $rows) g;
INSERT INTO scale_hash SELECT int8send(g::bigint) || '\x000000000000000000000000000000000000000000000000'::bytea,
    'tenant-' || (g % 1000), 'POST', '/v1/payments', md5(g::text)::uuid::text,
    decode(repeat('42', 32), 'hex'), 'completed', 201, decode(repeat('ab', 54), 'hex'),
    convert_to(repeat('x', 60), 'UTF8'), now(), now() + interval '1 day'
FROM generate_series($((have + 1)), $rows) g;
VACUUM ANALYZE scale_text;
VACUUM ANALYZE scale_hash;
CHECKPOINT;
SQL
  have=$rows
  echo "$rows rows; primary-key index MB text / digest (+ tenant index):" \
    "$(psql -qAt "$URL" -F ' ' -c "SELECT pg_relation_size('scale_text_pkey') / 1048576, pg_relation_size('scale_hash_pkey') / 1048576, pg_relation_size('scale_hash_tenant') / 1048576")"
  for r in $(seq 1 "$ROUNDS"); do
    line="  round $r:"
    # Today's key: the scale curve's own scripts (bench/pgbench_scale_text_*.sql).
    for s in text_replay digest_replay text_miss digest_miss; do
      case $s in text_*) script=../pgbench_scale_$s.sql ;; *) script=$s.sql ;; esac
      tps=$(pgbench -n -M prepared -c 8 -j 2 -T "$T" -D rows="$rows" -f "$script" "$URL" 2>&1 | grep -oP 'tps = \K[0-9.]+' || echo failed)
      line="$line $s=${tps%.*}"
    done
    echo "$line"
  done
done
