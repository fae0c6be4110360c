-- pgbench: records_replay.sql with a look-back window of two days (schema.sql's `p_window`):
-- the read skips the partitions made before it.
\set k random(1, 1000)
SELECT * FROM idem_records_reserve('', 'POST', '/payments', 'r-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 60000000::bigint, interval '2 days');
