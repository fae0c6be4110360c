-- Back to migration 000010's partitioned complete (no second try of the response INSERT).
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
        v_claimed tid := nullif(current_setting('idempotency.claimed_row', true), '')::tid;
        v_done boolean := false;
    BEGIN
        IF v_claimed IS NOT NULL THEN
            UPDATE idempotency_keys k
               SET state = 'completed', response_status = p_status, completed_at = now(),
                   locked_until = NULL, expires_at = v_expires_at
             WHERE k.ctid = v_claimed AND k.state = 'in_flight' AND k.token = p_token;
            v_done := FOUND;
        END IF;
        IF NOT v_done THEN
            UPDATE idempotency_keys k
               SET state = 'completed', response_status = p_status, completed_at = now(),
                   locked_until = NULL, expires_at = v_expires_at
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
            IF NOT FOUND THEN
                RETURN false;
            END IF;
        END IF;
        -- The token is fresh per reservation and this is its only completion (the fenced
        -- update above matched once), so the key (token, expires_at) is new.
        INSERT INTO idempotency_responses (token, expires_at, response_headers, response_body)
        VALUES (p_token, v_expires_at, p_headers, p_body);
        RETURN true;
    END
    $fn$
    $ddl$;
END
$do$;
