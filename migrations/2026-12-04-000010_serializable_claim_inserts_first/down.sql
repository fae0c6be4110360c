-- Back to migrations 000003 (the claim), 000004 and 000005 (the complete of each layout):
-- read first, and complete by the primary key, at every isolation level.
CREATE OR REPLACE FUNCTION idempotency_tx_claim(
    p_setting text, p_setting_value text,
    p_tenant text, p_method text, p_path text, p_key text,
    p_fingerprint bytea, p_token uuid, p_lease_us bigint
)
RETURNS TABLE (
    outcome text, state text, fingerprint bytea, lease_remaining_us bigint,
    response_status smallint, response_headers bytea, response_body bytea,
    live boolean, eligible boolean
)
LANGUAGE plpgsql VOLATILE ROWS 1
AS $fn$
BEGIN
    IF p_setting IS NOT NULL THEN
        PERFORM set_config(p_setting, p_setting_value, true);
    END IF;
    RETURN QUERY SELECT * FROM idempotency_reserve(p_tenant, p_method, p_path, p_key,
                                                   p_fingerprint, p_token, p_lease_us);
END
$fn$;

COMMENT ON FUNCTION idempotency_tx_claim(text, text, text, text, text, text, bytea, uuid, bigint) IS
    'Claim of idempotency-actix''s transactional mode: tenant setting, then idempotency_reserve in the caller''s transaction. See docs/sql.md.';

-- Back to migration 000004's complete (plain layout): by the primary key only.
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NOT NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_complete(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
        p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint
    )
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    BEGIN
        UPDATE idempotency_keys k
           SET state = 'completed', response_status = p_status, response_headers = p_headers,
               response_body = p_body, completed_at = now(), locked_until = NULL,
               expires_at = now() + p_ttl_us * interval '1 microsecond'
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
        RETURN FOUND;
    END
    $fn$
    $ddl$;
END
$do$;

-- Back to migration 000005's complete (partitioned layout).
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_complete(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
        p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint
    )
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_expires_at timestamptz := now() + p_ttl_us * interval '1 microsecond';
    BEGIN
        UPDATE idempotency_keys k
           SET state = 'completed', response_status = p_status, completed_at = now(),
               locked_until = NULL, expires_at = v_expires_at
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        INSERT INTO idempotency_responses (token, expires_at, response_headers, response_body)
        VALUES (p_token, v_expires_at, p_headers, p_body);
        RETURN true;
    END
    $fn$
    $ddl$;
END
$do$;
