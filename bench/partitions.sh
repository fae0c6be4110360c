# The partitioned or the rotated layout against the plain one (issue 15). Sourced by
# bench/load.sh (BENCH_PARTITIONS=1 or only) after its setup, so it uses that script's cluster,
# server binary, knobs and cleanup; not for CI (10 M rows per layout: a few GB of disk, 10-20
# minutes).
#
#   PART_ROWS    expired rows purged per layout (default 10000000)
#   PART_RUNS    paired rounds of the miss/replay throughput comparison (default 3)
#   PART_LAYOUT  partitioned (default: daily partitions) or rotated (the default period); or
#                plain, a second plain database: the A/A control, whose ratios are this
#                machine's noise, against which "within noise" is judged
#
# Two databases on the same cluster: idem_bench (plain, load.sh's) and idem_bench_part
# (`idem-cli migrate --partitioned --interval daily`, or `--rotated`), one bench server on
# each. (In the output and the JSON the second layout is called "partitioned" whichever it is;
# `layout_under_test` says which.)
# 1. Throughput: miss and replay through the store on the plain layout and on the partitioned
#    one, back to back per round (wrk, BENCH_DURATION s each).
# 2. Purge: PART_ROWS expired completed records in each layout (in the partitioned one the
#    responses sit in past daily partitions, as if created ahead of time by earlier purges),
#    then `idem-cli purge` with its defaults while keyed miss traffic (one wrk thread, 16
#    connections) runs against the same database; the same traffic without a purge first as
#    the baseline. Recorded: the purge's seconds, WAL bytes written during it (and net of the
#    baseline traffic's own WAL rate), and the traffic's throughput and p99 during it.
# Results: PART_JSON (load.sh writes it into the raw results) and one table on stderr.

PART_ROWS=${PART_ROWS:-10000000}
PART_RUNS=${PART_RUNS:-3}
PART_LAYOUT=${PART_LAYOUT:-partitioned}
case $PART_LAYOUT in
  partitioned) PART_MIGRATE=(--partitioned --interval daily) ;;
  rotated) PART_MIGRATE=(--rotated) ;;
  plain) PART_MIGRATE=() ;;
  *) echo "PART_LAYOUT must be partitioned, rotated or plain, not $PART_LAYOUT" >&2; exit 2 ;;
esac
PART_OUT="$WORK/partitions.jsonl"
: >"$PART_OUT"
PART_URL=$(python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/idem_bench_part")))' "$ADMIN_URL")

log "partitions: building idem-cli (release)"
cargo build --release -q -p idempotency-cli
CLI="$WORK/idem-cli"
cp "$TARGET_DIR/release/idem-cli" "$CLI"

psql "$ADMIN_URL" -XAtq -c 'DROP DATABASE IF EXISTS idem_bench_part WITH (FORCE)' -c 'CREATE DATABASE idem_bench_part'
PART_DB_CREATED=1
"$CLI" --database-url "$PART_URL" migrate "${PART_MIGRATE[@]}" >&2
psql "$PART_URL" -XAtq -c 'CREATE EXTENSION IF NOT EXISTS pg_stat_statements' >/dev/null 2>&1 || true

part_server() { # name port url ; sets PART_PID
  "$SERVER" serve --mode postgres --addr "127.0.0.1:$2" --workers "$WORKERS" --database-url "$3" \
    --pool "$POOL" >"$WORK/$1.log" 2>&1 &
  PART_PID=$!
  PIDS+=("$PART_PID")
  wait_up "$1" "$2" "$PART_PID"
}
part_server part-plain 18101 "$DB_URL"
PLAIN_PID=$PART_PID
part_server part-partitioned 18102 "$PART_URL"
PARTED_PID=$PART_PID
declare -A PART_PORT=([plain]=18101 [partitioned]=18102)
declare -A PART_URLS=([plain]="$DB_URL" [partitioned]="$PART_URL")

part_tag() { # layout extra-json : add the layout (and more) to measure.py's JSON line
  python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); r["layout"]=sys.argv[1]; r.update(json.loads(sys.argv[2])); print(json.dumps(r))' "$1" "$2"
}

