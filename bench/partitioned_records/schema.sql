-- Issue 15's second design, as a measurable prototype (docs/benchmarks.md, "The whole record
-- partitioned, reserves serialised by scope"): not a layout the store ships.
--
-- Every record (claim and response together, as in the plain layout) lives in one table
-- partitioned by the time its reservation was made, so that purge could drop whole
-- partitions and delete nothing row by row. The primary key must then contain that time, so
-- it no longer makes one scope one row: two reserves of a new key would both insert. What
-- keeps one winner instead is the scope's transaction-scoped advisory lock (the one the
-- transactional claim already takes, `idempotency_lock_key`), taken with the try-variant
-- before every write, and a read under it: every write of a scope is made by a holder of
-- that lock, which it keeps to its commit, so the read after taking it sees the last one.
-- The price is the read: without the partition key in the WHERE clause it probes the primary
-- key index of every partition (newest row of the scope first). With `p_window` (the layout's
-- bound on TTL plus lease and grace, which such a layout would have to enforce) the read and
-- the complete skip the partitions made before the window, pruned when the plan starts.
--
--   psql -v parts=N -v filler=M -f schema.sql    (run after migrations/, which it borrows from)
--
-- N daily range partitions (the last one holds tomorrow, the one before it today) and a
-- DEFAULT partition; M expired completed records in each partition older than today; the
-- replay keys 'r-1'..'r-1000' live and completed in today's partition, as
-- bench/plain_statements/decompose.sh's plain layout has them.
DROP TABLE IF EXISTS idem_records;
-- The same columns, defaults and CHECK constraints as idempotency_keys.
CREATE TABLE idem_records (LIKE idempotency_keys INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (created_at);
ALTER TABLE idem_records ADD PRIMARY KEY (tenant, method, path, idempotency_key, created_at);
CREATE TABLE idem_records_default PARTITION OF idem_records DEFAULT;
SELECT format('CREATE TABLE idem_records_p%s PARTITION OF idem_records FOR VALUES FROM (%L) TO (%L)',
              i, day, day + interval '1 day')
  FROM (SELECT i, date_trunc('day', now()) + (i - :parts + 1) * interval '1 day' AS day
          FROM generate_series(1, :parts) i) d
\gexec

INSERT INTO idem_records (tenant, method, path, idempotency_key, fingerprint, state,
                          response_status, response_headers, response_body, created_at,
                          completed_at, expires_at)
SELECT '', 'POST', '/payments', 'x-' || i || '-' || g, decode(repeat('42', 32), 'hex'),
       'completed', 201, '\x00'::bytea, convert_to(repeat('x', 60), 'UTF8'),
       date_trunc('day', now()) + (i - :parts + 1) * interval '1 day' + interval '1 hour',
       date_trunc('day', now()) + (i - :parts + 1) * interval '1 day' + interval '1 hour',
       date_trunc('day', now()) + (i - :parts + 1) * interval '1 day' + interval '2 hours'
  FROM generate_series(1, :parts - 2) i, generate_series(1, :filler) g;
INSERT INTO idem_records (tenant, method, path, idempotency_key, fingerprint, state,
                          response_status, response_headers, response_body, created_at,
                          completed_at, expires_at)
SELECT '', 'POST', '/payments', 'r-' || g, decode(repeat('42', 32), 'hex'), 'completed', 201,
       '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea,
       '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea,
       now(), now(), now() + interval '1 day'
  FROM generate_series(1, 1000) g;

-- idempotency_reserve's outcomes and output row, on this table.
CREATE OR REPLACE FUNCTION idem_records_reserve(
    p_tenant text, p_method text, p_path text, p_key text,
    p_fingerprint bytea, p_token uuid, p_lease_us bigint, p_window interval DEFAULT NULL
)
RETURNS TABLE (
    outcome text, state text, fingerprint bytea, lease_remaining_us bigint,
    response_status smallint, response_headers bytea, response_body bytea,
    live boolean, eligible boolean
)
LANGUAGE plpgsql VOLATILE ROWS 1
AS $fn$
#variable_conflict use_column
DECLARE
    v_created timestamptz;
    v_locked boolean := false;
BEGIN
    FOR attempt IN 1..2 LOOP
        -- The newest row of the scope, no lock: one index probe per partition.
        SELECT k.state, k.fingerprint, k.response_status, k.response_headers, k.response_body,
               k.expires_at > now(),
               k.state = 'completed' OR k.fingerprint = p_fingerprint,
               (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                * 1000000)::bigint,
               k.created_at
          INTO state, fingerprint, response_status, response_headers, response_body,
               live, eligible, lease_remaining_us, v_created
          FROM idem_records k
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key
           AND k.created_at > now() - coalesce(p_window, interval '1000 years')
         ORDER BY k.created_at DESC
         LIMIT 1;

        IF FOUND AND (live OR NOT eligible) THEN
            -- Replay, live reservation, or an ended reservation of another request.
            outcome := 'existing';
            RETURN NEXT;
            RETURN;
        END IF;

        IF NOT v_locked THEN
            IF NOT pg_try_advisory_xact_lock(
                    idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                lease_remaining_us := p_lease_us; response_status := NULL;
                response_headers := NULL; response_body := NULL; live := true; eligible := true;
                RETURN NEXT;
                RETURN;
            END IF;
            v_locked := true;
            -- Read again, under the lock: the last write of this scope is now visible.
            CONTINUE;
        END IF;

        IF NOT FOUND OR state = 'completed' THEN
            -- Absent, or an expired completed record (which stays in its partition until the
            -- partition is dropped): a new row in the partition of now().
            INSERT INTO idem_records
                (tenant, method, path, idempotency_key, fingerprint, state, token,
                 locked_until, created_at, expires_at)
            VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                    now() + p_lease_us * interval '1 microsecond', now(),
                    now() + p_lease_us * interval '1 microsecond');
        ELSE
            -- An ended reservation of this request: taken over in place (its partition key
            -- does not change, so the row does not move).
            UPDATE idem_records k
               SET token = p_token,
                   locked_until = now() + p_lease_us * interval '1 microsecond',
                   expires_at = now() + p_lease_us * interval '1 microsecond'
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.created_at = v_created;
        END IF;
        outcome := 'reserved';
        state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
        response_status := NULL; response_headers := NULL; response_body := NULL;
        live := NULL; eligible := NULL;
        RETURN NEXT;
        RETURN;
    END LOOP;
END
$fn$;

-- idempotency_complete on this table: the token is the fence; without the partition key the
-- UPDATE probes every partition too.
CREATE OR REPLACE FUNCTION idem_records_complete(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
    p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint,
    p_window interval DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql
AS $fn$
BEGIN
    UPDATE idem_records k
       SET state = 'completed', response_status = p_status, response_headers = p_headers,
           response_body = p_body, completed_at = now(), locked_until = NULL,
           expires_at = now() + p_ttl_us * interval '1 microsecond'
     WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
       AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token
       AND k.created_at > now() - coalesce(p_window, interval '1000 years');
    RETURN FOUND;
END
$fn$;

VACUUM ANALYZE idem_records;
