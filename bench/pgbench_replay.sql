-- pgbench ceiling of the replay path: the raw anchor's SELECT of a stored response by primary
-- key on its own table (bench_anchor), over the 1000 keys stored by the HTTP replay cases of
-- bench_server's `raw` mode.
\set k random(1, 1000)
SELECT fingerprint, status, headers, body FROM bench_anchor WHERE key = 'r-' || (:k)::text AND status IS NOT NULL AND expires_at > now();
