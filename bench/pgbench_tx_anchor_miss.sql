-- SQL-only anchor of the transactional payments miss: what payments-raw sends, run by pgbench
-- itself (-M prepared): one transaction holding the reservation INSERT on the anchor's own
-- table (bench_anchor, created by `bench_server migrate`), the payment INSERT and the response
-- UPDATE.
\set k random(1, 9000000000000000000)
BEGIN;
INSERT INTO bench_anchor (key, fingerprint, token, expires_at) VALUES ('pa-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242', md5((:k)::text)::uuid, now() + interval '60 seconds') ON CONFLICT DO NOTHING;
INSERT INTO payments (idempotency_key, amount) VALUES ('pa-' || (:k)::text, 1000);
UPDATE bench_anchor SET status = 201, headers = '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea, body = '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea, token = NULL, expires_at = now() + interval '24 hours' WHERE key = 'pa-' || (:k)::text AND token = md5((:k)::text)::uuid;
COMMIT;
