#!/usr/bin/env bash
# What the rotated generations' purge costs live traffic (docs/benchmarks.md, "Generations
# rotated by hand"): misses on rotation.sql's prototype (pgbench, 8 clients, prepared,
# synchronous_commit off, per-transaction latencies logged) for T seconds (default 20) without
# and then with a job that every INTERVAL seconds (default 2) purges and switches in one
# transaction, as `idem-cli purge` would on such a layout:
#     TRUNCATE <the table after the current one>; UPDATE idem_rot_state SET gen = <it>;
# So R is INTERVAL here, far shorter than in any deployment, and shorter than the misses' TTL:
# the keys are all new, so nothing is looked up again, and the switch and purge run as often
# as the run allows. The first purge empties ROWS expired rows (default 200000); every later
# one what the traffic wrote while that table was current. Prints tps, p50/p99/max latency of
# each phase, and the job's transactions: how many rows each emptied, the slowest.
#
#   bash bench/partitioned_records/rotate_under_load.sh [URL of a maintenance database]
#
# Makes the scratch database idem_rotate and drops it on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVER=${1:-postgres://postgres@127.0.0.1:5432/postgres}
T=${T:-20}
INTERVAL=${INTERVAL:-2}
ROWS=${ROWS:-200000}
DB=idem_rotate
. bench/partitioned_records/scratch.sh
URL=$(url_of $DB)
WORK=$(mktemp -d)
cleanup() {
  drop_db $DB
  rm -rf "$WORK"
}
trap cleanup EXIT
scratch_db $DB
psql -qAt "$URL" -v ON_ERROR_STOP=1 -v filler="$ROWS" -f bench/partitioned_records/rotation.sql 2>&1 |
  grep -v NOTICE || true
sed "s/'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid/md5((:k)::text)::uuid/g" \
  bench/partitioned_records/rotation_miss.sql >"$WORK/miss.sql"

# Latencies (µs) of a pgbench log: tps, p50, p99, max.
summary() {
  python3 - "$@" <<'PY'
import glob, sys
lat = sorted(int(line.split()[2]) for f in glob.glob(sys.argv[1] + '*') for line in open(f))
secs = float(sys.argv[2])
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] / 1000
print(f"{len(lat) / secs:,.0f} tps, latency p50 {q(0.5):.2f} ms, p99 {q(0.99):.2f} ms, max {lat[-1] / 1000:.2f} ms")
PY
}

export PGOPTIONS='-c synchronous_commit=off'
run() {
  (cd "$WORK" && pgbench -n -M prepared -c 8 -j 2 -T "$T" -l --log-prefix="$1" -f miss.sql "$URL" >/dev/null 2>&1)
}
run quiet
echo "misses, no rotation:      $(summary "$WORK/quiet" "$T")"

# The job: purge and switch in one transaction, timed (the count before it is not).
job() {
  local until=$((SECONDS + T))
  while [ $SECONDS -lt "$until" ]; do
    sleep "$INTERVAL"
    next=$(psql -qAt "$URL" -c "SELECT (gen + 1) % 3 FROM idem_rot_state")
    rows=$(psql -qAt "$URL" -c "SELECT count(*) FROM idem_rot_$next")
    ms=$(psql -qAt "$URL" <<SQL | tail -n1
SET lock_timeout = '1s';
BEGIN;
SELECT clock_timestamp() AS t0 \gset
TRUNCATE idem_rot_$next;
UPDATE idem_rot_state SET gen = $next;
COMMIT;
SELECT round(extract(epoch FROM clock_timestamp() - :'t0') * 1000, 2);
SQL
)
    echo "$ms $rows" >>"$WORK/job_ms"
  done
}
job &
run rotating
wait
echo "misses, rotating every ${INTERVAL} s: $(summary "$WORK/rotating" "$T")"
echo "purge-and-switch transactions: $(wc -l <"$WORK/job_ms"), rows emptied by each:" \
  "$(cut -d' ' -f2 "$WORK/job_ms" | paste -sd' ')," \
  "slowest $(sort -n "$WORK/job_ms" | tail -n1 | cut -d' ' -f1) ms"
