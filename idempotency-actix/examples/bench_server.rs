//! The server behind the load benchmark (`bash bench/load.sh`, see `docs/benchmarks.md`).
//!
//! ```text
//! bench_server serve --mode bare|memory|memory-cached|postgres|postgres-cached|raw|raw-local|payments-today|payments-tx|payments-raw \
//!     [--addr 127.0.0.1:18080] [--workers 2] [--database-url URL] [--pool 16] [--sync-commit off]
//!     [--max-entries 100000] [--metrics prometheus] [--body-bytes N] [--tenant-header NAME]
//!     [--replay-fast-path on] [--pool-per-thread on] [--prefill N] [--watchdog MS] [--max-lifetime S]
//! bench_server serve --mode redis|redis-raw|redis-raw-local --redis-url redis://127.0.0.1:6379 [--workers 2]
//! bench_server footprint [--records 100000]
//! bench_server migrate --database-url URL
//! ```
//!
//! Every mode serves the same handler on `POST /payments` (it reads the body and answers 201
//! with a small JSON document and a `Location` header):
//! - `bare`: the handler alone, no middleware: the ceiling.
//! - `memory`, `memory-cached`: behind `Idempotency` with the memory store (bounded at its
//!   default 100,000 records), without or with `CachedStore` in front.
//! - `postgres`, `postgres-cached`: behind `Idempotency` with the PostgreSQL store (pool of
//!   `--pool` connections), without or with `CachedStore`; `--sync-commit off` builds the store
//!   with `PostgresStoreBuilder::synchronous_commit(false)`.
//! - `raw`: no middleware; the handler itself runs the least SQL an idempotent endpoint needs
//!   over a plain bb8/diesel-async pool of the same size, with prepared statements, on a table
//!   of its own (`bench_anchor`, created by `migrate`): for a request with
//!   `x-bench-case: replay` one SELECT of the stored response by primary key, otherwise one
//!   INSERT of the reservation and one UPDATE storing the response. The key is
//!   taken from the header as it is and the fingerprint is a constant: the anchor does none of
//!   the middleware's work except its round trips.
//! - `raw-local`: the same with a pool per worker (`--pool` split between them), built on the
//!   worker's runtime (`App::data_factory`) so its connections are driven there, as the
//!   store's `pool_per_thread` does.
//!
//! - `redis`: behind `Idempotency` with the Redis store (its default connections: one multiplexed connection per worker thread).
//! - `redis-raw`: no middleware; the handler sends the least Redis commands a hand-written
//!   idempotent endpoint needs over the same kind of connection: a replay is one `GET` of the
//!   stored response; a miss is `SET key token NX PX lease`, the handler, then `SET key
//!   response PX ttl` (two round trips, as the store's reserve and complete), over one
//!   `ConnectionManager` shared by the workers, as a hand-written endpoint would keep it.
//! - `redis-raw-local`: the same with a connection per worker made on the worker's runtime
//!   (`App::data_factory`), as the store's `connection_per_thread` does.
//! - `payments-today`, `payments-tx`, `payments-raw`: a handler that inserts one row into a
//!   `payments` table (created by `migrate`). `payments-today`: the default mode, the handler
//!   inserting through its own pool connection (its own commit, besides the store's two);
//!   `payments-tx`: transactional mode, the handler inserting through `IdempotentTx` (one
//!   commit for everything); `payments-raw`: no middleware, the anchor: one hand-written
//!   transaction (BEGIN, reservation INSERT, payment INSERT, response UPDATE, COMMIT) over a
//!   plain pool.
//! - `memory-evicting`: the memory store at its `--max-entries` bound with live-record eviction
//!   opted in (`evict_live_completed_when_full`).
//!
//! Options for the scale curves and the overhead cases: `--metrics prometheus` installs
//! metrics-exporter-prometheus's recorder (no listener: the recorder alone, as an app that
//! serves `/metrics` has it); `--body-bytes N` makes the handler answer an N-byte body (bare
//! and middleware modes alike) instead of the 60-byte document; `--tenant-header NAME` scopes
//! records by that request header; `--replay-fast-path on` builds the PostgreSQL store with
//! `PostgresStoreBuilder::replay_fast_path(true)`; `--pool-per-thread on` builds it with
//! `pool_per_thread(Some(pool / workers))` (the same connections in all, each worker's opened
//! on its own runtime); `--redis-wait N` (mode `redis`) builds the
//! Redis store with `wait_for_replicas(N, 100 ms)`; `--prefill N` (mode `memory`) stores N
//! completed records before serving and prints `PREFILL {json}` with the resident memory per
//! record; `--watchdog MS` (the store modes and `raw`, `raw-local`) starts two tasks on each
//! worker, one on its runtime (`tokio::spawn`) and one on its `LocalSet` (as requests run),
//! each sleeping 2 ms in a loop, and prints to stderr every wake-up more than MS late: late on
//! both at once means the thread was not running (descheduled, or a poll blocked it); late on
//! the `LocalSet` alone means its tasks were starved. A tool for tail-latency hunts
//! (`docs/benchmarks.md`, "A second machine"): off by default; on, it adds 1,000 timer
//! wake-ups a second per worker and nothing to a request's own path; `--max-lifetime S`
//! builds the PostgreSQL store with `max_lifetime(S seconds)` (to see its reconnections).
//!
//! `footprint` fills a memory store with records shaped like the benchmark's and prints the
//! resident memory per record, as JSON.

