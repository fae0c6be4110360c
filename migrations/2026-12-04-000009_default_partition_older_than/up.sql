-- `idem-cli purge --older-than` keeps the default partition's expired responses as it keeps
-- the range partitions it drops: a row goes once its expiry is at least `--older-than` ago
-- (review, 2026-12-04: the default partition's rows went at expiry whatever `--older-than`
-- said, so a record the claims purge kept showed no stored response). A no-op on the plain
-- layout.
--
-- A new overload with the age; the one-argument function stays, as the same with an age of
-- zero, so an idem-cli from before this migration keeps working during an upgrade.
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE FUNCTION idempotency_purge_default(p_limit integer, p_older_than_us bigint)
    RETURNS bigint
    LANGUAGE sql VOLATILE
    AS $fn$
        WITH gone AS (
            DELETE FROM idempotency_responses_default WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM idempotency_responses_default
                 WHERE expires_at <= now() - greatest(p_older_than_us, 0) * interval '1 microsecond'
                 ORDER BY expires_at LIMIT p_limit
                 FOR UPDATE SKIP LOCKED))
            RETURNING 1)
        SELECT count(*) FROM gone
    $fn$
    $ddl$;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_purge_default(p_limit integer)
    RETURNS bigint
    LANGUAGE sql VOLATILE
    AS $fn$
        SELECT idempotency_purge_default(p_limit, 0)
    $fn$
    $ddl$;
END
$do$;
