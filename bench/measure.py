#!/usr/bin/env python3
"""Run one load-bench case and print one JSON line (used by bench/load.sh).

    measure.py --case NAME --run N [--pids "PID ..."] [--postmaster PID]
               [--psql "psql args"] [--pgbench-log PREFIX] -- COMMAND...

COMMAND is wrk (with bench/common.lua's `done`, which prints a `JSON {...}` line) or pgbench
(-l, logs under PREFIX). Around it this records:
- CPU used on the whole machine (/proc/stat) and by our processes: the bench servers (--pids),
  the PostgreSQL cluster (the postmaster, its children, and children it has reaped) and the
  load generator (this script's children). The rest is other people's work on the machine:
  `foreign_cpu_pct`, the noise figure of the case, in percent of all CPUs.
- with --psql: statements run on the benchmark database (pg_stat_statements, reset before
  the case; every top-level statement but this script's probes, so a function call counts
  as the one statement it is on the wire) and transactions committed (pg_stat_database.xact_commit), per request.
"""

import json
import os
import resource
import subprocess
import sys
import time


def proc_cpu(pid, with_children=False):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    # fields[0] is state (field 3); utime/stime are fields 14/15, cutime/cstime 16/17.
    total = int(fields[11]) + int(fields[12])
    if with_children:
        total += int(fields[13]) + int(fields[14])
    return total


def children_of(ppid):
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(ppid):
            out.append(int(entry))
    return out


def machine_cpu():
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts[:8]), sum(parts[:8]) - idle


def ours(pids, postmaster):
    total = sum(proc_cpu(p) for p in pids)
    if postmaster:
        total += proc_cpu(postmaster, with_children=True)
        total += sum(proc_cpu(c) for c in children_of(postmaster))
    return total


def children_rusage():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def psql(args, sql):
    out = subprocess.run(
        args + ["-XAtq", "-c", sql], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


def main():
    argv = sys.argv[1:]
    split = argv.index("--")
    opts, command = argv[:split], argv[split + 1 :]
    o = {}
    i = 0
    while i < len(opts):
        o[opts[i].lstrip("-")] = opts[i + 1]
        i += 2
    pids = [int(p) for p in o.get("pids", "").split()]
    postmaster = int(o["postmaster"]) if o.get("postmaster") else None
    psql_args = o["psql"].split() if o.get("psql") else None

    if psql_args:
        psql(psql_args, "SELECT pg_stat_statements_reset()")
        commits0 = int(psql(psql_args, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()") or 0)
    hz = os.sysconf("SC_CLK_TCK")
    t0, busy0 = machine_cpu()
    ours0 = ours(pids, postmaster)
    servers0 = sum(proc_cpu(p) for p in pids)
    kids0 = children_rusage()
    wall0 = time.time()
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.time() - wall0
    if not command[0].endswith("wrk"):
        # pgbench's server processes exit after it does; let the postmaster reap them so
        # their CPU time is counted (as its children's).
        time.sleep(0.5)
    t1, busy1 = machine_cpu()
    ours1 = ours(pids, postmaster)
    kids1 = children_rusage()

    result = {"case": o["case"], "run": int(o["run"])}
    if command[0].endswith("wrk"):
        line = next((l for l in run.stdout.splitlines() if l.startswith("JSON ")), None)
        if line is None:
            sys.stderr.write(run.stdout + run.stderr)
            raise SystemExit(f"{o['case']}: wrk printed no summary")
        result.update(json.loads(line[5:]))
    else:
        result.update(pgbench_result(run, o.get("pgbench-log")))

    total = max(t1 - t0, 1)
    busy = busy1 - busy0
    server_and_db = ours1 - ours0
    generator = (kids1 - kids0) * hz
    result["machine_busy_pct"] = round(100 * busy / total, 1)
    result["foreign_cpu_pct"] = round(max(0.0, 100 * (busy - server_and_db - generator) / total), 1)
    result["wall_s"] = round(wall, 2)
    # CPU per request of the servers (only the one under test is busy) and of the database.
    n = max(result["requests"], 1)
    servers = sum(proc_cpu(p) for p in pids) - servers0
    result["server_cpu_us_per_request"] = round(servers / hz / n * 1e6, 1)
    if postmaster:
        result["db_cpu_us_per_request"] = round((server_and_db - servers) / hz / n * 1e6, 1)

    if psql_args:
        time.sleep(1.1)  # PostgreSQL 15 flushes per-backend counters about once a second
        rows = psql(
            psql_args,
            "SELECT coalesce(sum(calls), 0), "
            "coalesce(sum(calls) FILTER (WHERE query ILIKE 'select%' OR query ILIKE 'with%'), 0) "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            # Every statement sent to the benchmark database (the store's function call names
            # no table), except this script's own probes, which all read pg_stat_* views.
            "WHERE d.datname = current_database() AND s.toplevel "
            "AND query NOT ILIKE '%pg_stat%'",
        )
        commits1 = int(psql(psql_args, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()") or 0)
        n = max(result["requests"], 1)
        try:
            calls, _reads = (int(x) for x in rows.split("|"))
            result["statements_per_request"] = round(calls / n, 3)
        except ValueError:  # pg_stat_statements is not loaded on this server
            result["statements_per_request"] = None
        # Where the database time goes: the statements of this case (nested ones too, with
        # pg_stat_statements.track = all), by total time, per request.
        top = psql(
            psql_args,
            "SELECT round((s.calls::numeric / " + str(n) + "), 2) || '|' "
            "|| round((s.mean_exec_time * 1000)::numeric, 1) || '|' || s.toplevel || '|' "
            "|| left(regexp_replace(s.query, '\\s+', ' ', 'g'), 90) "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            "WHERE d.datname = current_database() AND query NOT ILIKE '%pg_stat%' "
            "ORDER BY s.total_exec_time DESC LIMIT 8",
        )
        result["statements"] = [
            dict(zip(("calls_per_request", "mean_us", "toplevel", "query"), line.split("|", 3)))
            for line in (top or "").splitlines()
            if line.count("|") >= 3
        ]
        # The psql calls of this script commit too (about 4); negligible against n.
        result["commits_per_request"] = round((commits1 - commits0) / n, 3)
    print(json.dumps(result), flush=True)


def pgbench_result(run, prefix):
    tps = None
    for line in run.stdout.splitlines():
        if line.startswith("tps =") and "without initial" in line:
            tps = float(line.split()[2])
        if line.startswith("number of transactions actually processed"):
            requests = int(line.split(":")[1].split("/")[0].strip())
        if line.startswith("number of failed transactions"):
            failed = int(line.split(":")[1].split()[0])
    if tps is None:
        sys.stderr.write(run.stdout + run.stderr)
        raise SystemExit("pgbench printed no tps")
    latencies = []
    if prefix:
        directory, base = os.path.split(prefix)
        for name in os.listdir(directory or "."):
            if name.startswith(base):
                with open(os.path.join(directory, name)) as f:
                    latencies.extend(int(l.split()[2]) for l in f if l.strip())
    latencies.sort()

    def pct(p):
        if not latencies:
            return None
        return round(latencies[min(len(latencies) - 1, int(len(latencies) * p / 100))] / 1000, 3)

    return {
        "requests": requests,
        "rps": tps,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "errors": failed if "failed" in locals() else 0,
        "status_errors": 0,
    }


if __name__ == "__main__":
    main()
