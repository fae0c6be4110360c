//! `idem-cli` against a `RedisStore` (`--redis-url` / `REDIS_URL`): `list`, `show`, `stats` and
//! `release` read the records the store writes (one string per record, decoded by
//! `idempotency_actix::store::redis::record`); `migrate` and `purge` have nothing to do.
//!
//! Records are found with `SCAN MATCH <prefix>...` (never `KEYS`, which blocks the server),
//! except by `show` and `release` given a whole scope (tenant, method, path), which read the
//! one key it names.
//! On a Redis Cluster (the URL names any of its nodes: the command asks it with
//! `INFO cluster`), the scan walks every primary and each record is read from its own node
//! ([`KeyScan`]), so `list` and `stats` count the whole cluster.
//! The key parts are percent-encoded by the store, so a pattern built from a tenant or key
//! holds no glob character of the user's; every key found is parsed back and compared
//! exactly. Ages and expiries are measured against the server's clock (`TIME`), the clock
//! the store uses for leases and TTLs. The output is the PostgreSQL commands' own (same
//! columns, same JSON).

use std::io::Write;
use std::time::Duration;

use futures_util::future::try_join_all;
use idempotency_actix::store::postgres::admin::{Detail, Record, State, Time};
use idempotency_actix::store::redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use idempotency_actix::store::redis::redis::{self, AsyncConnectionConfig, RedisError};
use idempotency_actix::store::redis::{
    cluster_enabled, encode_key_part, parse_record_key, record, record_key, skips_tls_verification,
    validate_key_prefix, KeyScan, DEFAULT_PREFIX, UNVERIFIED_TLS_REFUSED,
};
use idempotency_actix::store::Scope;
use serde_json::json;

use crate::cli::{Command, Format, ListArgs, ReleaseArgs, ScopeArgs, ShowArgs, StateFilter};
use crate::commands::release::{check, finish, refuse, released};
use crate::commands::show::{ambiguous_key, detail_json, detail_text, method, no_record};
use crate::duration::format_age_secs;
use crate::error::CliError;
use crate::output::{display, quoted, table, Out};
use crate::record::{round_ms, RecordView, TABLE_HEADER};

/// Records read per batch when only their heads are read (`list`, `stats`, `release`, and
/// `show`'s first look): their reads are all in flight at once, about 150 bytes each. A record
/// with its response (up to the app's `max_response_bytes`, 1 MiB by default) is read alone,
/// as `show` prints it.
const READ_BATCH: usize = 1000;

/// What a connection must be to serve the commands: a single server's or a cluster's.
trait Conn: ConnectionLike + Clone + Send + Sync + 'static {}
impl<C: ConnectionLike + Clone + Send + Sync + 'static> Conn for C {}

/// Run `command` against the Redis at `url`, keys under `prefix`.
pub async fn run(
    url: &str,
    prefix: Option<&str>,
    command: &Command,
    format: Format,
    timeout: Duration,
    out: &mut Out,
) -> Result<(), CliError> {
    let prefix = prefix.unwrap_or(DEFAULT_PREFIX);
    // The store's own rule, so idem-cli never reads or releases another prefix's records.
    // Not repeated: a connection string split at a space (`redis://u:pw`) can land here.
    validate_key_prefix(prefix).map_err(|_| {
        CliError::Usage(
            "invalid --redis-prefix (not shown): it must be non-empty printable ASCII without \
             { } * ? [ ] \\, ending with `:` (the store's default is `idem:`)"
                .into(),
        )
    })?;
    // Connected first, for `migrate` and `purge` too: they need nothing done, but a Redis
    // that is down (or a URL that is not Redis's) must fail them as it fails every command,
    // or a deploy's `migrate --check` turns green on the wrong `REDIS_URL`.
    let mut conn = connect(url, timeout).await?;
    if matches!(command, Command::Migrate(_) | Command::Purge(_)) {
        // A command the server must answer: connecting alone does not show a missing password.
        server_time_us(&mut conn).await?;
    }
    match command {
        Command::Migrate(_) => {
            return summary(
                out,
                format,
                "migrate",
                "Redis needs no migration: the store creates each record on first use",
            )
        }
        Command::Purge(_) => {
            return summary(
                out,
                format,
                "purge",
                "Redis needs no purge: every record carries its own expiry (PEXPIRE) and \
                 Redis deletes it when it ends",
            )
        }
        _ => {}
    }
    if !in_cluster_mode(&mut conn, prefix).await? {
        return run_on(conn, prefix, command, format, out).await;
    }
    let cluster = redis::cluster::ClusterClientBuilder::new([url])
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .build()
        .map_err(|e| invalid_url(&e))?;
    match tokio::time::timeout(timeout, cluster.get_async_connection()).await {
        Ok(Ok(conn)) => run_on(conn, prefix, command, format, out).await,
        Ok(Err(e)) => Err(unavailable(e)),
        Err(_) => Err(CliError::Unavailable(format!(
            "Redis Cluster did not accept a connection within {} s",
            timeout.as_secs_f64()
        ))),
    }
}