use std::sync::OnceLock;
use std::time::Duration;

use actix_web::http::header;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{Bytea, Nullable, SmallInt, Text, Untyped};
use diesel::{QueryResult, QueryableByName};
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::{
    CachedStore, Fingerprint, IdempotencyStore, MemoryStore, ReserveOutcome, Scope, StoredResponse,
};
use idempotency_actix::{Idempotency, IdempotentTx};

const RESPONSE_BODY: &str = r#"{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}"#;

/// The handler's response body: [`RESPONSE_BODY`], or `--body-bytes` bytes of JSON.
static BODY: OnceLock<Bytes> = OnceLock::new();

/// A JSON document of exactly `len` bytes (at least the smallest one, `{"p":""}`).
fn body_of_len(len: usize) -> Bytes {
    let filler = len.saturating_sub(8);
    let mut body = Vec::with_capacity(len.max(8));
    body.extend_from_slice(b"{\"p\":\"");
    body.resize(6 + filler, b'x');
    body.extend_from_slice(b"\"}");
    Bytes::from(body)
}

async fn create_payment(body: Bytes) -> HttpResponse {
    if body.is_empty() {
        return HttpResponse::BadRequest().finish();
    }
    let response = BODY
        .get()
        .cloned()
        .unwrap_or_else(|| Bytes::from_static(RESPONSE_BODY.as_bytes()));
    HttpResponse::Created()
        .insert_header((header::LOCATION, "/payments/1"))
        .content_type("application/json")
        .body(response)
}

/// The response the handler gives, as the store keeps it.
fn stored_response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("location".into(), Bytes::from_static(b"/payments/1")),
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
        ],
        body: Bytes::from_static(RESPONSE_BODY.as_bytes()),
    }
}

struct Args {
    mode: String,
    addr: String,
    workers: usize,
    database_url: Option<String>,
    pool: u32,
    sync_commit: bool,
    records: usize,
    max_entries: usize,
    redis_url: String,
    metrics: bool,
    body_bytes: Option<usize>,
    tenant_header: Option<String>,
    replay_fast_path: bool,
    pool_per_thread: bool,
    prefill: usize,
    redis_wait: u32,
    watchdog: Option<u64>,
    max_lifetime: Option<u64>,
}

