-- Back to autovacuum's own thresholds on the request path's tables, and to migration 000008's
-- partition create step.
DO $do$
DECLARE
    v_table regclass;
BEGIN
    FOR v_table IN
        SELECT c.oid::regclass
          FROM pg_class c
         WHERE c.relkind = 'r'
           AND c.oid IN (to_regclass('idempotency_keys'), to_regclass('idempotency_keys_0'),
                         to_regclass('idempotency_keys_1'), to_regclass('idempotency_keys_2'))
        UNION ALL
        SELECT t.relid
          FROM pg_partition_tree(to_regclass('idempotency_responses')) t
         WHERE t.isleaf
    LOOP
        EXECUTE format('ALTER TABLE %s RESET (autovacuum_analyze_threshold, autovacuum_vacuum_threshold%s)',
                       v_table,
                       CASE WHEN current_setting('server_version_num')::int >= 130000
                            THEN ', autovacuum_vacuum_insert_threshold' ELSE '' END);
    END LOOP;

    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_partitions_create(p_ahead integer, p_lock_timeout_ms integer)
    RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_step interval := (SELECT step FROM idempotency_partitioning);
        v_unit text := CASE (SELECT step FROM idempotency_partitioning)
                           WHEN interval '1 hour' THEN 'hour' ELSE 'day' END;
        v_base timestamp := date_trunc(v_unit, now() AT TIME ZONE 'UTC');
        v_lo timestamptz;
        v_hi timestamptz;
        v_name text;
    BEGIN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
        FOR i IN 0..greatest(p_ahead, 0) LOOP
            -- UTC wall-clock arithmetic, then the instant: the same span in every session.
            v_lo := (v_base + i * v_step) AT TIME ZONE 'UTC';
            v_hi := (v_base + (i + 1) * v_step) AT TIME ZONE 'UTC';
            v_name := 'idempotency_responses_p'
                      || to_char(v_base + i * v_step, 'YYYYMMDD_HH24');
            CONTINUE WHEN to_regclass(quote_ident(v_name)) IS NOT NULL;
            -- An index probe (idempotency_responses_default_expires_at_idx), no lock taken
            -- beyond a reader's: the range keeps its rows in the default partition.
            CONTINUE WHEN EXISTS (SELECT 1 FROM idempotency_responses_default
                                   WHERE expires_at >= v_lo AND expires_at < v_hi);
            BEGIN
                EXECUTE format('CREATE TABLE %I (LIKE idempotency_responses INCLUDING DEFAULTS)', v_name);
                EXECUTE format('ALTER TABLE idempotency_responses ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                               v_name, v_lo, v_hi);
            EXCEPTION WHEN check_violation THEN
                -- A row of the range arrived after the probe: leave the range to the default.
                CONTINUE;
            END;
            RETURN NEXT v_name;
        END LOOP;
    END
    $fn$
    $ddl$;
END
$do$;

DROP FUNCTION IF EXISTS idempotency_table_settings();
