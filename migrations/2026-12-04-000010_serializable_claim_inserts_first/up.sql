-- Transactional mode under SERIALIZABLE: the middleware's own statements no longer make
-- requests with different keys fail each other (docs/sql.md, "Under SERIALIZABLE";
-- docs/transactional.md, "Serialization failures"). Both layouts.
--
-- Why: serializable snapshot isolation tracks what a transaction reads, and a B-tree lookup is
-- tracked by the index *page* it read, whether it found a row or not. The claim read the
-- scope's primary-key entry before inserting it, and the complete looked its row up by the
-- primary key before updating it (a non-HOT update, so it also inserts index entries). Requests
-- open at once with keys on the same page (always, on a small table or a small tenant) each
-- wrote where another had read: read/write cycles, and PostgreSQL aborted requests at COMMIT,
-- with their handlers' writes, though nothing they did conflicted (8 requests open at once:
-- 7 failed; 8 concurrent completes: 2 to 7 failed).
--
-- What changes, under SERIALIZABLE only (other levels keep today's statements: without
-- serializable snapshot isolation a read takes no lock, and a replay then writes nothing):
-- - A claim that takes the scope's advisory lock (try-variant, as before) inserts first: an
--   INSERT is tracked as a write, not a read. When the row already exists, or the lock is held
--   elsewhere (another claim, replay, 409 or 422 of this scope is open), it reads through
--   idempotency_reserve as at every other level: a replay, a record in flight, a mismatch, an
--   ended record to take over. (Answering "in flight" on a held lock, as a first version of
--   this migration did, turned retries of a completed request into 409s whenever another
--   retry of it was open.)
-- - The claim keeps the new row's physical address in a transaction-local setting, and
--   idempotency_complete updates that row by address (a TID scan, no index read), fenced by
--   the token as before; it falls back to the primary-key lookup when the setting is absent
--   (every other caller) or the address holds no in-flight row with this token.
--
-- Why it is race-free (docs/sql.md's argument for the reserve function, unchanged):
-- - Every writer of a new row or a takeover holds the scope's advisory lock, taken without
--   waiting; a request that cannot take it writes nothing (idempotency_reserve reads, and its
--   own try-lock fails before any write), so the INSERT below never waits on another request's
--   uncommitted row of this scope.
-- - The lock is re-entrant: idempotency_reserve's own try-lock in this transaction succeeds.
-- - A row committed after this transaction's snapshot makes the INSERT's conflict check fail
--   with a serialization failure (40001) rather than do nothing: the middleware claims again in
--   a new transaction, as it does for the read-first claim's failures.
-- - The address is this transaction's own: set with is_local = true it ends with the
--   transaction, and the row it names was inserted by this transaction, so no one else can
--   have moved it; the token check makes a stale address match nothing.
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
#variable_conflict use_column
DECLARE
    v_claimed tid;
BEGIN
    IF p_setting IS NOT NULL THEN
        -- Transaction-local (is_local = true): gone at COMMIT or ROLLBACK, so a pooled
        -- connection never carries one request's tenant into the next.
        PERFORM set_config(p_setting, p_setting_value, true);
    END IF;
    -- Under SERIALIZABLE, a claim that takes the scope's lock inserts first. One that cannot
    -- take it is contended (a claim, a replay, a 409 or a 422 of this scope is open elsewhere)
    -- and reads, as at every other level: the row may be committed, and a retry of a completed
    -- request is a replay, never a 409.
    -- Nested, not `AND`: SQL does not promise to evaluate the isolation test first, and the
    -- lock must never be taken at another level.
    IF current_setting('transaction_isolation') = 'serializable' THEN
        IF pg_try_advisory_xact_lock(idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
            INSERT INTO idempotency_keys AS k
                (tenant, method, path, idempotency_key, fingerprint, state, token,
                 locked_until, created_at, expires_at)
            VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                    now() + p_lease_us * interval '1 microsecond', now(),
                    now() + p_lease_us * interval '1 microsecond')
            ON CONFLICT DO NOTHING
            RETURNING k.ctid INTO v_claimed;
            IF FOUND THEN
                -- For idempotency_complete: the row to update, found without an index read.
                PERFORM set_config('idempotency.claimed_row', v_claimed::text, true);
                outcome := 'reserved';
                RETURN NEXT;
                RETURN;
            END IF;
            -- The row exists: a replay, a record in flight, or an ended one to take over.
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM idempotency_reserve(p_tenant, p_method, p_path, p_key,
                                                   p_fingerprint, p_token, p_lease_us);
END
$fn$;

COMMENT ON FUNCTION idempotency_tx_claim(text, text, text, text, text, text, bytea, uuid, bigint) IS
    'Claim of idempotency-actix''s transactional mode: tenant setting, then reserve-or-fetch in the caller''s transaction (under SERIALIZABLE, insert first). See docs/sql.md.';

-- The plain layout's complete (migration 000004), by the claimed row's address first.
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
    DECLARE
        v_claimed tid := nullif(current_setting('idempotency.claimed_row', true), '')::tid;
    BEGIN
        -- The token is the fence (C9): a takeover wrote a new one under the row lock, so an
        -- old holder matches nothing. `state = 'in_flight'` keeps a second completion from
        -- overwriting the stored response.
        IF v_claimed IS NOT NULL THEN
            UPDATE idempotency_keys k
               SET state = 'completed', response_status = p_status, response_headers = p_headers,
                   response_body = p_body, completed_at = now(), locked_until = NULL,
                   expires_at = now() + p_ttl_us * interval '1 microsecond'
             WHERE k.ctid = v_claimed AND k.state = 'in_flight' AND k.token = p_token;
            IF FOUND THEN
                RETURN true;
            END IF;
        END IF;
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

-- The partitioned layout's complete (migration 000005), likewise.
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