fn parse_args() -> Result<(String, Args), String> {
    let mut argv = std::env::args().skip(1);
    let command = argv.next().unwrap_or_else(|| "serve".into());
    let mut args = Args {
        mode: "bare".into(),
        addr: "127.0.0.1:18080".into(),
        workers: 2,
        database_url: std::env::var("DATABASE_URL").ok(),
        pool: 16,
        sync_commit: true,
        records: 100_000,
        max_entries: 100_000,
        redis_url: "redis://127.0.0.1:6379".into(),
        metrics: false,
        body_bytes: None,
        tenant_header: None,
        replay_fast_path: false,
        pool_per_thread: false,
        prefill: 0,
        redis_wait: 0,
        watchdog: None,
        max_lifetime: None,
    };
    while let Some(flag) = argv.next() {
        let mut value = || argv.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--mode" => args.mode = value()?,
            "--addr" => args.addr = value()?,
            "--workers" => args.workers = value()?.parse().map_err(|e| format!("{e}"))?,
            "--database-url" => args.database_url = Some(value()?),
            "--pool" => args.pool = value()?.parse().map_err(|e| format!("{e}"))?,
            "--sync-commit" => args.sync_commit = value()? != "off",
            "--records" => args.records = value()?.parse().map_err(|e| format!("{e}"))?,
            "--max-entries" => args.max_entries = value()?.parse().map_err(|e| format!("{e}"))?,
            "--redis-url" => args.redis_url = value()?,
            "--metrics" => match value()?.as_str() {
                "prometheus" => args.metrics = true,
                "none" => args.metrics = false,
                other => return Err(format!("--metrics prometheus|none, not {other}")),
            },
            "--body-bytes" => args.body_bytes = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            "--tenant-header" => args.tenant_header = Some(value()?),
            "--replay-fast-path" => args.replay_fast_path = value()? == "on",
            "--pool-per-thread" => args.pool_per_thread = value()? == "on",
            "--prefill" => args.prefill = value()?.parse().map_err(|e| format!("{e}"))?,
            "--redis-wait" => args.redis_wait = value()?.parse().map_err(|e| format!("{e}"))?,
            "--watchdog" => args.watchdog = Some(value()?.parse().map_err(|e| format!("{e}"))?),
            "--max-lifetime" => {
                args.max_lifetime = Some(value()?.parse().map_err(|e| format!("{e}"))?)
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok((command, args))
}

fn main() -> std::io::Result<()> {
    let (command, args) = parse_args().map_err(std::io::Error::other)?;
    if let Some(len) = args.body_bytes {
        let _ = BODY.set(body_of_len(len));
    }
    // The recorder alone, as an app serving `/metrics` has it; the handle renders on scrape.
    let _handle = if args.metrics {
        Some(
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .map_err(std::io::Error::other)?,
        )
    } else {
        None
    };
    match command.as_str() {
        "serve" => actix_web::rt::System::new().block_on(serve(args)),
        "footprint" => actix_web::rt::System::new().block_on(footprint(args.records)),
        "migrate" => actix_web::rt::System::new().block_on(async {
            let url = database_url(&args)?;
            idempotency_actix::store::postgres::run_migrations(&url)
                .await
                .map(|_| ())
                .map_err(std::io::Error::other)?;
            // The payments cases' and the anchors' own tables.
            let mut conn = idempotency_actix::store::postgres::establish(&url)
                .await
                .map_err(std::io::Error::other)?;
            diesel_async::SimpleAsyncConnection::batch_execute(&mut conn, BENCH_TABLES)
                .await
                .map_err(std::io::Error::other)
        }),
        other => Err(std::io::Error::other(format!("unknown command {other}"))),
    }
}

fn database_url(args: &Args) -> std::io::Result<String> {
    args.database_url
        .clone()
        .ok_or_else(|| std::io::Error::other("--database-url or DATABASE_URL is required"))
}

async fn postgres_store(args: &Args) -> std::io::Result<PostgresStore> {
    PostgresStore::builder(database_url(args)?)
        .max_size(args.pool)
        .min_idle(Some(args.pool))
        .synchronous_commit(args.sync_commit)
        .replay_fast_path(args.replay_fast_path)
        .pool_per_thread(args.pool_per_thread.then(|| per_worker_pool(args)))
        .max_lifetime(args.max_lifetime.map(Duration::from_secs))
        .build()
        .await
        .map_err(std::io::Error::other)
}

/// Run the server for one mode; `$store` is the store expression (cloned per worker).
macro_rules! serve_with_store {
    ($args:expr, $store:expr) => {{
        let store = $store;
        let tenant_header = $args.tenant_header.clone();
        let watchdog = $args.watchdog;
        HttpServer::new(move || {
            watchdog::start(watchdog);
            let builder = Idempotency::builder(store.clone());
            let middleware = match &tenant_header {
                Some(name) => builder.tenant_header(name.as_str()).build(),
                None => builder.build(),
            };
            App::new()
                .wrap(middleware)
                .route("/payments", web::post().to(create_payment))
        })
        .workers($args.workers)
        .bind(&$args.addr)?
        .run()
        .await
    }};
}

async fn serve(args: Args) -> std::io::Result<()> {
    match args.mode.as_str() {
        "bare" => {
            HttpServer::new(|| App::new().route("/payments", web::post().to(create_payment)))
                .workers(args.workers)
                .bind(&args.addr)?
                .run()
                .await
        }
        // Sized by --max-entries, no byte bound: no request is refused while it has room.
        "memory" => {
            let store = MemoryStore::builder()
                .max_entries(args.max_entries)
                .max_bytes(usize::MAX)
                .build();
            if args.prefill > 0 {
                println!("PREFILL {}", fill(&store, args.prefill).await?);
            }
            serve_with_store!(args, store)
        }
        // At the bound with live-record eviction opted in (the cache-like setting).
        "memory-evicting" => serve_with_store!(
            args,
            MemoryStore::builder()
                .max_entries(args.max_entries)
                .max_bytes(usize::MAX)
                .evict_live_completed_when_full(true)
                .build()
        ),
        "memory-cached" => serve_with_store!(args, CachedStore::new(MemoryStore::new())),
        "postgres" => serve_with_store!(args, postgres_store(&args).await?),
        "postgres-cached" => {
            serve_with_store!(args, CachedStore::new(postgres_store(&args).await?))
        }
        "raw" | "raw-local" => serve_raw(args).await,
        #[cfg(feature = "redis")]
        "redis" => serve_with_store!(
            args,
            idempotency_actix::store::RedisStore::builder()
                .wait_for_replicas(args.redis_wait, Duration::from_millis(100))
                .connect(&args.redis_url)
                .await
                .map_err(std::io::Error::other)?
        ),
        #[cfg(feature = "redis")]
        "redis-raw" | "redis-raw-local" => redis_raw::serve(args).await,
        "payments-today" => {
            let store = postgres_store(&args).await?;
            let data = web::Data::new(store.clone());
            HttpServer::new(move || {
                App::new()
                    .app_data(data.clone())
                    .wrap(Idempotency::new(store.clone()))
                    .route("/payments", web::post().to(payment_own_connection))
            })
            .workers(args.workers)
            .bind(&args.addr)?
            .run()
            .await
        }
        "payments-tx" => {
            let store = postgres_store(&args).await?;
            HttpServer::new(move || {
                App::new()
                    .wrap(Idempotency::builder(store.clone()).transactional().build())
                    .route("/payments", web::post().to(payment_in_transaction))
            })
            .workers(args.workers)
            .bind(&args.addr)?
            .run()
            .await
        }
        "payments-raw" => serve_payments_raw(args).await,
        other => Err(std::io::Error::other(format!("unknown mode {other}"))),
    }
}

// ---------------------------------------------------------------------------------------------
// The payments cases: a handler that inserts one row

/// The payments cases' table and the raw anchors' table (created by `bench_server migrate`).
///
/// `bench_anchor` is what a hand-written idempotent endpoint would keep: its own table, keyed by
/// the client's key alone, with the stored response; `status` stays NULL while the handler
/// runs. The anchors never touch the store's `idempotency_keys`, whose columns are the schema
/// module's and the migrations' alone.
const BENCH_TABLES: &str = "CREATE TABLE IF NOT EXISTS payments (
    id              bigserial   PRIMARY KEY,
    idempotency_key text,
    amount          bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS bench_anchor (
    key         text        PRIMARY KEY,
    fingerprint bytea       NOT NULL,
    token       uuid,
    status      smallint,
    headers     bytea,
    body        bytea,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
)";

fn key_of(req: &HttpRequest) -> &str {
    req.headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Default mode: the handler's insert on a connection of its own (its own commit).
async fn payment_own_connection(
    req: HttpRequest,
    body: Bytes,
    store: web::Data<PostgresStore>,
) -> HttpResponse {
    let Ok(mut conn) = store.pool().get().await else {
        return HttpResponse::ServiceUnavailable().finish();
    };
    let insert = PaymentInsert { key: key_of(&req) };
    if let Err(e) = insert.execute(&mut conn).await {
        return HttpResponse::InternalServerError().body(e.to_string());
    }
    drop(conn);
    create_payment(body).await
}

/// Transactional mode: the insert in the request's transaction.
async fn payment_in_transaction(tx: IdempotentTx, req: HttpRequest, body: Bytes) -> HttpResponse {
    let insert = PaymentInsert { key: key_of(&req) };
    let mut conn = tx.conn();
    if let Err(e) = insert.execute(&mut *conn).await {
        return HttpResponse::InternalServerError().body(e.to_string());
    }
    drop(conn);
    create_payment(body).await
}

async fn serve_payments_raw(args: Args) -> std::io::Result<()> {
    let pool = raw_pool(&args).await?;
    let headers = stored_response().encode_headers();
    let state = web::Data::new(RawState { pool, headers });
    HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .route("/payments", web::post().to(raw_payment_in_transaction))
    })
    .workers(args.workers)
    .bind(&args.addr)?
    .run()
    .await
}

/// The anchor: reservation, payment and response in one hand-written transaction.
async fn raw_payment_in_transaction(
    req: HttpRequest,
    body: Bytes,
    state: web::Data<RawState>,
) -> HttpResponse {
    let key = key_of(&req).to_owned();
    let Ok(mut conn) = state.pool.get().await else {
        return HttpResponse::ServiceUnavailable().finish();
    };
    let headers = state.headers.clone();
    let done = conn
        .transaction::<_, diesel::result::Error, _>(async |c| {
            let token = uuid::Uuid::new_v4();
            let key = key.as_str();
            RawInsert { key, token }.execute(c).await?;
            PaymentInsert { key }.execute(c).await?;
            let update = RawUpdate {
                key,
                token,
                headers: &headers,
                body: RESPONSE_BODY.as_bytes(),
            };
            update.execute(c).await?;
            Ok(())
        })
        .await;
    drop(conn);
    match done {
        Ok(()) => create_payment(body).await,
        Err(e) => HttpResponse::InternalServerError().body(e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// The raw-SQL anchor

type RawPool = Pool<AsyncPgConnection>;

async fn raw_pool(args: &Args) -> std::io::Result<RawPool> {
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    // `Fast`: no `SELECT 1` on checkout (the store does not send one either).
    config.recycling_method = RecyclingMethod::Fast;
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
        database_url(args)?,
        config,
    );
    Pool::builder()
        .max_size(args.pool)
        .min_idle(Some(args.pool))
        .connection_timeout(Duration::from_secs(2))
        .build(manager)
        .await
        .map_err(std::io::Error::other)
}

async fn serve_raw(args: Args) -> std::io::Result<()> {
    let local = args.mode == "raw-local";
    let state = if local {
        None
    } else {
        let pool = raw_pool(&args).await?;
        let headers = stored_response().encode_headers();
        Some(web::Data::new(RawState { pool, headers }))
    };
    let per_worker = per_worker_pool(&args);
    let url = database_url(&args)?;
    let watchdog = args.watchdog;
    HttpServer::new(move || {
        watchdog::start(watchdog);
        let app = App::new();
        let app = if let Some(state) = &state {
            app.app_data(state.clone())
        } else {
            // A pool per worker, its connections made (and driven) on the worker's runtime.
            let url = url.clone();
            app.data_factory(move || {
                let url = url.clone();
                async move {
                    let mut config = ManagerConfig::<AsyncPgConnection>::default();
                    config.recycling_method = RecyclingMethod::Fast;
                    let manager =
                        AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(
                            url, config,
                        );
                    let pool = Pool::builder()
                        .max_size(per_worker)
                        .min_idle(Some(per_worker))
                        .connection_timeout(Duration::from_secs(2))
                        .build(manager)
                        .await
                        .map_err(|e| eprintln!("raw-local pool: {e}"))?;
                    let headers = stored_response().encode_headers();
                    Ok::<_, ()>(RawState { pool, headers })
                }
            })
        };
        app.route("/payments", web::post().to(raw_payment))
    })
    .workers(args.workers)
    .bind(&args.addr)?
    .run()
    .await
}

/// `--pool` split between the workers (each worker's own pool in the `-local` modes).
fn per_worker_pool(args: &Args) -> u32 {
    let workers = u32::try_from(args.workers.max(1)).unwrap_or(1);
    args.pool.div_ceil(workers).max(1)
}

struct RawState {
    pool: RawPool,
    headers: Vec<u8>,
}

static FINGERPRINT: &[u8] = &[0x42; 32];

async fn raw_payment(req: HttpRequest, body: Bytes, state: web::Data<RawState>) -> HttpResponse {
    let Some(key) = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
    else {
        return create_payment(body).await;
    };
    let replay = req
        .headers()
        .get("x-bench-case")
        .is_some_and(|v| v.as_bytes() == b"replay");
    let Ok(mut conn) = state.pool.get().await else {
        return HttpResponse::ServiceUnavailable().finish();
    };
    if replay {
        let rows: QueryResult<Vec<RawRow>> = RawSelect { key }.load(&mut conn).await;
        drop(conn);
        return match rows.ok().and_then(|rows| rows.into_iter().next()) {
            Some(row) => raw_replay(row),
            // Not stored yet (the warm-up's first pass): behave like a miss would.
            None => create_payment(body).await,
        };
    }
    let token = uuid::Uuid::new_v4();
    if let Err(e) = (RawInsert { key, token }).execute(&mut conn).await {
        return HttpResponse::InternalServerError().body(e.to_string());
    }
    drop(conn);
    let response = create_payment(body).await;
    let Ok(mut conn) = state.pool.get().await else {
        return HttpResponse::ServiceUnavailable().finish();
    };
    let update = RawUpdate {
        key,
        token,
        headers: &state.headers,
        body: RESPONSE_BODY.as_bytes(),
    };
    if let Err(e) = update.execute(&mut conn).await {
        return HttpResponse::InternalServerError().body(e.to_string());
    }
    response
}

fn raw_replay(row: RawRow) -> HttpResponse {
    let status = row
        .status
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| actix_web::http::StatusCode::from_u16(s).ok())
        .unwrap_or(actix_web::http::StatusCode::OK);
    let mut response = HttpResponse::build(status);
    let headers = row.headers.unwrap_or_default();
    for (name, value) in StoredResponse::decode_headers(&headers).unwrap_or_default() {
        response.append_header((name.as_str(), value.as_ref()));
    }
    response.body(row.body.unwrap_or_default())
}

macro_rules! static_statement {
    ($name:ident, $id:ident) => {
        struct $id;
        impl QueryId for $name<'_> {
            type QueryId = $id;
            const HAS_STATIC_QUERY_ID: bool = true;
        }
        impl Query for $name<'_> {
            type SqlType = Untyped;
        }
    };
}

