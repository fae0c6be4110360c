-- The two scratch tables that compare record-key layouts (bench/scale.sh, bench/hashed_key/):
-- today's four-text-column key (scale_text) against a 32-byte hashed key (scale_hash). Not the
-- store's table: their columns are named like the store's on purpose, so the two layouts store
-- the same bytes and compare like for like.
CREATE TABLE scale_text (
    tenant text NOT NULL, method text NOT NULL, path text NOT NULL, idempotency_key text NOT NULL,
    fingerprint bytea NOT NULL, state text NOT NULL, response_status smallint,
    response_headers bytea, response_body bytea, created_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, method, path, idempotency_key));
CREATE TABLE scale_hash (
    scope_hash bytea PRIMARY KEY,
    tenant text NOT NULL, method text NOT NULL, path text NOT NULL, idempotency_key text NOT NULL,
    fingerprint bytea NOT NULL, state text NOT NULL, response_status smallint,
    response_headers bytea, response_body bytea, created_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL);
-- The CLI's --tenant filter: in today's layout the primary key's leading column serves it.
CREATE INDEX scale_hash_tenant ON scale_hash (tenant);
