-- The rotated layout (issue 15; docs/benchmarks.md, "Generations rotated by hand", where its
-- prototype was measured: replays within noise of the plain layout, purge by TRUNCATE). A no-op
-- unless the session that provisions a database asks for it:
--     SET idempotency.layout = 'rotated';
--     SET idempotency.rotation_period = '2 days';     -- R below; at least 1 hour
-- Chosen, like the partitioned layout of migration 000005, when a database is provisioned: it
-- refuses a non-empty idempotency_keys.
--
-- The record is the plain layout's row, kept in three plain tables used in turn,
-- idempotency_keys_0/_1/_2. One of them is current (idempotency_generation names it); the one
-- before it is the previous; the third is next. Every write goes into the current table, and a
-- request reads the current table and then the previous one. idempotency_rotate(), which
-- `idem-cli purge` calls, empties the next table (TRUNCATE: no row deleted, no WAL per row) and
-- makes it current, at most once per R. The previous table then becomes the next one, which no
-- request reads; the rotation first carries into the new current table the few records in it
-- that still matter (a TTL, or a reservation's lease plus purge's grace, longer than R), so R
-- bounds no TTL: it sets how often the tables turn over and how long dead rows stay on disk
-- (up to 3R).
--
-- One row per scope across the current and previous tables (docs/sql.md, "Rotated layout",
-- gives the whole argument):
-- - A row is only ever in one of them. A write to a row found in the previous table moves it:
--   DELETE there (under its row lock, conditions re-checked) and INSERT into the current one,
--   in one transaction. So every fenced write (complete, renewal, release) and every takeover
--   meets the other on the same row lock, as in the plain layout.
-- - A new row is inserted only by a writer that holds the scope's advisory lock and has read
--   the generation, then both tables, after taking it: every earlier writer of the scope has
--   committed by then, into the table its own read of the generation named, which is the
--   current or the previous one, so this writer sees its row. That needs every transaction to
--   end within R (a writer two generations late would write into the next table); rotation
--   refuses while a transaction older than the last switch is open.
-- - A reader uses the generation its session read last, so a replay reads no extra row. A
--   session behind by a rotation or more reads other tables than the current and previous
--   ones, where a live row is still the scope's newest: a newer row comes from a move, a
--   takeover or a rotation's carry, which all delete the row it would find, and the carry
--   judges what still matters as of the start of the oldest open transaction, so a table a
--   rotation made unread holds no row such a reader would call live. Anything else sends it to
--   the write path, which reads the generation afresh and brings the session up to date.
DO $do$
DECLARE
    v_layout text := coalesce(nullif(current_setting('idempotency.layout', true), ''), 'plain');
    v_period interval := coalesce(
        nullif(current_setting('idempotency.rotation_period', true), ''), '2 days')::interval;