/// `INSERT` of a reservation: the miss path's first round trip.
struct RawInsert<'a> {
    key: &'a str,
    token: uuid::Uuid,
}
static_statement!(RawInsert, RawInsertId);

impl QueryFragment<Pg> for RawInsert<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO bench_anchor (key, fingerprint, token, expires_at) VALUES (");
        out.push_bind_param::<Text, _>(&self.key)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&FINGERPRINT)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        out.push_sql(", now() + interval '60 seconds') ON CONFLICT DO NOTHING");
        Ok(())
    }
}

/// `UPDATE` storing the response: the miss path's second round trip.
struct RawUpdate<'a> {
    key: &'a str,
    token: uuid::Uuid,
    headers: &'a [u8],
    body: &'a [u8],
}
static_statement!(RawUpdate, RawUpdateId);

impl QueryFragment<Pg> for RawUpdate<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("UPDATE bench_anchor SET status = 201, headers = ");
        out.push_bind_param::<Bytea, _>(&self.headers)?;
        out.push_sql(", body = ");
        out.push_bind_param::<Bytea, _>(&self.body)?;
        out.push_sql(", token = NULL, expires_at = now() + interval '24 hours' WHERE key = ");
        out.push_bind_param::<Text, _>(&self.key)?;
        out.push_sql(" AND token = ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        Ok(())
    }
}

