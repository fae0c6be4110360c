-- pgbench: what a replay would cost the database if reserve were a PL/pgSQL function that
-- reads first and writes only when it must (bench_reserve_read_first, created by
-- bench/load.sh in the benchmark database only; its write half is left out because replays
-- never reach it). Compare with pgbench_store_replay.sql (the store's one-statement CTE) and
-- pgbench_replay.sql (a bare SELECT).
\set k random(1, 1000)
SELECT * FROM bench_reserve_read_first('', 'POST', '/payments', 'r-' || (:k)::text, '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea, 'a81bc81b-dead-4e5d-abff-90865d1e13b1'::uuid, 60000000::bigint);
