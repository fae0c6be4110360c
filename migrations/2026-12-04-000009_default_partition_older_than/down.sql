-- Back to migration 000005's default-partition purge (no age). A no-op on the plain layout.
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_purge_default(p_limit integer)
    RETURNS bigint
    LANGUAGE sql VOLATILE
    AS $fn$
        WITH gone AS (
            DELETE FROM idempotency_responses_default WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM idempotency_responses_default
                 WHERE expires_at <= now()
                 ORDER BY expires_at LIMIT p_limit
                 FOR UPDATE SKIP LOCKED))
            RETURNING 1)
        SELECT count(*) FROM gone
    $fn$
    $ddl$;
    DROP FUNCTION idempotency_purge_default(integer, bigint);
END
$do$;
