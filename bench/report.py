#!/usr/bin/env python3
"""Turn bench/load.sh's JSON lines into one table (stdout) and one JSON document.

    report.py RESULTS.jsonl OUT.json --meta JSON --hwm JSON --footprint JSON
"""

import json
import statistics
import sys

# (label, numerator case, denominator case, target). Each case runs right after its anchor in
# every round (bench/load.sh), and the value is the median of the per-round ratios.
RATIOS = [
    ("(2) memory miss (sized, 10 M) / bare", "memory-miss", "bare-miss", 0.85),
    ("(2) memory miss (at bound, evicting) / bare", "memory-evicting-miss", "bare-miss", 0.85),
    ("(2) memory replay / bare", "memory-replay", "bare-replay", 0.95),
    ("memory miss, prometheus recorder / none", "memory-metrics-miss", "memory-miss", 0.97),
    ("(3) postgres miss / raw-SQL anchor", "postgres-miss", "raw-miss", 0.95),
    ("(3) postgres replay / raw-SQL anchor", "postgres-replay", "raw-replay", 0.95),
    ("(3) postgres miss, replay fast path / raw", "postgres-fast-miss", "raw-miss", 0.95),
    ("(3) postgres replay, replay fast path / raw", "postgres-fast-replay", "raw-replay", 0.95),
    ("(3) postgres miss, pool per thread / raw", "postgres-local-miss", "raw-miss", 0.95),
    ("(3) postgres replay, pool per thread / raw", "postgres-local-replay", "raw-replay", 0.95),
    ("(3) postgres replay, pool per thread + fast path / raw", "postgres-fast-local-replay", "raw-replay", 0.95),
    ("postgres miss, pool per thread / shared pool", "postgres-local-miss", "postgres-miss", None),
    ("postgres replay, pool per thread / shared pool", "postgres-local-replay", "postgres-replay", None),
    ("postgres miss, pool per thread / raw, pool per worker", "postgres-local-miss", "raw-local-miss", None),
    ("postgres replay, pool per thread / raw, pool per worker", "postgres-local-replay", "raw-local-replay", None),
    ("raw replay, pool per worker / shared pool", "raw-local-replay", "raw-replay", None),
    ("postgres miss, fast path / function only", "postgres-fast-miss", "postgres-miss", None),
    ("postgres replay, fast path / function only", "postgres-fast-replay", "postgres-replay", None),
    ("(3) postgres miss / pgbench", "postgres-miss", "pgbench-miss", None),
    ("(3) postgres replay / pgbench", "postgres-replay", "pgbench-replay", None),
    ("(4) raw miss / pgbench", "raw-miss", "pgbench-miss", None),
    ("(4) raw replay / pgbench", "raw-replay", "pgbench-replay", None),
    ("(5) pgbench: store's reserve / plain SELECT", "pgbench-store-replay", "pgbench-replay", None),
    ("cached postgres replay / bare", "postgres-cached-replay", "bare-replay", 0.95),
    ("postgres miss, sync commit off / on", "postgres-async-miss", "postgres-miss", None),
    ("(6) transactional payments miss / one-transaction anchor", "payments-tx-miss", "payments-raw-miss", 0.95),
    ("(6) transactional / default mode, payments miss", "payments-tx-miss", "payments-today-miss", None),
    ("(6) transactional, pool per thread / one-transaction anchor", "payments-tx-local-miss", "payments-raw-miss", 0.95),
    ("(6) transactional, pool per thread / shared pool", "payments-tx-local-miss", "payments-tx-miss", None),
    ("(6) SQL only: transactional statements / anchor", "pgbench-tx-miss", "pgbench-tx-anchor-miss", None),
]

ORDER = [
    "bare-miss", "memory-miss", "memory-metrics-miss", "memory-evicting-miss", "bare-replay",
    "memory-replay", "postgres-cached-replay", "raw-miss", "postgres-miss", "postgres-fast-miss",
    "postgres-async-miss", "raw-local-miss", "postgres-local-miss", "postgres-fast-local-miss",
    "raw-replay", "postgres-replay", "postgres-fast-replay", "raw-local-replay",
    "postgres-local-replay", "postgres-fast-local-replay",
    "pgbench-replay", "pgbench-store-replay", "pgbench-miss", "pgbench-tx-anchor-miss", "pgbench-tx-miss",
    "payments-raw-miss", "payments-today-miss", "payments-tx-miss", "payments-tx-local-miss",
    "payments-tx-replay",
]


