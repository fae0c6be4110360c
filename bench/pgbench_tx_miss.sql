-- SQL-only transactional payments miss: the statements transactional mode sends around the
-- handler's INSERT (store/postgres/transactional.rs: BEGIN with SET LOCAL, the claim, the
-- complete, COMMIT), through the store's functions (no column of idempotency_keys is named
-- here), run by pgbench itself (-M prepared). Without a tenant source the claim sets no tenant.
\set k random(1, 9000000000000000000)
BEGIN;
SET LOCAL idle_in_transaction_session_timeout = 30000;
SELECT * FROM idempotency_tx_claim(NULL, NULL, '', 'POST', '/payments', 'pt-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242', md5((:k)::text)::uuid, 30000000);
INSERT INTO payments (idempotency_key, amount) VALUES ('pt-' || (:k)::text, 1000);
SELECT idempotency_complete('', 'POST', '/payments', 'pt-' || (:k)::text, md5((:k)::text)::uuid, 201::smallint, '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea, '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea, 86400000000);
COMMIT;
