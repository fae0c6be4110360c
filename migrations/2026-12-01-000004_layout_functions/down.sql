DROP FUNCTION IF EXISTS idempotency_response(text, text, text, text, uuid, timestamptz);
DROP FUNCTION IF EXISTS idempotency_replay(text, text, text, text);
DROP FUNCTION IF EXISTS idempotency_complete(text, text, text, text, uuid, smallint, bytea, bytea, bigint);
