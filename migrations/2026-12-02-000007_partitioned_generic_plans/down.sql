-- Back to the plan cache's own choice (a no-op on the plain layout).
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    ALTER FUNCTION idempotency_reserve(text, text, text, text, bytea, uuid, bigint)
        RESET plan_cache_mode;
END
$do$;
