-- The store's PL/pgSQL functions plan their statements with enable_seqscan = off (and jit =
-- off), so a lookup by primary key is an index scan whatever the table's statistics say
-- (docs/sql.md, "Statistics of a table that starts empty"). All layouts.
--
-- Why: PL/pgSQL caches each statement's plan for the session, after its first five calls a
-- generic plan, kept until something invalidates it (an ANALYZE or VACUUM of a table it reads).
-- The planner makes it from the table's statistics as they are then. For a table whose
-- statistics say it holds a page or two, a sequential scan is the cheaper plan for a lookup of
-- one row (cost 3.2 against 8.2 at 60 rows), and the sessions keep it while the table grows,
-- until the next analyze: measured, a reserve took 40-60 ms on a 300,000-row table instead of
-- 0.5 ms. A table that starts empty is where that happens, by autovacuum's first analyze (50
-- changed rows) or by hand: a new deployment's table, the rotated layout's current table after
-- each rotation (its TRUNCATE keeps the count of changed rows, so autovacuum analyzes it at
-- once, nearly empty), each new response partition. Autovacuum's thresholds cannot prevent it
-- (they count changes, not rows: a few reservations renewed many times reach any threshold),
-- so the plans do not depend on them: with sequential scans off, the planner takes an index
-- whenever one serves the statement, as for every statement of these functions.
--
-- And jit = off with it. A statement with nothing but a sequential scan to read (the rotated
-- layout's one-row idempotency_generation) is still planned, priced at 10^10, past
-- jit_above_cost: each call then compiled it, 20-50 ms a statement, and rotated misses fell
-- from about 10,000 to 20 a second (bench/rotated_layout/compare.sh, found before it shipped).
-- No statement of these functions reads enough rows for compiling to pay. PostgreSQL applies
-- and undoes both settings on each call; measured cost: docs/benchmarks.md, "A setting on
-- the request functions".
--
-- The functions are those the store calls on the request path, where they are PL/pgSQL (in
-- the plain and partitioned layouts idempotency_replay is a SQL function the planner inlines
-- into the store's statement; it cannot carry a setting without losing that). Functions they
-- call run with the setting too. A migration that redefines one of them (CREATE OR REPLACE)
-- must repeat `SET enable_seqscan = off SET jit = off`, which CREATE OR REPLACE drops:
-- tests/tests/e2e/small_table_statistics.rs checks every one of them in each layout.
DO $do$
DECLARE
    v_function regprocedure;
BEGIN
    FOR v_function IN
        SELECT p.oid::regprocedure
          FROM pg_proc p
          JOIN pg_language l ON l.oid = p.prolang
         WHERE l.lanname = 'plpgsql'
           AND p.pronamespace = (SELECT c.relnamespace FROM pg_class c
                                  WHERE c.oid = to_regclass('idempotency_keys'))
           AND p.proname IN ('idempotency_reserve', 'idempotency_replay', 'idempotency_complete',
                             'idempotency_tx_claim', 'idempotency_release',
                             'idempotency_renew_lease', 'idempotency_completed_by')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET enable_seqscan = off SET jit = off', v_function);
    END LOOP;
END
$do$;