/// Whether the server at the end of `conn` is a Redis Cluster node: `INFO cluster` says so.
/// A user without `INFO` (an ACL) was taken for a single server, and on a cluster idem-cli
/// then walked one node only: `stats` counted one shard with exit 0 (review, 2026-12-06).
/// Then keys under `prefix` of many slots are asked for instead (`EXISTS`, read-only): a
/// cluster node answers `MOVED` for the slots it does not serve (all of them land on it only
/// when it serves every slot, where walking it alone is walking everything). A user refused
/// that too is taken for a single server, as before.
async fn in_cluster_mode(conn: &mut MultiplexedConnection, prefix: &str) -> Result<bool, CliError> {
    let lost = |e: &RedisError| e.is_io_error() || e.is_timeout() || e.is_connection_dropped();
    match cluster_enabled(conn).await {
        Ok(enabled) => return Ok(enabled),
        Err(e) if lost(&e) => return Err(unavailable(e)),
        Err(_) => {}
    }
    // 64 keys: were the slots split between two primaries, all 64 would land on this one once
    // in 2^64 runs.
    for probe in 0..64 {
        let asked: Result<i64, RedisError> = redis::cmd("EXISTS")
            .arg(format!("{prefix}cluster-probe-{probe}"))
            .query_async(conn)
            .await;
        match asked {
            Ok(_) => {}
            Err(e) if e.kind() == redis::ErrorKind::Moved || e.code() == Some("MOVED") => {
                return Ok(true)
            }
            Err(e) if lost(&e) => return Err(unavailable(e)),
            Err(_) => return Ok(false),
        }
    }
    Ok(false)
}

async fn run_on<C: Conn>(
    mut conn: C,
    prefix: &str,
    command: &Command,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let now_us = server_time_us(&mut conn).await?;
    let mut redis = Redis {
        conn,
        prefix,
        now_us,
    };
    match command {
        Command::List(args) => list(&mut redis, args, format, out).await,
        Command::Show(args) => show(&mut redis, args, format, out).await,
        Command::Stats => stats(&mut redis, format, out).await,
        Command::Release(args) => release(&mut redis, args, format, out).await,
        Command::Migrate(_) | Command::Purge(_) => Ok(()),
    }
}

fn summary(out: &mut Out, format: Format, command: &str, text: &str) -> Result<(), CliError> {
    match format {
        Format::Json => out.json(&json!({ "command": command, "store": "redis", "note": text }))?,
        Format::Text => out.line(text)?,
    }
    out.flush()
}

async fn connect(url: &str, timeout: Duration) -> Result<MultiplexedConnection, CliError> {
    // Neither message repeats the URL: it may carry a password.
    if skips_tls_verification(url) {
        return Err(CliError::Usage(UNVERIFIED_TLS_REFUSED.to_owned()));
    }
    let client = redis::Client::open(url).map_err(|e| invalid_url(&e))?;
    // The response timeout bounds every later command (INFO, TIME, SCAN, GET...) too: a
    // server gone silent mid-command is "unavailable" (exit 3), never a hang.
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout);
    let connecting = client.get_multiplexed_async_connection_with_config(&config);
    // A TLS handshake with a server that speaks none waits for the timeout and says only that
    // (review, 2026-12-06): name the likely cause.
    let tls = matches!(
        client.get_connection_info().addr,
        redis::ConnectionAddr::TcpTls { .. }
    );
    let hint = if tls {
        " (a rediss:// URL: is TLS enabled on that port?)"
    } else {
        ""
    };
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) if e.is_timeout() && tls => Err(CliError::Unavailable(format!(
            "Redis unavailable: {e}{hint}"
        ))),
        Ok(Err(e)) => Err(unavailable(e)),
        Err(_) => Err(CliError::Unavailable(format!(
            "Redis did not accept a connection within {} s{hint}",
            timeout.as_secs_f64()
        ))),
    }
}

/// A URL the redis crate refused; the message never repeats it (it may carry a password).
fn invalid_url(e: &RedisError) -> CliError {
    CliError::Usage(format!(
        "invalid Redis URL ({}): expected redis:// or rediss://host[:port][/db]",
        e.category()
    ))
}

fn unavailable(e: RedisError) -> CliError {
    CliError::Unavailable(format!("Redis unavailable: {e}"))
}

fn failed(e: RedisError) -> CliError {
    // A password the server wants and the URL lacks shows only at the first command after
    // connecting (`NOAUTH`): the credentials, as a wrong password at connect is (exit 3).
    let credentials = matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
        || e.kind() == redis::ErrorKind::AuthenticationFailed;
    if credentials || e.is_io_error() || e.is_timeout() || e.is_connection_dropped() {
        unavailable(e)
    } else {
        CliError::Other(format!("Redis command failed: {e}"))
    }
}