/// `SELECT` of the stored response: the replay path's one round trip.
struct RawSelect<'a> {
    key: &'a str,
}
static_statement!(RawSelect, RawSelectId);

impl QueryFragment<Pg> for RawSelect<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT fingerprint, status, headers, body FROM bench_anchor WHERE key = ");
        out.push_bind_param::<Text, _>(&self.key)?;
        out.push_sql(" AND status IS NOT NULL AND expires_at > now()");
        Ok(())
    }
}

/// `INSERT` of one payment: the handler's own statement in the payments cases.
struct PaymentInsert<'a> {
    key: &'a str,
}
static_statement!(PaymentInsert, PaymentInsertId);

impl QueryFragment<Pg> for PaymentInsert<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("INSERT INTO payments (idempotency_key, amount) VALUES (");
        out.push_bind_param::<Text, _>(&self.key)?;
        out.push_sql(", 1000)");
        Ok(())
    }
}

#[derive(QueryableByName)]
struct RawRow {
    #[diesel(sql_type = Bytea)]
    #[allow(dead_code)]
    fingerprint: Vec<u8>,
    #[diesel(sql_type = Nullable<SmallInt>)]
    status: Option<i16>,
    #[diesel(sql_type = Nullable<Bytea>)]
    headers: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Bytea>)]
    body: Option<Vec<u8>>,
}

