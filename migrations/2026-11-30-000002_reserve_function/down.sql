DROP FUNCTION IF EXISTS idempotency_reserve(text, text, text, text, bytea, uuid, bigint);
