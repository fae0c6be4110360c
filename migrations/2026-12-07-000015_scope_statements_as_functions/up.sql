-- The last three request-path statements that named the table's key become functions, like
-- reserve, complete and replay before them (migration 000004): idempotency_release,
-- idempotency_renew_lease and idempotency_completed_by. Same statements, same fences, both
-- layouts (the claims are `idempotency_keys` in each). docs/sql.md, "The request path is
-- function calls only".
--
-- Why: a statement the application sends names the table's key, so a migration that changes
-- the key (issue 13's hashed scope key: a digest of the scope as the primary key) would leave
-- app instances of the version before it sending statements that no index serves any more, on
-- every release of a non-2xx response, for the length of the rolling deploy. Once every
-- request-path statement is a function call, a migration can change the key by replacing the
-- functions, and app instances of either version send the same calls (as they already do for
-- reserve and complete: docs/operations.md, "Migrations").
--
-- CREATE OR REPLACE, as every migration from 000005 on: each can run again over itself.
-- LANGUAGE plpgsql, as idempotency_complete: its plans are prepared once per session (a SQL
-- function that writes is not inlined, and the SQL-function executor plans its body on every
-- call). Each returns whether it found its row, which is all the store reads.

-- Release (C9: only the holder, only while in flight): the holder's DELETE of its reservation.
CREATE OR REPLACE FUNCTION idempotency_release(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    DELETE FROM idempotency_keys k
     WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;

COMMENT ON FUNCTION idempotency_release(text, text, text, text, uuid) IS
    'Release of idempotency-actix''s PostgresStore: deletes the reservation, fenced by the token; true when it was still the holder''s. See docs/sql.md.';

-- Lease renewal: the holder moves its lease end (and the row's expiry with it) to now + lease.
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
     WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;

COMMENT ON FUNCTION idempotency_renew_lease(text, text, text, text, uuid, bigint) IS
    'Lease renewal of idempotency-actix''s PostgresStore, fenced by the token; true when applied. See docs/sql.md.';

-- Whether a completion this holder's earlier call may have made is stored: asked after a
-- complete that matched nothing (a retry after a lost answer).
CREATE OR REPLACE FUNCTION idempotency_completed_by(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid
)
RETURNS boolean
LANGUAGE plpgsql STABLE
AS $fn$
BEGIN
    PERFORM FROM idempotency_keys k
      WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
        AND k.idempotency_key = p_key AND k.state = 'completed' AND k.token = p_token;
    RETURN FOUND;
END
$fn$;

COMMENT ON FUNCTION idempotency_completed_by(text, text, text, text, uuid) IS
    'Whether the record is completed under this token (idempotency-actix''s check after a complete that matched nothing). See docs/sql.md.';