// ---------------------------------------------------------------------------------------------
// Memory footprint

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn footprint(records: usize) -> std::io::Result<()> {
    let store = MemoryStore::builder()
        .max_entries(records)
        .max_bytes(usize::MAX)
        .build();
    println!("{}", fill(&store, records).await?);
    Ok(())
}

/// Store `records` completed records shaped like the benchmark's; the resident memory they
/// took, as JSON.
async fn fill(store: &MemoryStore, records: usize) -> std::io::Result<String> {
    let response = stored_response();
    let lease = Duration::from_secs(60);
    let ttl = Duration::from_secs(86_400);
    let before = rss_kib();
    for i in 0..records {
        // The keys the load benchmark sends: `m-<run>-<thread>-<counter>`, about 20 bytes.
        let scope = Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/payments".into(),
            key: format!("m-1732960000-1-{i:08}"),
        };
        let fingerprint = Fingerprint([(i % 251) as u8; 32]);
        let outcome = store
            .reserve(&scope, &fingerprint, lease)
            .await
            .map_err(std::io::Error::other)?;
        let ReserveOutcome::Reserved { token } = outcome else {
            return Err(std::io::Error::other("expected a reservation"));
        };
        store
            .complete(&scope, &token, &response, ttl)
            .await
            .map_err(std::io::Error::other)?;
    }
    let after = rss_kib();
    let per_record = (after.saturating_sub(before) * 1024) as f64 / records.max(1) as f64;
    Ok(format!(
        "{{\"records\":{records},\"rss_before_kib\":{before},\"rss_after_kib\":{after},\
         \"bytes_per_record\":{per_record:.0},\"response_bytes\":{}}}",
        response.size_bytes()
    ))
}

