-- The request-path and admin statements that touch the stored response, as functions, so the
-- store and idem-cli send the same statements whichever layout the database has (the
-- partitioned layout, migration 000005, replaces these with same-named functions over its two
-- tables; docs/sql.md, "Layouts").
--
-- 1. idempotency_complete: store the response, fenced by the token (the UPDATE the store sent
--    before, unchanged). true = applied, false = stale.
-- 2. idempotency_replay: the replay fast path's read of a live completed record, in the shape
--    of idempotency_reserve's row. LANGUAGE sql, STABLE, not STRICT, one SELECT: the planner
--    inlines it, so the plan is the plain primary-key lookup it replaces.
-- 3. idempotency_response: the stored response of a record (idem-cli show/list, test helpers),
--    given its scope, token and expiry (here the scope finds it; the partitioned layout uses
--    the token and expiry). Inlined too.

CREATE FUNCTION idempotency_complete(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
    p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    -- The token is the fence (C9): a takeover wrote a new one under the row lock, so an old
    -- holder matches nothing. `state = 'in_flight'` keeps a second completion from
    -- overwriting the stored response.
    UPDATE idempotency_keys k
       SET state = 'completed', response_status = p_status, response_headers = p_headers,
           response_body = p_body, completed_at = now(), locked_until = NULL,
           expires_at = now() + p_ttl_us * interval '1 microsecond'
     WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;

COMMENT ON FUNCTION idempotency_complete(text, text, text, text, uuid, smallint, bytea, bytea, bigint) IS
    'Complete of idempotency-actix''s PostgresStore: stores the response, fenced by the token; true when applied. See docs/sql.md.';

CREATE FUNCTION idempotency_replay(p_tenant text, p_method text, p_path text, p_key text)
RETURNS TABLE (
    outcome text, state text, fingerprint bytea, lease_remaining_us bigint,
    response_status smallint, response_headers bytea, response_body bytea,
    live boolean, eligible boolean
)
LANGUAGE sql STABLE
AS $fn$
    SELECT 'existing'::text, k.state, k.fingerprint,
           (extract(epoch FROM k.expires_at - now()) * 1000000)::bigint,
           k.response_status, k.response_headers, k.response_body, true, true
      FROM idempotency_keys k
     WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'completed' AND k.expires_at > now()
$fn$;

COMMENT ON FUNCTION idempotency_replay(text, text, text, text) IS
    'Replay fast path of idempotency-actix''s PostgresStore: a live completed record, shaped like idempotency_reserve''s row. Inlined by the planner. See docs/sql.md.';

CREATE FUNCTION idempotency_response(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid, p_expires_at timestamptz
)
RETURNS TABLE (response_headers bytea, response_body bytea)
LANGUAGE sql STABLE
AS $fn$
    SELECT k.response_headers, k.response_body
      FROM idempotency_keys k
     WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'completed'
$fn$;

COMMENT ON FUNCTION idempotency_response(text, text, text, text, uuid, timestamptz) IS
    'The stored response of a record (idem-cli show, list): headers and body. See docs/sql.md.';
