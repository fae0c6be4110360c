# Bulk rows of idempotency_keys for the benchmarks: sourced by bench/load.sh, bench/scale.sh and
# idempotency-cli/benches/purge-1m.sh.
#
# The one place outside migrations/ and the schema module
# (idempotency-actix/src/store/postgres/schema.rs) where a script names the table's columns and
# state values, on purpose: the benches fill the table with 10^5..10^7 rows, which one
# INSERT ... SELECT over generate_series does inside the server in seconds. Through the store
# (reserve, then complete: two calls per row) or the admin API (no bulk insert) it would take
# minutes to hours. Keep the column list in step with the migrations; `bench/load.sh` and
# `scale.sh` fail at once (ON_ERROR_STOP) if a column is renamed.

# The stored record every bulk fill uses: the fingerprint, headers (Location, Content-Type, in
# StoredResponse's length-prefixed encoding) and body the payments handler stores, as SQL.
ROWS_FINGERPRINT="decode(repeat('42', 32), 'hex')"
ROWS_HEADERS="decode('0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e', 'hex')"
ROWS_BODY="convert_to('{\"id\":1,\"amount\":1000,\"currency\":\"EUR\",\"status\":\"succeeded\"}', 'UTF8')"

# rows_fill_completed URL FIRST LAST TENANT KEY FINGERPRINT HEADERS BODY CREATED EXPIRES
# Insert completed records for g in FIRST..LAST; every other argument is an SQL expression over
# `g` (the series value). completed_at is CREATED, the status 201.
rows_fill_completed() {
  local url=$1 first=$2 last=$3 tenant=$4 key=$5 fingerprint=$6 headers=$7 body=$8 created=$9 expires=${10}
  psql "$url" -XAtq -v ON_ERROR_STOP=1 >/dev/null <<SQL
INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint, state, token,
    response_status, response_headers, response_body, created_at, completed_at, expires_at)
SELECT $tenant, 'POST', '/payments', $key, $fingerprint, 'completed', gen_random_uuid(), 201,
    $headers, $body, $created, $created, $expires
FROM generate_series($first, $last) g;
SQL
}

# rows_fill_completed_rotated URL FIRST LAST TENANT KEY FINGERPRINT HEADERS BODY CREATED EXPIRES
# The same records on the rotated layout (migration 000016), straight into its next table (the
# one the next rotation empties), where records last written more than a period ago are: a bulk
# insert through the view's trigger would take a lock and run a statement per row.
rows_fill_completed_rotated() {
  local url=$1 first=$2 last=$3 tenant=$4 key=$5 fingerprint=$6 headers=$7 body=$8 created=$9 expires=${10}
  local next
  next=$(psql "$url" -XAtq -v ON_ERROR_STOP=1 -c "SELECT 'idempotency_keys_' || (current + 1) % 3 FROM idempotency_generation")
  psql "$url" -XAtq -v ON_ERROR_STOP=1 >/dev/null <<SQL
INSERT INTO $next (tenant, method, path, idempotency_key, fingerprint, state, token,
    response_status, response_headers, response_body, created_at, completed_at, expires_at)
SELECT $tenant, 'POST', '/payments', $key, $fingerprint, 'completed', gen_random_uuid(), 201,
    $headers, $body, $created, $created, $expires
FROM generate_series($first, $last) g;
SQL
}

# rows_delete_replays_not_of_size URL BYTES
# Delete the stored replay keys (`r-*`, bench/replay.lua) whose body is not BYTES long, so the
# next replay run stores them again at that size.
rows_delete_replays_not_of_size() {
  psql "$1" -XAtq -v ON_ERROR_STOP=1 -c "DELETE FROM idempotency_keys WHERE idempotency_key LIKE 'r-%' AND length(response_body) <> $2" >/dev/null
}

# rows_fill_completed_partitioned URL FIRST LAST TENANT KEY FINGERPRINT HEADERS BODY CREATED EXPIRES
# The same records on the partitioned layout (migration 000005): the claims in idempotency_keys,
# the responses in idempotency_responses under each claim's token and expiry. First creates the
# range partitions (of the layout's interval, named as the migration names them) that the
# EXPIRES range needs and that do not exist, so the rows land where traffic would have put them
# (partitions are created ahead of time in production), not in the default partition.
rows_fill_completed_partitioned() {
  local url=$1 first=$2 last=$3 tenant=$4 key=$5 fingerprint=$6 headers=$7 body=$8 created=$9 expires=${10}
  psql "$url" -XAtq -v ON_ERROR_STOP=1 >/dev/null <<SQL
DO \$\$
DECLARE
    v_step interval := (SELECT step FROM idempotency_partitioning);
    v_unit text := CASE (SELECT step FROM idempotency_partitioning) WHEN interval '1 hour' THEN 'hour' ELSE 'day' END;
    v_first timestamptz;
    v_last timestamptz;
    v_lo timestamptz;
    v_name text;
BEGIN
    SELECT min(e), max(e) INTO v_first, v_last FROM (SELECT $expires AS e FROM generate_series($first, $last) g) s;
    v_lo := date_trunc(v_unit, v_first AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    WHILE v_lo <= v_last LOOP
        v_name := 'idempotency_responses_p' || to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD_HH24');
        IF to_regclass(quote_ident(v_name)) IS NULL THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF idempotency_responses FOR VALUES FROM (%L) TO (%L)',
                           v_name, v_lo, v_lo + v_step);
        END IF;
        v_lo := v_lo + v_step;
    END LOOP;
END
\$\$;
WITH src AS (
    SELECT g, gen_random_uuid() AS token, $created AS created, $expires AS expires
    FROM generate_series($first, $last) g
), claims AS (
    INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint, state, token,
        response_status, created_at, completed_at, expires_at)
    SELECT $tenant, 'POST', '/payments', $key, $fingerprint, 'completed', token, 201,
        created, created, expires
    FROM src
)
INSERT INTO idempotency_responses (token, expires_at, response_headers, response_body)
SELECT token, expires, $headers, $body FROM src;
SQL
}
