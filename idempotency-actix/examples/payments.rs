//! A small payments API behind the Idempotency-Key middleware.
//!
//! ```text
//! cargo run --example payments                      # memory store
//! DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!   cargo run --example payments -- --migrate      # PostgreSQL store, table created on start
//! REDIS_URL=redis://127.0.0.1:6379/ \
//!   cargo run --example payments --features redis  # Redis store
//! REDIS_URL=redis://127.0.0.1:7000/ REDIS_CLUSTER=1 \
//!   cargo run --example payments --features redis-cluster  # Redis Cluster (any node's URL)
//! ```
//!
//! Endpoints (on 127.0.0.1:8080, or `PAYMENTS_ADDR`):
//! - `POST /payments` `{"amount": 1000, "currency": "EUR"}` creates a payment; keyed requests
//!   carry the account they act for in `X-Account-Id` (keys are scoped per account; a keyed
//!   request without one gets 400 `MISSING_TENANT`); add `?delay_ms=3000` to make the handler
//!   slow enough to see a 409 from a second terminal.
//! - `GET /payments/{id}` reads one back.
//! - `GET /stats` counts handler executions, in total and per key: the number that
//!   idempotency keeps at one per key.
//! - `GET /metrics` the middleware's metrics in Prometheus' text format (see the `outcome`
//!   module docs: `idempotency_requests_total{outcome="replay",...}` and friends).
//!
//! A demo, not an API to copy whole: the `GET`s check no account (any caller reads any payment,
//! every key and the metrics), and the account is a header a gateway is trusted to set.
//!
//! `IDEMPOTENCY_LOCK_TIMEOUT_MS` sets the lease (default 60 s); the fault tests shorten it.
//! `PAYMENTS_POOL_PER_THREAD=N` builds the PostgreSQL store with
//! `PostgresStoreBuilder::pool_per_thread(Some(N))` (a pool of N connections per worker).
//!
//! # Transactional mode
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!   cargo run --example payments -- --migrate --transactional
//! ```
//! (or `PAYMENTS_TRANSACTIONAL=1`). Payments then live in a real `payments` table (created on
//! start) and the handler inserts its row through `IdempotentTx`: the row, the idempotency
//! record and the stored response commit together. A rejected payment (400) is inserted
//! first and rolled back with its reservation, to show that a non-2xx keeps nothing; the
//! delay of `?delay_ms=` comes after the insert and before COMMIT (the window the fault tests
//! SIGKILL in). `GET /stats` still counts handler *runs* (a rolled-back run counts); the table
//! is the truth about effects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::{IdempotencyStore, MemoryStore};
use idempotency_actix::{shutdown, Idempotency, IdempotencyKey};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Deserialize)]
struct NewPayment {
    amount: u64,
    currency: String,
}

#[derive(Deserialize)]
struct Options {
    delay_ms: Option<u64>,
}

#[derive(Clone, Serialize)]
struct Payment {
    id: u64,
    amount: u64,
    currency: String,
    status: &'static str,
    idempotency_key: Option<String>,
}

#[derive(Default)]
struct Ledger {
    next_id: AtomicU64,
    payments: Mutex<HashMap<u64, Payment>>,
    executions: Mutex<HashMap<String, u64>>,
    total_executions: AtomicU64,
}

async fn create_payment(
    ledger: web::Data<Ledger>,
    key: Option<IdempotencyKey>,
    options: web::Query<Options>,
    body: web::Json<NewPayment>,
) -> HttpResponse {
    ledger.total_executions.fetch_add(1, Ordering::SeqCst);
    if let Some(key) = &key {
        if let Ok(mut executions) = ledger.executions.lock() {
            *executions.entry(key.to_string()).or_default() += 1;
        }
    }
    if let Some(delay) = options.delay_ms {
        tokio::time::sleep(Duration::from_millis(delay.min(60_000))).await;
    }
    if body.amount == 0 || body.currency.len() != 3 {
        // Not a 2xx: the middleware releases the key, so the client can fix and retry it.
        return HttpResponse::BadRequest()
            .json(json!({ "error": "amount must be positive and currency a 3-letter code" }));
    }
    let payment = Payment {
        id: ledger.next_id.fetch_add(1, Ordering::SeqCst) + 1,
        amount: body.amount,
        currency: body.currency.to_uppercase(),
        status: "succeeded",
        idempotency_key: key.map(IdempotencyKey::into_string),
    };
    if let Ok(mut payments) = ledger.payments.lock() {
        payments.insert(payment.id, payment.clone());
    }
    HttpResponse::Created()
        .insert_header(("location", format!("/payments/{}", payment.id)))
        .json(payment)
}

