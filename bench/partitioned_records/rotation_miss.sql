-- pgbench: a miss on the rotation prototype (rotation.sql): both tables read, then the
-- INSERT into the current one, then the complete.
\set k random(1, 9000000000000000000)
SELECT * FROM idem_rot_reserve('', 'POST', '/payments', 'f-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 60000000::bigint);
SELECT idem_rot_complete('', 'POST', '/payments', 'f-' || (:k)::text, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 201::smallint, '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea, '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea, 86400000000::bigint);