// ---------------------------------------------------------------------------------------------
// The raw Redis anchor

#[cfg(feature = "redis")]
mod redis_raw {
    use super::*;
    use idempotency_actix::store::redis::redis::{self, aio::ConnectionManager};

    const LEASE_MS: u64 = 60_000;
    const TTL_MS: u64 = 24 * 3600 * 1000;

    pub(super) async fn serve(args: Args) -> std::io::Result<()> {
        let client = redis::Client::open(args.redis_url.as_str()).map_err(std::io::Error::other)?;
        let conn = ConnectionManager::new(client.clone())
            .await
            .map_err(std::io::Error::other)?;
        let state = web::Data::new(conn);
        let local = args.mode == "redis-raw-local";
        HttpServer::new(move || {
            let app = App::new();
            let app = if local {
                // A connection per worker, made on the worker's own runtime.
                let client = client.clone();
                app.data_factory(move || ConnectionManager::new(client.clone()))
            } else {
                app.app_data(state.clone())
            };
            app.route("/payments", web::post().to(payment))
        })
        .workers(args.workers)
        .bind(&args.addr)?
        .run()
        .await
    }

    async fn payment(
        req: HttpRequest,
        body: Bytes,
        conn: web::Data<ConnectionManager>,
    ) -> HttpResponse {
        let Some(key) = req
            .headers()
            .get("idempotency-key")
            .map(|v| format!("raw:{}", String::from_utf8_lossy(v.as_bytes())))
        else {
            return create_payment(body).await;
        };
        let mut conn = conn.get_ref().clone();
        let replay = req
            .headers()
            .get("x-bench-case")
            .is_some_and(|v| v.as_bytes() == b"replay");
        if replay {
            let stored: redis::RedisResult<Option<Vec<u8>>> =
                redis::cmd("GET").arg(&key).query_async(&mut conn).await;
            return match stored {
                Ok(Some(body)) if body.starts_with(b"{") => HttpResponse::Created()
                    .insert_header((header::LOCATION, "/payments/1"))
                    .content_type("application/json")
                    .body(body),
                Ok(_) => miss(&mut conn, &key, body).await,
                Err(_) => HttpResponse::ServiceUnavailable().finish(),
            };
        }
        miss(&mut conn, &key, body).await
    }

