-- Digest key: the same INSERT with the digest the app would send (32 bytes, random order; the 0x01 keeps it apart from the filled rows' digests).
\set n random(1, 1000000000000)
INSERT INTO scale_hash (scope_hash, tenant, method, path, idempotency_key, fingerprint, state, created_at, expires_at)
VALUES (int8send(:n::bigint) || int8send(:client_id::bigint) || '\x01000000000000000000000000000000'::bytea, 'tenant-' || (:n::bigint % 1000), 'POST', '/v1/payments', 'new-' || :client_id::text || '-' || :n::text, '\x42', 'in_flight', now(), now() + interval '60 seconds')
ON CONFLICT DO NOTHING;