BEGIN
    IF v_layout <> 'rotated' THEN
        RETURN;
    END IF;
    IF v_period < interval '1 hour' THEN
        RAISE EXCEPTION 'idempotency.rotation_period must be at least 1 hour, not %', v_period;
    END IF;
    IF to_regclass('idempotency_responses') IS NOT NULL THEN
        RAISE EXCEPTION 'this database has the partitioned layout: a layout is chosen when a database is provisioned (see docs/operations.md)';
    END IF;
    -- As in 000005: locked before it is found empty, so a claim not committed yet is waited for.
    LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM idempotency_keys) THEN
        RAISE EXCEPTION 'idempotency_keys is not empty: the rotated layout is chosen when a database is provisioned (see docs/operations.md for moving a deployment)';
    END IF;

    EXECUTE 'ALTER TABLE idempotency_keys RENAME TO idempotency_keys_0';
    EXECUTE 'ALTER INDEX idempotency_keys_pkey RENAME TO idempotency_keys_0_pkey';
    EXECUTE 'ALTER INDEX idempotency_keys_expires_at_idx RENAME TO idempotency_keys_0_expires_at_idx';
    EXECUTE 'CREATE TABLE idempotency_keys_1 (LIKE idempotency_keys_0 INCLUDING ALL)';
    EXECUTE 'CREATE TABLE idempotency_keys_2 (LIKE idempotency_keys_0 INCLUDING ALL)';
    FOR g IN 0..2 LOOP
        EXECUTE format($ddl$
        COMMENT ON TABLE %I IS
            'Idempotency-Key records of idempotency-actix (rotated layout), generation table %s of 3: current, previous or next as idempotency_generation says; emptied by idempotency_rotate() before it becomes current.'
        $ddl$, 'idempotency_keys_' || g, g);
    END LOOP;

    EXECUTE $ddl$
    CREATE TABLE idempotency_generation (
        singleton   BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
        current     SMALLINT    NOT NULL CHECK (current BETWEEN 0 AND 2),
        switched_at TIMESTAMPTZ NOT NULL,
        period      INTERVAL    NOT NULL CHECK (period > interval '0')
    )
    $ddl$;
    EXECUTE $ddl$
    COMMENT ON TABLE idempotency_generation IS
        'The current generation table of idempotency-actix''s rotated layout (idempotency_keys_<current>), when it became current, and R: the least time between two rotations (at least 1 hour when provisioned).'
    $ddl$;
    EXECUTE 'INSERT INTO idempotency_generation (current, switched_at, period) VALUES (0, now(), $1)'
        USING v_period;

    -- What idem-cli reads (list, show, stats): the records of the current and previous tables.
    -- The next table's rows are garbage awaiting its TRUNCATE, and a scope may have a row
    -- there as well as a newer one in the other two.
    EXECUTE $ddl$
    CREATE VIEW idempotency_keys AS
        SELECT k.* FROM idempotency_keys_0 k
         WHERE (SELECT g.current FROM idempotency_generation g) IN (0, 1)
        UNION ALL
        SELECT k.* FROM idempotency_keys_1 k
         WHERE (SELECT g.current FROM idempotency_generation g) IN (1, 2)
        UNION ALL
        SELECT k.* FROM idempotency_keys_2 k
         WHERE (SELECT g.current FROM idempotency_generation g) IN (2, 0)
    $ddl$;
    -- (A scalar subquery, not a join: each branch is then gated by one evaluation of it, and
    -- the planner does not multiply each table's rows by its guess of the generation table's.
    -- With the join, and the tables not analysed yet, an idem-cli query with a response
    -- column was estimated costly enough to be JIT-compiled: 0.7 s for one row.)
    EXECUTE 'ANALYZE idempotency_generation';
    -- With the reader's rights (PostgreSQL 15 on), so that row-level security on the tables
    -- applies to it too; otherwise the owner's, which bypass it.
    IF current_setting('server_version_num')::int >= 150000 THEN
        EXECUTE 'ALTER VIEW idempotency_keys SET (security_invoker = true)';
    END IF;
    EXECUTE $ddl$
    COMMENT ON VIEW idempotency_keys IS
        'Idempotency-Key records of idempotency-actix (rotated layout): the current and previous generation tables. Read-only; the store writes through its functions.'
    $ddl$;

    -- The generation as a writer must read it: the committed row. Under REPEATABLE READ or
    -- SERIALIZABLE a plain read returns the transaction's snapshot, which may predate a
    -- rotation, and a write decided on it could land beside the scope's newer row in the table
    -- that rotation made current; locking the row (FOR KEY SHARE) fails with a serialization
    -- failure (40001) when a rotation replaced it since, and the caller retries the
    -- transaction, as the plain layout's INSERT does when it meets a row newer than its
    -- snapshot. READ COMMITTED reads the newest row anyway, without a lock: one row that every
    -- writer locked would cost each of them a multixact.
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_generation_for_write(OUT o_current smallint)
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    BEGIN
        IF current_setting('transaction_isolation') = 'read committed' THEN
            SELECT g.current INTO o_current FROM idempotency_generation g;
        ELSE
            SELECT g.current INTO o_current FROM idempotency_generation g FOR KEY SHARE;
        END IF;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'idempotency_generation has no row'
                USING ERRCODE = 'serialization_failure';
        END IF;
    END
    $fn$
    $ddl$;

    -- Writes through the view (idem-cli release, and a test's or an operator's UPDATE of a
    -- record) go to the table that holds the row: a scope has at most one row in the current
    -- and previous tables. Not a request path: a statement built per call is fine here.
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_keys_write() RETURNS trigger
    LANGUAGE plpgsql
    AS $fn$
    DECLARE
        v_gen int;
        v_fresh int;
        v_table text;
        v_found boolean;
    BEGIN
        SELECT o_current INTO v_gen FROM idempotency_generation_for_write();
        IF TG_OP = 'INSERT' THEN
            -- A new row, as the reserve function makes one: under the scope's lock, and only
            -- if neither table the requests read holds the scope.
            PERFORM pg_advisory_xact_lock(
                idempotency_lock_key(NEW.tenant, NEW.method, NEW.path, NEW.idempotency_key));
            SELECT o_current INTO v_gen FROM idempotency_generation_for_write();
            FOREACH v_table IN ARRAY ARRAY['idempotency_keys_' || (v_gen + 2) % 3,
                                           'idempotency_keys_' || v_gen] LOOP
                EXECUTE format('SELECT EXISTS (SELECT FROM %I k WHERE (k.tenant, k.method, k.path, k.idempotency_key) = ($1.tenant, $1.method, $1.path, $1.idempotency_key))', v_table)
                    INTO v_found USING NEW;
                IF v_found THEN
                    RAISE EXCEPTION 'a record of this scope exists in %', v_table
                        USING ERRCODE = 'unique_violation';
                END IF;
            END LOOP;
            EXECUTE format('INSERT INTO %I SELECT ($1).*', 'idempotency_keys_' || v_gen) USING NEW;
            RETURN NEW;
        END IF;
        -- The row as the statement read it (same state, token and expiry: a renewal or a
        -- takeover since is not undone), in the table that holds it; again after a rotation
        -- that may have moved it.
        FOR attempt IN 1..3 LOOP
            FOREACH v_table IN ARRAY ARRAY['idempotency_keys_' || v_gen,
                                           'idempotency_keys_' || (v_gen + 2) % 3] LOOP
                IF TG_OP = 'DELETE' THEN
                    EXECUTE format('DELETE FROM %I k WHERE (k.tenant, k.method, k.path, k.idempotency_key) = ($1.tenant, $1.method, $1.path, $1.idempotency_key) AND k.state = $1.state AND k.token IS NOT DISTINCT FROM $1.token', v_table)
                        USING OLD;
                ELSE
                    EXECUTE format('UPDATE %I k SET (tenant, method, path, idempotency_key, fingerprint, state, token, locked_until, response_status, response_headers, response_body, created_at, completed_at, expires_at) = (SELECT ($2).*) WHERE (k.tenant, k.method, k.path, k.idempotency_key) = ($1.tenant, $1.method, $1.path, $1.idempotency_key) AND k.state = $1.state AND k.token IS NOT DISTINCT FROM $1.token AND k.expires_at = $1.expires_at', v_table)
                        USING OLD, NEW;
                END IF;
                GET DIAGNOSTICS v_found = ROW_COUNT;
                IF v_found THEN
                    RETURN CASE TG_OP WHEN 'DELETE' THEN OLD ELSE NEW END;
                END IF;
            END LOOP;
            SELECT o_current INTO v_fresh FROM idempotency_generation_for_write();
            EXIT WHEN v_fresh = v_gen;
            v_gen := v_fresh;
        END LOOP;
        RETURN NULL;
    END
    $fn$
    $ddl$;
    EXECUTE 'ALTER VIEW idempotency_keys ALTER COLUMN created_at SET DEFAULT now()';
    EXECUTE $ddl$
    CREATE TRIGGER idempotency_keys_write INSTEAD OF INSERT OR UPDATE OR DELETE
        ON idempotency_keys FOR EACH ROW EXECUTE FUNCTION idempotency_keys_write()
    $ddl$;

    -- idempotency_purge_rows: the plain layout's purge statement (docs/sql.md, "Purge") on the
    -- current and previous tables, which the store's purge_expired and idem-cli purge call
    -- between rotations (a rotation empties the next table whole). Same rows, same
    -- SKIP LOCKED, same counts; `p_limit` rows at most in all.
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_purge_rows(
        p_grace_us bigint, p_older_than_us bigint, p_tenant text, p_limit bigint
    )
    RETURNS TABLE (completed bigint, in_flight bigint)
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    #variable_conflict use_column
    DECLARE
        v_gen int;
        v_completed bigint;
        v_in_flight bigint;
    BEGIN
        SELECT g.current INTO v_gen FROM idempotency_generation g;
        completed := 0;
        in_flight := 0;
        FOR v_step IN 0..1 LOOP
            EXIT WHEN completed + in_flight >= p_limit;
            EXECUTE format($q$
                WITH gone AS (
                    DELETE FROM %1$I WHERE ctid = ANY (ARRAY(
                        SELECT ctid FROM %1$I k
                         WHERE k.expires_at <= now()
                           AND (k.state = 'completed'
                                OR k.expires_at <= now() - $1 * interval '1 microsecond')
                           AND ($2::bigint IS NULL
                                OR k.created_at <= now() - $2 * interval '1 microsecond')
                           AND ($3::text IS NULL OR k.tenant = $3)
                         ORDER BY k.expires_at LIMIT $4 FOR UPDATE SKIP LOCKED))
                    RETURNING state)
                SELECT count(*) FILTER (WHERE state = 'completed'),
                       count(*) FILTER (WHERE state = 'in_flight')
                  FROM gone
            $q$, 'idempotency_keys_' || (v_gen + 3 - v_step) % 3)
            INTO v_completed, v_in_flight
            USING p_grace_us, p_older_than_us, p_tenant, p_limit - completed - in_flight;
            completed := completed + v_completed;
            in_flight := in_flight + v_in_flight;
        END LOOP;
        RETURN NEXT;
    END
    $fn$
    $ddl$;

    -- Each function below names each table in its own static statement (PL/pgSQL plans a
    -- static statement once per session; one built with EXECUTE is planned on every call, which
    -- cost replays 40 % in the partitioned layout's measurement). So a statement is written once
    -- here, with @T for its table (and @P for the table before it: the previous one when @T
    -- is current), and pg_temp.per_table expands it into a branch per table.
    CREATE FUNCTION pg_temp.per_table(p_var text, p_stmt text) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $f$
        SELECT format('IF %1$s = 0 THEN %2$s ELSIF %1$s = 1 THEN %3$s ELSE %4$s END IF;',
                      p_var,
                      replace(replace(p_stmt, '@T', 'idempotency_keys_0'), '@P', 'idempotency_keys_2'),
                      replace(replace(p_stmt, '@T', 'idempotency_keys_1'), '@P', 'idempotency_keys_0'),
                      replace(replace(p_stmt, '@T', 'idempotency_keys_2'), '@P', 'idempotency_keys_1'))
    $f$;

    -- A writer's read of the generation, @GENERATION(variable) in the bodies below: under READ
    -- COMMITTED the newest row, read in place (a call of idempotency_generation_for_write per
    -- write cost misses a tenth: docs/benchmarks.md, "Rotated layout, as shipped"); otherwise
    -- through that function, which locks it.
    CREATE FUNCTION pg_temp.with_generation_reads(p_body text) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $f$
        SELECT regexp_replace(p_body, '@GENERATION\((\w+)\)',
            'IF current_setting(''transaction_isolation'') = ''read committed'' THEN '
            'SELECT g.current INTO \1 FROM idempotency_generation g; '
            'ELSE SELECT o_current INTO \1 FROM idempotency_generation_for_write(); END IF;',
            'g')
    $f$;

    -- Under REPEATABLE READ and SERIALIZABLE, before a new row goes into the current table:
    -- the scope's row committed into the previous table (@T) after this transaction's snapshot
    -- by a writer that read the generation before a rotation. The snapshot cannot show it, and
    -- the current table's unique index does not hold it; the previous table's does. So an
    -- INSERT there, undone at once: it raises a serialization failure on such a row (as the
    -- plain layout's INSERT does), waits for one not yet committed, and otherwise leaves
    -- nothing behind (docs/sql.md, "Rotated layout", point 3). With p_found, it also sets
    -- that variable to whether the table has the scope's row (one the snapshot shows): the
    -- SERIALIZABLE claim's look at the table, made without an index read, so that claims of
    -- different keys do not fail each other through the read locks of serializable snapshot
    -- isolation (a review found three claims of three keys failing one of them).
    CREATE FUNCTION pg_temp.previous_table_probe(p_found text) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $f$
        SELECT format($s$
                BEGIN
                    INSERT INTO @T
                        (tenant, method, path, idempotency_key, fingerprint, state, token,
                         locked_until, created_at, expires_at)
                    VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight',
                            p_token, now(), now(), now())
                    ON CONFLICT DO NOTHING;
                    %s
                    RAISE SQLSTATE 'IDPRB';
                EXCEPTION WHEN SQLSTATE 'IDPRB' THEN
                    NULL;
                END;
        $s$, CASE WHEN p_found IS NULL THEN '' ELSE p_found || ' := NOT FOUND;' END)
    $f$;

    -- idempotency_reserve: the plain layout's outcomes and output row (docs/sql.md).
    EXECUTE format(pg_temp.with_generation_reads($f$
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
        v_gen int := nullif(current_setting('idempotency.generation', true), '')::int;
        v_fresh int;
        v_locked boolean := false;
        v_busy boolean := false;  -- the scope's lock was held by another transaction
        v_where int;       -- where the row was found: 0 current table, 1 previous, NULL none
        v_t int;
    BEGIN
        -- The generation this session read last (see the header: one that a rotation has
        -- made stale only sends a call to the write path, which reads it afresh and brings
        -- the session up to date).
        IF v_gen IS NULL THEN
            SELECT g.current INTO v_gen FROM idempotency_generation g;
            PERFORM set_config('idempotency.generation', v_gen::text, false);
        END IF;

        -- The fast path: the outcomes nearly every call has, in the fewest statements (each
        -- costs a miss about a seventh: docs/benchmarks.md, "Rotated layout, as shipped").
        -- A live row in the current table (a replay, a live reservation) is answered as read.
        v_t := v_gen;
        %1$s
        IF FOUND THEN
            IF live THEN
                outcome := 'existing';
                RETURN NEXT;
                RETURN;
            END IF;
        ELSIF current_setting('transaction_isolation') = 'read committed'
              AND pg_try_advisory_xact_lock(
                  idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
            -- Not in the current table: under the scope's lock, one INSERT into it that
            -- reads the previous table and the generation in its own snapshot, and inserts
            -- only if the generation is still the session's and the previous table has no
            -- row of the scope. That is the loop's locked read of the previous table and its
            -- generation read, made at one instant (a rotation commits its carry and the new
            -- generation together: a snapshot shows both or neither), then its INSERT, in one
            -- statement: a miss makes as many as on the plain layout (docs/benchmarks.md,
            -- "One statement for a miss's second table"). Nothing inserted (a row in the
            -- previous table, a rotation, a lost race) goes to the loop, which reads again.
            v_locked := true;
            %5$s
            IF FOUND THEN
                outcome := 'reserved';
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;
        -- Anything else (an ended row to take over, a lost race, the scope's lock held by
        -- another transaction, REPEATABLE READ or SERIALIZABLE, a rotation since the session
        -- read the generation) takes the loop, which reads again; the lock, once held, stays.
        FOR attempt IN 1..6 LOOP
            -- The read: the current table, then the previous one.
            v_where := NULL;
            v_busy := false;
            FOR v_step IN 0..1 LOOP
                IF v_step = 1 AND NOT v_locked THEN
                    -- Not in the current table (a miss, or a record a rotation left in the
                    -- previous one). The previous table is read under the scope's lock, so a
                    -- miss reads it once: every earlier writer of this scope has committed by
                    -- then, into the current or previous table of the generation it read (one
                    -- that read the generation before a rotation commits into what is the
                    -- previous table now), and a row committed into the current table since
                    -- the read above is caught by the INSERT's conflict. Held by another
                    -- transaction, the read is made without it, for an answer that needs no
                    -- write (a replay); anything else is answered in flight below.
                    v_locked := pg_try_advisory_xact_lock(
                        idempotency_lock_key(p_tenant, p_method, p_path, p_key));
                    v_busy := NOT v_locked;
                END IF;
                v_t := (v_gen + 3 - v_step) %% 3;
                %1$s
                IF FOUND THEN
                    v_where := v_step;
                    EXIT;
                END IF;
            END LOOP;
            IF v_locked OR (v_where IS NOT NULL AND NOT live AND NOT eligible) THEN
                -- Before a write, and before answering with an ended reservation of another
                -- request: the generation read after the tables. Unchanged, the reads saw the
                -- tables as they were before any rotation that commits later (whose carry
                -- then meets this call's writes on their row locks, or moves rows it did not
                -- touch); changed, a rotation may have carried the scope's row out of what was
                -- read, and the tables of the new generation are read again.
                @GENERATION(v_fresh)
                IF v_fresh <> v_gen THEN
                    v_gen := v_fresh;
                    PERFORM set_config('idempotency.generation', v_gen::text, false);
                    CONTINUE;
                END IF;
            END IF;

            IF v_where IS NOT NULL AND (live OR NOT eligible) THEN
                -- Replay, live reservation, or an ended reservation of another request: no
                -- write.
                outcome := 'existing';
                RETURN NEXT;
                RETURN;
            END IF;

            IF NOT v_locked THEN
                -- An ended, eligible row in the current table (the lock is taken for it, and
                -- it is read again), or the lock was held above.
                IF v_busy OR NOT pg_try_advisory_xact_lock(
                        idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                    -- Held by another transaction: a transactional request whose reservation
                    -- is not committed yet, or a concurrent reserve.
                    outcome := 'existing'; state := 'in_flight'; fingerprint := p_fingerprint;
                    lease_remaining_us := p_lease_us; response_status := NULL;
                    response_headers := NULL; response_body := NULL; live := true;
                    eligible := true;
                    RETURN NEXT;
                    RETURN;
                END IF;
                v_locked := true;
                -- Read again under the lock (and the generation after, above); a takeover
                -- re-checks under the row lock too.
                CONTINUE;
            END IF;

            IF v_where = 0 THEN
                -- Ended and eligible, in the current table: taken over in place, the
                -- conditions re-checked under the row lock (as in the plain layout).
                %2$s
            ELSIF v_where = 1 THEN
                -- Ended and eligible, in the previous table: moved. The DELETE re-checks the
                -- conditions under the row lock, so a late complete of the holder or a
                -- rotation's carry (which move the row too) and this takeover meet there.
                v_t := (v_gen + 2) %% 3;
                %3$s
                IF FOUND THEN
                    %4$s
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'idempotency_reserve: a row of this scope in two generation tables';
                    END IF;
                END IF;
            ELSE
                IF current_setting('transaction_isolation') <> 'read committed' THEN
                    v_t := (v_gen + 2) %% 3;
                    %6$s
                END IF;
                %4$s
            END IF;
            IF FOUND THEN
                outcome := 'reserved';
                state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
                response_status := NULL; response_headers := NULL; response_body := NULL;
                live := NULL; eligible := NULL;
                RETURN NEXT;
                RETURN;
            END IF;
            -- Lost to another writer since the read: read again.
        END LOOP;
        outcome := 'raced';
        state := NULL; fingerprint := NULL; lease_remaining_us := NULL;
        response_status := NULL; response_headers := NULL; response_body := NULL;
        live := NULL; eligible := NULL;
        RETURN NEXT;
    END
    $fn$
    $f$),
    -- 1: the read, filling the output columns.
    pg_temp.per_table('v_t', $s$
                SELECT k.state, k.fingerprint, k.response_status, k.response_headers,
                       k.response_body, k.expires_at > now(),
                       k.state = 'completed' OR k.fingerprint = p_fingerprint,
                       (extract(epoch FROM greatest(k.expires_at - now(), interval '0'))
                        * 1000000)::bigint
                  INTO state, fingerprint, response_status, response_headers, response_body,
                       live, eligible, lease_remaining_us
                  FROM @T k
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key;
    $s$),
    -- 2: the takeover in place.
    pg_temp.per_table('v_gen', $s$
                UPDATE @T k
                   SET fingerprint = p_fingerprint, state = 'in_flight', token = p_token,
                       locked_until = now() + p_lease_us * interval '1 microsecond',
                       expires_at = now() + p_lease_us * interval '1 microsecond',
                       created_at = now(), completed_at = NULL, response_status = NULL,
                       response_headers = NULL, response_body = NULL
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key AND k.expires_at <= now()
                   AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
    $s$),
    -- 3: the ended row's DELETE in the previous table.
    pg_temp.per_table('v_t', $s$
                DELETE FROM @T k
                 WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                   AND k.idempotency_key = p_key AND k.expires_at <= now()
                   AND (k.state = 'completed' OR k.fingerprint = p_fingerprint);
    $s$),
    -- 4: a new reservation in the current table.
    pg_temp.per_table('v_gen', $s$
                INSERT INTO @T AS k
                    (tenant, method, path, idempotency_key, fingerprint, state, token,
                     locked_until, created_at, expires_at)
                VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                        now() + p_lease_us * interval '1 microsecond', now(),
                        now() + p_lease_us * interval '1 microsecond')
                ON CONFLICT DO NOTHING;
    $s$),
    -- 5: a new reservation in the current table, if the generation is still v_gen and the
    -- previous table has no row of the scope (the fast path's one statement).
    pg_temp.per_table('v_gen', $s$
                INSERT INTO @T AS k
                    (tenant, method, path, idempotency_key, fingerprint, state, token,
                     locked_until, created_at, expires_at)
                SELECT p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight', p_token,
                       now() + p_lease_us * interval '1 microsecond', now(),
                       now() + p_lease_us * interval '1 microsecond'
                  FROM idempotency_generation g
                 WHERE g.current = v_gen
                   AND NOT EXISTS (SELECT FROM @P p
                                    WHERE p.tenant = p_tenant AND p.method = p_method
                                      AND p.path = p_path AND p.idempotency_key = p_key)
                ON CONFLICT DO NOTHING;
    $s$),
    -- 6: the previous table's probe (REPEATABLE READ and SERIALIZABLE).
    pg_temp.per_table('v_t', pg_temp.previous_table_probe(NULL)));

    -- The holder's writes read the generation afresh: what they write must land in the table
    -- that is current now (or was at this transaction's start: still R before its TRUNCATE).
    -- A row of theirs in the previous table is moved into the current one. @F is the
    -- WHERE clause of the holder's row: scope, in flight, token.

    -- The complete's UPDATE of the holder's row in table @T, found by p_find: 'address' (the
    -- row a transactional claim inserted, by ctid), 'scope' (its primary key), or
    -- 'scope, generation' (and the generation, read in the same statement, still v_gen).
    CREATE FUNCTION pg_temp.complete_update(p_find text) RETURNS text
    LANGUAGE sql IMMUTABLE
    AS $f$
        SELECT format($s$
            UPDATE @T k
               SET state = 'completed', response_status = p_status, response_headers = p_headers,
                   response_body = p_body, completed_at = now(), locked_until = NULL,
                   expires_at = now() + p_ttl_us * interval '1 microsecond'
              %s
             WHERE %s AND k.state = 'in_flight' AND k.token = p_token;
        $s$,
            CASE WHEN p_find = 'scope, generation' THEN 'FROM idempotency_generation g' ELSE '' END,
            CASE p_find
                WHEN 'address' THEN 'k.ctid = split_part(v_claimed, '':'', 2)::tid'
                ELSE CASE WHEN p_find = 'scope, generation' THEN 'g.current = v_gen AND ' ELSE '' END
                     || 'k.tenant = p_tenant AND k.method = p_method AND k.path = p_path '
                     || 'AND k.idempotency_key = p_key'
            END)
    $f$;

    -- idempotency_complete: store the response, fenced by the token.
    EXECUTE format(pg_temp.with_generation_reads($f$
    CREATE OR REPLACE FUNCTION idempotency_complete(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
        p_status smallint, p_headers bytea, p_body bytea, p_ttl_us bigint
    )
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_claimed text := current_setting('idempotency.claimed_row', true);
        v_gen int;
        v_fresh int;
        v_t int;
        v_fingerprint bytea;
        v_created timestamptz;
    BEGIN
        -- The fast path (READ COMMITTED, not a transactional claim): the session's generation
        -- (idempotency_reserve keeps it), checked in the UPDATE's own snapshot, so the write
        -- lands in the table current in that snapshot, as after the generation read below.
        -- A stale generation updates nothing and takes the path below.
        v_gen := nullif(current_setting('idempotency.generation', true), '')::int;
        IF v_gen IS NOT NULL AND nullif(v_claimed, '') IS NULL
           AND current_setting('transaction_isolation') = 'read committed' THEN
            %5$s
            IF FOUND THEN
                RETURN true;
            END IF;
        END IF;
        @GENERATION(v_gen)
        -- The row a transactional claim inserted ("<generation>:<ctid>"), found without an
        -- index read when it is still in the current table.
        IF nullif(v_claimed, '') IS NOT NULL AND split_part(v_claimed, ':', 1)::int = v_gen THEN
            %1$s
            IF FOUND THEN
                RETURN true;
            END IF;
        END IF;
        FOR attempt IN 1..3 LOOP
            %2$s
            IF FOUND THEN
                RETURN true;
            END IF;
            v_t := (v_gen + 2) %% 3;
            %3$s
            IF FOUND THEN
                %4$s
                RETURN true;
            END IF;
            -- Not the holder, unless a rotation committed meanwhile and carried the row into
            -- the table it made current: then again, in the new generation's tables.
            @GENERATION(v_fresh)
            EXIT WHEN v_fresh = v_gen;
            v_gen := v_fresh;
        END LOOP;
        RETURN false;
    END
    $fn$
    $f$),
    pg_temp.per_table('v_gen', pg_temp.complete_update('address')),
    pg_temp.per_table('v_gen', pg_temp.complete_update('scope')),
    pg_temp.per_table('v_t', $s$
            DELETE FROM @T k
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token
            RETURNING k.fingerprint, k.created_at INTO v_fingerprint, v_created;
    $s$),
    pg_temp.per_table('v_gen', $s$
            INSERT INTO @T
                (tenant, method, path, idempotency_key, fingerprint, state, token,
                 response_status, response_headers, response_body, created_at, completed_at,
                 expires_at)
            VALUES (p_tenant, p_method, p_path, p_key, v_fingerprint, 'completed', p_token,
                    p_status, p_headers, p_body, v_created, now(),
                    now() + p_ttl_us * interval '1 microsecond');
    $s$),
    pg_temp.per_table('v_gen', pg_temp.complete_update('scope, generation')));

    -- idempotency_renew_lease: the holder moves its lease end (and expiry) to now + lease.
    EXECUTE format(pg_temp.with_generation_reads($f$
    CREATE OR REPLACE FUNCTION idempotency_renew_lease(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid, p_lease_us bigint
    )
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_gen int;
        v_fresh int;
        v_t int;
        v_fingerprint bytea;
        v_created timestamptz;
    BEGIN
        @GENERATION(v_gen)
        FOR attempt IN 1..3 LOOP
            %1$s
            IF FOUND THEN
                RETURN true;
            END IF;
            v_t := (v_gen + 2) %% 3;
            %2$s
            IF FOUND THEN
                %3$s
                RETURN true;
            END IF;
            -- As in idempotency_complete: again after a rotation that may have carried it.
            @GENERATION(v_fresh)
            EXIT WHEN v_fresh = v_gen;
            v_gen := v_fresh;
        END LOOP;
        RETURN false;
    END
    $fn$
    $f$),
    pg_temp.per_table('v_gen', $s$
            UPDATE @T k
               SET locked_until = now() + p_lease_us * interval '1 microsecond',
                   expires_at = now() + p_lease_us * interval '1 microsecond'
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    $s$),
    pg_temp.per_table('v_t', $s$
            DELETE FROM @T k
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token
            RETURNING k.fingerprint, k.created_at INTO v_fingerprint, v_created;
    $s$),
    pg_temp.per_table('v_gen', $s$
            INSERT INTO @T
                (tenant, method, path, idempotency_key, fingerprint, state, token,
                 locked_until, created_at, expires_at)
            VALUES (p_tenant, p_method, p_path, p_key, v_fingerprint, 'in_flight', p_token,
                    now() + p_lease_us * interval '1 microsecond', v_created,
                    now() + p_lease_us * interval '1 microsecond');
    $s$));

    -- idempotency_release (C9): the holder's DELETE of its reservation, wherever it is.
    EXECUTE format(pg_temp.with_generation_reads($f$
    CREATE OR REPLACE FUNCTION idempotency_release(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid
    )
    RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    DECLARE
        v_gen int;
        v_fresh int;
        v_t int;
    BEGIN
        @GENERATION(v_gen)
        FOR attempt IN 1..3 LOOP
            FOR v_step IN 0..1 LOOP
                v_t := (v_gen + 3 - v_step) %% 3;
                %1$s
                IF FOUND THEN
                    RETURN true;
                END IF;
            END LOOP;
            -- As in idempotency_complete: again after a rotation that may have carried it.
            @GENERATION(v_fresh)
            EXIT WHEN v_fresh = v_gen;
            v_gen := v_fresh;
        END LOOP;
        RETURN false;
    END
    $fn$
    $f$),
    pg_temp.per_table('v_t', $s$
            DELETE FROM @T k
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.state = 'in_flight' AND k.token = p_token;
    $s$));

    -- idempotency_completed_by: whether the record is completed under this token.
    EXECUTE format($f$
    CREATE OR REPLACE FUNCTION idempotency_completed_by(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid
    )
    RETURNS boolean
    LANGUAGE plpgsql STABLE
    AS $fn$
    DECLARE
        v_gen int;
        v_fresh int;
        v_t int;
    BEGIN
        SELECT g.current INTO v_gen FROM idempotency_generation g;
        FOR attempt IN 1..3 LOOP
            FOR v_step IN 0..1 LOOP
                v_t := (v_gen + 3 - v_step) %% 3;
                %1$s
                IF FOUND THEN
                    RETURN true;
                END IF;
            END LOOP;
            -- As in idempotency_complete: again after a rotation that may have carried it.
            SELECT g.current INTO v_fresh FROM idempotency_generation g;
            EXIT WHEN v_fresh = v_gen;
            v_gen := v_fresh;
        END LOOP;
        RETURN false;
    END
    $fn$
    $f$,
    pg_temp.per_table('v_t', $s$
            PERFORM FROM @T k
              WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
                AND k.idempotency_key = p_key AND k.state = 'completed' AND k.token = p_token;
    $s$));

    -- idempotency_replay (the replay fast path's read of a live completed record): the current
    -- table, then the previous one, with the generation the session read last, as the
    -- reserve function reads them. Not over the view: a plan over the view locks the next
    -- table too, and a rotation's TRUNCATE would wait for (and queue) replays.
    EXECUTE format($f$
    CREATE OR REPLACE FUNCTION idempotency_replay(p_tenant text, p_method text, p_path text, p_key text)
    RETURNS TABLE (
        outcome text, state text, fingerprint bytea, lease_remaining_us bigint,
        response_status smallint, response_headers bytea, response_body bytea,
        live boolean, eligible boolean
    )
    LANGUAGE plpgsql STABLE ROWS 1
    AS $fn$
    #variable_conflict use_column
    DECLARE
        v_gen int := nullif(current_setting('idempotency.generation', true), '')::int;
        v_t int;
    BEGIN
        IF v_gen IS NULL THEN
            SELECT g.current INTO v_gen FROM idempotency_generation g;
        END IF;
        FOR v_step IN 0..1 LOOP
            v_t := (v_gen + 3 - v_step) %% 3;
            %1$s
            IF FOUND THEN
                RETURN NEXT;
                RETURN;
            END IF;
        END LOOP;
    END
    $fn$
    $f$,
    pg_temp.per_table('v_t', $s$
            SELECT 'existing'::text, k.state, k.fingerprint,
                   (extract(epoch FROM k.expires_at - now()) * 1000000)::bigint,
                   k.response_status, k.response_headers, k.response_body, true, true
              INTO outcome, state, fingerprint, lease_remaining_us, response_status,
                   response_headers, response_body, live, eligible
              FROM @T k
             WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
               AND k.idempotency_key = p_key AND k.state = 'completed' AND k.expires_at > now();
    $s$));

    -- idempotency_response (idem-cli's read of a stored response), over the view.
    EXECUTE $ddl$
    CREATE OR REPLACE FUNCTION idempotency_response(
        p_tenant text, p_method text, p_path text, p_key text, p_token uuid,
        p_expires_at timestamptz
    )
    RETURNS TABLE (response_headers bytea, response_body bytea)
    LANGUAGE sql STABLE
    AS $fn$
        SELECT k.response_headers, k.response_body
          FROM idempotency_keys k
         WHERE k.tenant = p_tenant AND k.method = p_method AND k.path = p_path
           AND k.idempotency_key = p_key AND k.state = 'completed'
    $fn$
    $ddl$;

    -- idempotency_tx_claim (transactional mode): as the plain layout's, whose SERIALIZABLE
    -- insert-first path must also find no row of the scope in the previous table.
    EXECUTE format(pg_temp.with_generation_reads($f$
    CREATE OR REPLACE FUNCTION idempotency_tx_claim(
        p_setting text, p_setting_value text,
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
        v_fresh int;
        v_found boolean;
        v_t int;
        v_claimed tid;
    BEGIN
        IF p_setting IS NOT NULL THEN
            PERFORM set_config(p_setting, p_setting_value, true);
        END IF;
        IF current_setting('transaction_isolation') = 'serializable' THEN
            IF pg_try_advisory_xact_lock(idempotency_lock_key(p_tenant, p_method, p_path, p_key)) THEN
                @GENERATION(v_gen)
                v_t := (v_gen + 2) %% 3;
                -- The previous table: the probe (see pg_temp.previous_table_probe), which
                -- fails to serialize on the scope's row committed after the snapshot.
                %1$s
                -- No row in the previous table, and the generation unchanged since (a rotation
                -- may have carried the scope's row out of it): insert first; otherwise the
                -- reserve function decides.
                @GENERATION(v_fresh)
                IF NOT v_found AND v_fresh = v_gen THEN
                    %2$s
                    IF FOUND THEN
                        PERFORM set_config('idempotency.claimed_row',
                                           v_gen::text || ':' || v_claimed::text, true);
                        outcome := 'reserved';
                        RETURN NEXT;
                        RETURN;
                    END IF;
                END IF;
            END IF;
        END IF;
        RETURN QUERY SELECT * FROM idempotency_reserve(p_tenant, p_method, p_path, p_key,
                                                       p_fingerprint, p_token, p_lease_us);
    END
    $fn$
    $f$),
    pg_temp.per_table('v_t', pg_temp.previous_table_probe('v_found')),
    pg_temp.per_table('v_gen', $s$
                    INSERT INTO @T AS k
                        (tenant, method, path, idempotency_key, fingerprint, state, token,
                         locked_until, created_at, expires_at)
                    VALUES (p_tenant, p_method, p_path, p_key, p_fingerprint, 'in_flight',
                            p_token, now() + p_lease_us * interval '1 microsecond', now(),
                            now() + p_lease_us * interval '1 microsecond')
                    ON CONFLICT DO NOTHING
                    RETURNING k.ctid INTO v_claimed;
    $s$));

    -- idempotency_rotate (idem-cli purge): empty the next table and make it current, if R has
    -- passed since the last switch and no transaction that began before it is still open (it
    -- may have read the generation two switches back, and would write into the table emptied
    -- here). The previous table becomes the next one, which no request reads: the records in
    -- it that still matter (purge's own test: a completed record before its expiry, a
    -- reservation until p_grace_us after its lease) are carried into the table made current,
    -- so a TTL longer than R is kept too, at the cost of one move per rotation. Returns whether
    -- it switched, the generation current afterwards, the earliest time of the next switch,
    -- how many records it carried, and the oldest late transaction's pid when one held it
    -- back. p_lock_timeout_ms bounds the TRUNCATE's wait: no request reads or writes the next
    -- table (an idem-cli read of the view does), and requests would queue behind the waiting
    -- lock.
    EXECUTE format($f$
    CREATE OR REPLACE FUNCTION idempotency_rotate(p_lock_timeout_ms integer, p_grace_us bigint)
    RETURNS TABLE (rotated boolean, generation smallint, next_rotation timestamptz,
                   carried bigint, blocked_by_pid integer)
    LANGUAGE plpgsql VOLATILE
    AS $fn$
    #variable_conflict use_column
    DECLARE
        v_gen smallint;
        v_switched timestamptz;
        v_period interval;
        v_next int;
        v_horizon timestamptz;
    BEGIN
        PERFORM set_config('lock_timeout', p_lock_timeout_ms::text, true);
        -- Serialises rotations, and first: a writer under REPEATABLE READ or SERIALIZABLE
        -- holds FOR KEY SHARE on the row to its commit (idempotency_generation_for_write), and
        -- this waits for it before holding anything a writer could wait for (the rows carried
        -- below), so the two cannot deadlock; such writers then wait for this transaction.
        -- READ COMMITTED requests read the row without a lock and never wait for it.
        SELECT g.current, g.switched_at, g.period INTO v_gen, v_switched, v_period
          FROM idempotency_generation g FOR UPDATE;
        generation := v_gen;
        next_rotation := v_switched + v_period;
        rotated := false;
        carried := 0;
        IF clock_timestamp() < v_switched + v_period THEN
            RETURN NEXT;
            RETURN;
        END IF;
        -- A session whose activity this role may not see (another role's, without
        -- pg_read_all_stats: its backend_type and xact_start read as NULL) counts as such a
        -- transaction: not knowing is no proof.
        SELECT a.pid INTO blocked_by_pid
          FROM pg_stat_activity a
         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
           AND ((a.backend_type = 'client backend' AND a.xact_start < v_switched)
                OR a.backend_type IS NULL)
         ORDER BY a.xact_start NULLS FIRST
         LIMIT 1;
        IF FOUND THEN
            RETURN NEXT;
            RETURN;
        END IF;
        v_next := (v_gen + 1) %% 3;
        %1$s
        -- What still matters is judged as of the start of the oldest transaction open now, if
        -- that is earlier: a request judges a record live by its own transaction's start
        -- (now()), and one that began before this rotation may still read the table it makes
        -- unread (review, 2026-12-07: a transaction begun before a record expired replayed it
        -- from there after a rotation had left it behind and a retry had stored a newer one).
        SELECT least(now(), min(a.xact_start)) INTO v_horizon
          FROM pg_stat_activity a
         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
           AND a.backend_type = 'client backend';
        -- Once per rotation, not per request: a statement built here is fine.
        EXECUTE format('WITH moved AS (DELETE FROM %%I k WHERE NOT (k.expires_at <= $2 AND (k.state = ''completed'' OR k.expires_at <= $2 - $1 * interval ''1 microsecond'')) RETURNING k.*) INSERT INTO %%I SELECT * FROM moved',
                       'idempotency_keys_' || (v_gen + 2) %% 3, 'idempotency_keys_' || v_next)
            USING p_grace_us, v_horizon;
        GET DIAGNOSTICS carried = ROW_COUNT;
        v_switched := clock_timestamp();
        -- Replaced rather than updated: a writer under REPEATABLE READ or SERIALIZABLE whose
        -- snapshot predates this rotation then fails to lock the old row (40001) and retries
        -- (idempotency_generation_for_write).
        DELETE FROM idempotency_generation;
        INSERT INTO idempotency_generation (current, switched_at, period)
        VALUES (v_next, v_switched, v_period);
        rotated := true;
        generation := v_next;
        next_rotation := v_switched + v_period;
        RETURN NEXT;
    END
    $fn$
    $f$,
    pg_temp.per_table('v_next', 'TRUNCATE @T;'));

    COMMENT ON FUNCTION idempotency_rotate(integer, bigint) IS
        'Rotation of idempotency-actix''s rotated layout (idem-cli purge): empties the next generation table and makes it current, at most once per period. See docs/sql.md.';
END
$do$;
