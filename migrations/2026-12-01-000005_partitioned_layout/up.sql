-- The time-partitioned layout (issue 15; docs/sql.md "Partitioned layout", docs/operations.md
-- "Choosing the partitioned layout"). A no-op unless the session that runs it asks for it:
--     SET idempotency.layout = 'partitioned';             -- `idem-cli migrate --partitioned`
--     SET idempotency.partition_interval = 'daily';       -- or 'hourly' (--interval)
-- It is a numbered migration rather than a second set of files so that migrations/ stays the
-- one source of the schema, diesel's bookkeeping records it either way (`migrate --check`
-- works for both layouts), and every later migration runs on both layouts (it must then test
-- `to_regclass('idempotency_responses')` before touching the response columns).
--
-- What it does, on a database provisioned just now (it refuses a non-empty idempotency_keys):
-- - idempotency_keys keeps the scope primary key, state, token, lease, fingerprint, expiry and
--   response_status; the response headers and body move out. The table stays unpartitioned,
--   so the primary key is still the whole scope and the race-freedom argument of the reserve
--   function holds unchanged for claims.
-- - idempotency_responses (token, expires_at, headers, body), PARTITION BY RANGE (expires_at),
--   primary key (token, expires_at). A response belongs to the reservation whose token it
--   carries; a takeover issues a new token, so an older response row is garbage that the drop
--   of its partition removes. A DEFAULT partition takes rows no range partition covers (long
--   TTLs), so no insert ever fails for want of a partition.
-- - The same-named functions of migrations 000003/000004 over the two tables, and the
--   partition maintenance functions idem-cli purge calls.
DO $do$
DECLARE
    v_layout text := coalesce(nullif(current_setting('idempotency.layout', true), ''), 'plain');
    v_interval text := coalesce(nullif(current_setting('idempotency.partition_interval', true), ''), 'daily');