async fn get_payment(ledger: web::Data<Ledger>, id: web::Path<u64>) -> HttpResponse {
    let payment = ledger
        .payments
        .lock()
        .ok()
        .and_then(|p| p.get(&id.into_inner()).cloned());
    match payment {
        Some(payment) => HttpResponse::Ok().json(payment),
        None => HttpResponse::NotFound().json(json!({ "error": "no such payment" })),
    }
}

async fn stats(ledger: web::Data<Ledger>) -> HttpResponse {
    let per_key = ledger
        .executions
        .lock()
        .map(|e| e.clone())
        .unwrap_or_default();
    HttpResponse::Ok()
        // Which process answered: the fault tests start instances on free ports, and must
        // know that the one answering on a port is the one they started.
        .insert_header(("x-process-id", std::process::id().to_string()))
        .json(json!({
            "handler_executions": ledger.total_executions.load(Ordering::SeqCst),
            "per_key": per_key,
        }))
}

async fn metrics(handle: web::Data<PrometheusHandle>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(handle.render())
}

/// The lease from `IDEMPOTENCY_LOCK_TIMEOUT_MS`, if set.
/// How long a stop (SIGTERM, SIGINT) waits for handlers whose clients left and for responses
/// still being stored before it cuts them (`idempotency_actix::shutdown`). With actix's own
/// graceful stop after it ([`ACTIX_SHUTDOWN_SECS`]), a stop lasts at most 28 s, inside
/// Kubernetes' default grace period of 30 s.
const STOP_WAIT: Duration = Duration::from_secs(20);

/// `HttpServer::shutdown_timeout`: how long actix then waits for connections still open (a
/// client sending its body slowly, a request outside the middleware's count).
const ACTIX_SHUTDOWN_SECS: u64 = 8;

fn lease_from_env() -> Option<Duration> {
    std::env::var("IDEMPOTENCY_LOCK_TIMEOUT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(Duration::from_millis)
}

async fn serve<S: IdempotencyStore + Clone>(store: S, addr: &str) -> std::io::Result<()> {
    let ledger = web::Data::new(Ledger::default());
    // The middleware records through the `metrics` facade; this recorder exposes it at /metrics.
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(std::io::Error::other)?;
    let prometheus = web::Data::new(prometheus);
    // The lease of a reservation; the fault tests shorten it to see a crashed holder's key freed.
    let lease = lease_from_env();
    println!("payments API on http://{addr} (try: curl -i -X POST http://{addr}/payments -H 'Idempotency-Key: k1' -H 'X-Account-Id: acct_1' -H 'content-type: application/json' -d '{{\"amount\":1000,\"currency\":\"EUR\"}}')");
    let server = HttpServer::new(move || {
        App::new()
            .app_data(ledger.clone())
            .app_data(prometheus.clone())
            .service(
                web::scope("/payments")
                    .wrap({
                        // In a real API the tenant comes from authentication. Keyed requests
                        // without `x-account-id` get 400 MISSING_TENANT (C23).
                        let builder =
                            Idempotency::builder(store.clone()).tenant_header("X-Account-Id");
                        match lease {
                            Some(lease) => builder.lock_timeout(lease).build(),
                            None => builder.build(),
                        }
                    })
                    .route("", web::post().to(create_payment))
                    .route("/{id}", web::get().to(get_payment)),
            )
            .route("/stats", web::get().to(stats))
            .route("/metrics", web::get().to(metrics))
    })
    // SIGTERM and SIGINT stop it through `shutdown`, which first lets a handler whose client
    // left, or a retry storing a delivered response, end (actix alone would cut them).
    .disable_signals()
    .shutdown_timeout(ACTIX_SHUTDOWN_SECS)
    .bind(addr)?
    .run();
    shutdown::stop_on_signal(server.handle(), STOP_WAIT);
    server.await
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,idempotency_actix=debug".into()),
        )
        .init();
    let addr = std::env::var("PAYMENTS_ADDR").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let migrate = std::env::args().any(|arg| arg == "--migrate");
    let transactional = std::env::args().any(|arg| arg == "--transactional")
        || std::env::var("PAYMENTS_TRANSACTIONAL").is_ok_and(|v| v == "1");
    if let Some(url) = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        // A PostgreSQL option with the Redis store would be ignored: refuse, never serve a
        // mode other than the one asked for.
        if migrate || transactional {
            return Err(std::io::Error::other(
                "--migrate and --transactional are PostgreSQL options: unset REDIS_URL to use them",
            ));
        }
        return serve_redis(&url, &addr).await;
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => serve_postgres(&url, migrate, transactional, &addr).await,
        _ if transactional => Err(std::io::Error::other(
            "--transactional needs PostgreSQL: set DATABASE_URL",
        )),
        _ => {
            println!("store: memory (set DATABASE_URL for PostgreSQL)");
            serve(MemoryStore::new(), &addr).await
        }
    }
}

