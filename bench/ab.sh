#!/usr/bin/env bash
# Two builds of bench_server side by side, and the raw anchor with them: the quick before/after
# of one change (docs/benchmarks.md, "Two builds side by side"). bench/load.sh measures every
# case of one build; this measures one case of two builds in the same rounds.
#
#   bash bench/ab.sh OLD_BINARY NEW_BINARY
#
# Both are release bench_server binaries (build one, copy it away, change the code, build the
# other). Each gets its own scratch database on one PostgreSQL server (BENCH_SERVER_URL, default
# the local one, user postgres: a maintenance database's URL), migrated by its own binary's
# `migrate`; the raw anchor (mode `raw`) runs from OLD on the old database. Per round and per
# script the three are driven back to back with the same wrk command, so a round's ratio pairs
# runs seconds apart. Prints each round, then the median of the rounds' new/old and new/anchor
# ratios per script. Stops everything it started and drops its databases on exit.
#
# Settings (environment): MODE (postgres; any bench_server mode), EXTRA (more `serve` options,
# for both builds, e.g. "--pool-per-thread on"), POOL (16), WORKERS (2), SCRIPTS ("miss
# replay": bench/<name>.lua), ROUNDS (5), DURATION (8 s), CONNECTIONS (64), ORDER ("anchor old
# new": the order within a round; reverse it to check for an order effect), ANCHOR (raw: the
# anchor's bench_server mode; `bare` for the memory-store cases, with MODE=memory).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
  echo "usage: bash bench/ab.sh OLD_BINARY NEW_BINARY" >&2
  exit 2
fi
declare -A BIN=([old]=$1 [new]=$2 [anchor]=$1)
for b in "$1" "$2"; do
  [ -x "$b" ] || { echo "ab.sh: $b is not an executable bench_server" >&2; exit 2; }
done
command -v wrk >/dev/null || { echo "ab.sh: wrk is not installed (apt-get install wrk)" >&2; exit 2; }
SERVER_URL=${BENCH_SERVER_URL:-postgres://postgres@127.0.0.1:5432/postgres}
MODE=${MODE:-postgres}
EXTRA=${EXTRA:-}
POOL=${POOL:-16}
WORKERS=${WORKERS:-2}
SCRIPTS=${SCRIPTS:-miss replay}
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-8}
CONNECTIONS=${CONNECTIONS:-64}
ORDER=${ORDER:-anchor old new}
ANCHOR=${ANCHOR:-raw}
RUN=ab_$$
declare -A DB=([old]=idem_${RUN}_old [new]=idem_${RUN}_new)
DB[anchor]=${DB[old]}
declare -A PORT=([anchor]=18401 [old]=18402 [new]=18403)
declare -A SERVE_MODE=([anchor]=$ANCHOR [old]=$MODE [new]=$MODE)
PIDS=()
WORK=$(mktemp -d)

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for name in old new; do
    psql -qAt "$SERVER_URL" -c "DROP DATABASE IF EXISTS ${DB[$name]} WITH (FORCE)" >/dev/null 2>&1 || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

url_of() { echo "${SERVER_URL%/*}/$1"; }
for name in old new; do
  psql -qAt "$SERVER_URL" -c "CREATE DATABASE ${DB[$name]}" >/dev/null
  "${BIN[$name]}" migrate --database-url "$(url_of "${DB[$name]}")" >/dev/null
done
for name in anchor old new; do
  if (exec 3<>"/dev/tcp/127.0.0.1/${PORT[$name]}") 2>/dev/null; then
    echo "ab.sh: port ${PORT[$name]} is in use (a leftover bench_server?)" >&2
    exit 1
  fi
  extra=$EXTRA
  [ "$name" = anchor ] && extra=""
  # shellcheck disable=SC2086
  "${BIN[$name]}" serve --mode "${SERVE_MODE[$name]}" --addr "127.0.0.1:${PORT[$name]}" \
    --workers "$WORKERS" --pool "$POOL" --database-url "$(url_of "${DB[$name]}")" $extra \
    >"$WORK/$name.log" 2>&1 &
  PIDS+=("$!")
done
for name in anchor old new; do
  for _ in $(seq 1 100); do
    curl -s -o /dev/null -X POST -H 'content-type: application/json' -d '{}' \
      "http://127.0.0.1:${PORT[$name]}/payments" && break
    sleep 0.1
  done
  # Warm-up: connections opened, statements prepared, the replay keys stored.
  wrk -t2 -c"$CONNECTIONS" -d3s -s bench/replay.lua "http://127.0.0.1:${PORT[$name]}/payments" >/dev/null
done

rps() { # name script round
  wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" -s "bench/$2.lua" \
    "http://127.0.0.1:${PORT[$1]}/payments" "ab$$-$3-$1" 2>/dev/null |
    sed -n 's/^JSON .*"rps":\([0-9.]*\).*"errors":\([0-9]*\).*/\1 \2/p'
}
for r in $(seq 1 "$ROUNDS"); do
  for script in $SCRIPTS; do
    line="$script round $r:"
    for name in $ORDER; do
      read -r rate errors < <(rps "$name" "$script" "$r")
      [ "$errors" = 0 ] || echo "ab.sh: $name had $errors errors in $script round $r" >&2
      line="$line $name=$rate"
      echo "$script $r $name $rate" >>"$WORK/results"
    done
    echo "$line"
  done
done
python3 - "$WORK/results" $SCRIPTS <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
for script in sys.argv[2:]:
    by_round = {}
    for s, r, name, rate in rows:
        if s == script:
            by_round.setdefault(r, {})[name] = float(rate)
    new_old = [v["new"] / v["old"] for v in by_round.values()]
    new_anchor = [v["new"] / v["anchor"] for v in by_round.values()]
    old_anchor = [v["old"] / v["anchor"] for v in by_round.values()]
    print(f"{script}: new/old median {statistics.median(new_old):.3f} "
          f"({' / '.join(f'{x:.3f}' for x in new_old)}); "
          f"old/anchor {statistics.median(old_anchor):.3f}, new/anchor {statistics.median(new_anchor):.3f}")
PY
