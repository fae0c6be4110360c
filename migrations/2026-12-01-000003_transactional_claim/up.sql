-- Transactional mode (docs/transactional.md, docs/sql.md "transactional claim").
--
-- 1. idempotency_lock_key: the 64-bit key of the transaction-scoped advisory lock of a scope.
-- 2. idempotency_reserve, replaced: same signature and outcomes, but every *write* (the insert
--    of a new key, the takeover of an ended one) first takes that advisory lock with the
--    try-variant. A failed try means another transaction holds the scope (a transactional
--    request whose reservation is not committed yet, or a concurrent reserve): the function
--    then answers 'existing' / 'in_flight' with the caller's own fingerprint and writes
--    nothing, so the caller gets 409 at once instead of waiting on an uncommitted row.
-- 3. idempotency_tx_claim: the first statement of a transactional request after BEGIN: sets
--    the tenant setting (transaction-local, for row-level security) and calls
--    idempotency_reserve in the request's own transaction, so the reservation commits or rolls
--    back with the handler's writes. The advisory lock is held until that transaction ends.
--
-- Why both modes may share the table (a rolling switch from one mode to the other): every
-- write to a scope's row by either mode happens under the scope's advisory lock, taken with
-- the try-variant, so no reserve ever waits for another transaction's uncommitted row (the
-- INSERT ... ON CONFLICT of the old function did). The replay path still reads without any
-- lock. See docs/sql.md for the full argument.

-- The advisory-lock key of a scope: hashtextextended (stable across versions: hash partitioning
-- depends on it) over a length-prefixed concatenation, so no two scopes share an input. Two
-- scopes can still share a 64-bit hash: that only ever makes one of them wait or get a
-- spurious 409, never run twice (the lock only adds exclusion; the row is still the record).
CREATE FUNCTION idempotency_lock_key(p_tenant text, p_method text, p_path text, p_key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $fn$
    SELECT hashtextextended(
        octet_length(p_tenant) || ':' || p_tenant || octet_length(p_method) || ':' || p_method
        || octet_length(p_path) || ':' || p_path || octet_length(p_key) || ':' || p_key,
        7218830631155870501)
$fn$;

COMMENT ON FUNCTION idempotency_lock_key(text, text, text, text) IS
    'Key of the transaction-scoped advisory lock idempotency-actix takes before writing a scope''s row.';

-- The reserve function of the second migration, with the try-lock before each write.
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
            IF NOT pg_try_advisory_xact_lock(
                    idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                -- Held by another transaction: a transactional request whose reservation is
                -- not committed yet (its row is invisible to us), or a concurrent reserve.
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
            -- A concurrent insert of this key committed first: read it.
            CONTINUE;
        END IF;

        IF live OR NOT eligible THEN
            -- Replay, live reservation, or an ended reservation of another request: no write.
            outcome := 'existing';
            RETURN NEXT;
            RETURN;
        END IF;

        IF NOT pg_try_advisory_xact_lock(
                idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
            -- Held by another transaction: a transactional request whose reservation is
            -- not committed yet (its row is invisible to us), or a concurrent reserve.
            outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
            lease_remaining_us := p_lease_us; response_status := NULL;
            response_headers := NULL; response_body := NULL; live := true; eligible := true;
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
    'Reserve-or-fetch of idempotency-actix''s PostgresStore: reads first, writes only for an absent or ended eligible key and only under the scope''s advisory lock (try-variant: never waits); races resolved inside. See docs/sql.md.';

-- The claim of a transactional request: the tenant setting, then reserve-or-fetch inside the
-- caller's open transaction. A reservation made here is the caller's uncommitted row, under
-- the scope's advisory lock until the transaction ends: invisible to everyone else, and every
-- other writer of this scope fails its try-lock and answers 409 instead of waiting.
-- p_setting NULL: no tenant setting (no tenant source configured).
CREATE FUNCTION idempotency_tx_claim(
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
        -- Transaction-local (is_local = true): gone at COMMIT or ROLLBACK, so a pooled
        -- connection never carries one request's tenant into the next.
        PERFORM set_config(p_setting, p_setting_value, true);
    END IF;
    RETURN QUERY SELECT * FROM idempotency_reserve(p_tenant, p_method, p_path, p_key,
                                                   p_fingerprint, p_token, p_lease_us);
END
$fn$;

COMMENT ON FUNCTION idempotency_tx_claim(text, text, text, text, text, text, bytea, uuid, bigint) IS
    'Claim of idempotency-actix''s transactional mode: tenant setting, then idempotency_reserve in the caller''s transaction. See docs/sql.md.';