    async fn miss(conn: &mut ConnectionManager, key: &str, body: Bytes) -> HttpResponse {
        let token = uuid::Uuid::new_v4().to_string();
        let reserved: redis::RedisResult<Option<String>> = redis::cmd("SET")
            .arg(key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(LEASE_MS)
            .query_async(conn)
            .await;
        if !matches!(reserved, Ok(Some(_))) {
            return HttpResponse::Conflict().finish();
        }
        let response = create_payment(body).await;
        let stored: redis::RedisResult<()> = redis::cmd("SET")
            .arg(key)
            .arg(RESPONSE_BODY)
            .arg("PX")
            .arg(TTL_MS)
            .query_async(conn)
            .await;
        match stored {
            Ok(()) => response,
            Err(_) => HttpResponse::ServiceUnavailable().finish(),
        }
    }
}

/// `--watchdog MS`: see the module docs.
mod watchdog {
    use std::time::{Duration, Instant};

    const TICK: Duration = Duration::from_millis(2);

    /// Start the two late-wake-up detectors on this worker (called from the app factory, which
    /// runs once per worker, on the worker's thread and inside its `LocalSet`).
    pub(super) fn start(threshold_ms: Option<u64>) {
        let Some(ms) = threshold_ms else {
            return;
        };
        let threshold = Duration::from_millis(ms);
        let thread = format!("{:?}", std::thread::current().id());
        let since = Instant::now();
        tokio::spawn(detector("runtime", thread.clone(), since, threshold));
        actix_rt::spawn(detector("localset", thread, since, threshold));
    }

    async fn detector(on: &'static str, thread: String, since: Instant, threshold: Duration) {
        loop {
            let asleep = Instant::now();
            tokio::time::sleep(TICK).await;
            let late = asleep.elapsed().saturating_sub(TICK);
            if late > threshold {
                let at = asleep.duration_since(since).as_secs_f64();
                eprintln!("watchdog: {thread} {on} woke {late:?} late at {at:.3} s");
            }
        }
    }
}
