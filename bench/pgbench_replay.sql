-- pgbench ceiling of the replay path: the raw anchor's SELECT of a stored response by primary
-- key, over the 1000 keys stored by the HTTP replay cases.
\set k random(1, 1000)
SELECT fingerprint, response_status, response_headers, response_body FROM idempotency_keys WHERE tenant = '' AND method = 'POST' AND path = '/payments' AND idempotency_key = 'r-' || (:k)::text AND state = 'completed' AND expires_at > now();
