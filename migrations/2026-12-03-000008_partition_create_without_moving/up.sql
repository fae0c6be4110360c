-- The partitioned layout's create step never moves rows and never locks the whole response
-- table (review of issue 15; docs/sql.md, "Partition maintenance and its locks"). A no-op on
-- the plain layout.
--
-- Why: migration 000005's idempotency_partitions_create took ACCESS EXCLUSIVE on
-- idempotency_responses (every partition) and moved a whole interval's rows out of the
-- default partition under it, so every replay and complete waited for time proportional to
-- those rows (1.1 s for 250,000 rows in tests/tests/e2e/postgres_store.rs; past the store's
-- 5 s query timeout that is 503s). Now:
-- - A range the default partition already holds rows for gets no partition: those rows, and
--   later rows of that range, stay in the default partition, which idempotency_purge_default
--   deletes in batches once they expire. Nothing is ever moved, so no lock is held while rows
--   are copied.
-- - Otherwise an empty table is created (no lock on idempotency_responses beyond the
--   catalog's) and attached. ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE on
--   idempotency_responses (it blocks no reads or writes) and ACCESS EXCLUSIVE on the default
--   partition, which it scans to check it holds none of the range: that scan is the whole
--   hold, and it is short while the default partition is small, which is what creating
--   partitions far enough ahead (idem-cli purge --horizon) keeps it.
-- - A row of the range inserted into the default partition between the check and the ATTACH
--   makes the ATTACH fail with check_violation: that range is skipped (its subtransaction,
--   with the table and the lock, rolled back) rather than failing the step.
-- - The bounds are computed on `timestamp without time zone` in UTC and only then turned into
--   timestamptz: adding '1 day' to a timestamptz depends on the session's TimeZone across a
--   DST change, which 000005's arithmetic did (the shipped tools run in UTC sessions, so it
--   never showed).
-- Same signature and results as before (the names created), so callers are unchanged; the
-- store's admin::create_partitions calls it once per interval ahead so that each ATTACH is
-- its own transaction and the default partition's lock is held for one scan at a time.
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
