//! The actix-web middleware: [`Idempotency`] and the request flow of the contract.
//!
//! For a covered request (POST/PATCH by default) carrying a key:
//!
//! 1. parse the key (C2), take the tenant (C3, C23), buffer the body up to `max_body_bytes`
//!    (C14) and fingerprint method, path, query and body (C4);
//! 2. one `reserve` call on the store (C5): it either reserves the key for us, or tells us what
//!    is there: a completed record (replay it, C6, or 422 if the fingerprint differs, C7) or a
//!    running one (409 with `Retry-After`, or wait for it, C8; 422 if the fingerprint differs);
//! 3. run the handler with the buffered body and the [`IdempotencyKey`](crate::IdempotencyKey)
//!    in the extensions;
//! 4. if the response is to be stored (C10, C11), `complete` the record with the reservation's
//!    token (C9) and send it; otherwise `release` the key so the client can retry.
//!
//! A store failure before the handler runs answers 503 (C15, or passes through with
//! `fail_open`); after the handler ran, the client still gets the response, the failure is
//! logged, and the reservation stays until its lease ends (C16).
//!
//! One `Idempotency` per request: one wrapped inside another (on the `App` and again on a
//! scope) leaves a keyed request whose key the outer one holds (reserved, or claimed in its
//! transaction) to the outer one, and warns once per worker. Without that, the inner one found
//! the outer one's reservation and answered 409 on every attempt. A request the outer one let
//! through unprotected (`fail_open`) is protected by the inner one as usual. The inner one's
//! own settings (store, tenant, transactional mode) do not apply to what it passes through.
//!
//! # Cancellation: steps 2 to 4 run on a task of their own (C21)
//! actix drops the future that serves a request when its client goes away (a FIN or a TCP
//! reset mid-request; on HTTP/2 it keeps running it, see below). Had the handler run inside
//! that future, it would
//! stop at its next `.await` with its effects half done and the key neither completed nor
//! released; a retry after the lease would run it again. So from the reservation on, the flow
//! runs on a task of the worker's local runtime (`actix_rt::spawn`: the handler's future is
//! `!Send`), and the request's future only awaits its answer. The task is made only when the
//! flow has to wait: it is polled once inside the request's own poll first, and a replay or
//! miss that never waits (memory store, cached replays) finishes there without one (`detach`).
//! A client that disconnects changes nothing: the handler, the store write and the release run
//! to their end, and the response nobody can receive is dropped. A retry gets the replay.
//!
//! This needs a local task set, which every actix-web server has (`#[actix_web::main]`, and
//! actix-web's workers on a plain Tokio runtime). **Tests** that call the middleware through
//! `actix_web::test::init_service` must run on actix's runtime too: `#[actix_web::test]` (or
//! `#[actix_rt::test]`), not a bare `#[tokio::test]`, where Tokio refuses to spawn a local task.
//!
//! ## Streamed responses (C24)
//! A response whose body is not a single buffer (a stream, server-sent events) is never held
//! back: its head is sent at once and each chunk is forwarded as it comes, while the task keeps
//! a copy up to `max_response_bytes`. While the response may still be stored, the task reads
//! the handler's stream at the handler's pace, not the client's: what a slow client has no room
//! for yet waits for it in one buffer (at most `max_response_bytes`, the copy's own limit, with
//! no per-chunk overhead) and moves as it makes room, so a client that stops reading cannot
//! hold up the record, nor keep the key until renewal gives up and a retry runs the handler
//! again. Once the stream is over the
//! limit (the key is released), a channel of 16 chunks applies backpressure: the task stops
//! pulling from the handler's stream until the client catches up. When the client is gone the
//! task keeps pulling (without forwarding) until the stream ends, so the record is stored and
//! the retry replays, but no longer than the key is held (`renew_lease_up_to`, or the lease if
//! longer; one lease when the store cannot renew leases): an endless stream whose client left is then dropped, its reservation left to its
//! lease. Once the stream is over the limit and nobody listens, the task stops and drops it. The end of the body reaches the client only
//! after the record is stored (with a `Content-Length`, the chunk that completes the body), so
//! a client that read the whole response and retries at once gets the replay, never a 409.
//! Two exceptions, both for a body with a `Content-Length`: its last bytes wait for the
//! stream's end at most 1 s (`flow::LAST_BYTES_HELD_AT_MOST`: a stream that stays open after
//! them hung its client), and not at all once the response is too large to store. If the
//! stream fails after its head was sent, the connection is aborted (the error text goes to the
//! log only) and the reservation is left to its lease: the handler ran, so its effects may
//! exist (over the size limit the key was already released). A client that already has every
//! declared byte (the two exceptions) sees a whole response all the same; it is not stored.
//!
//! ## Graceful shutdown
//! On a graceful stop actix-web waits up to `shutdown_timeout` (30 s by default) for open
//! connections, then stops each worker's runtime, which drops its remaining tasks. A task whose
//! connection is still open is waited for like any request. A task whose client has already
//! gone, and the background retry of a store write (C16), are not counted by actix: a worker
//! with no connection left stops at once and cuts them like a crash, and after the lease the
//! client's retry runs the handler again. Stop the server through [`crate::shutdown`]
//! (`HttpServer::disable_signals()` and `shutdown::stop_on_signal`), which waits for them
//! first; and give `shutdown_timeout` at least your slowest handler's duration.
//!
//! ## HTTP/2
//! An app that enables HTTP/2 (actix-web's `http2` feature; TLS with ALPN, or `bind_auto_h2c`)
//! gets the same guarantees, tested over h2c (`tests/tests/e2e/http2.rs`): runs once under
//! `RST_STREAM` and connection drops, many streams with one key, keys sent twice or split by
//! HPACK. One difference underneath: actix-http runs each stream's service future on a task of
//! its own and never drops it, so in wait mode the middleware learns that a waiting client left
//! from the request's body stream instead (`flow::Answer`); until 2026-12-05 it did not, and
//! a waiter whose client had reset its stream ran the handler once the key came free.

