-- DRAFT, not a migration: issue 13's hashed scope key for the plain layout, with the digest
-- computed in SQL inside the functions (so app instances of every version agree during a
-- rolling deploy: they all call these functions). Measured by bench/hashed_key/store.sh
-- against the shipped plain layout (docs/benchmarks.md, "The hashed key, digest in SQL").
-- Generated from the shipped functions (pg_get_functiondef of a database provisioned by
-- migrations/) by two edits: every lookup by scope also names the digest (the parts are still
-- compared: a digest match alone is not identity), and every INSERT writes it. What a real
-- migration would add: the partitioned layout's functions, idem-cli's exact-scope queries,
-- down.sql, and the online path. The three functions of migration 000015 (release, lease
-- renewal, completed-by) are at the end: with them every statement the store sends is a
-- function call, so app instances of either version keep sending the same statements.

-- The digest of a scope: SHA-256 of the four parts in UTF-8, NUL-separated. A text value
-- cannot hold NUL, so no two scopes share an input. LANGUAGE sql, STABLE (convert_to is), one
-- expression that names each parameter once: the planner inlines it, so a lookup evaluates
-- sha256() once per statement, as an index key. (Declared IMMUTABLE, or with a parameter used
-- twice, it would not be inlined, and a call through the SQL-function executor costs tens of
-- microseconds: the first measurement of the hashed key paid that.)
CREATE FUNCTION idempotency_scope_digest(p_tenant text, p_method text, p_path text, p_key text)
RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE
AS $fn$
    SELECT sha256(convert_to(p_tenant, 'UTF8') || '\x00'::bytea || convert_to(p_method, 'UTF8')
                  || '\x00'::bytea || convert_to(p_path, 'UTF8') || '\x00'::bytea
                  || convert_to(p_key, 'UTF8'))
$fn$;

-- The table: the digest becomes the primary key (32 bytes an entry instead of the four text
-- columns), and a tenant index keeps idem-cli's --tenant filter an index scan. Rewrites the
-- table under ACCESS EXCLUSIVE: store.sh prints the time per table size.
ALTER TABLE idempotency_keys ADD COLUMN scope_digest bytea;
UPDATE idempotency_keys SET scope_digest = idempotency_scope_digest(tenant, method, path, idempotency_key);
ALTER TABLE idempotency_keys ALTER COLUMN scope_digest SET NOT NULL;
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope_digest);
CREATE INDEX idempotency_keys_tenant_idx ON idempotency_keys (tenant);

CREATE OR REPLACE FUNCTION public.idempotency_reserve(p_tenant text, p_method text, p_path text, p_key text, p_fingerprint bytea, p_token uuid, p_lease_us bigint)
 RETURNS TABLE(outcome text, state text, fingerprint bytea, lease_remaining_us bigint, response_status smallint, response_headers bytea, response_body bytea, live boolean, eligible boolean)
 LANGUAGE plpgsql
 ROWS 1
AS $function$
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
         WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
           AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
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
                (scope_digest, tenant, method, path, idempotency_key, fingerprint, state, token,
                 locked_until, created_at, expires_at)
            VALUES (idempotency_scope_digest(p_tenant, p_method, p_path, p_key),
                    p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
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
         WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
           AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
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
$function$;

CREATE OR REPLACE FUNCTION public.idempotency_tx_claim(p_setting text, p_setting_value text, p_tenant text, p_method text, p_path text, p_key text, p_fingerprint bytea, p_token uuid, p_lease_us bigint)
 RETURNS TABLE(outcome text, state text, fingerprint bytea, lease_remaining_us bigint, response_status smallint, response_headers bytea, response_body bytea, live boolean, eligible boolean)
 LANGUAGE plpgsql
 ROWS 1
AS $function$
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
                (scope_digest, tenant, method, path, idempotency_key, fingerprint, state, token,
                 locked_until, created_at, expires_at)
            VALUES (idempotency_scope_digest(p_tenant, p_method, p_path, p_key),
                    p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
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
$function$;

CREATE OR REPLACE FUNCTION public.idempotency_complete(p_tenant text, p_method text, p_path text, p_key text, p_token uuid, p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
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
         WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
           AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
        RETURN FOUND;
    END
    $function$;

CREATE OR REPLACE FUNCTION public.idempotency_replay(p_tenant text, p_method text, p_path text, p_key text)
 RETURNS TABLE(outcome text, state text, fingerprint bytea, lease_remaining_us bigint, response_status smallint, response_headers bytea, response_body bytea, live boolean, eligible boolean)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT 'existing'::text, k.state, k.fingerprint,
           (extract(epoch FROM k.expires_at - now()) * 1000000)::bigint,
           k.response_status, k.response_headers, k.response_body, true, true
      FROM idempotency_keys k
     WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
       AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'completed' AND k.expires_at > now()
$function$;

CREATE OR REPLACE FUNCTION public.idempotency_response(p_tenant text, p_method text, p_path text, p_key text, p_token uuid, p_expires_at timestamp with time zone)
 RETURNS TABLE(response_headers bytea, response_body bytea)
 LANGUAGE sql
 STABLE
AS $function$
    SELECT k.response_headers, k.response_body
      FROM idempotency_keys k
     WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
       AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'completed'
$function$;

CREATE OR REPLACE FUNCTION idempotency_release(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    DELETE FROM idempotency_keys k
     WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
       AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency_renew_lease(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid, p_lease_us bigint
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    UPDATE idempotency_keys k
       SET locked_until = now() + p_lease_us * interval '1 microsecond',
           expires_at = now() + p_lease_us * interval '1 microsecond'
     WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
       AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;

CREATE OR REPLACE FUNCTION idempotency_completed_by(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid
)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $fn$
BEGIN
    PERFORM FROM idempotency_keys k
      WHERE k.scope_digest = idempotency_scope_digest(p_tenant, p_method, p_path, p_key)
        AND k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
        AND k.idempotency_key = p_key AND k.state = 'completed' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;