async fn server_time_us<C: Conn>(conn: &mut C) -> Result<i64, CliError> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.map_err(failed)?;
    Ok(secs.saturating_mul(1_000_000).saturating_add(micros))
}

struct Redis<'a, C> {
    conn: C,
    prefix: &'a str,
    now_us: i64,
}

/// One record read back: its key, scope and fields.
struct Found {
    key: Vec<u8>,
    record: Record,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
}

/// A record key whose value is not a readable record: another type, bytes that are not a
/// record, a record cut short. The app answers 503 for requests with its key, so the commands
/// name it instead of leaving it out (found by review, 2026-12-05: `stats` counted around it,
/// and `show` and `release` answered "no record with key", sending the operator elsewhere).
struct Unreadable {
    scope: Scope,
    /// The Redis key, for `redis-cli`; `None` when it is not printable ASCII.
    key: Option<String>,
    /// What is there, in words.
    what: String,
}

impl Unreadable {
    /// Where, spelled as a record's scope is in messages (`RecordView::scope_label`).
    fn scope_label(&self) -> String {
        format!(
            "tenant={} {} {} key={}",
            if self.scope.tenant.is_empty() {
                "(global)".to_owned()
            } else {
                quoted(&self.scope.tenant)
            },
            display(&self.scope.method, 0),
            display(&self.scope.path, 0),
            quoted(&self.scope.key),
        )
    }

    /// Where, marked unreadable: one of the matches `release` names.
    fn label(&self) -> String {
        format!("{} (unreadable)", self.scope_label())
    }

    /// One line: where, what, and what to do.
    fn describe(&self) -> String {
        let redis_key = self
            .key
            .as_ref()
            .map_or_else(String::new, |k| format!(" (Redis key {k})"));
        format!(
            "{}{redis_key} holds no readable record ({}): requests with it get 503 until it \
             is removed; check it with redis-cli TYPE/GET, then DEL it",
            self.scope_label(),
            self.what
        )
    }
}

/// One key's value as `Redis::read` reads it.
enum Value {
    /// Gone since the scan.
    Gone,
    /// Not a string: its `TYPE`.
    OtherType(String),
    /// A string: its head (or all of it), its length and its `PTTL` in ms.
    Bytes(Vec<u8>, usize, i64),
}

/// What `Redis::read` found.
#[derive(Default)]
struct Read {
    found: Vec<Found>,
    unreadable: Vec<Unreadable>,
}

