-- Today's key: the reservation INSERT of a new key.
\set n random(1, 1000000000000)
INSERT INTO scale_text (tenant, method, path, idempotency_key, fingerprint, state, created_at, expires_at)
VALUES ('tenant-' || (:n::bigint % 1000), 'POST', '/v1/payments', 'new-' || :client_id::text || '-' || :n::text, '\x42', 'in_flight', now(), now() + interval '60 seconds')
ON CONFLICT DO NOTHING;
