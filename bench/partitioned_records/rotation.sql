-- A third way to purge without row deletes, as a measurable prototype (docs/benchmarks.md,
-- "Generations rotated by hand"): not a layout the store ships.
--
-- Three plain tables like idempotency_keys (the whole record, primary key the scope), used in
-- turn: a job switches the current one every R, a bound on how long a record may matter (TTL,
-- and a reservation's lease plus grace), which the layout would have to enforce. A request reads
-- its generation's table first and the one before it second, and writes only into its own:
-- a new key, a takeover, and (not needed by the paths measured here) a completion or renewal of
-- a reservation made in the generation before, which moves the row. So a row in the third table
-- was last written at least R ago and has expired, and purge is a TRUNCATE of that table, which
-- no request reads. One winner per scope is still the primary key's: every write that decides
-- is an INSERT into the current table (ON CONFLICT DO NOTHING) or an UPDATE under its row lock
-- there; a row left behind in the older table is shadowed, because the current table is read
-- first.
--
--   psql -v filler=M -f rotation.sql    (run after migrations/, which it borrows from)
--
-- M expired records in the older table and M in the third; the replay keys 'r-1'..'r-1000'
-- live and completed in the current table, and 'o-1'..'o-1000' in the older one.
DROP TABLE IF EXISTS idem_rot_0, idem_rot_1, idem_rot_2;
CREATE TABLE idem_rot_0 (LIKE idempotency_keys INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE idem_rot_0 ADD PRIMARY KEY (tenant, method, path, idempotency_key);
CREATE TABLE idem_rot_1 (LIKE idem_rot_0 INCLUDING ALL);
CREATE TABLE idem_rot_2 (LIKE idem_rot_0 INCLUDING ALL);

-- The current generation, which the job that rotates moves (after a TRUNCATE of the table it
-- moves to). A writer reads it under its scope's advisory lock, which every writer of the
-- scope takes, and then reads both tables again: so a writer that began before a switch and
-- committed into the table before the current one is seen (see the reserve function). That
-- needs R longer than any transaction, so that no write lands two generations back.
CREATE TABLE IF NOT EXISTS idem_rot_state (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    gen int NOT NULL CHECK (gen IN (0, 1, 2))
);
INSERT INTO idem_rot_state (gen) VALUES (1) ON CONFLICT (singleton) DO UPDATE SET gen = 1;
-- For placing the rows below; the functions read the row with a statement of their own (a
-- SQL function called per request cost replays 0.70x, docs/benchmarks.md).
CREATE OR REPLACE FUNCTION idem_rot_generation() RETURNS int
LANGUAGE sql STABLE
AS $$ SELECT gen FROM idem_rot_state $$;

SELECT format($f$
INSERT INTO %1$I (tenant, method, path, idempotency_key, fingerprint, state, response_status,
                  response_headers, response_body, created_at, completed_at, expires_at)
SELECT '', 'POST', '/payments', 'x-' || g, decode(repeat('42', 32), 'hex'), 'completed', 201,
       '\x00'::bytea, convert_to(repeat('x', 60), 'UTF8'), now() - interval '2 days',
       now() - interval '2 days', now() - interval '1 day'
  FROM generate_series(1, %2$s) g
$f$, 'idem_rot_' || ((idem_rot_generation() + n) % 3), :filler)
  FROM generate_series(1, 2) n
\gexec
SELECT format($f$
INSERT INTO %1$I (tenant, method, path, idempotency_key, fingerprint, state, response_status,
                  response_headers, response_body, created_at, completed_at, expires_at)
SELECT '', 'POST', '/payments', %2$L || g, decode(repeat('42', 32), 'hex'), 'completed', 201,
       '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea,
       '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea,
       now(), now(), now() + interval '1 day'
  FROM generate_series(1, 1000) g
$f$, 'idem_rot_' || ((idem_rot_generation() + n) % 3), CASE n WHEN 0 THEN 'r-' ELSE 'o-' END)
  FROM generate_series(0, 2, 2) n
\gexec

-- idempotency_reserve's outcomes and output row. PL/pgSQL plans each static statement once per
-- connection, so each table gets its own statement, chosen by the generation: the three
-- branches repeat on purpose. One statement built and run with EXECUTE would be planned on
-- every call (docs/benchmarks.md, "Two ways around the generic plan": 13,000-15,000 against
-- 22,000-23,000 replays/s).
CREATE OR REPLACE FUNCTION idem_rot_reserve(
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
    v_gen int;
    v_switched int;
    v_locked boolean := false;
    v_steps int[] := ARRAY[0, 2];
    v_step int;
    v_table int;
    v_found boolean;
BEGIN
    -- The generation this session saw last: a read needs no more. Stale (a switch since), it
    -- reads the tables before the current ones; what it finds there is still the newest row of
    -- its scope unless that row has ended (rows written since are in the current table), and
    -- an ended row or none sends it to the write path, which checks the generation.
    v_gen := nullif(current_setting('idempotency.rot_gen', true), '')::int;
    IF v_gen IS NULL THEN
        SELECT gen INTO v_gen FROM idem_rot_state;
        PERFORM set_config('idempotency.rot_gen', v_gen::text, false);
    END IF;
    FOR attempt IN 1..4 LOOP
        v_found := false;
        -- The current table, then the one before it (2 = -1 mod 3).
        FOREACH v_step IN ARRAY v_steps LOOP
            v_table := (v_gen + v_step) % 3;
            IF v_table = 0 THEN
                SELECT k.state, k.fingerprint, k.response_status, k.response_headers,
                       k.response_body, k.expires_at > now(),
                       k.state = 'completed' OR k.fingerprint = p_fingerprint,
                       (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                        * 1000000)::bigint
                  INTO state, fingerprint, response_status, response_headers, response_body,
                       live, eligible, lease_remaining_us
                  FROM idem_rot_0 k
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key;
            ELSIF v_table = 1 THEN
                SELECT k.state, k.fingerprint, k.response_status, k.response_headers,
                       k.response_body, k.expires_at > now(),
                       k.state = 'completed' OR k.fingerprint = p_fingerprint,
                       (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                        * 1000000)::bigint
                  INTO state, fingerprint, response_status, response_headers, response_body,
                       live, eligible, lease_remaining_us
                  FROM idem_rot_1 k
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key;
            ELSE
                SELECT k.state, k.fingerprint, k.response_status, k.response_headers,
                       k.response_body, k.expires_at > now(),
                       k.state = 'completed' OR k.fingerprint = p_fingerprint,
                       (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                        * 1000000)::bigint
                  INTO state, fingerprint, response_status, response_headers, response_body,
                       live, eligible, lease_remaining_us
                  FROM idem_rot_2 k
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key;
            END IF;
            v_found := FOUND;
            EXIT WHEN v_found;
        END LOOP;
        v_steps := ARRAY[0, 2];

        IF v_found AND (live OR NOT eligible) THEN
            outcome := 'existing';
            RETURN NEXT;
            RETURN;
        END IF;

        IF NOT v_locked THEN
            IF NOT pg_try_advisory_xact_lock(
                    idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                lease_remaining_us := p_lease_us; response_status := NULL;
                response_headers := NULL; response_body := NULL; live := true;
                eligible := true;
                RETURN NEXT;
                RETURN;
            END IF;
            v_locked := true;
            -- Every earlier writer of this scope has ended now (each held this lock from its
            -- own read of the generation to its commit). Read the generation as it is: after a
            -- switch, both tables again.
            SELECT gen INTO v_switched FROM idem_rot_state;
            IF v_switched <> v_gen THEN
                v_gen := v_switched;
                PERFORM set_config('idempotency.rot_gen', v_gen::text, false);
                CONTINUE;
            END IF;
            IF NOT (v_found AND v_step = 0) THEN
                -- Nothing in the current table: a row committed there since is caught by the
                -- INSERT's conflict, but one that a writer which read the generation before a
                -- switch committed into the older table is not: read that one again. (A row
                -- in the current table shadows the older one, and its takeover re-checks under
                -- the row lock.)
                v_steps := ARRAY[2];
                CONTINUE;
            END IF;
        END IF;

        IF v_found AND v_step = 0 THEN
            -- Ended and eligible, in the current table: taken over in place, the conditions
            -- re-checked under the row lock (as in the plain layout).
            IF v_table = 0 THEN
                UPDATE idem_rot_0 k
                   SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
                       locked_until = now() + p_lease_us * interval '1 microsecond',
                       expires_at = now() + p_lease_us * interval '1 microsecond',
                       created_at = now(), completed_at = NULL, response_status = NULL,
                       response_headers = NULL, response_body = NULL
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key AND k.expires_at <= now()
                   AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
            ELSIF v_table = 1 THEN
                UPDATE idem_rot_1 k
                   SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
                       locked_until = now() + p_lease_us * interval '1 microsecond',
                       expires_at = now() + p_lease_us * interval '1 microsecond',
                       created_at = now(), completed_at = NULL, response_status = NULL,
                       response_headers = NULL, response_body = NULL
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key AND k.expires_at <= now()
                   AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
            ELSE
                UPDATE idem_rot_2 k
                   SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
                       locked_until = now() + p_lease_us * interval '1 microsecond',
                       expires_at = now() + p_lease_us * interval '1 microsecond',
                       created_at = now(), completed_at = NULL, response_status = NULL,
                       response_headers = NULL, response_body = NULL
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key AND k.expires_at <= now()
                   AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
            END IF;
        ELSE
            -- Absent, or ended and eligible in the older table (left there, shadowed): a new
            -- row in the current table, whose primary key decides between racing writers.
            IF v_gen = 0 THEN
                INSERT INTO idem_rot_0 (tenant, method, path, idempotency_key, fingerprint,
                                        state, token, locked_until, created_at, expires_at)
                VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                        now() + p_lease_us * interval '1 microsecond', now(),
                        now() + p_lease_us * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
            ELSIF v_gen = 1 THEN
                INSERT INTO idem_rot_1 (tenant, method, path, idempotency_key, fingerprint,
                                        state, token, locked_until, created_at, expires_at)
                VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                        now() + p_lease_us * interval '1 microsecond', now(),
                        now() + p_lease_us * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
            ELSE
                INSERT INTO idem_rot_2 (tenant, method, path, idempotency_key, fingerprint,
                                        state, token, locked_until, created_at, expires_at)
                VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                        now() + p_lease_us * interval '1 microsecond', now(),
                        now() + p_lease_us * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
            END IF;
        END IF;
        IF FOUND THEN
            outcome := 'reserved';
            state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
            response_status := NULL; response_headers := NULL; response_body := NULL;
            live := NULL; eligible := NULL;
            RETURN NEXT;
            RETURN;
        END IF;
        -- Lost to a concurrent writer: read again.
    END LOOP;
    outcome := 'raced';
    state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
    response_status := NULL; response_headers := NULL; response_body := NULL;
    live := NULL; eligible := NULL;
    RETURN NEXT;
END
$fn$;

-- idempotency_complete, for a reservation made in the current generation (the only one the
-- measured miss makes; one made in the generation before would be moved into the current
-- table here, as the header says).
CREATE OR REPLACE FUNCTION idem_rot_complete(
    p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
    p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint
)
RETURNS boolean
LANGUAGE plpgsql
AS $fn$
DECLARE
    v_gen int;
BEGIN
    -- A completion sets an expiry up to R ahead: it is written into the table that is current
    -- now (a switch during this transaction still leaves that table R before its truncation).
    SELECT gen INTO v_gen FROM idem_rot_state;
    IF v_gen = 0 THEN
        UPDATE idem_rot_0 k
           SET state = 'completed', response_status = p_status, response_headers = p_headers,
               response_body = p_body, completed_at = now(), locked_until = NULL,
               expires_at = now() + p_ttl_us * interval '1 microsecond'
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    ELSIF v_gen = 1 THEN
        UPDATE idem_rot_1 k
           SET state = 'completed', response_status = p_status, response_headers = p_headers,
               response_body = p_body, completed_at = now(), locked_until = NULL,
               expires_at = now() + p_ttl_us * interval '1 microsecond'
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    ELSE
        UPDATE idem_rot_2 k
           SET state = 'completed', response_status = p_status, response_headers = p_headers,
               response_body = p_body, completed_at = now(), locked_until = NULL,
               expires_at = now() + p_ttl_us * interval '1 microsecond'
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    END IF;
    RETURN FOUND;
END
$fn$;

VACUUM ANALYZE idem_rot_0;
VACUUM ANALYZE idem_rot_1;
VACUUM ANALYZE idem_rot_2;
