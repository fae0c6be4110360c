-- The store's replay today: idempotency_reserve on a stored key.
\set k random(1, 1000)
SELECT * FROM idempotency_reserve('', 'POST', '/payments', 'r-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 60000000::bigint);
