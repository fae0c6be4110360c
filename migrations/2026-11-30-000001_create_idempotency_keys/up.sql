-- One row per idempotency key in its scope. Written by idempotency-actix's PostgresStore,
-- read and purged by idem-cli. See docs/sql.md (merged into docs/design.md) for the
-- statements that touch it and why each is one round trip and race-free.
CREATE TABLE idempotency_keys (
    tenant           TEXT        NOT NULL,
    method           TEXT        NOT NULL,
    path             TEXT        NOT NULL,
    idempotency_key  TEXT        NOT NULL,
    fingerprint      BYTEA       NOT NULL,
    state            TEXT        NOT NULL,
    token            UUID,
    locked_until     TIMESTAMPTZ,
    response_status  SMALLINT,
    response_headers BYTEA,
    response_body    BYTEA,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at     TIMESTAMPTZ,
    expires_at       TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, method, path, idempotency_key),
    CONSTRAINT idempotency_keys_state_check CHECK (state IN ('in_flight', 'completed')),
    CONSTRAINT idempotency_keys_in_flight_check CHECK (
        state <> 'in_flight' OR (token IS NOT NULL AND locked_until IS NOT NULL)
    ),
    CONSTRAINT idempotency_keys_completed_check CHECK (
        state <> 'completed' OR (
            response_status IS NOT NULL AND response_headers IS NOT NULL
            AND response_body IS NOT NULL AND completed_at IS NOT NULL
        )
    ),
    CONSTRAINT idempotency_keys_fingerprint_check CHECK (octet_length(fingerprint) = 32)
);

-- Purge walks expired rows in expiry order, in batches (ORDER BY expires_at LIMIT n).
-- Request-path statements never need it: they all look rows up by the primary key.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);

COMMENT ON TABLE idempotency_keys IS
    'Idempotency-Key records of idempotency-actix: reservations in flight and stored responses.';
COMMENT ON COLUMN idempotency_keys.tenant IS
    'Scope part 1: tenant from the configured extractor; empty string when none (global scope).';
COMMENT ON COLUMN idempotency_keys.method IS 'Scope part 2: HTTP method of the request.';
COMMENT ON COLUMN idempotency_keys.path IS 'Scope part 3: request path (without query string).';
COMMENT ON COLUMN idempotency_keys.idempotency_key IS
    'Scope part 4: the client''s Idempotency-Key, parsed (sf-string unescaped).';
COMMENT ON COLUMN idempotency_keys.fingerprint IS
    'SHA-256 of method, path, query and canonicalised body; a retry must match it (else 422).';
COMMENT ON COLUMN idempotency_keys.state IS
    'in_flight: a handler holds the reservation; completed: response stored for replay.';
COMMENT ON COLUMN idempotency_keys.token IS
    'Fencing token of the current reservation; complete and release must present it.';
COMMENT ON COLUMN idempotency_keys.locked_until IS
    'Lease deadline of an in_flight reservation; after it a retry may take the key over.';
COMMENT ON COLUMN idempotency_keys.response_status IS 'Stored HTTP status (completed rows).';
COMMENT ON COLUMN idempotency_keys.response_headers IS
    'Stored response headers, length-prefixed binary (see StoredResponse::decode_headers).';
COMMENT ON COLUMN idempotency_keys.response_body IS 'Stored response body, byte for byte.';
COMMENT ON COLUMN idempotency_keys.created_at IS 'When the current reservation was made.';
COMMENT ON COLUMN idempotency_keys.completed_at IS 'When the response was stored.';
COMMENT ON COLUMN idempotency_keys.expires_at IS
    'When the row stops mattering: completed rows at completion + TTL, in_flight rows at lease end (= locked_until).';
