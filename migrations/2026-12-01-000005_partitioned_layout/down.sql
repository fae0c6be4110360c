-- The partitioned layout is not reverted by a migration. Going back to the plain layout would
-- need the plain layout's functions of migrations 000003/000004 here as well (the ones this
-- migration replaced); without them a revert left functions that read idempotency_responses
-- after dropping it, and once migrated up again (a no-op without the layout setting) every
-- replay failed. To leave the partitioned layout, drop the idempotency tables and functions
-- (or the database) and provision again (docs/operations.md, "Choosing the partitioned layout").
-- On the plain layout this migration did nothing, and its revert does nothing. Without
-- idempotency_responses (the plain layout, or a partitioned one whose tables were dropped to
-- provision again, as docs/operations.md describes), it drops the layout's own functions if
-- they are there: left behind, idempotency_partitions_drop marked a plain schema as partitioned
-- (the provisioning probe then called it unprovisioned) and a partitioned migration failed on
-- functions that "already exist".
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        DROP FUNCTION IF EXISTS idempotency_partitions();
        DROP FUNCTION IF EXISTS idempotency_partitions_create(integer, integer);
        DROP FUNCTION IF EXISTS idempotency_partitions_drop(bigint, integer);
        DROP FUNCTION IF EXISTS idempotency_purge_default(integer);
        DROP FUNCTION IF EXISTS idempotency_purge_default(integer, bigint);
        RETURN;
    END IF;
    RAISE EXCEPTION 'the partitioned layout cannot be reverted by a migration: drop the idempotency tables and provision again (docs/operations.md)';
END
$do$;
