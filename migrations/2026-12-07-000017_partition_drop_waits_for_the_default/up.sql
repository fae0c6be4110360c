-- The partitioned layout's drop step waits up to 100 ms (or --lock-timeout, if shorter) for
-- the default partition once it holds the response table, instead of giving up at once. A
-- no-op on the plain and rotated layouts.
--
-- Why: a transaction that detaches or drops a partition takes both the response table and the
-- default partition, and releases them one by one when it commits. Migration 000014's drop
-- step, waiting for the response table, was woken by the first release and found the default
-- partition still held (`NOWAIT`): it dropped nothing that run. Seen as a flaky test in CI
-- (`partitioned_layout_races::a_partition_dropped_or_detached_while_the_drop_waits_is_left_alone`,
-- 2026-12-07). Same signature and results (the names dropped).
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_partitions_drop(p_grace_us bigint, p_lock_timeout_ms integer)
    RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_names text[];
        v_name text;
    BEGIN
        -- Pass 1 decides whether to lock at all; pass 2, under the lock, what to drop.
        FOR v_pass IN 1..2 LOOP
            SELECT array_agg(p.name ORDER BY p.upper_bound) INTO v_names
              FROM (SELECT c.relname::text AS name,
                           (regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                         'TO \(''([^'']*)''\)'))[1]::timestamptz AS upper_bound
                      FROM pg_inherits i
                      JOIN pg_class c ON c.oid = i.inhrelid
                     WHERE i.inhparent = 'idempotency_responses'::regclass) p
             WHERE p.upper_bound <= now() - p_grace_us * interval '1 microsecond';
            IF v_names IS NULL THEN
                RETURN;
            END IF;
            EXIT WHEN v_pass = 2;
            -- The one wait requests queue behind. ONLY: without it LOCK TABLE takes every
            -- partition too, waiting for each.
            PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
            LOCK TABLE ONLY idempotency_responses IN ACCESS EXCLUSIVE MODE;
            -- Every DROP of a partition also takes the default partition. Waited for briefly
            -- (the table is held meanwhile, and requests queue behind it): long enough for a
            -- transaction that is committing to let it go, not for one that holds it. (At
            -- least 1 ms: 0 would be no limit.)
            PERFORM set_config('lock_timeout', least(greatest(p_lock_timeout_ms, 1), 100) || 'ms', true);
            BEGIN
                LOCK TABLE idempotency_responses_default IN ACCESS EXCLUSIVE MODE;
            EXCEPTION WHEN lock_not_available THEN
                RETURN;
            END;
        END LOOP;
        FOREACH v_name IN ARRAY v_names LOOP
            BEGIN
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', v_name);
            EXCEPTION WHEN lock_not_available OR undefined_table THEN
                CONTINUE;
            END;
            EXECUTE format('DROP TABLE %I', v_name);
            RETURN NEXT v_name;
        END LOOP;
    END
    $fn$
    $ddl$;
END
$do$;
