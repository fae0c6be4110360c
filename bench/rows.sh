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

# rows_delete_replays_not_of_size URL BYTES
# Delete the stored replay keys (`r-*`, bench/replay.lua) whose body is not BYTES long, so the
# next replay run stores them again at that size.
rows_delete_replays_not_of_size() {
  psql "$1" -XAtq -v ON_ERROR_STOP=1 -c "DELETE FROM idempotency_keys WHERE idempotency_key LIKE 'r-%' AND length(response_body) <> $2" >/dev/null
}