#[cfg(feature = "postgres")]
async fn serve_postgres(
    url: &str,
    migrate: bool,
    transactional: bool,
    addr: &str,
) -> std::io::Result<()> {
    use idempotency_actix::store::postgres::{run_migrations, PostgresStore};
    let fail = |e: idempotency_actix::store::StoreError| std::io::Error::other(e.to_string());
    if migrate {
        let applied = run_migrations(url).await.map_err(fail)?;
        println!(
            "migrations applied: {}",
            if applied.is_empty() {
                "none pending".to_owned()
            } else {
                applied.join(", ")
            }
        );
    }
    let per_thread = std::env::var("PAYMENTS_POOL_PER_THREAD")
        .ok()
        .and_then(|n| n.parse().ok());
    let store = PostgresStore::builder(url)
        .pool_per_thread(per_thread)
        .build()
        .await
        .map_err(fail)?;
    if transactional {
        println!("store: PostgreSQL, transactional mode (payments in the `payments` table)");
        return tx::serve(store, url, addr).await;
    }
    println!("store: PostgreSQL");
    serve(store, addr).await
}

#[cfg(not(feature = "postgres"))]
async fn serve_postgres(_: &str, _: bool, _: bool, _: &str) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "DATABASE_URL is set but this build has no `postgres` feature",
    ))
}

#[cfg(feature = "redis")]
async fn serve_redis(url: &str, addr: &str) -> std::io::Result<()> {
    use idempotency_actix::store::RedisStore;
    let fail = |e: idempotency_actix::store::StoreError| std::io::Error::other(e.to_string());
    if std::env::var("REDIS_CLUSTER").is_ok_and(|v| v == "1") {
        #[cfg(feature = "redis-cluster")]
        {
            let store = RedisStore::builder()
                .connect_cluster(&[url])
                .await
                .map_err(fail)?;
            println!("store: Redis Cluster");
            return serve(store, addr).await;
        }
        #[cfg(not(feature = "redis-cluster"))]
        return Err(std::io::Error::other(
            "REDIS_CLUSTER=1 but this build has no `redis-cluster` feature",
        ));
    }
    let store = RedisStore::connect(url).await.map_err(fail)?;
    println!("store: Redis");
    serve(store, addr).await
}

#[cfg(not(feature = "redis"))]
async fn serve_redis(_: &str, _: &str) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "REDIS_URL is set but this build has no `redis` feature",
    ))
}

/// Transactional mode: the payment row, the record and the response commit together.
#[cfg(feature = "postgres")]
mod tx {
    use super::*;
    use diesel::sql_types::{BigInt, Nullable, Text};
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
    use idempotency_actix::store::postgres::{establish, PostgresStore};
    use idempotency_actix::IdempotentTx;

    /// The example's own table (in a real app: a migration of the app).
    const PAYMENTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS payments (
        id              bigserial   PRIMARY KEY,
        account_id      text        NOT NULL,
        idempotency_key text,
        amount          bigint      NOT NULL,
        currency        text        NOT NULL,
        created_at      timestamptz NOT NULL DEFAULT now()
    )";