mod detach;
mod flow;
mod forward;
mod renewal;
pub(crate) mod replay;
#[cfg(feature = "postgres")]
mod transactional;

use std::cell::Cell;
use std::future::{ready, Ready};
use std::rc::Rc;
use std::sync::Arc;

use actix_service::{Service, Transform};
use actix_web::body::{BoxBody, EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::{Error, HttpMessage};
use futures_util::future::LocalBoxFuture;

use crate::config::{Config, ConfigError, IdempotencyBuilder};
use crate::outcome::Meters;
use crate::store::IdempotencyStore;
use flow::Flow;

pub use flow::MAX_BACKGROUND_RETRIES;
pub use replay::REPLAYED_HEADER;
#[cfg(feature = "postgres")]
pub(crate) use transactional::TxConfig;
#[cfg(feature = "postgres")]
pub use transactional::{IdempotentTx, TxConn, TxConnError, DEFAULT_TENANT_SETTING};

/// The Idempotency-Key middleware. `.wrap()` it around an `App` or a scope.
///
/// ```
/// use actix_web::{web, App, HttpResponse};
/// use idempotency_actix::{store::MemoryStore, Idempotency};
///
/// let store = MemoryStore::new(); // clones share the records: create it outside the app factory
/// let app = App::new()
///     .wrap(Idempotency::new(store.clone()))
///     .route("/payments", web::post().to(|| async { HttpResponse::Created().finish() }));
/// ```
///
/// Wrap compression *outside* it (`.wrap(Idempotency::new(..))` first, then
/// `.wrap(Compress::default())`: actix applies the last `wrap` outermost), so responses are
/// stored unencoded and every replay is encoded for its own client.
pub struct Idempotency<S> {
    store: Arc<S>,
    config: Arc<Config>,
    /// Room for background retries ([`MAX_BACKGROUND_RETRIES`]), shared by its clones (its
    /// workers' too when it is built outside the app factory; built inside, one per worker).
    retries: Arc<tokio::sync::Semaphore>,
}

impl<S> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            retries: Arc::clone(&self.retries),
        }
    }
}

impl<S: IdempotencyStore> Idempotency<S> {
    /// The middleware with the contract's defaults (see [`crate::config`] for each and why).
    ///
    /// # Panics
    /// If a default cannot be used with this store: a store that declares less room for a
    /// response than the default `max_response_bytes` (1 MiB), such as a `MemoryStore` whose
    /// `response_allowance` was lowered. Use [`builder`](Self::builder) and set
    /// `max_response_bytes` to match; this happens when the app is built, never while serving.
    pub fn new(store: S) -> Self {
        Self::builder(store).build()
    }

    /// Configure the middleware.
    pub fn builder(store: S) -> IdempotencyBuilder<S> {
        IdempotencyBuilder::new(store)
    }
}