def main():
    results_path, out_path = sys.argv[1], sys.argv[2]
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    rows = [json.loads(l) for l in open(results_path) if l.strip()]
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)

    summary = {}
    for case, runs in by_case.items():
        def mean(key):
            values = [r[key] for r in runs if r.get(key) is not None]
            return statistics.fmean(values) if values else None
        summary[case] = {
            "runs": len(runs),
            "rps": mean("rps"),
            "rps_each": [round(r["rps"]) for r in runs],
            "p50_ms": mean("p50_ms"),
            "p99_ms": mean("p99_ms"),
            "errors": sum(r.get("errors", 0) for r in runs),
            "foreign_cpu_pct": mean("foreign_cpu_pct"),
            "server_cpu_us_per_request": mean("server_cpu_us_per_request"),
            "db_cpu_us_per_request": mean("db_cpu_us_per_request"),
            "statements_per_request": mean("statements_per_request"),
            "commits_per_request": mean("commits_per_request"),
        }

    ratios = []
    for label, num, den, target in RATIOS:
        if num not in by_case or den not in by_case:
            continue
        per_round = []
        for a in by_case[num]:
            for b in by_case[den]:
                if a["run"] == b["run"]:
                    per_round.append(a["rps"] / b["rps"])
        if not per_round:
            continue
        value = statistics.median(per_round)
        cpu = (summary[num]["server_cpu_us_per_request"], summary[den]["server_cpu_us_per_request"])
        ratios.append({
            "ratio": label, "value": value, "per_round": [round(x, 3) for x in per_round],
            "noise": round(max(per_round) - min(per_round), 3),
            "app_cpu_us": cpu,
            "target": target,
            "met": None if target is None else value >= target,
        })

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print()
    print(f"{'case':<24} {'req/s':>9} {'runs (req/s)':>17} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'stmts/req':>9} {'commits/req':>11} {'app µs/req':>10} {'db µs/req':>9} {'foreign cpu':>11} {'errors':>6}")
    for case in ORDER + sorted(set(summary) - set(ORDER)):
        if case not in summary:
            continue
        s = summary[case]
        print(f"{case:<24} {fmt(s['rps'], '9.0f')} {'/'.join(map(str, s['rps_each'])):>17} "
              f"{fmt(s['p50_ms'], '7.2f')} {fmt(s['p99_ms'], '7.2f')} "
              f"{fmt(s['statements_per_request'], '9.2f')} {fmt(s['commits_per_request'], '11.2f')} "
              f"{fmt(s['server_cpu_us_per_request'], '10.1f')} {fmt(s['db_cpu_us_per_request'], '9.1f')} "
              f"{fmt(s['foreign_cpu_pct'], '10.1f')}% {s['errors']:>6}")
    print()
    print(f"{'ratio (req/s, median of rounds)':<46} {'value':>6} {'per round':>34} {'app µs/req':>13} {'target':>7}")
    for r in ratios:
        target = "-" if r["target"] is None else f">={r['target']:.2f}"
        met = "" if r["met"] is None else ("  met" if r["met"] else "  MISSED")
        cpu = "/".join(fmt(c, ".1f") for c in r["app_cpu_us"])
        print(f"{r['ratio']:<46} {r['value']:6.3f} {'/'.join(map(str, r['per_round'])):>34} {cpu:>13} {target:>7}{met}")
    print()
    meta = json.loads(opts.get("--meta", "{}"))
    hwm = json.loads(opts.get("--hwm", "{}"))
    footprint = json.loads(opts.get("--footprint", "{}"))
    print("peak RSS (VmHWM) of each server: " + ", ".join(f"{k} {v / 1024:.1f} MiB" for k, v in hwm.items()))
    if footprint:
        print(f"memory store: {footprint['bytes_per_record']} bytes per stored record "
              f"({footprint['records']} records with a {footprint['response_bytes']}-byte response)")
    purge = json.loads(opts.get("--purge", "{}"))
    if purge.get("purge"):
        p = purge["purge"]
        base, during = purge.get("traffic_baseline", {}), purge.get("traffic_during_purge", {})
        print(f"purge: {json.dumps(p)}")
        print(f"keyed traffic (wrk -t1 -c16, miss path): baseline {base.get('rps', 0):.0f} req/s, "
              f"p99 {base.get('p99_ms', 0):.2f} ms; during the purge {during.get('rps', 0):.0f} req/s, "
              f"p99 {during.get('p99_ms', 0):.2f} ms, max {during.get('max_ms', 0):.2f} ms")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in meta.items()))

    md = [
        "| case | req/s (mean) | req/s per round | p50 ms | p99 ms | statements/req | commits/req | app CPU µs/req | db CPU µs/req | foreign CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in ORDER + sorted(set(summary) - set(ORDER)):
        if case not in summary:
            continue
        s = summary[case]
        md.append(f"| {case} | {fmt(s['rps'], '.0f')} | {' / '.join(map(str, s['rps_each']))} | "
                  f"{fmt(s['p50_ms'], '.2f')} | {fmt(s['p99_ms'], '.2f')} | "
                  f"{fmt(s['statements_per_request'], '.2f')} | {fmt(s['commits_per_request'], '.2f')} | "
                  f"{fmt(s['server_cpu_us_per_request'], '.1f')} | {fmt(s['db_cpu_us_per_request'], '.1f')} | "
                  f"{fmt(s['foreign_cpu_pct'], '.1f')} % |")
    md += ["", "| ratio (req/s, median of the per-round ratios) | value | per round | spread | app CPU µs/req (case / anchor) | target | |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in ratios:
        target = "" if r["target"] is None else f">= {r['target']:.2f}"
        met = "" if r["met"] is None else ("met" if r["met"] else "**missed**")
        cpu = " / ".join(fmt(c, ".1f") for c in r["app_cpu_us"])
        md.append(f"| {r['ratio']} | {r['value']:.3f} | {' / '.join(map(str, r['per_round']))} | {r['noise']:.3f} | {cpu} | {target} | {met} |")
    scale = json.loads(opts.get("--scale", "{}"))
    for title, rows_ in scale.items():
        if not rows_:
            continue
        cols = list(rows_[0].keys())
        md += ["", f"**{title}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        print(f"\n{title}")
        print("  " + " | ".join(cols))
        for row in rows_:
            cells = [str(row.get(c, "")) for c in cols]
            md.append("| " + " | ".join(cells) + " |")
            print("  " + " | ".join(cells))
    with open(out_path.replace(".json", ".md"), "w") as f:
        f.write("\n".join(md) + "\n")

    with open(out_path, "w") as f:
        json.dump({"meta": meta, "cases": summary, "ratios": ratios, "peak_rss_kib": hwm, "scale": json.loads(opts.get("--scale", "{}")),
                   "memory_store_footprint": footprint, "purge": purge, "runs": rows}, f, indent=2)
    print(f"written: {out_path}")


if __name__ == "__main__":
    main()