impl<C: Conn> Redis<'_, C> {
    /// A glob pattern for the records of a (partial) scope: missing parts match anything.
    fn pattern(&self, scope: &ScopeArgs, key: Option<&str>) -> String {
        let part = |p: Option<&str>| p.map_or_else(|| "*".to_owned(), encode_key_part);
        let method = method(scope);
        format!(
            "{}{}:{}:{}:{}",
            self.prefix,
            part(scope.tenant.as_deref()),
            part(method.as_deref()),
            part(scope.path.as_deref()),
            part(key)
        )
    }

    /// Every key matching `pattern`, by `SCAN` on every primary, each once. `SCAN` returns a key
    /// at least once, and twice when Redis shrinks its table during the walk (a wave of
    /// expiries) or a resharding moves a key to a node not yet walked: without this a record
    /// was counted or listed twice, and `release KEY` refused it as "matches 2 records".
    async fn scan(&mut self, pattern: &str) -> Result<Vec<Vec<u8>>, CliError> {
        let mut keys = KeyScan::new(pattern)
            .any_type()
            .collect(&mut self.conn)
            .await
            .map_err(failed)?;
        keys.sort_unstable();
        keys.dedup();
        Ok(keys)
    }

    /// Read the records at `keys`; keys that vanished or are not record keys are skipped,
    /// record keys holding something else are returned as [`Unreadable`]. Without
    /// `with_response` only each record's fixed head and length (`GETRANGE`, `STRLEN`): `list`
    /// and `stats` show no response, and pulling every stored body (up to the app's
    /// `max_response_bytes` each) through the production Redis's output buffer could make it
    /// refuse the app's writes. With `with_response`, the whole record (`GET`).
    async fn read(&mut self, keys: &[Vec<u8>], with_response: bool) -> Result<Read, CliError> {
        let mut read = Read::default();
        for chunk in keys.chunks(READ_BATCH) {
            // One transaction per key (one slot), so the head, the length and the expiry are
            // of the same record; all keys in flight at once: pipelined on one server's
            // connection, each sent to its own node on a cluster (where a pipeline may not span
            // slots). A key of another type answers an error (`WRONGTYPE`): not a record.
            let reads = chunk.iter().map(|key| {
                let mut conn = self.conn.clone();
                async move {
                    let mut pipe = redis::pipe();
                    pipe.atomic();
                    if with_response {
                        pipe.cmd("GET").arg(key.as_slice());
                    } else {
                        let last = record::HEAD_READ_LEN - 1;
                        pipe.cmd("GETRANGE").arg(key.as_slice()).arg(0).arg(last);
                    }
                    pipe.cmd("STRLEN").arg(key.as_slice());
                    pipe.cmd("PTTL").arg(key.as_slice());
                    let read: Result<(Option<Vec<u8>>, usize, i64), RedisError> =
                        pipe.query_async(&mut conn).await;
                    match read {
                        Ok((Some(bytes), len, pttl_ms)) if len > 0 => {
                            Ok(Value::Bytes(bytes, len, pttl_ms))
                        }
                        // A key that is gone (STRLEN 0, GETRANGE ""), or one of another type,
                        // whose `WRONGTYPE` inside the transaction reaches us as a type error
                        // or as nothing: its `TYPE` tells them apart (a rare second trip).
                        Err(e)
                            if e.kind() != redis::ErrorKind::TypeError
                                && e.code() != Some("WRONGTYPE") =>
                        {
                            Err(e)
                        }
                        _ => {
                            let kind: String = redis::cmd("TYPE")
                                .arg(key.as_slice())
                                .query_async(&mut conn)
                                .await?;
                            Ok(match kind.as_str() {
                                "none" => Value::Gone,
                                "string" => Value::Bytes(Vec::new(), 0, 0),
                                _ => Value::OtherType(kind),
                            })
                        }
                    }
                }
            });
            let values = try_join_all(reads).await.map_err(failed)?;
            for (key, value) in chunk.iter().zip(values) {
                let Some(scope) = parse_record_key(self.prefix, key) else {
                    continue;
                };
                let mut unreadable = |scope: Scope, what: String| {
                    let key = std::str::from_utf8(key)
                        .ok()
                        .filter(|k| k.bytes().all(|b| b.is_ascii_graphic()))
                        .map(str::to_owned);
                    read.unreadable.push(Unreadable { scope, key, what });
                };
                let (bytes, len, pttl_ms) = match value {
                    Value::Gone => continue,
                    Value::OtherType(kind) => {
                        unreadable(scope, format!("a value of type {kind}"));
                        continue;
                    }
                    Value::Bytes(bytes, len, pttl_ms) => (bytes, len, pttl_ms),
                };
                let head = match record::decode_head(&bytes, len) {
                    Ok(head) => head,
                    Err(why) => {
                        unreadable(scope, format!("a string of {len} bytes: {why}"));
                        continue;
                    }
                };
                let (headers, body) = if with_response {
                    match record::decode(bytes.into()) {
                        Ok(record::Record {
                            state: record::State::Completed { response, .. },
                            ..
                        }) => (
                            Some(response.encode_headers()),
                            Some(response.body.to_vec()),
                        ),
                        Ok(_) => (None, None),
                        Err(why) => {
                            unreadable(scope, format!("a record of {len} bytes: {why}"));
                            continue;
                        }
                    }
                } else {
                    (None, None)
                };
                read.found.push(Found {
                    key: key.clone(),
                    record: self.record(scope, &head, pttl_ms),
                    headers,
                    body,
                });
            }
        }
        Ok(read)
    }

    /// `stored` as the PostgreSQL commands show a row. A reservation's lease ends where its
    /// key's remaining life (`pttl_ms`) falls to its grace, by Redis's clock (`now_us`).
    fn record(&self, scope: Scope, stored: &record::Head, pttl_ms: i64) -> Record {
        let at = |us: u64| Time::from_unix_micros(i64::try_from(us).unwrap_or(i64::MAX));
        let (state, lease_end, completed_at, expires_at, status, body_len) = match &stored.state {
            record::HeadState::InFlight { grace_us, .. } => {
                if pttl_ms < 0 {
                    // No expiry (PERSIST, RESTORE with TTL 0): the store reads the lease as not
                    // ended, and no lease end is known: none is shown (`lease_unbounded`).
                    let never = Time::from_unix_micros(i64::MAX);
                    (State::InFlight, None, None, never, None, None)
                } else {
                    let life_us = pttl_ms.saturating_mul(1000);
                    let grace = i64::try_from(*grace_us).unwrap_or(i64::MAX);
                    let end = Time::from_unix_micros(
                        self.now_us.saturating_add(life_us).saturating_sub(grace),
                    );
                    (State::InFlight, Some(end), None, end, None, None)
                }
            }
            record::HeadState::Completed {
                completed_us,
                expires_us,
                status,
                body_len,
                ..
            } => (
                State::Completed,
                None,
                Some(at(*completed_us)),
                // A key with no expiry (PERSIST, RESTORE with TTL 0) is replayed for as long
                // as it lives, whatever expiry the record holds: it never expires (review,
                // 2026-12-06: it was shown expired, and `release` pointed at `purge`).
                if pttl_ms < 0 {
                    Time::from_unix_micros(i64::MAX)
                } else {
                    at(*expires_us)
                },
                i16::try_from(*status).ok(),
                i32::try_from(*body_len).ok(),
            ),
        };
        Record {
            tenant: scope.tenant,
            method: scope.method,
            path: scope.path,
            idempotency_key: scope.key,
            fingerprint: stored.fingerprint.as_bytes().to_vec(),
            state,
            token: Some(stored.token.as_uuid()),
            locked_until: lease_end,
            response_status: status,
            created_at: at(stored.created_us),
            completed_at,
            expires_at,
            body_bytes: body_len,
            read_at: Time::from_unix_micros(self.now_us),
        }
    }
}