# --- 1. throughput ---------------------------------------------------------------------------
for layout in plain partitioned; do
  wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s bench/replay.lua "http://127.0.0.1:${PART_PORT[$layout]}" >/dev/null
done
for run in $(seq 1 "$PART_RUNS"); do
  log "partitions: throughput round $run of $PART_RUNS"
  for script in miss replay; do
    for layout in plain partitioned; do
      python3 bench/measure.py --case "part-$layout-$script" --run "$run" --pids "$PLAIN_PID $PARTED_PID" \
        --psql "psql ${PART_URLS[$layout]}" --postmaster "${POSTMASTER:-}" -- \
        wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency -s "bench/$script.lua" \
        "http://127.0.0.1:${PART_PORT[$layout]}" -- "part-$STAMP-$run-$layout" |
        part_tag "$layout" "{\"section\":\"throughput\",\"script\":\"$script\"}" | tee -a "$PART_OUT" >&2
    done
  done
done

# --- 2. purge: DELETE (plain) against partition DROP (partitioned) ---------------------------
wal_lsn() { psql "$ADMIN_URL" -XAtq -c 'SELECT pg_current_wal_lsn()'; }
wal_bytes() { psql "$ADMIN_URL" -XAtq -c "SELECT pg_wal_lsn_diff('$2', '$1')::bigint"; }
for layout in plain partitioned; do
  url=${PART_URLS[$layout]}
  fill=rows_fill_completed
  if [ "$layout" = partitioned ] && [ "$PART_LAYOUT" != plain ]; then
    fill=rows_fill_completed_$PART_LAYOUT
  fi
  log "partitions: inserting $PART_ROWS expired rows ($layout)"
  fill_started=$(date +%s)
  "$fill" "$url" 1 "$PART_ROWS" "'part-bench'" "'old-' || g" "$ROWS_FINGERPRINT" "$ROWS_HEADERS" "$ROWS_BODY" \
    "now() - interval '3 days' + g * interval '1 millisecond'" "now() - interval '2 days' + g * interval '1 millisecond'"
  log "partitions: inserted in $(( $(date +%s) - fill_started )) s; VACUUM ANALYZE, CHECKPOINT"
  if [ "$layout" = partitioned ] && [ "$PART_LAYOUT" = rotated ]; then
    # Due now: the rotation, which empties the table the rows are in, is the purge measured.
    psql "$url" -XAtq -c "UPDATE idempotency_generation SET switched_at = now() - period" >/dev/null
  fi
  psql "$url" -XAtq -c 'VACUUM ANALYZE' >/dev/null
  psql "$ADMIN_URL" -XAtq -c 'CHECKPOINT' >/dev/null
  SIZE=$(psql "$url" -XAtq -c "SELECT pg_database_size(current_database())")
  TRAFFIC=(wrk -t1 -c16 --latency -s bench/miss.lua "http://127.0.0.1:${PART_PORT[$layout]}")
  lsn0=$(wal_lsn)
  BASE=$("${TRAFFIC[@]}" -d"${DURATION}s" -- "part-base-$STAMP-$layout" | grep '^JSON ' | cut -c6-)
  BASE_WAL=$(wal_bytes "$lsn0" "$(wal_lsn)")
  "${TRAFFIC[@]}" -d1800s -- "part-during-$STAMP-$layout" >"$WORK/part-traffic-$layout.out" &
  WRK_PID=$!
  PIDS+=("$WRK_PID")
  sleep 1
  lsn1=$(wal_lsn)
  t0=$(date +%s.%N)
  PURGE_OUT=$("$CLI" --database-url "$url" --format json purge)
  t1=$(date +%s.%N)
  lsn2=$(wal_lsn)
  kill -INT "$WRK_PID" 2>/dev/null || true
  wait "$WRK_PID" 2>/dev/null || true
  DURING=$(grep '^JSON ' "$WORK/part-traffic-$layout.out" | cut -c6-)
  WAL=$(wal_bytes "$lsn1" "$lsn2")
  if [ "$layout" = partitioned ] && [ "$PART_LAYOUT" = rotated ]; then
    LEFT=$(psql "$url" -XAtq -c "SELECT (SELECT count(*) FROM idempotency_keys_0 WHERE tenant = 'part-bench') + (SELECT count(*) FROM idempotency_keys_1 WHERE tenant = 'part-bench') + (SELECT count(*) FROM idempotency_keys_2 WHERE tenant = 'part-bench')")
  else
    LEFT=$(psql "$url" -XAtq -c "SELECT count(*) FROM idempotency_keys WHERE tenant = 'part-bench'")
  fi
  python3 -c '
