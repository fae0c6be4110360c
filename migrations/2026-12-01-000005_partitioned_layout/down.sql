-- Back to the plain layout, only from an empty database (the responses have nowhere to go).
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM idempotency_keys) THEN
        RAISE EXCEPTION 'idempotency_keys is not empty: cannot revert the partitioned layout';
    END IF;
    DROP FUNCTION idempotency_purge_default(integer);
    DROP FUNCTION idempotency_partitions_drop(bigint, integer);
    DROP FUNCTION idempotency_partitions_create(integer, integer);
    DROP FUNCTION idempotency_partitions();
    DROP TABLE idempotency_partitioning;
    DROP TABLE idempotency_responses;
    ALTER TABLE idempotency_keys
        DROP CONSTRAINT idempotency_keys_completed_check,
        ADD COLUMN response_headers BYTEA,
        ADD COLUMN response_body BYTEA,
        ADD CONSTRAINT idempotency_keys_completed_check CHECK (
            state <> 'completed' OR (
                response_status IS NOT NULL AND response_headers IS NOT NULL
                AND response_body IS NOT NULL AND completed_at IS NOT NULL
            )
        );
    RAISE NOTICE 'partitioned layout removed: run the down migrations of 000004 and 000003 and their up migrations again to restore the plain functions';
END
$do$;
