-- The partitioned layout's drop step lists the partitions to drop again once it holds the
-- response table (review, 2026-12-06; docs/sql.md, "Partition maintenance and its locks"). A
-- no-op on the plain layout.
--
-- Why: migration 000012's idempotency_partitions_drop listed the partitions before it waited
-- for ACCESS EXCLUSIVE on idempotency_responses, and dropped that list. A partition dropped
-- while it waited (by hand, by another tool) made its `LOCK TABLE ... NOWAIT` raise
-- undefined_table: the whole step failed and rolled back the drops it had made. A partition
-- detached while it waited (an operator archiving it) was still on the list, and its table
-- was dropped although it no longer belonged to idempotency_responses.
--
-- Now the first listing only decides whether to take the table at all (no lock when nothing
-- has expired); the list dropped is read again under the lock, where it cannot change: every
-- DROP, DETACH or ATTACH of a partition locks idempotency_responses too. A partition renamed
-- or dropped between that listing and its own lock is skipped like one that is locked. Same
-- signature and results (the names dropped).
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
            -- Every DROP of a partition also takes the default partition.
            BEGIN
                LOCK TABLE idempotency_responses_default IN ACCESS EXCLUSIVE MODE NOWAIT;
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
