//! A small payments API behind the Idempotency-Key middleware.
//!
//! ```text
//! cargo run --example payments                      # memory store
//! DATABASE_URL=postgres://postgres@127.0.0.1/test \
//!   cargo run --example payments -- --migrate      # PostgreSQL store, table created on start
//! REDIS_URL=redis://127.0.0.1:6379/ \
//!   cargo run --example payments --features redis  # Redis store
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
//! `IDEMPOTENCY_LOCK_TIMEOUT_MS` sets the lease (default 60 s); the fault tests shorten it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::{IdempotencyStore, MemoryStore};
use idempotency_actix::{Idempotency, IdempotencyKey};
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
    HttpResponse::Ok().json(json!({
        "handler_executions": ledger.total_executions.load(Ordering::SeqCst),
        "per_key": per_key,
    }))
}

async fn metrics(handle: web::Data<PrometheusHandle>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(handle.render())
}

async fn serve<S: IdempotencyStore + Clone>(store: S, addr: &str) -> std::io::Result<()> {
    let ledger = web::Data::new(Ledger::default());
    // The middleware records through the `metrics` facade; this recorder exposes it at /metrics.
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(std::io::Error::other)?;
    let prometheus = web::Data::new(prometheus);
    // The lease of a reservation; the fault tests shorten it to see a crashed holder's key freed.
    let lease = std::env::var("IDEMPOTENCY_LOCK_TIMEOUT_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map(Duration::from_millis);
    println!("payments API on http://{addr} (try: curl -i -X POST http://{addr}/payments -H 'Idempotency-Key: k1' -H 'X-Account-Id: acct_1' -H 'content-type: application/json' -d '{{\"amount\":1000,\"currency\":\"EUR\"}}')");
    HttpServer::new(move || {
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
    .bind(addr)?
    .run()
    .await
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
    if let Some(url) = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        return serve_redis(&url, &addr).await;
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => serve_postgres(&url, migrate, &addr).await,
        _ => {
            println!("store: memory (set DATABASE_URL for PostgreSQL)");
            serve(MemoryStore::new(), &addr).await
        }
    }
}

#[cfg(feature = "postgres")]
async fn serve_postgres(url: &str, migrate: bool, addr: &str) -> std::io::Result<()> {
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
    let store = PostgresStore::connect(url).await.map_err(fail)?;
    println!("store: PostgreSQL");
    serve(store, addr).await
}

#[cfg(not(feature = "postgres"))]
async fn serve_postgres(_: &str, _: bool, _: &str) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "DATABASE_URL is set but this build has no `postgres` feature",
    ))
}

#[cfg(feature = "redis")]
async fn serve_redis(url: &str, addr: &str) -> std::io::Result<()> {
    use idempotency_actix::store::RedisStore;
    let store = RedisStore::connect(url)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    println!("store: Redis");
    serve(store, addr).await
}

#[cfg(not(feature = "redis"))]
async fn serve_redis(_: &str, _: &str) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "REDIS_URL is set but this build has no `redis` feature",
    ))
}
