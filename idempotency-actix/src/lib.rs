//! `Idempotency-Key` support for actix-web: a retried POST runs its handler once.
//!
//! Wrap an app (or a scope) in [`Idempotency`] and every POST and PATCH that carries an
//! `Idempotency-Key` header runs at most once per key: a retry gets the stored response back
//! (with `Idempotent-Replayed: true`), a concurrent duplicate gets 409 while the first one
//! runs, and the same key with a different body gets 422. The behaviour follows the IETF
//! `Idempotency-Key` draft and Stripe's idempotent requests; the rules cited in the code as
//! C1-C26 are written out in the repository's `docs/contract.md`.
//!
//! ```no_run
//! use actix_web::{web, App, HttpResponse, HttpServer};
//! use idempotency_actix::{store::MemoryStore, Idempotency, IdempotencyKey};
//!
//! async fn create_payment(key: IdempotencyKey, body: web::Json<serde_json::Value>) -> HttpResponse {
//!     // Runs once per key; retries are answered from the store.
//!     HttpResponse::Created().json(serde_json::json!({ "key": key.as_str(), "amount": body["amount"] }))
//! }
//!
//! #[actix_web::main]
//! async fn main() -> std::io::Result<()> {
//!     // Clones share the records: create the store once, outside the app factory.
//!     let store = MemoryStore::new();
//!     HttpServer::new(move || {
//!         App::new()
//!             .wrap(Idempotency::new(store.clone()))
//!             .route("/payments", web::post().to(create_payment))
//!     })
//!     .bind(("127.0.0.1", 8080))?
//!     .run()
//!     .await
//! }
//! ```
//!
//! For several app instances, use the PostgreSQL store (feature `postgres`, on by default):
//! `let store = PostgresStore::connect(&url).await.map_err(std::io::Error::other)?;` (with
//! `use idempotency_actix::store::PostgresStore;`, outside the `HttpServer::new` closure)
//! instead of `MemoryStore::new()`, and provision the table with `idem-cli migrate`.
//!
//! # Modules
//! - [`middleware`]: the request flow, cancellation, streaming and shutdown; [`config`]: the
//!   builder and why each default is what it is.
//! - [`IdempotencyKey`]: which keys are accepted, and the extractor; [`Fingerprint`]: what
//!   makes a retry "the same request"; [`problem`]: the RFC 9457 errors and their codes;
//!   [`outcome`]: metrics and the outcome hook.
//! - [`shutdown`]: stopping a server without cutting a handler or a store write that runs
//!   past its client.
//! - [`store`]: the storage trait, how to write a store, and the stores.
//!
//! # What the middleware cannot do for you
//! If the store fails *after* your handler ran (the database goes away between the two
//! statements), the client still gets your response and the key stays reserved (a retry gets
//! 409) while the middleware keeps trying to store the response until the lease
//! (`lock_timeout`, 60 s) ends; while the store still answers (only its writes of responses
//! fail), it renews the lease between tries, up to `renew_lease_up_to` (10 minutes). If the
//! store is back by then, retries get the replay; if it is
//! still down, a retry after the lease runs the handler again. Handlers that move money should
//! therefore also be idempotent downstream (pass the key on to the payment provider, with the
//! tenant: see [`IdempotencyKey`]). See
//! `docs/design.md` and `docs/reliability.md`.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
mod fingerprint;
mod key;
mod log_text;
pub mod middleware;
pub mod outcome;
pub mod problem;
pub mod shutdown;
pub mod store;

pub use config::{
    ConfigError, IdempotencyBuilder, IntoHeaderName, ResponseParts, MAX_RETRY_AFTER,
    MIN_LOCK_TIMEOUT, MIN_TTL,
};
pub use fingerprint::Fingerprint;

/// Parsers this workspace's fuzzers, property tests and benchmarks drive directly. Not part of
/// the API: no semver promise, may change in any release.
#[doc(hidden)]
pub mod internals {
    pub use crate::fingerprint::{
        canonical_json, is_canonical_json, is_json_content_type, MAX_JSON_DEPTH,
    };
    pub use crate::key::{parse_key, to_sf_string, KeyError};
    pub use crate::middleware::replay::replay as replay_response;
}
pub use key::IdempotencyKey;
pub use middleware::Idempotency;
#[cfg(feature = "postgres")]
pub use middleware::{IdempotentTx, TxConn, TxConnError};
pub use outcome::{Outcome, OutcomeEvent};
pub use problem::{Problem, ProblemCode};
