-- Autovacuum leaves the request path's tables alone until they are large enough that no plan
-- made from their statistics reads a whole table (docs/sql.md, "Statistics of a table that
-- starts empty"). All layouts.
--
-- Why: the store's functions look records up by primary key in statements whose plans each
-- session caches (PL/pgSQL's generic plans, built once the first few calls have run). A table
-- that starts empty (a new deployment's, the rotated layout's current table after every
-- rotation, each new response partition) was analyzed or vacuumed by autovacuum as soon as 50
-- rows had changed. With statistics of a few pages, a sequential scan is the cheaper plan for a
-- lookup of one row, and the sessions cached that plan until the next analyze, which
-- autovacuum makes about a minute later at the earliest, while the table grew: a reserve took
-- 40-55 ms on a 300,000-row table instead of 0.5 ms (tests/tests/e2e/small_table_statistics.rs
-- watched the plan turn). Before its first analyze or vacuum a table's planner estimate is at
-- least 10 pages, which keeps the index scan; at 1,000 changed rows (about 18 pages of
-- records, or 9 of responses, at their smallest) statistics make the index scan the cheaper
-- plan too. So autovacuum's thresholds on these tables, rows changed before it analyzes and
-- dead or inserted rows before it vacuums, are raised from 50 (and 1,000 for inserts) to 1,000
-- each: the first visit is put off by at most 1,000 rows' changes, which on a large table is
-- nothing beside the default scale factors (10 % and 20 % of its rows). A threshold a table
-- already has (an operator's) is kept. TRUNCATE keeps them, so each rotated table keeps its
-- own; a new response partition gets them when idempotency_partitions_create makes it.
--
-- (An ANALYZE run by hand on such a table while it is small still plans the lookup as a
-- sequential scan until the next analyze: docs/operations.md says so.)

-- The settings, in one place: the tables below and each new response partition take them.
CREATE OR REPLACE FUNCTION idempotency_table_settings() RETURNS text[]
LANGUAGE sql STABLE
AS $fn$
    SELECT ARRAY['autovacuum_analyze_threshold = 1000', 'autovacuum_vacuum_threshold = 1000']
           -- PostgreSQL 13 on: vacuums of insert-only tables, the response partitions.
           || CASE WHEN current_setting('server_version_num')::int >= 130000
                   THEN ARRAY['autovacuum_vacuum_insert_threshold = 1000'] ELSE '{}' END
$fn$;

COMMENT ON FUNCTION idempotency_table_settings() IS
    'Autovacuum settings of idempotency-actix''s request tables (migration 000018): no statistics while a table is small. See docs/sql.md.';

DO $do$
DECLARE
    v_table regclass;
    v_settings text;
BEGIN
    -- The request path's tables in every layout: idempotency_keys (plain: the records; partitioned:
    -- the claims; rotated: a view, skipped), the rotated layout's generation tables, and every
    -- partition of idempotency_responses.
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
        SELECT string_agg(s, ', ') INTO v_settings
          FROM unnest(idempotency_table_settings()) s
         WHERE NOT EXISTS (
                   SELECT FROM pg_class c, unnest(c.reloptions) o
                    WHERE c.oid = v_table
                      AND split_part(o, '=', 1) = split_part(s, ' ', 1));
        IF v_settings IS NOT NULL THEN
            EXECUTE format('ALTER TABLE %s SET (%s)', v_table, v_settings);
        END IF;
    END LOOP;

    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    -- Migration 000008's create step, its new partitions made with the settings.
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
                -- Autovacuum leaves it alone while it is small (this migration's header).
                EXECUTE format('CREATE TABLE %I (LIKE idempotency_responses INCLUDING DEFAULTS) WITH (%s)',
                               v_name, array_to_string(idempotency_table_settings(), ', '));
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
