-- Today's key: a replay read of a random existing row by the four-text-column primary key.
\set i random(1, :rows)
SELECT fingerprint, response_status, response_headers, response_body FROM scale_text
 WHERE (tenant, method, path, idempotency_key) = ('tenant-' || (:i::bigint % 1000), 'POST', '/v1/payments', md5(:i::text)::uuid::text)
   AND expires_at > now();
