-- Back to migration 000005's reserve function for the partitioned layout (a missing response
-- of a record live by the transaction's clock fails the call), with migration 000007's generic
-- plans. A no-op on the plain layout.
DO $do$
BEGIN
    IF to_regclass('idempotency_responses') IS NULL THEN
        RETURN;
    END IF;
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_reserve(
        p_tenant text, p_method text, p_path text, p_key text,
        p_fingerprint bytea, p_token uuid, p_lease_us bigint
    )
    RETURNS TABLE (
        outcome text, state text, fingerprint bytea, lease_remaining_us bigint,
        response_status smallint, response_headers bytea, response_body bytea,
        live boolean, eligible boolean
    )
    LANGUAGE plpgsql VOLATILE ROWS 1
    SET plan_cache_mode = force_generic_plan
    AS $fn$
    #variable_conflict use_column
    DECLARE
        v_token uuid;
        v_expires_at timestamptz;
    BEGIN
        FOR attempt IN 1..4 LOOP
            SELECT k.state, k.fingerprint, k.response_status, k.token, k.expires_at,
                   k.expires_at > now(),
                   k.state = 'completed' OR k.fingerprint = p_fingerprint,
                   (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                    * 1000000)::bigint
              INTO state, fingerprint, response_status, v_token, v_expires_at,
                   live, eligible, lease_remaining_us
              FROM idempotency_keys k
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key;

            IF NOT FOUND THEN
                IF NOT pg_try_advisory_xact_lock(
                        idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                    outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                    lease_remaining_us := p_lease_us; response_status := NULL;
                    response_headers := NULL; response_body := NULL; live := true; eligible := true;
                    RETURN NEXT;
                    RETURN;
                END IF;
                INSERT INTO idempotency_keys AS k
                    (tenant, method, path, idempotency_key, fingerprint, state, token,
                     locked_until, created_at, expires_at)
                VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                        now() + p_lease_us * interval '1 microsecond', now(),
                        now() + p_lease_us * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
                IF FOUND THEN
                    outcome := 'reserved';
                    RETURN NEXT;
                    RETURN;
                END IF;
                CONTINUE;
            END IF;

            IF live OR NOT eligible THEN
                response_headers := NULL; response_body := NULL;
                IF live AND state = 'completed' THEN
                    -- The response the completing transaction inserted with the claim's
                    -- update: committed together, so visible to this later snapshot. Its
                    -- partition's upper bound is past expires_at > now(): never dropped yet.
                    SELECT r.response_headers, r.response_body
                      INTO response_headers, response_body
                      FROM idempotency_responses r
                     WHERE r.token = v_token AND r.expires_at = v_expires_at;
                    IF NOT FOUND THEN
                        -- Never answer a replay without its response (an empty body would be
                        -- a wrong answer): fail the call, the middleware answers 503.
                        RAISE EXCEPTION 'idempotency_responses has no row for a live completed record';
                    END IF;
                END IF;
                outcome := 'existing';
                RETURN NEXT;
                RETURN;
            END IF;

            IF NOT pg_try_advisory_xact_lock(
                    idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                lease_remaining_us := p_lease_us; response_status := NULL;
                response_headers := NULL; response_body := NULL; live := true; eligible := true;
                RETURN NEXT;
                RETURN;
            END IF;
            -- Takeover, fenced and re-checked under the row lock exactly as in the plain
            -- layout. The old response row (old token) is left to its partition's drop.
            UPDATE idempotency_keys k
               SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
                   locked_until = now() + p_lease_us * interval '1 microsecond',
                   expires_at = now() + p_lease_us * interval '1 microsecond',
                   created_at = now(), completed_at = NULL, response_status = NULL
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key
               AND k.expires_at <= now()
               AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
            IF FOUND THEN
                outcome := 'reserved';
                state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
                response_status := NULL; response_headers := NULL; response_body := NULL;
                live := NULL; eligible := NULL;
                RETURN NEXT;
                RETURN;
            END IF;
        END LOOP;

        outcome := 'raced';
        state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
        response_status := NULL; response_headers := NULL; response_body := NULL;
        live := NULL; eligible := NULL;
        RETURN NEXT;
    END
    $fn$
    $ddl$;
END
$do$;
