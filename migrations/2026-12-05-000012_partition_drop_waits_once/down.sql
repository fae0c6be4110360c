-- Back to migration 000005's drop step (waiting, holding the table, for each partition and the
-- default partition) and partition listing. A no-op on the plain layout.
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
        v_part record;
    BEGIN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
        FOR v_part IN
            SELECT p.name
              FROM idempotency_partitions() p
             WHERE NOT p.is_default
               AND p.upper_bound <= now() - p_grace_us * interval '1 microsecond'
             ORDER BY p.upper_bound
        LOOP
            EXECUTE format('DROP TABLE %I', v_part.name);
            RETURN NEXT v_part.name;
        END LOOP;
    END
    $fn$
    $ddl$;

    -- The partitions of idempotency_responses with their bounds (NULL for the default), as
    -- the catalog states them (pg_get_expr of the bound, read back in the same session).
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_partitions()
    RETURNS TABLE (name text, is_default boolean, lower_bound timestamptz,
                   upper_bound timestamptz, bytes bigint, estimated_rows bigint)
    LANGUAGE sql STABLE
    AS $fn$
        SELECT c.relname::text, b.bound = 'DEFAULT',
               (regexp_match(b.bound, 'FROM \(''([^'']*)''\)'))[1]::timestamptz,
               (regexp_match(b.bound, 'TO \(''([^'']*)''\)'))[1]::timestamptz,
               pg_total_relation_size(c.oid), greatest(c.reltuples, 0)::bigint
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
          CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
         WHERE i.inhparent = 'idempotency_responses'::regclass
         ORDER BY 4 NULLS LAST
    $fn$
    $ddl$;
END
$do$;
