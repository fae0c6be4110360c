-- The partitioned layout's complete no longer fails when `idem-cli purge` attaches the range
-- partition its response belongs to at that moment (docs/sql.md, "Partition maintenance").
-- Partitioned layout only; the function keeps its signature, so app instances of either
-- version work during a rolling deploy.
--
-- Why: `idempotency_partitions_create` attaches a new range partition, which takes an ACCESS
-- EXCLUSIVE lock on the default partition and scans it. A response INSERT whose expiry falls in
-- that range, planned before the ATTACH committed, is routed to the default partition and
-- waits for its lock behind the ATTACH; once the ATTACH commits, PostgreSQL checks the row
-- against the default partition's new, narrower constraint and refuses it (SQLSTATE 23514,
-- "violates partition constraint"). The complete failed: in the default mode the key stayed
-- in flight until the background retries stored it, in transactional mode the request was
-- rolled back with its handler's writes (COMMIT_FAILED). It needs the first write into a range
-- to coincide with that range's attach: a purge horizon at or near the TTL.
--
-- The INSERT is now tried again once when it fails with check_violation (the table has no
-- other check constraint): the second execution reads the partition list the ATTACH left and
-- routes the row to the new partition. The block with an EXCEPTION clause is a subtransaction
-- per complete; a miss costs one more savepoint inside the database, no round trip.
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
        FOR v_attempt IN 1..2 LOOP
            BEGIN
                INSERT INTO idempotency_responses (token, expires_at, response_headers, response_body)
                VALUES (p_token, v_expires_at, p_headers, p_body);
                RETURN true;
            EXCEPTION WHEN check_violation THEN
                -- Routed to the default partition by a partition list an ATTACH of this
                -- range replaced meanwhile: once more, with the new list.
                IF v_attempt = 2 THEN
                    RAISE;
                END IF;
            END;
        END LOOP;
        RETURN true;
    END
    $fn$
    $ddl$;
END
$do$;