impl<S: IdempotencyStore> IdempotencyBuilder<S> {
    /// The middleware.
    ///
    /// # Panics
    /// If a setting cannot be used (an invalid header name, a duration out of range, a
    /// `max_response_bytes` above the store's room for a response), with a message naming it. This
    /// happens when the app is built, never while serving; use [`try_build`](Self::try_build)
    /// to handle it yourself.
    pub fn build(self) -> Idempotency<S> {
        match self.try_build() {
            Ok(middleware) => middleware,
            Err(error) => panic!("{error}"),
        }
    }

    /// The middleware, or the first setting that cannot be used.
    pub fn try_build(self) -> Result<Idempotency<S>, ConfigError> {
        #[allow(unused_mut)]
        let mut config = self.config;
        #[cfg(feature = "postgres")]
        {
            config.transactional = self.tx.map(Arc::new);
        }
        if let Some(error) = self.errors.into_iter().next() {
            return Err(error);
        }
        if let Some(room) = self.store.max_response_bytes() {
            if config.max_response_bytes > room {
                return Err(ConfigError::response_room(config.max_response_bytes, room));
            }
        }
        // Not an error: a store without renewal works, with the lease it was given. But the
        // middleware was told to renew (`renew_lease_up_to` past the lease), so say it cannot,
        // once, when the app starts rather than with a handler's second run.
        if !self.store.renews_leases() && config.lease_renewal_limit > config.lock_timeout {
            tracing::warn!(target: "idempotency_actix", store = self.store.name(), lock_timeout = ?config.lock_timeout, "this store cannot renew leases: a handler that runs longer than lock_timeout is taken over by a retry and runs a second time; set lock_timeout above the slowest handler, or implement IdempotencyStore::renew_lease");
        }
        Ok(Idempotency {
            store: Arc::new(self.store),
            config: Arc::new(config),
            retries: Arc::new(tokio::sync::Semaphore::new(MAX_BACKGROUND_RETRIES)),
        })
    }
}

impl<S, Svc, B> Transform<Svc, ServiceRequest> for Idempotency<S>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B, BoxBody>>;
    type Error = Error;
    type Transform = IdempotencyMiddleware<S, Svc>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, ()>>;

    fn new_transform(&self, service: Svc) -> Self::Future {
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            meters: Rc::new(Meters::new(self.store.name())),
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            retries: Arc::clone(&self.retries),
            nested_warned: Cell::new(false),
        }))
    }
}

/// In a request's extensions while an `Idempotency` holds its key (a reservation or a
/// transaction's claim), so one wrapped inside it leaves the request to it.
#[derive(Clone, Copy)]
pub(crate) struct KeyHeld;

/// The per-worker service created by [`Idempotency`]; not used directly.
#[doc(hidden)]
pub struct IdempotencyMiddleware<S, Svc> {
    service: Rc<Svc>,
    meters: Rc<Meters>,
    store: Arc<S>,
    config: Arc<Config>,
    retries: Arc<tokio::sync::Semaphore>,
    /// Whether this worker said once that it sits inside another `Idempotency`.
    nested_warned: Cell<bool>,
}

impl<S, Svc, B> Service<ServiceRequest> for IdempotencyMiddleware<S, Svc>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B, BoxBody>>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Error>>;

    actix_service::forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let service = Rc::clone(&self.service);
        if !self.config.covers(req.method()) {
            return Box::pin(flow::pass_through(service, req));
        }
        // An outer `Idempotency` holds this request's key already (a reservation, or its
        // transaction's claim): a second reservation of the same scope would find the outer
        // one's and answer 409 on every attempt, so the handler never ran. The outer one
        // protects the request; this one stays out of its way. Not when the outer one let the
        // request through unprotected (`fail_open`): then this one protects it.
        if req.extensions().contains::<KeyHeld>() {
            if !self.nested_warned.replace(true) {
                tracing::warn!(target: "idempotency_actix", "an Idempotency middleware is wrapped inside another one: the outer one handles keyed requests, this one passes them through (configure one per route)");
            }
            return Box::pin(flow::pass_through(service, req));
        }
        let flow = Flow {
            service,
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
            meters: Rc::clone(&self.meters),
            retries: Arc::clone(&self.retries),
        };
        Box::pin(flow.run(req))
    }
}

impl<S, Svc> std::fmt::Debug for IdempotencyMiddleware<S, Svc> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyMiddleware")
            .finish_non_exhaustive()
    }
}
