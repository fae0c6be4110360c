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
