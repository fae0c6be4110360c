#!/usr/bin/env python3
"""Redis's CPU per miss cycle, with the store's complete script against a native fenced SET.

    redis_complete_cost.py PORT [N] [ROUNDS]

What it answers: how much of the Redis miss target (issue 12, >= 0.95x the anchor) a
complete without a script would win, on a server that has `SET ... IFEQ` (Valkey 8.1, Redis
8.4; the Redis 7.0 this project tests against has not, and refuses the native mode).

Each cycle is a miss as the store sends it: the reserve (`SET key <reservation> NX GET PX`
and `TIME`, pipelined), then the completion, one of:
- `lua`:    `EVALSHA` of idempotency-actix/src/store/redis/complete.lua (what the store runs);
- `native`: `SET key <completed record> IFEQ <reservation> GET PX ttl`, the same fence
            without a script (the completed record's times would come from the reserve's
            `TIME`; here they are fixed);
- `plain`:  an unfenced `SET key <completed record> PX ttl`, the anchor's kind of write.
Cycles go in pipelined batches so that the client is not what is measured; Redis's CPU is
`INFO cpu` (user + sys) before and after. Modes alternate, ROUNDS times; the database is
flushed before each. Needs redis-py (`pip install redis`) and a server of its own on PORT:
it runs FLUSHALL.
"""
import os
import sys
import uuid

import redis

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "idempotency-actix", "src", "store", "redis", "complete.lua")
BATCH = 200
LEASE_US, GRACE_US, TTL_US = 30_000_000, 86_400_000_000, 86_400_000_000
# Status, headers length (10 digits), then headers and body: a small JSON payment (record.rs).
HEADERS = b"\x00" * 40
TAIL = b"201" + b"%010d" % len(HEADERS) + HEADERS + b'{"id":"pay_123","amount":100}' * 4


def server_cpu(r):
    info = r.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def run(r, sha, mode, n):
    r.flushall()
    before = server_cpu(r)
    for start in range(0, n, BATCH):
        cycles = []
        pipe = r.pipeline(transaction=False)
        for i in range(start, start + BATCH):
            token = str(uuid.uuid4()).encode()
            # State, fingerprint, token, reserved at, lease, grace (record.rs, "Layout").
            reservation = (b"F" + b"\x01" * 32 + token + b"%016d" % 1
                           + b"%016d" % LEASE_US + b"%016d" % GRACE_US)
            key = f"idem:t:POST:%2Fp:{mode}-{i}"
            cycles.append((key, token, reservation))
            pipe.set(key, reservation, nx=True, get=True, px=(LEASE_US + GRACE_US) // 1000)
            pipe.time()
        pipe.execute()
        pipe = r.pipeline(transaction=False)
        for key, token, reservation in cycles:
            completed = b"C" + reservation[1:85] + b"%016d" % 2 + b"%016d" % 3 + TAIL
            if mode == "lua":
                pipe.evalsha(sha, 1, key, token, TTL_US, TAIL)
            elif mode == "native":
                pipe.execute_command("SET", key, completed, "IFEQ", reservation, "GET",
                                     "PX", TTL_US // 1000)
            else:
                pipe.set(key, completed, px=TTL_US // 1000)
        replies = pipe.execute()
        if mode == "lua" and not all(reply == 1 for reply in replies):
            sys.exit(f"complete.lua refused a completion: {replies[:3]}")
        # Every mode must have written the completed record (the native SET's reply is the old
        # value, which redis-py's SET callback does not pass through).
        if r.get(cycles[-1][0])[:1] != b"C":
            sys.exit(f"{mode}: the record was not completed")
    return (server_cpu(r) - before) / n * 1e6


def main():
    port = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    r = redis.Redis(port=port)
    try:
        r.execute_command("SET", "idem:probe", "x", "IFEQ", "x")
    except redis.ResponseError as e:
        sys.exit(f"this server has no SET ... IFEQ ({e}): Valkey >= 8.1 or Redis >= 8.4")
    with open(SCRIPT) as f:
        sha = r.script_load(f.read())
    results = {"plain": [], "lua": [], "native": []}
    for _ in range(rounds):
        for mode in results:
            results[mode].append(run(r, sha, mode, n))
    for mode, values in results.items():
        shown = " / ".join(f"{v:.2f}" for v in values)
        print(f"{mode:6} server CPU per miss cycle, us: {shown} (median {sorted(values)[len(values) // 2]:.2f})")


if __name__ == "__main__":
    main()
