#!/usr/bin/env bash
# Purge benchmark: seed ROWS expired records (plus LIVE live ones that must survive) with one
# INSERT ... SELECT generate_series, then time `idem-cli purge` and report rows/s and the
# longest single DELETE statement (longest_batch_ms from --format json).
#
# Not part of the test suite (it takes minutes and ~0.5 GB of disk). Run it by hand:
#
#   idempotency-cli/benches/purge-1m.sh                       # 1,000,000 rows, batches 1000 and 5000
#   ROWS=200000 BATCHES="500 2000" idempotency-cli/benches/purge-1m.sh
#
# Environment: SERVER_URL (default postgres://postgres@127.0.0.1:5432/postgres; the role needs
# CREATEDB), ROWS, LIVE, BATCHES, BODY_BYTES. Needs psql and a release build of idem-cli (built
# here if missing). The database it creates is dropped at the end.
set -euo pipefail

SERVER_URL=${SERVER_URL:-postgres://postgres@127.0.0.1:5432/postgres}
ROWS=${ROWS:-1000000}
LIVE=${LIVE:-100000}
BATCHES=${BATCHES:-"1000 5000"}
BODY_BYTES=${BODY_BYTES:-200}
DB=idem_bench_purge_$$
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN="$ROOT/target/release/idem-cli"

DB_URL="${SERVER_URL%/*}/$DB"
cleanup() { psql "$SERVER_URL" -qc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true; }
trap cleanup EXIT

(cd "$ROOT" && cargo build --release -q -p idempotency-cli)
psql "$SERVER_URL" -qc "CREATE DATABASE $DB"
"$BIN" --database-url "$DB_URL" migrate >/dev/null

# shellcheck source=../../bench/rows.sh
. "$ROOT/bench/rows.sh"

seed() {
    psql "$DB_URL" -qc "TRUNCATE idempotency_keys"
    # Expired completed records, expiry spread over a day so the expires_at index is exercised.
    rows_fill_completed "$DB_URL" 1 "$ROWS" "'tenant-' || (g % 100)" "'key-' || g" "sha256(g::text::bytea)" \
        "'\\x01000000010000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea" \
        "convert_to(repeat('x', $BODY_BYTES), 'UTF8')" "now() - interval '2 days'" \
        "now() - interval '1 hour' - (g % 86400000) * interval '1 millisecond'"
    # Live records that must survive.
    rows_fill_completed "$DB_URL" 1 "$LIVE" "'tenant-' || (g % 100)" "'live-' || g" "sha256(('live' || g)::bytea)" \
        "'\\x0100000000'::bytea" "convert_to(repeat('y', $BODY_BYTES), 'UTF8')" "now()" "now() + interval '1 day'"
    psql "$DB_URL" -qc "VACUUM ANALYZE idempotency_keys"
}

echo "server: $(psql "$SERVER_URL" -Atc 'SHOW server_version'), $(nproc) cores; rows: $ROWS expired + $LIVE live, body $BODY_BYTES B"
for batch in $BATCHES; do
    t0=$(date +%s.%N)
    seed
    t1=$(date +%s.%N)
    size=$(psql "$DB_URL" -Atc "SELECT pg_size_pretty(pg_total_relation_size('idempotency_keys'))")
    dry=$("$BIN" --database-url "$DB_URL" purge --dry-run --format json)
    result=$("$BIN" --database-url "$DB_URL" purge --batch-size "$batch" --format json)
    left=$(psql "$DB_URL" -Atc "SELECT count(*) FROM idempotency_keys")
    python3 - "$batch" "$result" "$dry" "$left" "$LIVE" "$size" "$t0" "$t1" <<'PY'
import json, sys
batch, result, dry, left, live, size, t0, t1 = sys.argv[1:]
r, d = json.loads(result), json.loads(dry)
secs = r["elapsed_ms"] / 1000
print(f"batch {batch:>6}: seeded in {float(t1) - float(t0):.1f}s ({size}); "
      f"dry run counted {d['would_purge']} in {d['elapsed_ms']} ms; "
      f"purged {r['purged']} in {secs:.1f}s = {r['purged'] / secs:,.0f} rows/s, "
      f"{r['batches']} batches, longest statement {r['longest_batch_ms']} ms; "
      f"rows left {left} (expected {live})")
assert int(left) == int(live), "live rows were deleted or expired rows left"
PY
done