BEGIN
    -- The rotated layout is migration 000016's: here it is the plain layout.
    IF v_layout IN ('plain', 'rotated') THEN
        RETURN;
    ELSIF v_layout <> 'partitioned' THEN
        RAISE EXCEPTION 'idempotency.layout must be plain, partitioned or rotated, not %', v_layout;
    END IF;
    IF v_interval NOT IN ('hourly', 'daily') THEN
        RAISE EXCEPTION 'idempotency.partition_interval must be hourly or daily, not %', v_interval;
    END IF;
    -- Locked before it is found empty: a claim not committed yet (a transactional request
    -- whose handler is running) is invisible to the test, and its complete would write the
    -- response into the columns dropped below, after the test passed. The lock waits for it
    -- (bounded by the session's lock_timeout), and the test then sees its row.
    LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM idempotency_keys) THEN
        RAISE EXCEPTION 'idempotency_keys is not empty: the partitioned layout is chosen when a database is provisioned (see docs/operations.md for moving a deployment)';
    END IF;

    EXECUTE $ddl$
    ALTER TABLE idempotency_keys
        DROP CONSTRAINT idempotency_keys_completed_check,
        DROP COLUMN response_headers,
        DROP COLUMN response_body,
        ADD CONSTRAINT idempotency_keys_completed_check CHECK (
            state <> 'completed' OR (response_status IS NOT NULL AND completed_at IS NOT NULL)
        )
    $ddl$;
    EXECUTE $ddl$
    COMMENT ON TABLE idempotency_keys IS
        'Idempotency-Key claims of idempotency-actix (partitioned layout): reservations in flight and completed records; the responses are in idempotency_responses.'
    $ddl$;

    EXECUTE $ddl$
    CREATE TABLE idempotency_responses (
        token            UUID        NOT NULL,
        expires_at       TIMESTAMPTZ NOT NULL,
        response_headers BYTEA       NOT NULL,
        response_body    BYTEA       NOT NULL,
        PRIMARY KEY (token, expires_at)
    ) PARTITION BY RANGE (expires_at)
    $ddl$;
    EXECUTE $ddl$
    COMMENT ON TABLE idempotency_responses IS
        'Stored responses of idempotency-actix (partitioned layout), by the token of the reservation that completed and its expiry. Range partitions are dropped by idem-cli purge once their upper bound is past.'
    $ddl$;
    EXECUTE 'CREATE TABLE idempotency_responses_default PARTITION OF idempotency_responses DEFAULT';
    -- Only the default partition is purged row by row (in expiry order); range partitions are
    -- dropped whole and need no such index.
    EXECUTE 'CREATE INDEX idempotency_responses_default_expires_at_idx ON idempotency_responses_default (expires_at)';

    EXECUTE $ddl$
    CREATE TABLE idempotency_partitioning (
        singleton BOOLEAN  PRIMARY KEY DEFAULT true CHECK (singleton),
        step      INTERVAL NOT NULL CHECK (step IN (interval '1 hour', interval '1 day'))
    )
    $ddl$;
    EXECUTE $ddl$
    COMMENT ON TABLE idempotency_partitioning IS
        'The partition interval of idempotency_responses, chosen at provisioning (idem-cli migrate --partitioned --interval).'
    $ddl$;
    EXECUTE format('INSERT INTO idempotency_partitioning (step) VALUES (%L)',
                   CASE v_interval WHEN 'hourly' THEN '1 hour' ELSE '1 day' END);

    -- Reserve-or-fetch: migration 000003's function (read first, try-lock before each write,
    -- the same outcomes), with the claim read from idempotency_keys and, for a live completed
    -- record only, the response from idempotency_responses by (token, expires_at): one more
    -- index probe in the same call, pruned to one partition.
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_reserve(
        p_tenant text, p_method text, p_path text, p_key text,
        p_fingerprint bytea, p_token uuid, p_lease_us bigint
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
        v_token uuid;
        v_expires_at timestamptz;
    BEGIN
        FOR attempt IN 1..4 LOOP
            SELECT k.state, k.fingerprint, k.response_status, k.token, k.expires_at,
                   k.expires_at > now(),
                   k.state = 'completed' OR k.fingerprint = p_fingerprint,
                   (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                    * 1000000)::bigint
              INTO state, fingerprint, response_status, v_token, v_expires_at,
                   live, eligible, lease_remaining_us
              FROM idempotency_keys k
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key;

            IF NOT FOUND THEN
                IF NOT pg_try_advisory_xact_lock(
                        idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                    outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                    lease_remaining_us := p_lease_us; response_status := NULL;
                    response_headers := NULL; response_body := NULL; live := true; eligible := true;
                    RETURN NEXT;
                    RETURN;
                END IF;
                INSERT INTO idempotency_keys AS k
                    (tenant, method, path, idempotency_key, fingerprint, state, token,
                     locked_until, created_at, expires_at)
                VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                        now() + p_lease_us * interval '1 microsecond', now(),
                        now() + p_lease_us * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
                IF FOUND THEN
                    outcome := 'reserved';
                    RETURN NEXT;
                    RETURN;
                END IF;
                CONTINUE;
            END IF;

            IF live OR NOT eligible THEN
                response_headers := NULL; response_body := NULL;
                IF live AND state = 'completed' THEN
                    -- The response the completing transaction inserted with the claim's
                    -- update: committed together, so visible to this later snapshot. Its
                    -- partition's upper bound is past expires_at > now(): never dropped yet.
                    SELECT r.response_headers, r.response_body
                      INTO response_headers, response_body
                      FROM idempotency_responses r
                     WHERE r.token = v_token AND r.expires_at = v_expires_at;
                    IF NOT FOUND THEN
                        -- Never answer a replay without its response (an empty body would be
                        -- a wrong answer): fail the call, the middleware answers 503.
                        RAISE EXCEPTION 'idempotency_responses has no row for a live completed record';
                    END IF;
                END IF;
                outcome := 'existing';
                RETURN NEXT;
                RETURN;
            END IF;

            IF NOT pg_try_advisory_xact_lock(
                    idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                lease_remaining_us := p_lease_us; response_status := NULL;
                response_headers := NULL; response_body := NULL; live := true; eligible := true;
                RETURN NEXT;
                RETURN;
            END IF;
            -- Takeover, fenced and re-checked under the row lock exactly as in the plain
            -- layout. The old response row (old token) is left to its partition's drop.
            UPDATE idempotency_keys k
               SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
                   locked_until = now() + p_lease_us * interval '1 microsecond',
                   expires_at = now() + p_lease_us * interval '1 microsecond',
                   created_at = now(), completed_at = NULL, response_status = NULL
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key
               AND k.expires_at <= now()
               AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
            IF FOUND THEN
                outcome := 'reserved';
                state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
                response_status := NULL; response_headers := NULL; response_body := NULL;
                live := NULL; eligible := NULL;
                RETURN NEXT;
                RETURN;
            END IF;
        END LOOP;

        outcome := 'raced';
        state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
        response_status := NULL; response_headers := NULL; response_body := NULL;
        live := NULL; eligible := NULL;
        RETURN NEXT;
    END
    $fn$
    $ddl$;

    -- Complete: the fenced claim update and the response insert, in one transaction (the
    -- statement's, or the request's in transactional mode), so a reader sees both or neither.
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
    BEGIN
        UPDATE idempotency_keys k
           SET state = 'completed', response_status = p_status, completed_at = now(),
               locked_until = NULL, expires_at = v_expires_at
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        -- The token is fresh per reservation and this is its only completion (the fenced
        -- update above matched once), so the key (token, expires_at) is new.
        INSERT INTO idempotency_responses (token, expires_at, response_headers, response_body)
        VALUES (p_token, v_expires_at, p_headers, p_body);
        RETURN true;
    END
    $fn$
    $ddl$;

    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_replay(p_tenant text, p_method text, p_path text, p_key text)
    RETURNS TABLE (
        outcome text, state text, fingerprint bytea, lease_remaining_us bigint,
        response_status smallint, response_headers bytea, response_body bytea,
        live boolean, eligible boolean
    )
    LANGUAGE sql STABLE
    AS $fn$
        SELECT 'existing'::text, k.state, k.fingerprint,
               (extract(epoch FROM k.expires_at - now()) * 1000000)::bigint,
               k.response_status, r.response_headers, r.response_body, true, true
          FROM idempotency_keys k
          JOIN idempotency_responses r ON r.token = k.token AND r.expires_at = k.expires_at
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'completed' AND k.expires_at > now()
    $fn$
    $ddl$;

    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_response(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid, p_expires_at timestamptz
    )
    RETURNS TABLE (response_headers bytea, response_body bytea)
    LANGUAGE sql STABLE
    AS $fn$
        SELECT r.response_headers, r.response_body
          FROM idempotency_responses r
         WHERE r.token = p_token AND r.expires_at = p_expires_at
    $fn$
    $ddl$;

    -- Partition maintenance (idem-cli purge). Each call is one transaction; p_lock_timeout_ms
    -- bounds how long it queues for its ACCESS EXCLUSIVE lock on idempotency_responses (and so
    -- how long live traffic queued behind that request waits); on timeout it fails and changes
    -- nothing, and the next run tries again.

    -- Create the partitions of the current interval and the next p_ahead ones that are
    -- missing, moving rows of their range out of the default partition first (a partition
    -- cannot be attached while the default holds rows of its range). Returns their names.
    EXECUTE $ddl$
    CREATE FUNCTION idempotency_partitions_create(p_ahead integer, p_lock_timeout_ms integer)
    RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_step interval := (SELECT step FROM idempotency_partitioning);
        v_unit text := CASE (SELECT step FROM idempotency_partitioning)
                           WHEN interval '1 hour' THEN 'hour' ELSE 'day' END;
        v_lo timestamptz;
        v_hi timestamptz;
        v_name text;
        v_locked boolean := false;
    BEGIN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
        FOR i IN 0..greatest(p_ahead, 0) LOOP
            -- Bounds in UTC, so an hourly or daily partition is the same span everywhere.
            v_lo := date_trunc(v_unit, now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + i * v_step;
            v_hi := v_lo + v_step;
            v_name := 'idempotency_responses_p'
                      || to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD_HH24');
            CONTINUE WHEN to_regclass(quote_ident(v_name)) IS NOT NULL;
            IF NOT v_locked THEN
                LOCK TABLE idempotency_responses IN ACCESS EXCLUSIVE MODE;
                v_locked := true;
            END IF;
            EXECUTE format('CREATE TABLE %I (LIKE idempotency_responses INCLUDING DEFAULTS)', v_name);
            EXECUTE format('WITH moved AS (DELETE FROM idempotency_responses_default
                                            WHERE expires_at >= $1 AND expires_at < $2
                                            RETURNING *)
                            INSERT INTO %I SELECT * FROM moved', v_name)
                USING v_lo, v_hi;
            EXECUTE format('ALTER TABLE idempotency_responses ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           v_name, v_lo, v_hi);
            RETURN NEXT v_name;
        END LOOP;
    END
    $fn$
    $ddl$;

    -- Drop the range partitions whose upper bound is at least p_grace_us in the past. Every
    -- row of such a partition has expires_at < upper bound <= now(): expired. A claim whose
    -- current response is in it has the same expires_at, so it is expired too and never
    -- replayed again (the reserve function takes an expired completed claim over without
    -- reading its response). Returns the names dropped.
    EXECUTE $ddl$
    CREATE FUNCTION idempotency_partitions_drop(p_grace_us bigint, p_lock_timeout_ms integer)
    RETURNS SETOF text
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_part record;
    BEGIN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
        FOR v_part IN
            SELECT p.name
              FROM idempotency_partitions() p
             WHERE NOT p.is_default
               AND p.upper_bound <= now() - p_grace_us * interval '1 microsecond'
             ORDER BY p.upper_bound
        LOOP
            EXECUTE format('DROP TABLE %I', v_part.name);
            RETURN NEXT v_part.name;
        END LOOP;
    END
    $fn$
    $ddl$;

    -- The partitions of idempotency_responses with their bounds (NULL for the default), as
    -- the catalog states them (pg_get_expr of the bound, read back in the same session).
    EXECUTE $ddl$
    CREATE FUNCTION idempotency_partitions()
    RETURNS TABLE (name text, is_default boolean, lower_bound timestamptz,
                   upper_bound timestamptz, bytes bigint, estimated_rows bigint)
    LANGUAGE sql STABLE
    AS $fn$
        SELECT c.relname::text, b.bound = 'DEFAULT',
               (regexp_match(b.bound, 'FROM \(''([^'']*)''\)'))[1]::timestamptz,
               (regexp_match(b.bound, 'TO \(''([^'']*)''\)'))[1]::timestamptz,
               pg_total_relation_size(c.oid), greatest(c.reltuples, 0)::bigint
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
          CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
         WHERE i.inhparent = 'idempotency_responses'::regclass
         ORDER BY 4 NULLS LAST
    $fn$
    $ddl$;

    -- Delete up to p_limit expired rows of the default partition (long TTLs); returns how many.
    EXECUTE $ddl$
    CREATE FUNCTION idempotency_purge_default(p_limit integer)
    RETURNS bigint
    LANGUAGE sql VOLATILE
    AS $fn$
        WITH gone AS (
            DELETE FROM idempotency_responses_default WHERE ctid = ANY (ARRAY(
                SELECT ctid FROM idempotency_responses_default
                 WHERE expires_at <= now()
                 ORDER BY expires_at LIMIT p_limit
                 FOR UPDATE SKIP LOCKED))
            RETURNING 1)
        SELECT count(*) FROM gone
    $fn$
    $ddl$;

    PERFORM idempotency_partitions_create(3, 60000);
END
$do$;
