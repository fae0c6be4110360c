# Sourced by this directory's scripts (after `cd` to the project root, with SERVER set to a
# maintenance database's URL): the scratch databases they make.

# The URL of database $1 on SERVER, the rest of the URL kept (the driver's parser, not string
# surgery: a password may hold `/`, `?`, `@`).
url_of() {
  python3 -c 'import sys,urllib.parse as u; p=u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/" + sys.argv[2])))' "$SERVER" "$1"
}

drop_db() {
  psql -qAt "$SERVER" -c "DROP DATABASE IF EXISTS $1 WITH (FORCE)" >/dev/null 2>&1 || true
}

# Database $1, made afresh, with migrations/ applied by psql in layout $2 (default plain).
scratch_db() {
  drop_db "$1"
  psql -qAt "$SERVER" -c "CREATE DATABASE $1" >/dev/null
  local f
  for f in migrations/*/up.sql; do
    PGOPTIONS="${PGOPTIONS:-} -c idempotency.layout=${2:-plain}" \
      psql -qAt "$(url_of "$1")" -v ON_ERROR_STOP=1 --single-transaction -f "$f" >/dev/null
  done
}

# The replay keys 'r-1'..'r-1000' in database $1, stored the way the store stores them (its
# reserve and complete functions), with the bench's 201 response.
store_replay_keys() {
  psql -qAt "$(url_of "$1")" -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
SELECT count(*) FROM generate_series(1, 1000) g,
  LATERAL idempotency_reserve('', 'POST', '/payments', 'r-' || g,
      '\x4242424242424242424242424242424242424242424242424242424242424242'::bytea,
      md5('r-' || g)::uuid, 60000000) r;
SELECT count(*) FROM generate_series(1, 1000) g
 WHERE idempotency_complete('', 'POST', '/payments', 'r-' || g, md5('r-' || g)::uuid,
      201::smallint, '\x0100000002000000086c6f636174696f6e0000000b2f7061796d656e74732f310000000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea,
      '{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}'::bytea, 86400000000);
SQL
}