import json, sys
rows, layout, size, base, base_wal, during, wal, t0, t1, purge, left, dur = sys.argv[1:]
secs = float(t1) - float(t0)
base = json.loads(base or "{}")
base_rate = int(base_wal) / max(base.get("duration_s", 1), 1e-9)
print(json.dumps({"section": "purge", "layout": layout, "rows": int(rows), "db_bytes_before": int(size),
  "purge_s": round(secs, 2), "wal_bytes": int(wal), "wal_bytes_net": int(int(wal) - base_rate * secs),
  "baseline_wal_bytes_per_s": int(base_rate), "rows_left": int(left),
  "traffic_baseline": base, "traffic_during_purge": json.loads(during or "{}"),
  "purge": json.loads(purge)}))' \
    "$PART_ROWS" "$layout" "$SIZE" "$BASE" "$BASE_WAL" "$DURING" "$WAL" "$t0" "$t1" "$PURGE_OUT" "$LEFT" "$DURATION" |
    tee -a "$PART_OUT" >&2
done

PART_JSON=$(python3 - "$PART_OUT" "$PART_LAYOUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = {"layout_under_test": sys.argv[2], "throughput": {},
       "purge": [r for r in rows if r.get("section") == "purge"]}
by_run = {}
for r in rows:
    if r.get("section") != "throughput":
        continue
    by_run.setdefault((r["script"], r["run"]), {})[r["layout"]] = r
for script in ("miss", "replay"):
    pairs = [v for (s, _), v in sorted(by_run.items()) if s == script and len(v) == 2]
    ratios = [p["partitioned"]["rps"] / p["plain"]["rps"] for p in pairs if p["plain"]["rps"]]
    out["throughput"][script] = {
        "plain_rps": [p["plain"]["rps"] for p in pairs],
        "partitioned_rps": [p["partitioned"]["rps"] for p in pairs],
        "plain_p99_ms": [p["plain"]["p99_ms"] for p in pairs],
        "partitioned_p99_ms": [p["partitioned"]["p99_ms"] for p in pairs],
        "ratio_per_round": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
    }
print(json.dumps(out))
PY
)
python3 - "$PART_JSON" >&2 <<'PY'
import json, sys
d = json.loads(sys.argv[1])
print(f"\n{d['layout_under_test']} layout / plain layout (paired rounds, median of per-round ratios)")
for script, t in d["throughput"].items():
    print(f"  {script:7} ratio {t['ratio_median']}  per round {t['ratio_per_round']}  "
          f"p99 ms plain {t['plain_p99_ms']} partitioned {t['partitioned_p99_ms']}")
print("\npurge of expired rows under keyed miss traffic")
print("  layout       rows        seconds  WAL MB (net)   traffic rps base/during  p99 ms base/during")
for p in d["purge"]:
    b, w = p["traffic_baseline"], p["traffic_during_purge"]
    print(f"  {p['layout']:12} {p['rows']:<11} {p['purge_s']:<8} {p['wal_bytes']/1e6:7.1f} ({p['wal_bytes_net']/1e6:.1f})"
          f"   {b.get('rps')}/{w.get('rps')}   {b.get('p99_ms')}/{w.get('p99_ms')}")
PY
psql "$ADMIN_URL" -XAtq -c 'DROP DATABASE IF EXISTS idem_bench_part WITH (FORCE)' >/dev/null 2>&1 || true
PART_DB_CREATED=""
