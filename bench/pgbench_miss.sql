-- pgbench ceiling of the miss path: the raw anchor's INSERT + UPDATE on its own table
-- (bench_anchor, created by `bench_server migrate`; the statements of bench_server's `raw`
-- mode), run by pgbench itself (-M prepared, one statement per round trip, autocommit).
\set k random(1, 9000000000000000000)
INSERT INTO bench_anchor (key, fingerprint, token, expires_at) VALUES ('p-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242', 'a81bc81b-dead-4e5d-abff-90865d1e13b1', now() + interval '60 seconds') ON CONFLICT DO NOTHING;
UPDATE bench_anchor SET status = 201, headers = '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea, body = '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea, token = NULL, expires_at = now() + interval '24 hours' WHERE key = 'p-' || (:k)::text AND token = 'a81bc81b-dead-4e5d-abff-90865d1e13b1';
