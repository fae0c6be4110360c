-- pgbench: the PostgreSQL store's own reserve statement (`Reserve` in
-- idempotency-actix/src/store/postgres/sql.rs: a call of idempotency_reserve, created by
-- migrations/2026-11-30-000002_reserve_function; `SELECT *` as there, the function's
-- RETURNS TABLE is the column list) on the stored replay keys: the database's ceiling for the
-- store's replay path, next to pgbench_replay.sql's plain SELECT on the anchor's table.
\set k random(1, 1000)
SELECT * FROM idempotency_reserve('', 'POST', '/payments', 'r-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 60000000::bigint);
