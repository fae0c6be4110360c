-- Back to the second migration's reserve function (no advisory lock) and no transactional claim.
DROP FUNCTION IF EXISTS idempotency_tx_claim(text, text, text, text, text, text, bytea, uuid, bigint);
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
AS $fn$
#variable_conflict use_column
BEGIN
    -- Each lost race means another writer changed this key between our read and our write;
    -- the next read sees its result. Four attempts cover insert/takeover/release/purge
    -- interleavings; more than that means the key is churning and the caller decides.
    FOR attempt IN 1..4 LOOP
        -- The read: one primary-key lookup, no lock. It fills the output columns directly
        -- (all computed in this one statement), so the paths that return the row as it is do
        -- no further work.
        SELECT k.state, k.fingerprint, k.response_status, k.response_headers, k.response_body,
               k.expires_at > now(),
               k.state = 'completed' OR k.fingerprint = p_fingerprint,
               (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                * 1000000)::bigint
          INTO state, fingerprint, response_status, response_headers, response_body,
               live, eligible, lease_remaining_us
          FROM idempotency_keys k
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key;

        IF NOT FOUND THEN
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
            -- A concurrent insert of this key committed first: read it.
            CONTINUE;
        END IF;

        IF live OR NOT eligible THEN
            -- Replay, live reservation, or an ended reservation of another request: no write.
            outcome := 'existing';
            RETURN NEXT;
            RETURN;
        END IF;

        -- Ended and eligible: take it over. The conditions are re-checked here, under the row
        -- lock, on the newest version of the row (see the header).
        UPDATE idempotency_keys k
           SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
               locked_until = now() + p_lease_us * interval '1 microsecond',
               expires_at = now() + p_lease_us * interval '1 microsecond',
               created_at = now(), completed_at = NULL, response_status = NULL,
               response_headers = NULL, response_body = NULL
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
        -- Taken over, released or purged by someone else since our read: read again.
    END LOOP;

    outcome := 'raced';
    state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
    response_status := NULL; response_headers := NULL; response_body := NULL;
    live := NULL; eligible := NULL;
    RETURN NEXT;
END
$fn$;

COMMENT ON FUNCTION idempotency_reserve(text, text, text, text, bytea, uuid, bigint) IS
    'Reserve-or-fetch of idempotency-actix''s PostgresStore: reads first, writes only for an absent or ended eligible key; races resolved inside. See docs/sql.md.';

DROP FUNCTION IF EXISTS idempotency_lock_key(text, text, text, text);
