-- The rotated layout is not reverted by a migration, for the reason migration 000005's revert
-- gives for the partitioned layout: going back would need the plain layout's functions here as
-- well. To leave it, drop the idempotency tables, view and functions (or the database) and
-- provision again. On the other layouts this migration did nothing; without
-- idempotency_generation (a rotated database whose tables were dropped to provision again) it
-- drops the layout's own function if it is there.
DO $do$
BEGIN
    IF to_regclass('idempotency_generation') IS NULL THEN
        DROP FUNCTION IF EXISTS idempotency_rotate(integer, bigint);
        DROP FUNCTION IF EXISTS idempotency_purge_rows(bigint, bigint, text, bigint);
        DROP FUNCTION IF EXISTS idempotency_keys_write();
        DROP FUNCTION IF EXISTS idempotency_generation_for_write();
        RETURN;
    END IF;
    RAISE EXCEPTION 'the rotated layout cannot be reverted by a migration: drop the idempotency tables and provision again (docs/operations.md)';
END
$do$;
