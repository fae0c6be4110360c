-- Digest key: the same read by the 32-byte digest the app would send, the parts re-checked.
\set i random(1, :rows)
SELECT fingerprint, response_status, response_headers, response_body FROM scale_hash
 WHERE scope_hash = int8send(:i::bigint) || '\x000000000000000000000000000000000000000000000000'::bytea
   AND (tenant, method, path, idempotency_key) = ('tenant-' || (:i::bigint % 1000), 'POST', '/v1/payments', md5(:i::text)::uuid::text)
   AND expires_at > now();
