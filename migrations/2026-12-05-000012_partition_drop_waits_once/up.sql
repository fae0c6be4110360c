-- The partitioned layout's drop step makes requests wait for requests only, and its partition
-- listing skips a partition dropped meanwhile (review of issue 15, 2026-12-05; docs/sql.md,
-- "Partition maintenance and its locks"). A no-op on the plain layout.
--
-- Why: migration 000005's idempotency_partitions_drop waited (up to the lock timeout) for
-- ACCESS EXCLUSIVE on idempotency_responses, which requests queue behind, and then, holding
-- it, waited again (each time up to the lock timeout) for the partition it dropped and for the
-- default partition. Requests always lock idempotency_responses before a partition, so once the
-- drop holds it, whoever holds a partition is not a request (autovacuum, a monitoring query on
-- one partition): waiting for it only held every request up longer, past the documented bound
-- (`--lock-timeout` plus the hold). Now, holding the table, the drop takes the default
-- partition and each partition with NOWAIT and leaves what it cannot lock for the next run.
-- The partitions to drop are found from the catalog's bounds alone, so no partition is opened
-- (or locked) before the table. Same signature and results (the names dropped).
--
-- idempotency_partitions() listed a partition whose DROP committed while the listing waited
-- for it (pg_inherits read before the commit) with NULL bounds and size, which its callers
-- decode as non-null (`idem-cli stats` failed); such a row is now left out.
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
        FOREACH v_name IN ARRAY v_names LOOP
            BEGIN
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', v_name);
            EXCEPTION WHEN lock_not_available THEN
                CONTINUE;
            END;
            EXECUTE format('DROP TABLE %I', v_name);
            RETURN NEXT v_name;
        END LOOP;
    END
    $fn$
    $ddl$;

    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_partitions()
    RETURNS TABLE (name text, is_default boolean, lower_bound timestamptz,
                   upper_bound timestamptz, bytes bigint, estimated_rows bigint)
    LANGUAGE sql STABLE
    AS $fn$
        SELECT p.name, p.is_default, p.lower_bound, p.upper_bound, p.bytes, p.estimated_rows
          FROM (SELECT c.relname::text AS name, b.bound = 'DEFAULT' AS is_default,
                       (regexp_match(b.bound, 'FROM \(''([^'']*)''\)'))[1]::timestamptz AS lower_bound,
                       (regexp_match(b.bound, 'TO \(''([^'']*)''\)'))[1]::timestamptz AS upper_bound,
                       pg_total_relation_size(c.oid) AS bytes,
                       greatest(c.reltuples, 0)::bigint AS estimated_rows
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                  CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
                 WHERE i.inhparent = 'idempotency_responses'::regclass) p
         -- A partition dropped while this waited for it has no bound and no size any more.
         WHERE p.is_default IS NOT NULL AND p.bytes IS NOT NULL
         ORDER BY p.upper_bound NULLS LAST
    $fn$
    $ddl$;
END
$do$;
