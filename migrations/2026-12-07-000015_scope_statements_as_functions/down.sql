-- The store of the version before this migration sends these statements itself.
DROP FUNCTION IF EXISTS idempotency_completed_by(text, text, text, text, uuid);
DROP FUNCTION IF EXISTS idempotency_renew_lease(text, text, text, text, uuid, bigint);
DROP FUNCTION IF EXISTS idempotency_release(text, text, text, text, uuid);