/// The records under a pattern, batch by batch as `SCAN` returns their keys, each key read
/// once. What it keeps per key is a 64-bit hash, to read a key `SCAN` returns twice once (see
/// [`Redis::scan`]): about 16 bytes a record, where holding every key (as `list` did until
/// 2026-12-06) took about 100. (Two keys of one hash, a chance of about one in two million at
/// 8.6 million keys, would be read as one.)
struct Walk {
    scan: KeyScan,
    hasher: std::collections::hash_map::RandomState,
    seen: std::collections::HashSet<u64>,
}

impl Walk {
    fn new(pattern: String) -> Walk {
        Walk {
            scan: KeyScan::new(pattern).any_type(),
            hasher: std::collections::hash_map::RandomState::new(),
            seen: std::collections::HashSet::new(),
        }
    }

    /// The next batch's records (heads only), or `None` when the walk is done.
    async fn next(&mut self, redis: &mut Redis<'_, impl Conn>) -> Result<Option<Read>, CliError> {
        let Some(batch) = self
            .scan
            .next_batch(&mut redis.conn)
            .await
            .map_err(failed)?
        else {
            return Ok(None);
        };
        let new: Vec<Vec<u8>> = batch
            .into_iter()
            .filter(|key| {
                self.seen
                    .insert(std::hash::BuildHasher::hash_one(&self.hasher, key))
            })
            .collect();
        redis.read(&new, false).await.map(Some)
    }
}

/// `list`'s rows: the `limit` oldest records seen (all of them with limit 0), in a heap whose
/// top is the youngest kept, so memory follows `--limit`, not the keyspace (until 2026-12-06
/// every match was held until sorted: gigabytes on a store of millions).
struct Oldest {
    limit: usize,
    kept: std::collections::BinaryHeap<ByAge>,
    /// Every record offered, kept or not: more than `limit` means the list was cut.
    seen: usize,
}

/// A record in `list`'s order, oldest first: by age in microseconds (the timestamp text has
/// milliseconds and ties), then by scope, which is unique.
struct ByAge {
    age_secs: f64,
    label: String,
    record: Record,
}

impl Ord for ByAge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .age_secs
            .total_cmp(&self.age_secs)
            .then_with(|| self.label.cmp(&other.label))
    }
}

impl PartialOrd for ByAge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for ByAge {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for ByAge {}

impl Oldest {
    /// At most `limit` records; 0 keeps every one.
    fn new(limit: usize) -> Oldest {
        Oldest {
            limit,
            kept: std::collections::BinaryHeap::new(),
            seen: 0,
        }
    }

    fn add(&mut self, record: Record) {
        self.seen += 1;
        self.kept.push(ByAge {
            age_secs: record.age_secs(),
            label: record.scope_label(),
            record,
        });
        if self.limit > 0 && self.kept.len() > self.limit {
            self.kept.pop();
        }
    }

