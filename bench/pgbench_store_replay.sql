-- pgbench: the PostgreSQL store's own reserve statement (RESERVE_SQL_* in
-- idempotency-actix/src/store/postgres/sql.rs: a call of idempotency_reserve, created by
-- migrations/2026-11-30-000002_reserve_function; re-copy it when that statement changes) on the
-- stored replay keys: the database's ceiling for the store's replay path, next to
-- pgbench_replay.sql's plain SELECT and pgbench_cte_replay.sql (the statement it replaced).
\set k random(1, 1000)
SELECT outcome, state, fingerprint, lease_remaining_us, response_status, response_headers, response_body, live, eligible FROM idempotency_reserve('', 'POST', '/payments', 'r-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 60000000::bigint);
