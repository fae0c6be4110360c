#!/usr/bin/env bash
# Resident memory per stored record of the memory store, as the release server grows it: for
# each bench_server binary given, a server (memory store, 10 M record bound, 2 workers) takes a
# warm-up of misses and then one run of misses (`bench/miss.lua`, a new key each, so one new
# completed record per request); prints the records stored in the run, its throughput, and the
# growth of the process's resident memory divided by those records. Binaries alternate, ROUNDS
# times, so before/after builds meet the same machine state. See docs/benchmarks.md,
# "A completed record in one allocation".
#
#   bash bench/record_memory.sh BINARY [BINARY ...]
#
# Knobs (environment): ROUNDS (2), DURATION (s per run, 10). The figure moves with where the
# store's tables are between two doublings (a table doubles at once): compare rounds, not one.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash bench/record_memory.sh BINARY [BINARY ...]" >&2; exit 2; }
command -v wrk >/dev/null || { echo "record_memory.sh: wrk is missing (bench/load.sh installs it)" >&2; exit 1; }
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-10}
SERVER=
trap '[ -z "$SERVER" ] || kill "$SERVER" 2>/dev/null || true' EXIT
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
for round in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$bin" serve --mode memory --max-entries 10000000 --addr "127.0.0.1:$port" --workers 2 >/dev/null 2>&1 &
    SERVER=$!
    for _ in $(seq 50); do
      (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
      sleep 0.1
    done
    url="http://127.0.0.1:$port/payments"
    wrk -t2 -c64 -d2s -s bench/miss.lua "$url" -- "warm-$round-$$" >/dev/null
    before=$(rss_kb "$SERVER")
    summary=$(wrk -t2 -c64 -d"${DURATION}s" -s bench/miss.lua "$url" -- "grow-$round-$$" | sed -n 's/^JSON //p')
    after=$(rss_kb "$SERVER")
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=
    python3 -c '
import json, sys
d = json.loads(sys.argv[1]); before, after = int(sys.argv[2]), int(sys.argv[3])
print("round %s %s: %d records, %.0f req/s, RSS %d -> %d KiB, %.0f B per record"
      % (sys.argv[4], sys.argv[5], d["requests"], d["rps"], before, after,
         (after - before) * 1024 / d["requests"]))' "$summary" "$before" "$after" "$round" "$bin"
  done
done