    /// The records kept, oldest first, and whether any was left out.
    fn finish(self) -> (Vec<Record>, bool) {
        let cut = self.limit > 0 && self.seen > self.limit;
        let rows = self.kept.into_sorted_vec().into_iter().map(|r| r.record);
        (rows.collect(), cut)
    }
}

async fn list(
    redis: &mut Redis<'_, impl Conn>,
    args: &ListArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let scope = ScopeArgs {
        tenant: args.tenant.clone(),
        method: None,
        path: None,
    };
    let in_scope = |tenant: &str, key: &str| {
        args.tenant.as_ref().is_none_or(|t| tenant == t)
            && args
                .key_prefix
                .as_ref()
                .is_none_or(|p| key.starts_with(p.as_str()))
    };
    let wanted = |r: &Record| {
        in_scope(&r.tenant, &r.idempotency_key)
            && args
                .older_than
                .is_none_or(|d| r.age_secs() >= d.0.as_secs_f64())
            && match args.state {
                None => true,
                Some(StateFilter::InFlight) => r.is_in_flight(),
                Some(StateFilter::Completed) => !r.is_in_flight() && !r.is_expired(),
                Some(StateFilter::Expired) => !r.is_in_flight() && r.is_expired(),
            }
    };
    let mut walk = Walk::new(redis.pattern(&scope, None));
    let mut oldest = Oldest::new(usize::try_from(args.limit).unwrap_or(usize::MAX));
    let mut unreadable = Vec::new();
    while let Some(read) = walk.next(redis).await? {
        unreadable.extend(
            read.unreadable
                .into_iter()
                .filter(|u| in_scope(&u.scope.tenant, &u.scope.key)),
        );
        for found in read.found {
            if wanted(&found.record) {
                oldest.add(found.record);
            }
        }
    }
    let (rows, truncated) = oldest.finish();
    // In key order, as when every key was collected and sorted first: `SCAN`'s order changes
    // from run to run.
    let mut unreadable: Vec<&Unreadable> = unreadable.iter().collect();
    unreadable.sort_by(|a, b| {
        a.key
            .cmp(&b.key)
            .then_with(|| a.scope_label().cmp(&b.scope_label()))
    });
    match format {
        Format::Json => {
            for row in &rows {
                out.json(&row.to_json())?;
            }
        }
        Format::Text if rows.is_empty() => out.line("no matching records")?,
        Format::Text => {
            let cells: Vec<Vec<String>> = rows.iter().map(RecordView::table_cells).collect();
            for line in table(TABLE_HEADER, &cells) {
                out.line(line)?;
            }
        }
    }
    out.flush()?;
    if truncated {
        // On stderr so `--format json | jq` still sees only records; best effort, as in the
        // PostgreSQL `list`: `eprintln!` panics when stderr is a closed pipe.
        let _ = writeln!(
            std::io::stderr(),
            "idem-cli: showing the first {} records; raise --limit (0 = all) for more",
            args.limit
        );
    }
    warn_unreadable(&unreadable);
    Ok(())
}

/// On stderr (so JSON output stays records only): each record key that holds no readable
/// record. Best effort, as the other stderr notes.
fn warn_unreadable(unreadable: &[&Unreadable]) {
    for u in unreadable {
        let _ = writeln!(std::io::stderr(), "idem-cli: warning: {}", u.describe());
    }
}

/// The records (and the unreadable values) at `key` within `scope`.
/// Read without their responses (`show` then reads each in turn).
async fn matching(
    redis: &mut Redis<'_, impl Conn>,
    key: &str,
    scope: &ScopeArgs,
) -> Result<Read, CliError> {
    let method = method(scope);
    let keys = match (&scope.tenant, &method, &scope.path) {
        // The whole scope is named: its one record key is read directly. A SCAN walks the
        // whole keyspace whatever its pattern (millions of keys for one record), and a user
        // refused SCAN could not show or release a key it could name exactly.
        (Some(tenant), Some(method), Some(path)) => vec![record_key(
            redis.prefix,
            &Scope {
                tenant: tenant.clone(),
                method: method.clone(),
                path: path.clone(),
                key: key.to_owned(),
            },
        )
        .into_bytes()],
        _ => redis.scan(&redis.pattern(scope, Some(key))).await?,
    };
    let matches = |tenant: &str, m: &str, path: &str, k: &str| {
        k == key
            && scope.tenant.as_deref().is_none_or(|t| tenant == t)
            && method.as_deref().is_none_or(|want| m == want)
            && scope.path.as_deref().is_none_or(|p| path == p)
    };
    let mut read = redis.read(&keys, false).await?;
    read.found.retain(|f| {
        let r = &f.record;
        matches(&r.tenant, &r.method, &r.path, &r.idempotency_key)
    });
    read.unreadable.retain(|u| {
        let s = &u.scope;
        matches(&s.tenant, &s.method, &s.path, &s.key)
    });
    read.found.sort_by_key(|f| f.record.scope_label());
    Ok(read)
}

/// Why nothing was found at `key`: the unreadable values there, or no record at all.
fn nothing_readable(key: &str, scope: &ScopeArgs, unreadable: &[Unreadable]) -> String {
    if unreadable.is_empty() {
        return no_record(key, scope);
    }
    unreadable
        .iter()
        .map(Unreadable::describe)
        .collect::<Vec<_>>()
        .join("; ")
}

async fn show(
    redis: &mut Redis<'_, impl Conn>,
    args: &ShowArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    // The matches first without their responses, then each with its response as it is
    // printed: a bare key can name a record in every tenant, each with a response of up to the
    // app's `max_response_bytes`, and only the one being printed is held (as on PostgreSQL).
    let read = matching(redis, &args.key, &args.scope).await?;
    let mut unreadable = read.unreadable;
    let mut shown = 0usize;
    for listed in read.found {
        let mut whole = redis.read(std::slice::from_ref(&listed.key), true).await?;
        unreadable.append(&mut whole.unreadable);
        // Gone since it was listed (expired, released): nothing to show.
        let Some(f) = whole.found.pop() else {
            continue;
        };
        let row = Detail {
            record: f.record,
            response_headers: f.headers,
            response_body: f.body,
        };
        match format {
            Format::Json => out.json(&detail_json(&row))?,
            Format::Text => {
                if shown > 0 {
                    out.line("")?;
                }
                for line in detail_text(&row) {
                    out.line(line)?;
                }
            }
        }
        shown += 1;
    }
    if shown == 0 {
        return Err(CliError::NotFoundOrRefused(nothing_readable(
            &args.key,
            &args.scope,
            &unreadable,
        )));
    }
    warn_unreadable(&unreadable.iter().collect::<Vec<_>>());
    out.flush()
}

/// What `stats` counts, record by record.
#[derive(Default)]
struct Tally {
    total: usize,
    in_flight: usize,
    lease_live: usize,
    completed_expired: usize,
    /// The in-flight record created longest ago.
    oldest: Option<Record>,
}

impl Tally {
    fn add(&mut self, r: Record) {
        self.total += 1;
        if !r.is_in_flight() {
            self.completed_expired += usize::from(r.is_expired());
            return;
        }
        self.in_flight += 1;
        self.lease_live += usize::from(r.lease_live());
        // By age (microseconds), not by the millisecond timestamp text, which ties; equal ages
        // by scope, as `list` orders them, so the answer does not follow `SCAN`'s order.
        let older = |o: &Record| {
            r.age_secs()
                .total_cmp(&o.age_secs())
                .then_with(|| o.scope_label().cmp(&r.scope_label()))
                .is_gt()
        };
        if self.oldest.as_ref().is_none_or(older) {
            self.oldest = Some(r);
        }
    }
}

/// Counted batch by batch as `SCAN` returns them ([`Walk`]), keeping no record but the oldest
/// in-flight one: a 24 h TTL at 100 requests a second is some 8.6 million records, which held
/// whole (as until 2026-12-06, found by review) took gigabytes, and a monitoring job died for
/// want of memory.
async fn stats(
    redis: &mut Redis<'_, impl Conn>,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let mut walk = Walk::new(format!("{}*", redis.prefix));
    let mut tally = Tally::default();
    let mut unreadable = Vec::new();
    while let Some(read) = walk.next(redis).await? {
        unreadable.extend(read.unreadable);
        for found in read.found {
            tally.add(found.record);
        }
    }
    let Tally {
        total,
        in_flight,
        lease_live,
        completed_expired,
        oldest,
    } = tally;
    let completed = total - in_flight;
    let oldest = oldest.as_ref();
    let unreadable_count = unreadable.len();
    match format {
        Format::Json => out.json(&json!({
            "store": "redis",
            "total": total,
            "in_flight": in_flight,
            "in_flight_lease_live": lease_live,
            "in_flight_lease_ended": in_flight - lease_live,
            "completed": completed,
            "completed_live": completed - completed_expired,
            "completed_expired": completed_expired,
            "expired_not_purged": 0,
            "unreadable": unreadable_count,
            "oldest_in_flight": oldest.map(|r| r.to_json()),
            "oldest_in_flight_age_seconds": oldest.map(|r| round_ms(r.age_secs())),
        }))?,
        Format::Text => {
            out.line(format!("records              {total}"))?;
            out.line(format!(
                "  in-flight          {}  (lease running {}, lease ended {})",
                in_flight,
                lease_live,
                in_flight - lease_live
            ))?;
            out.line(format!(
                "  completed          {}  (replayable {}, expired {})",
                completed,
                completed - completed_expired,
                completed_expired
            ))?;
            out.line("expired, not purged  0  (Redis deletes expired records itself)")?;
            if unreadable_count > 0 {
                out.line(format!(
                    "unreadable           {unreadable_count}  (record keys holding no readable record: \
                     requests with them get 503; see the warnings, or `idem-cli list`)"
                ))?;
            }
            match oldest {
                None => out.line("oldest in-flight     none")?,
                Some(r) => out.line(format!(
                    "oldest in-flight     {} created {} ago, {}",
                    r.scope_label(),
                    format_age_secs(r.age_secs()),
                    r.expiry_words()
                ))?,
            }
        }
    }
    out.flush()?;
    warn_unreadable(&unreadable.iter().collect::<Vec<_>>());
    Ok(())
}

async fn release(
    redis: &mut Redis<'_, impl Conn>,
    args: &ReleaseArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let mut refusals: Vec<String> = Vec::new();
    let result = release_each(redis, args, format, out, &mut refusals).await;
    finish(out, result, refusals, args.keys.len())
}

/// Release each key in turn, recording the refused ones in `refusals`; stops at the first
/// error.
async fn release_each(
    redis: &mut Redis<'_, impl Conn>,
    args: &ReleaseArgs,
    format: Format,
    out: &mut Out,
    refusals: &mut Vec<String>,
) -> Result<(), CliError> {
    let script = redis::Script::new(record::RELEASE_INSPECTED);
    for key in &args.keys {
        let read = matching(redis, key, &args.scope).await?;
        let verdict = match (read.found.as_slice(), read.unreadable.as_slice()) {
            // Never deleted here, even with --force: what cannot be read cannot be checked to
            // be a dead reservation, and it may be another program's data.
            ([], unreadable) => Err(nothing_readable(key, &args.scope, unreadable)),
            ([f], []) => check(&f.record, args).map(|()| f),
            // An unreadable match is a match: releasing the one readable record beside it, as
            // if it were the key's only one, deleted another tenant's record when the operator
            // meant the broken one (review, 2026-12-06).
            (found, unreadable) => Err(ambiguous_key(
                key,
                &found
                    .iter()
                    .map(|f| f.record.scope_label())
                    .chain(unreadable.iter().map(Unreadable::label))
                    .collect::<Vec<_>>(),
            )),
        };
        let f = match verdict {
            Ok(f) => f,
            Err(reason) => {
                refuse(out, format, key, &reason, refusals)?;
                continue;
            }
        };
        let row = &f.record;
        let state = if row.is_in_flight() {
            record::IN_FLIGHT
        } else {
            record::COMPLETED
        };
        let deleted: i64 = script
            .key(f.key.as_slice())
            .arg(&[state][..])
            .arg(
                row.token
                    .map(|t| t.hyphenated().to_string())
                    .unwrap_or_default(),
            )
            .arg(if args.force { "1" } else { "0" })
            .invoke_async(&mut redis.conn)
            .await
            .map_err(failed)?;
        if deleted != 1 {
            let reason = format!(
                "{} changed while releasing (completed, taken over or expired); nothing removed",
                row.scope_label()
            );
            refuse(out, format, key, &reason, refusals)?;
            continue;
        }
        released(out, format, row)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use idempotency_actix::store::postgres::admin::{Record, State, Time};

    use super::{Oldest, Tally};

    /// A completed record of `key` created `age_us` before it was read.
    fn record(key: &str, age_us: i64) -> Record {
        let read_at = 1_800_000_000_000_000;
        Record {
            tenant: "t".into(),
            method: "POST".into(),
            path: "/p".into(),
            idempotency_key: key.into(),
            fingerprint: vec![0; 32],
            state: State::Completed,
            token: None,
            locked_until: None,
            response_status: Some(201),
            created_at: Time::from_unix_micros(read_at - age_us),
            completed_at: None,
            expires_at: Time::from_unix_micros(read_at + 1),
            body_bytes: Some(0),
            read_at: Time::from_unix_micros(read_at),
        }
    }

    /// `stats`' oldest in-flight record: the oldest, and of equal ages the first by scope, in
    /// whichever order `SCAN` returns them.
    #[test]
    fn the_oldest_in_flight_does_not_follow_the_scan_order() {
        let in_flight = |key: &str, age_us: i64| Record {
            state: State::InFlight,
            ..record(key, age_us)
        };
        for order in [["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"]] {
            let mut tally = Tally::default();
            for key in order {
                tally.add(in_flight(key, if key == "c" { 1 } else { 9 }));
            }
            let oldest = tally.oldest.map(|r| r.idempotency_key);
            assert_eq!(oldest.as_deref(), Some("a"), "{order:?}");
        }
    }

    fn keys(rows: &[Record]) -> Vec<&str> {
        rows.iter().map(|r| r.idempotency_key.as_str()).collect()
    }

    /// `list` keeps the `limit` oldest records, oldest first, ties by scope, whatever order
    /// they arrive in; it says whether any was left out; limit 0 keeps all.
    #[test]
    fn the_oldest_are_kept_in_order() {
        let offered = [("c", 5), ("a", 9), ("e", 1), ("b", 9), ("d", 7), ("f", 3)];
        let mut all = Oldest::new(0);
        let mut three = Oldest::new(3);
        let mut six = Oldest::new(6);
        for (key, age) in offered {
            all.add(record(key, age));
            three.add(record(key, age));
            six.add(record(key, age));
        }
        let (rows, cut) = all.finish();
        assert_eq!(keys(&rows), ["a", "b", "d", "c", "f", "e"]);
        assert!(!cut);
        let (rows, cut) = three.finish();
        assert_eq!(keys(&rows), ["a", "b", "d"]);
        assert!(cut);
        let (rows, cut) = six.finish();
        assert_eq!(rows.len(), 6);
        assert!(!cut, "exactly the limit is not cut");
        let (rows, cut) = Oldest::new(2).finish();
        assert!(rows.is_empty() && !cut);
    }
}
