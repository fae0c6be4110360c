-- Back to the third migration's definition (same values, not inlinable).
CREATE OR REPLACE FUNCTION idempotency_lock_key(p_tenant text, p_method text, p_path text, p_key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT hashtextextended(
        octet_length(p_tenant) || ':' || p_tenant || octet_length(p_method) || ':' || p_method
        || octet_length(p_path) || ':' || p_path || octet_length(p_key) || ':' || p_key,
        7218830631155870501)
$fn$;