    #[derive(diesel::QueryableByName, Serialize)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = Text)]
        account_id: String,
        #[diesel(sql_type = Nullable<Text>)]
        idempotency_key: Option<String>,
        #[diesel(sql_type = BigInt)]
        amount: i64,
        #[diesel(sql_type = Text)]
        currency: String,
    }

    fn db_error(error: diesel::result::Error) -> actix_web::Error {
        tracing::error!(%error, "payments query failed");
        actix_web::error::ErrorInternalServerError("database error")
    }

    /// The account a payment is booked for: the one `X-Account-Id` (the middleware's tenant),
    /// or none. Sent twice, or not as text, it is refused, as the middleware refuses it for a
    /// keyed request: the first of two values would book the payment for an account the
    /// gateway did not vouch for, and a keyless request passes the middleware unchecked.
    fn account_of(req: &actix_web::HttpRequest) -> actix_web::Result<String> {
        let mut values = req.headers().get_all("x-account-id");
        match (values.next(), values.next()) {
            (None, _) => Ok(String::new()),
            (Some(value), None) => value.to_str().map(str::to_owned).map_err(|_| {
                actix_web::error::ErrorBadRequest("X-Account-Id must be visible ASCII")
            }),
            (Some(_), Some(_)) => Err(actix_web::error::ErrorBadRequest(
                "X-Account-Id was sent more than once",
            )),
        }
    }

    async fn create_payment(
        tx: IdempotentTx,
        req: actix_web::HttpRequest,
        ledger: web::Data<Ledger>,
        key: Option<IdempotencyKey>,
        options: web::Query<Options>,
        body: web::Json<NewPayment>,
    ) -> actix_web::Result<HttpResponse> {
        ledger.total_executions.fetch_add(1, Ordering::SeqCst);
        if let Some(key) = &key {
            if let Ok(mut executions) = ledger.executions.lock() {
                *executions.entry(key.to_string()).or_default() += 1;
            }
        }
        let account = account_of(&req)?;
        let row = {
            let mut conn = tx.conn(); // this request's transaction
            diesel::sql_query(
                "INSERT INTO payments (account_id, idempotency_key, amount, currency) \
                 VALUES ($1, $2, $3, upper($4)) \
                 RETURNING id, account_id, idempotency_key, amount, currency",
            )
            .bind::<Text, _>(&account)
            .bind::<Nullable<Text>, _>(key.as_ref().map(|k| k.as_str()))
            .bind::<BigInt, _>(i64::try_from(body.amount).unwrap_or(i64::MAX))
            .bind::<Text, _>(&body.currency)
            .get_result::<Row>(&mut *conn)
            .await
            .map_err(db_error)?
        };
        if let Some(delay) = options.delay_ms {
            // After the insert, before COMMIT: a crash here leaves nothing behind.
            tokio::time::sleep(Duration::from_millis(delay.min(60_000))).await;
        }
        if body.amount == 0 || body.currency.len() != 3 {
            // Not a 2xx: the middleware rolls back, and the row inserted above goes with it.
            return Ok(HttpResponse::BadRequest()
                .json(json!({ "error": "amount must be positive and currency a 3-letter code" })));
        }
        Ok(HttpResponse::Created()
            .insert_header(("location", format!("/payments/{}", row.id)))
            .json(json!({
                "id": row.id,
                "account_id": row.account_id,
                "amount": row.amount,
                "currency": row.currency,
                "status": "succeeded",
                "idempotency_key": row.idempotency_key,
            })))
    }

    async fn get_payment(
        store: web::Data<PostgresStore>,
        id: web::Path<i64>,
    ) -> actix_web::Result<HttpResponse> {
        let mut conn = store
            .pool()
            .get()
            .await
            .map_err(actix_web::error::ErrorServiceUnavailable)?;
        let rows = diesel::sql_query(
            "SELECT id, account_id, idempotency_key, amount, currency FROM payments WHERE id = $1",
        )
        .bind::<BigInt, _>(id.into_inner())
        .load::<Row>(&mut *conn)
        .await
        .map_err(db_error)?;
        Ok(match rows.into_iter().next() {
            Some(row) => HttpResponse::Ok().json(row),
            None => HttpResponse::NotFound().json(json!({ "error": "no such payment" })),
        })
    }

    pub(super) async fn serve(store: PostgresStore, url: &str, addr: &str) -> std::io::Result<()> {
        let mut conn = establish(url)
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        conn.batch_execute(PAYMENTS_TABLE)
            .await
            .map_err(std::io::Error::other)?;
        drop(conn);
        let ledger = web::Data::new(Ledger::default());
        let prometheus = PrometheusBuilder::new()
            .install_recorder()
            .map_err(std::io::Error::other)?;
        let prometheus = web::Data::new(prometheus);
        let lease = lease_from_env();
        let data = web::Data::new(store.clone());
        let server = HttpServer::new(move || {
            let builder = Idempotency::builder(store.clone()).tenant_header("X-Account-Id");
            let builder = match lease {
                Some(lease) => builder.lock_timeout(lease),
                None => builder,
            };
            App::new()
                .app_data(ledger.clone())
                .app_data(prometheus.clone())
                .app_data(data.clone())
                .service(
                    web::scope("/payments")
                        .wrap(builder.transactional().build())
                        .route("", web::post().to(create_payment))
                        .route("/{id}", web::get().to(get_payment)),
                )
                .route("/stats", web::get().to(stats))
                .route("/metrics", web::get().to(metrics))
        })
        .disable_signals()
        .shutdown_timeout(super::ACTIX_SHUTDOWN_SECS)
        .bind(addr)?
        .run();
        shutdown::stop_on_signal(server.handle(), super::STOP_WAIT);
        server.await
    }
}
