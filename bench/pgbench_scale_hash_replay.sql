-- Scale curve, hashed key: the same read by a 32-byte SHA-256 digest of the length-prefixed
-- scope parts (computed in SQL, as the store's function would), with the parts re-checked
-- (a digest match alone is not identity).
\set i random(1, :rows)
SELECT fingerprint, response_status, response_headers, response_body FROM scale_hash
 WHERE scope_hash = sha256(convert_to(length('tenant-' || (:i::bigint % 1000)) || ':' || ('tenant-' || (:i::bigint % 1000)) || '4:' || 'POST12:/v1/payments36:' || md5(:i::text)::uuid::text, 'UTF8'))
   AND (tenant, method, path, idempotency_key) = ('tenant-' || (:i::bigint % 1000), 'POST', '/v1/payments', md5(:i::text)::uuid::text)
   AND expires_at > now();
