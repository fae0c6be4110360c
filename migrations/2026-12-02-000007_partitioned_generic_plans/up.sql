-- The partitioned layout's reserve function runs its statements on generic plans
-- (docs/benchmarks.md, "Partitioned layout"; docs/sql.md, "Partitioned layout"). A no-op on
-- the plain layout.
--
-- Why: PL/pgSQL caches a plan per statement, and PostgreSQL's plan cache (plan_cache_mode
-- `auto`) uses a generic plan only when it looks no dearer than the custom plans it tried
-- first. For the replay's read of idempotency_responses it never does: a generic plan over a
-- partitioned table is costed with every partition (it prunes at run time), a custom plan with
-- the one partition it pruned to at plan time. So every replay planned that statement again.
-- Measured with pgbench (8 clients, prepared, one replay per transaction, daily partitions, 5
-- leaves; the same 2-core machine, 5 alternating rounds, medians): plain layout 27,992 calls/s,
-- partitioned 16,489 (0.59x), partitioned with this setting 23,720 (0.85x). With 29 hourly
-- leaves: 13,831 -> 16,163 (a generic plan locks every leaf, past PostgreSQL's 16 fast-path
-- lock slots, so daily partitions stay the better choice). Misses: within noise.
--
-- A function's SET clause applies while it runs, to its own statements only. It would stop a
-- LANGUAGE sql function from being inlined, which is why idempotency_replay (inlined into the
-- store's prepared statement) is left as it is.
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    ALTER FUNCTION idempotency_reserve(text, text, text, text, bytea, uuid, bigint)
        SET plan_cache_mode = force_generic_plan;
END
$do$;
