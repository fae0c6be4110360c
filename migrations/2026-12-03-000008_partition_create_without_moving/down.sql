-- Back to migration 000005's create step (moving rows out of the default partition under
-- ACCESS EXCLUSIVE on idempotency_responses). A no-op on the plain layout.
DO $do$
BEGIN
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
        v_lo timestamptz;
        v_hi timestamptz;
        v_name text;
        v_locked boolean := false;
    BEGIN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
        FOR i IN 0..greatest(p_ahead, 0) LOOP
            -- Bounds in UTC, so an hourly or daily partition is the same span everywhere.
            v_lo := date_trunc(v_unit, now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + i * v_step;
            v_hi := v_lo + v_step;
            v_name := 'idempotency_responses_p'
                      || to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD_HH24');
            CONTINUE WHEN to_regclass(quote_ident(v_name)) IS NOT NULL;
            IF NOT v_locked THEN
                LOCK TABLE idempotency_responses IN ACCESS EXCLUSIVE MODE;
                v_locked := true;
            END IF;
            EXECUTE format('CREATE TABLE %I (LIKE idempotency_responses INCLUDING DEFAULTS)', v_name);
            EXECUTE format('WITH moved AS (DELETE FROM idempotency_responses_default
                                            WHERE expires_at >= $1 AND expires_at < $2
                                            RETURNING *)
                            INSERT INTO %I SELECT * FROM moved', v_name)
                USING v_lo, v_hi;
            EXECUTE format('ALTER TABLE idempotency_responses ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           v_name, v_lo, v_hi);
            RETURN NEXT v_name;
        END LOOP;
    END
    $fn$
    $ddl$;
END
$do$;
