-- The partitioned layout is not reverted by a migration. Going back to the plain layout would
-- need the plain layout's functions of migrations 000003/000004 here as well (the ones this
-- migration replaced); without them a revert left functions that read idempotency_responses
-- after dropping it, and once migrated up again (a no-op without the layout setting) every
-- replay failed. To leave the partitioned layout, drop the idempotency tables and functions
-- (or the database) and provision again (docs/operations.md, "Choosing the partitioned layout").
-- On the plain layout this migration did nothing, and its revert does nothing.
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    RAISE EXCEPTION 'the partitioned layout cannot be reverted by a migration: drop the idempotency tables and provision again (docs/operations.md)';
END
$do$;
