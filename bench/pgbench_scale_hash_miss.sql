-- Scale curve, hashed key: the same INSERT with the digest computed in SQL.
\set n random(1, 1000000000000)
INSERT INTO scale_hash (scope_hash, tenant, method, path, idempotency_key, fingerprint, state, created_at, expires_at)
SELECT sha256(convert_to(length(t) || ':' || t || '4:' || 'POST12:/v1/payments' || length(k) || ':' || k, 'UTF8')), t, 'POST', '/v1/payments', k, '\x42', 'in_flight', now(), now() + interval '60 seconds'
  FROM (SELECT 'tenant-' || (:n::bigint % 1000) AS t, 'new-' || :client_id::text || '-' || :n::text AS k) v
ON CONFLICT DO NOTHING;
