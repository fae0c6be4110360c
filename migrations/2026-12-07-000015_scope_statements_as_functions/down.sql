-- The store of the version before this migration sends these statements itself.
DROP FUNCTION idempotency_completed_by(text, text, text, text, uuid);
DROP FUNCTION idempotency_renew_lease(text, text, text, text, uuid, bigint);
DROP FUNCTION idempotency_release(text, text, text, text, uuid);
