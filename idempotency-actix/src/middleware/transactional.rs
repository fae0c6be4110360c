//! Transactional mode (C25, `IdempotencyBuilder::<PostgresStore>::transactional`): the
//! reservation, the handler's writes through [`IdempotentTx`] and the stored response commit
//! in one PostgreSQL transaction.
//!
//! Per request, on the request's own task (C21), on one pooled connection:
//! 1. BEGIN (+ `SET LOCAL idle_in_transaction_session_timeout`, one round trip);
//! 2. keyed: the claim (tenant setting, then reserve-or-fetch in this transaction). A replay,
//!    a 409 or a 422 rolls back at once and answers as in the default mode; a reservation
//!    goes on. Keyless: only the tenant setting, when a tenant source is configured;
//! 3. the handler, with the connection lent through [`IdempotentTx`];
//! 4. a storable response (status filter, `store_if`, within `max_response_bytes`) is
//!    buffered whole (nothing reaches the client before COMMIT: C24's streaming does not apply),
//!    stored with `complete` (keyed; refused in a transaction a failed statement aborted) and
//!    committed, or (keyless) committed as `SELECT 1; COMMIT`, whose `SELECT 1` is refused in
//!    an aborted transaction (PostgreSQL answers COMMIT of one with a rollback, not an error);
//!    anything else rolls back, and with it the handler's writes.
//!
//! A failed COMMIT never answers the handler's response: the client gets `COMMIT_FAILED`
//! (nothing was done, a retry with the same key is safe) or `COMMIT_OUTCOME_UNKNOWN` (the
//! connection was lost during COMMIT; a retry with the same key replays if it committed and
//! runs once if not). `docs/transactional.md` is the user-facing description.

use std::cell::{Cell, RefCell, RefMut};
use std::fmt;
use std::future::{ready, Ready};
use std::ops::{Deref, DerefMut};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_service::Service;
use actix_web::body::{to_bytes_limited, BoxBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{Error, FromRequest, HttpMessage, HttpRequest, HttpResponse};
use bytes::Bytes;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};

use super::detach::detach;
use super::flow::{opaque_500, read_body, unavailable_detail, Flow, FlowResult, MAX_POLL_INTERVAL};
use super::renewal::{Renewal, Reservation};
use super::replay::{replay, storable_headers};
use crate::config::{saturating_deadline, Config, ResponseParts};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::log_text::LogText;
use crate::outcome::{Outcome, Report};
use crate::problem::{Problem, ProblemCode};
use crate::store::postgres::transactional::{self as sql, CommitError, TxConnection};
use crate::store::postgres::{IsolationLevel, PostgresStore};
use crate::store::{
    IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
    WriteOutcome,
};

/// Default name of the transaction-local setting that carries the tenant.
pub const DEFAULT_TENANT_SETTING: &str = "app.tenant_id";

/// How often a claim that answered `raced` is tried again before giving up with 503.
const CLAIM_ATTEMPTS: usize = 5;

/// The settings of transactional mode, shared by all workers (type-erased out of the store
/// type: the flow stays generic, and this holds the PostgreSQL store it needs).
pub(crate) struct TxConfig {
    pub(crate) store: PostgresStore,
    pub(crate) tenant_setting: String,
    pub(crate) isolation: IsolationLevel,
    pub(crate) serialization_retries: u32,
}

impl TxConfig {
    pub(crate) fn new(store: PostgresStore) -> Self {
        Self {
            store,
            tenant_setting: DEFAULT_TENANT_SETTING.to_owned(),
            isolation: IsolationLevel::default(),
            serialization_retries: 0,
        }
    }
}

impl fmt::Debug for TxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxConfig")
            .field("tenant_setting", &self.tenant_setting)
            .field("isolation", &self.isolation)
            .field("serialization_retries", &self.serialization_retries)
            .finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------------
// the extractor

/// The connection slot of one request: filled while the handler runs, emptied by the
/// middleware before COMMIT.
struct TxSlot {
    conn: RefCell<Option<TxConnection>>,
    /// The handler has returned (or its work was dropped): the transaction is the
    /// middleware's, or nobody's. No new borrow; the last one ends it (see [`TxConn`]'s drop).
    finished: Cell<bool>,
}

/// Takes the connection out of its slot when dropped (unless a `TxConn` borrows it): see
/// `run_and_settle`.
struct EmptyOnDrop(Rc<TxSlot>);

impl Drop for EmptyOnDrop {
    fn drop(&mut self) {
        self.0.finished.set(true);
        if let Ok(mut conn) = self.0.conn.try_borrow_mut() {
            drop(conn.take());
        }
    }
}

/// The transaction of this request, for handlers behind a transactional
/// [`Idempotency`](crate::Idempotency) middleware (see
/// [`IdempotencyBuilder::transactional`](crate::IdempotencyBuilder::transactional)).
///
/// Every statement run on [`conn`](Self::conn) belongs to the transaction that also holds this
/// request's idempotency record: it commits with the stored response, or rolls back with the
/// reservation (non-2xx response, handler error, failed COMMIT, crash). On a covered method it
/// works with or without an `Idempotency-Key` (without one it is a plain transaction, committed
/// when the response is storable).
///
/// ```no_run
/// use actix_web::{web, HttpResponse};
/// use diesel_async::RunQueryDsl;
/// use idempotency_actix::IdempotentTx;
///
/// async fn create_payment(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
///     let mut conn = tx.conn();
///     diesel::sql_query("INSERT INTO payments (amount) VALUES (1000)")
///         .execute(&mut *conn)
///         .await
///         .map_err(actix_web::error::ErrorInternalServerError)?;
///     Ok(HttpResponse::Created().finish())
/// }
/// ```
///
/// Do not `COMMIT` or `ROLLBACK` on it yourself: `conn.transaction(..)` opens a savepoint
/// inside the request's transaction, which is what you want for a part that may fail alone.
///
/// Used on a route that is not behind a transactional middleware (or on a method it does not
/// cover), the extractor fails with a 500 and an error log line saying why.
#[derive(Clone)]
pub struct IdempotentTx {
    slot: Rc<TxSlot>,
}

impl fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

/// The connection of the request's transaction, borrowed from an [`IdempotentTx`]. Derefs
/// (mutably) to [`AsyncPgConnection`]: pass `&mut *conn` to diesel-async.
pub struct TxConn<'a> {
    /// `Some` from the borrow until the drop.
    conn: Option<RefMut<'a, AsyncPgConnection>>,
    slot: &'a TxSlot,
}

impl Deref for TxConn<'_> {
    type Target = AsyncPgConnection;

    fn deref(&self) -> &AsyncPgConnection {
        match &self.conn {
            Some(conn) => conn,
            None => unreachable!("a TxConn is emptied only by its drop"),
        }
    }
}

impl DerefMut for TxConn<'_> {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        match &mut self.conn {
            Some(conn) => conn,
            None => unreachable!("a TxConn is emptied only by its drop"),
        }
    }
}

impl Drop for TxConn<'_> {
    fn drop(&mut self) {
        drop(self.conn.take());
        if self.slot.finished.get() {
            // A borrow that outlived the handler (on a task of the handler's), now over: the
            // request already answered 500 and nothing may commit, so the transaction ends
            // here, not when the last IdempotentTx clone goes. Dropped inside its transaction,
            // the connection is discarded by the pool and PostgreSQL rolls back (review,
            // 2026-12-06: the task could borrow again, hold the claim, and COMMIT).
            if let Ok(mut conn) = self.slot.conn.try_borrow_mut() {
                drop(conn.take());
            }
        }
    }
}

impl fmt::Debug for TxConn<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxConn").finish_non_exhaustive()
    }
}

/// Why [`IdempotentTx::try_conn`] has no connection to lend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TxConnError {
    /// Another [`TxConn`] of this request is still alive (drop it first).
    #[error(
        "the request's transaction connection is already borrowed (drop the other TxConn first)"
    )]
    Borrowed,
    /// The handler has returned: the middleware took the connection back to commit or roll
    /// back (an `IdempotentTx` kept beyond the handler, e.g. in a spawned task).
    #[error("the request's transaction is over (IdempotentTx used after the handler returned)")]
    Finished,
}

impl IdempotentTx {
    /// The connection of this request's transaction.
    ///
    /// # Panics
    /// If another [`TxConn`] of this request is alive, or the handler has already returned
    /// (see [`try_conn`](Self::try_conn), which reports both instead).
    pub fn conn(&self) -> TxConn<'_> {
        match self.try_conn() {
            Ok(conn) => conn,
            Err(error) => panic!("IdempotentTx::conn: {error}"),
        }
    }

    /// The connection of this request's transaction, or why there is none to lend.
    ///
    /// # Errors
    /// [`TxConnError::Borrowed`] while another [`TxConn`] is alive, [`TxConnError::Finished`]
    /// once the handler has returned.
    pub fn try_conn(&self) -> Result<TxConn<'_>, TxConnError> {
        if self.slot.finished.get() {
            return Err(TxConnError::Finished);
        }
        let slot = self
            .slot
            .conn
            .try_borrow_mut()
            .map_err(|_| TxConnError::Borrowed)?;
        RefMut::filter_map(slot, |conn| conn.as_mut().map(|pooled| &mut **pooled))
            .map(|conn| TxConn {
                conn: Some(conn),
                slot: &self.slot,
            })
            .map_err(|_| TxConnError::Finished)
    }
}

impl FromRequest for IdempotentTx {
    type Error = Error;
    type Future = Ready<Result<Self, Error>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        match req.extensions().get::<IdempotentTx>() {
            Some(tx) => ready(Ok(tx.clone())),
            None => {
                tracing::error!(target: "idempotency_actix", method = %req.method(), path = %LogText(req.path()), "IdempotentTx used outside a transactional scope: wrap this route in Idempotency::builder(postgres_store).transactional() and make sure it covers this method");
                ready(Err(actix_web::error::InternalError::from_response(
                    "IdempotentTx outside a transactional scope",
                    HttpResponse::InternalServerError()
                        .content_type("text/plain; charset=utf-8")
                        .body("server misconfiguration: this route has no idempotent transaction"),
                )
                .into()))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// the flow

/// A keyed request's identity.
pub(super) struct Keyed {
    pub(super) scope: Scope,
    pub(super) fingerprint: Fingerprint,
    pub(super) report: Report,
}

/// What the part after the handler decided.
enum After<B> {
    Answer(FlowResult<B>),
    /// The handler ended the request's transaction itself (diesel's `commit_transaction` or
    /// `rollback_transaction`): what it committed stays committed, and nothing of ours is
    /// left to commit. A keyed request then finishes as in the default mode (store or release
    /// through the store, C16's retries included), so a retry replays a stored response
    /// instead of running the handler again after the lease.
    Ended(Result<ServiceResponse<B>, Error>),
    /// A serialization failure at `complete` or COMMIT: everything was rolled back, and the
    /// request may run again (the retry option): its request, to rebuild it from.
    Retry(HttpRequest),
}

/// The claim of a keyed request, or the answer instead of running the handler.
enum Claimed {
    Reserved(Box<TxConnection>, ReservationToken),
    Answered(HttpResponse, Outcome),
    Replay(StoredResponse),
    InFlight,
}

/// A keyed request in transactional mode, on its own task (called by `Flow::settle`).
pub(super) async fn settle_keyed<S, Svc, B>(
    flow: Flow<S, Svc>,
    tx: Arc<TxConfig>,
    req: ServiceRequest,
    keyed: Keyed,
    body: Bytes,
    answer: super::flow::Answer<B>,
) where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let Keyed {
        scope,
        fingerprint,
        report,
    } = keyed;
    let config = Arc::clone(&flow.config);
    let wait_until = config
        .wait_for_in_flight
        .map(|wait| saturating_deadline(Instant::now(), wait));
    let mut pause = Duration::from_millis(10);
    let mut req = req;
    // The router advances the match info as it matches; a re-run starts from here again.
    let match_info = req.match_info().clone();
    let mut runs = 0u32;
    let mut answer = answer;
    let mut waited = false;
    loop {
        // A client that left while waiting (wait mode) is not run for: see `Flow::reserve`.
        if waited && answer.is_closed() {
            tracing::info!(target: "idempotency_actix", outcome = ran_before(Outcome::Abandoned, runs).as_str(), runs, key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "the client left while waiting for the first request with this key; not run (again)");
            report.outcome(
                ran_before(Outcome::Abandoned, runs),
                crate::outcome::client_closed(),
                Some(&scope),
            );
            answer.abandoned(req);
            return;
        }
        // No later than the transaction's start, which the stored response's expiry counts
        // from (see `run_and_settle`).
        let opened = Instant::now();
        let (conn, token) = match claim(&flow, &tx, &scope, &fingerprint).await {
            // The client left while this claim was on its way: rolled back, not run for nobody.
            Claimed::Reserved(conn, _) if waited && answer.is_closed() => {
                let mut conn = *conn;
                sql::rollback(&tx.store, &mut conn).await;
                tracing::info!(target: "idempotency_actix", outcome = ran_before(Outcome::Abandoned, runs).as_str(), runs, key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "the client left while waiting for the first request with this key; the claim it then got is rolled back, not run (again)");
                report.outcome(
                    ran_before(Outcome::Abandoned, runs),
                    crate::outcome::client_closed(),
                    Some(&scope),
                );
                answer.abandoned(req);
                return;
            }
            Claimed::Reserved(conn, token) => (*conn, token),
            Claimed::Answered(response, outcome) => {
                report.outcome(ran_before(outcome, runs), response.status(), Some(&scope));
                let _ = answer.send(Ok(req.into_response(response).map_into_right_body()));
                return;
            }
            Claimed::Replay(stored) => {
                let (response, outcome) = match replay(stored, &req, &config.deny_headers) {
                    Ok(response) => (response, Outcome::Replay),
                    Err(problem) => {
                        tracing::info!(target: "idempotency_actix", outcome = "replay_not_acceptable", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "stored response encoded in a way this retry does not accept");
                        (config.problem(problem), Outcome::ReplayNotAcceptable)
                    }
                };
                report.outcome(ran_before(outcome, runs), response.status(), Some(&scope));
                let _ = answer.send(Ok(req.into_response(response).map_into_right_body()));
                return;
            }
            Claimed::InFlight => {
                let now = Instant::now();
                if let Some(until) = wait_until.filter(|until| *until > now) {
                    tokio::select! {
                        () = tokio::time::sleep(pause.min(until - now)) => {}
                        () = answer.closed() => {}
                    }
                    pause = (pause * 2).min(MAX_POLL_INTERVAL);
                    waited = true;
                    continue;
                }
                tracing::info!(target: "idempotency_actix", outcome = ran_before(Outcome::Conflict, runs).as_str(), runs, key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "the first request with this key is still running (its transaction is open)");
                let problem = Problem::new(
                    ProblemCode::Conflict,
                    "the first request with this key is still being processed; retry after it finishes",
                )
                .with_retry_after(config.retry_after);
                report.outcome(
                    ran_before(Outcome::Conflict, runs),
                    problem.status(),
                    Some(&scope),
                );
                let response = config.problem(problem);
                let _ = answer.send(Ok(req.into_response(response).map_into_right_body()));
                return;
            }
        };
        tracing::debug!(target: "idempotency_actix", outcome = "miss", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "claimed in a transaction; running the handler");
        let _held = flow.meters.held();
        req.extensions_mut()
            .insert(IdempotencyKey(scope.key.clone()));
        req.extensions_mut().insert(super::KeyHeld);
        runs += 1;
        let retries_left = runs <= tx.serialization_retries;
        let after = run_and_settle(
            &flow,
            &tx,
            req,
            conn,
            Some((&scope, token, opened)),
            Some(&report),
            retries_left,
        )
        .await;
        match after {
            After::Answer(result) => {
                let _ = answer.send(result);
                return;
            }
            After::Ended(result) => {
                tracing::error!(target: "idempotency_actix", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "the handler ended the request's transaction itself (never do: use the transaction, savepoints through conn.transaction); finishing as in the default mode, not atomically");
                // Its claim is a committed reservation now, held by the lease that began with
                // the transaction and lasts its idle limit (`claim`); nothing renews it
                // (`renew_lease_up_to` zero), but a streamed body whose client left is read no
                // longer than that lease.
                let renewal = Renewal::new(Reservation {
                    store: &flow.store,
                    meters: &flow.meters,
                    scope: &scope,
                    token,
                    lease: idle_limit(&flow.config),
                    limit: Duration::ZERO,
                    reserved_at: opened,
                });
                flow.finish(&scope, token, result, &report, answer, renewal)
                    .await;
                return;
            }
            After::Retry(http_req) => {
                let mut next = ServiceRequest::from_parts(http_req, Payload::from(body.clone()));
                // actix routes through `match_info_mut`, which panics when the request is
                // shared: the handler (or a middleware inside this one) kept a copy of its
                // `HttpRequest`, on a spawned task say. Such a request cannot run again; all of
                // it was rolled back, so it is answered like a failed commit.
                let restored = catch_unwind(AssertUnwindSafe(|| {
                    *next.match_info_mut() = match_info.clone();
                }));
                if restored.is_err() {
                    tracing::error!(target: "idempotency_actix", outcome = "commit_failed", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "serialization failure, rolled back; not run again because a copy of the request is still held (a handler kept its HttpRequest)");
                    let (http_req, _) = next.into_parts();
                    let _ = answer.send(commit_failed(
                        &flow,
                        http_req,
                        Some(&scope),
                        Some(&report),
                        "serialization failure, and the request could not be run again",
                    ));
                    return;
                }
                tracing::info!(target: "idempotency_actix", outcome = "serialization_retry", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), run = runs, "serialization failure; everything rolled back, running the request again");
                req = next;
            }
        }
    }
}

/// The outcome to report for what a claim answered after `runs` runs of the handler: once a
/// run was rolled back by a serialization failure (the retry option), the handler has run,
/// whatever the next claim finds (the key taken meanwhile: 409; another request's response:
/// a replay; the store down: 503), so that is [`Outcome::RolledBack`] with the status the
/// client got, never an outcome that says nothing ran. (The claim's own log lines say what it
/// found; the `runs` field of the lines here tells a re-run apart.)
fn ran_before(outcome: Outcome, runs: u32) -> Outcome {
    if runs > 0 && !outcome.ran_handler() {
        Outcome::RolledBack
    } else {
        outcome
    }
}

/// A covered request without a key in transactional mode: a plain transaction, committed with
/// a storable response (no record, no claim). On its own task, like a keyed one (C21).
pub(super) async fn run_keyless<S, Svc, B>(
    flow: Flow<S, Svc>,
    tx: Arc<TxConfig>,
    mut req: ServiceRequest,
) -> FlowResult<B>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    // The body first, before the transaction opens: a client that uploads slowly must not hold
    // a pooled connection (in an open transaction) while it does, or a few of them take the
    // pool from everyone. So a keyless body, like a keyed one, is at most `max_body_bytes`
    // (413 past it): read inside the transaction, the rest of a larger body would hold the
    // connection for as long as its client liked.
    match read_body(&mut req, flow.config.max_body_bytes).await {
        Ok((body, _)) => req.set_payload(Payload::from(body)),
        Err(problem) => {
            tracing::info!(target: "idempotency_actix", code = %problem.code, "keyless request refused: its body is over max_body_bytes or could not be read, and in transactional mode a body is read whole before the transaction opens");
            return Ok(req
                .into_response(flow.config.problem(problem))
                .map_into_right_body());
        }
    }
    let (answer, answered) = tokio::sync::oneshot::channel();
    // Boxed in its own statement, so that the work's state takes no room in this future.
    let work = Box::pin(async move {
        let result = keyless(&flow, &tx, req).await;
        let _ = answer.send(result);
    });
    let panicked = || {
        tracing::error!(target: "idempotency_actix", outcome = "handler_panic", "the request's task ended without a response; its transaction was rolled back");
    };
    detach(work, panicked).await;
    match answered.await {
        Ok(result) => result,
        Err(_) => Err(opaque_500("the request's task ended without a response")),
    }
}

async fn keyless<S, Svc, B>(
    flow: &Flow<S, Svc>,
    tx: &TxConfig,
    req: ServiceRequest,
) -> FlowResult<B>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let config = &flow.config;
    // Keyless: no tenant (nor a panicking source) refuses nothing; the transaction then has
    // no tenant setting.
    let tenant = config
        .tenant_of(&req)
        .ok()
        .flatten()
        .filter(|tenant| !tenant.is_empty());
    let mut conn = match open(tx, idle_limit(config)).await {
        Ok(conn) => conn,
        Err(error) => {
            tracing::error!(target: "idempotency_actix", outcome = "store_error", path = %LogText(req.path()), %error, "could not open the request's transaction");
            let problem = Problem::new(ProblemCode::StorageUnavailable, unavailable_detail(&error))
                .with_retry_after(config.retry_after);
            return Ok(req
                .into_response(config.problem(problem))
                .map_into_right_body());
        }
    };
    // With a tenant source, the setting is always set in the transaction: to `''` when this
    // request has no tenant, never left to whatever an earlier request's handler set for the
    // session on this pooled connection (row-level security keyed on it then shows nothing).
    let tenant = match (&config.tenant, tenant) {
        (Some(_), tenant) => Some(tenant.unwrap_or_default()),
        (None, _) => None,
    };
    if let Some(tenant) = &tenant {
        if let Err(error) = sql::set_tenant(&tx.store, &mut conn, &tx.tenant_setting, tenant).await
        {
            sql::rollback(&tx.store, &mut conn).await;
            let _ = sql::discard_if_altered(&tx.store, &mut conn, &error).await;
            tracing::error!(target: "idempotency_actix", outcome = "store_error", path = %LogText(req.path()), %error, "could not set the tenant on the request's transaction");
            let problem = Problem::new(ProblemCode::StorageUnavailable, unavailable_detail(&error))
                .with_retry_after(config.retry_after);
            return Ok(req
                .into_response(config.problem(problem))
                .map_into_right_body());
        }
    }
    match run_and_settle(flow, tx, req, conn, None, None, false).await {
        After::Answer(result) => result,
        // No record to finish: the handler's own answer.
        After::Ended(result) => result.map(|response| response.map_into_left_body()),
        // Not asked for (no retries for keyless requests).
        After::Retry(_) => Err(opaque_500("unexpected retry of a keyless request")),
    }
}

/// Checkout and BEGIN.
/// How long the request's transaction may sit idle (`idle_in_transaction_session_timeout`):
/// a handler waiting on its payment provider between two statements is idle. Default mode
/// renews a running handler's lease up to `renew_lease_up_to`; here the open transaction is
/// what holds the key, so it may stay idle as long (or `lock_timeout`, when longer, or when
/// renewal is off). Past it PostgreSQL ends the session and everything rolls back. A process
/// that dies closes its connections and frees its claims at once; only a host that vanishes
/// without closing them holds them this long (the server's `tcp_keepalives_*` settings can
/// shorten that). It is also the lease of the claim's row, which matters only once a handler
/// commits the transaction itself: the key is then held as long, even by a process that died.
fn idle_limit(config: &Config) -> Duration {
    config.lock_timeout.max(config.lease_renewal_limit)
}

async fn open(tx: &TxConfig, idle_limit: Duration) -> Result<TxConnection, StoreError> {
    let mut conn = sql::checkout(&tx.store).await?;
    sql::begin(&tx.store, &mut conn, tx.isolation, idle_limit).await?;
    Ok(conn)
}

/// Open the transaction and claim the key in it.
async fn claim<S, Svc>(
    flow: &Flow<S, Svc>,
    tx: &TxConfig,
    scope: &Scope,
    fingerprint: &Fingerprint,
) -> Claimed {
    let config = &flow.config;
    let unavailable = |error: &StoreError| {
        tracing::error!(target: "idempotency_actix", outcome = "store_error", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), %error, "could not claim the key (transactional mode fails closed: fail_open does not apply)");
        let problem = Problem::new(ProblemCode::StorageUnavailable, unavailable_detail(error))
            .with_retry_after(config.retry_after);
        Claimed::Answered(config.problem(problem), Outcome::StoreUnavailable)
    };
    let setting = config
        .tenant
        .is_some()
        .then_some((tx.tenant_setting.as_str(), scope.tenant.as_str()));
    for _ in 0..CLAIM_ATTEMPTS {
        let mut conn = match open(tx, idle_limit(config)).await {
            Ok(conn) => conn,
            Err(error) => return unavailable(&error),
        };
        // A schema without `complete` would run the handler and roll it back on every try.
        if let Err(error) = tx.store.ensure_provisioned(&mut conn).await {
            sql::rollback(&tx.store, &mut conn).await;
            // A handler's leaked `search_path` hides a schema that is there: not one to
            // migrate, and the connection is closed.
            if sql::discard_if_altered(&tx.store, &mut conn, &error).await {
                return unavailable(&StoreError::unavailable(
                    "the connection's session was changed by a handler; it is closed",
                ));
            }
            return unavailable(&error);
        }
        // The claim's lease matters only if the handler commits the transaction itself (then
        // its row is a committed reservation before the response is stored): it holds the key
        // as long as the open transaction could have, not `lock_timeout` from its start.
        let claimed = sql::claim(
            &tx.store,
            &mut conn,
            setting,
            scope,
            fingerprint,
            idle_limit(config),
        )
        .await;
        let outcome = match claimed {
            Ok(Some(ReserveOutcome::Reserved { token })) => {
                return Claimed::Reserved(Box::new(conn), token);
            }
            Ok(outcome) => outcome,
            // Under REPEATABLE READ or SERIALIZABLE the claim's snapshot may predate a row
            // another transaction committed (or deleted) meanwhile. Nothing has run yet: claim
            // again in a new transaction, whose snapshot sees it.
            Err(error) if sql::is_serialization_store_error(&error) => {
                sql::rollback(&tx.store, &mut conn).await;
                continue;
            }
            Err(error) => {
                sql::rollback(&tx.store, &mut conn).await;
                let _ = sql::discard_if_altered(&tx.store, &mut conn, &error).await;
                let error = sql::classify_claim_error(&tx.store, &mut conn, error).await;
                return unavailable(&error);
            }
        };
        // Anything but a reservation wrote nothing: end the transaction now, so its connection
        // and advisory lock are free before we answer (or wait).
        sql::rollback(&tx.store, &mut conn).await;
        drop(conn);
        match outcome {
            None => continue, // raced: nothing written, claim again
            Some(ReserveOutcome::Completed {
                fingerprint: stored,
                ..
            })
            | Some(ReserveOutcome::InFlight {
                fingerprint: stored,
                ..
            }) if stored != *fingerprint => {
                tracing::info!(target: "idempotency_actix", outcome = "mismatch", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "key reused for a different request");
                let problem = Problem::fingerprint_mismatch();
                return Claimed::Answered(config.problem(problem), Outcome::Mismatch);
            }
            Some(ReserveOutcome::Completed { response, .. }) => {
                tracing::debug!(target: "idempotency_actix", outcome = "replay", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), status = response.status, "replaying the stored response");
                return Claimed::Replay(response);
            }
            Some(ReserveOutcome::InFlight { .. }) => return Claimed::InFlight,
            Some(ReserveOutcome::Reserved { .. }) => return unreachable_reserved(),
        }
    }
    unavailable(&StoreError::Backend(
        format!("the claim lost {CLAIM_ATTEMPTS} races in a row for one key").into(),
    ))
}

/// A reservation is returned above; this arm exists for the match to be exhaustive.
fn unreachable_reserved() -> Claimed {
    Claimed::Answered(
        HttpResponse::InternalServerError().finish(),
        Outcome::StoreUnavailable,
    )
}

/// Run the handler with the lent connection, then commit or roll back, and decide the answer.
#[allow(clippy::too_many_arguments)]
async fn run_and_settle<S, Svc, B>(
    flow: &Flow<S, Svc>,
    tx: &TxConfig,
    req: ServiceRequest,
    conn: TxConnection,
    record: Option<(&Scope, ReservationToken, Instant)>,
    report: Option<&Report>,
    may_retry: bool,
) -> After<B>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    let config = &flow.config;
    let scope = record.as_ref().map(|(scope, _, _)| *scope);
    let outcome = |outcome: Outcome, status: StatusCode| {
        if let Some(report) = report {
            report.outcome(outcome, status, scope);
        }
    };
    // With retries on: watch for a serialization failure on any statement (the handler's
    // too). A handler's error comes back as a response holding the request (actix converts
    // it), from which the request is run again; the request cannot be cloned beforehand (the
    // router needs it unshared).
    let mut conn = conn;
    let watch = may_retry.then(|| sql::watch_serialization_failures(&mut conn));
    let slot = Rc::new(TxSlot {
        conn: RefCell::new(Some(conn)),
        finished: Cell::new(false),
    });
    req.extensions_mut().insert(IdempotentTx {
        slot: Rc::clone(&slot),
    });
    // If the handler panics (or the task is dropped) the connection must not stay in the slot:
    // a copy of the request kept by the handler (on a task, in a log buffer) holds the
    // extensions, and with them the open transaction, its claim and its locks, for as long as
    // it lives. Emptied on unwind, the connection is dropped inside its transaction, which the
    // pool discards and PostgreSQL rolls back.
    let _empty_on_unwind = EmptyOnDrop(Rc::clone(&slot));
    let result = flow.service.call(req).await;
    // The handler is done: take the connection back. Still borrowed means a TxConn outlived
    // the handler (held by a response body): we cannot commit; dropping the slot's last
    // reference later closes the connection (the pool discards a connection in a transaction,
    // and PostgreSQL rolls back).
    slot.finished.set(true);
    let taken = slot.conn.try_borrow_mut().ok().and_then(|mut c| c.take());
    let Some(mut conn) = taken else {
        tracing::error!(target: "idempotency_actix", outcome = "rolled_back", "the transaction's connection is still borrowed after the handler returned (a TxConn kept in the response?); rolled back");
        // Counted as logged: rolled back (not `commit_failed`, whose client is told so).
        outcome(Outcome::RolledBack, StatusCode::INTERNAL_SERVER_ERROR);
        return After::Answer(Err(opaque_500("TxConn outlived the handler")));
    };
    // The handler may have ended the transaction itself (diesel's commit_transaction or
    // rollback_transaction): then there is nothing left to roll back, and what it committed
    // stays committed whatever its status (see the depth check below).
    let ended_by_handler = AnsiTransactionManager::transaction_manager_status_mut(&mut *conn)
        .transaction_depth()
        .is_ok_and(|depth| depth.is_none());
    if ended_by_handler {
        drop(conn); // no transaction left on it: back to the pool, as any finished one
        return After::Ended(result);
    }
    let log_rollback = |reason: &str| match scope {
        Some(scope) => {
            tracing::info!(target: "idempotency_actix", outcome = "rolled_back", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), reason, "response not storable; the transaction (the handler's writes and the reservation) was rolled back");
        }
        None => {
            tracing::debug!(target: "idempotency_actix", outcome = "rolled_back", reason, "keyless transactional request rolled back");
        }
    };
    let result = match result {
        Ok(response) if watch.as_ref().is_some_and(|w| w.serialization_failed()) => {
            // The transaction was aborted by a serialization failure (whatever the handler
            // answered): nothing of it can commit; run it again.
            sql::rollback(&tx.store, &mut conn).await;
            let (http_req, _) = response.into_parts();
            return After::Retry(http_req);
        }
        other => other,
    };
    let response = match result {
        Ok(response) if config.stores_status(response.status()) => response,
        Ok(response) => {
            sql::rollback(&tx.store, &mut conn).await;
            let status = response.status();
            log_rollback(status.as_str());
            outcome(Outcome::RolledBack, status);
            return After::Answer(Ok(response.map_into_left_body()));
        }
        Err(error) => {
            sql::rollback(&tx.store, &mut conn).await;
            log_rollback("handler error");
            outcome(Outcome::RolledBack, error.as_response_error().status_code());
            return After::Answer(Err(error));
        }
    };
    let (http_req, response) = response.into_parts();
    let (head, body) = response.into_parts();
    let status = head.status();
    // Nothing reaches the client before COMMIT: the whole body, within the limit. The
    // transaction sits idle meanwhile, so past its idle limit PostgreSQL has ended the session
    // and nothing can commit: a body that has not ended by then (an upstream that hangs) is
    // given up, or it would hold the pooled connection for as long as the process lives.
    let buffered = tokio::time::timeout(
        idle_limit(config),
        to_bytes_limited(body, config.max_response_bytes),
    );
    let bytes = match buffered.await {
        Err(_) => {
            sql::rollback(&tx.store, &mut conn).await;
            tracing::error!(target: "idempotency_actix", outcome = "rolled_back", idle_limit_ms = idle_limit(config).as_millis(), "the response body did not end within the transaction's idle limit (PostgreSQL has ended the session); rolled back");
            outcome(Outcome::RolledBack, StatusCode::INTERNAL_SERVER_ERROR);
            return After::Answer(Err(opaque_500("the response body did not end in time")));
        }
        Ok(buffered) => buffered,
    };
    let bytes = match bytes {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(error)) => {
            sql::rollback(&tx.store, &mut conn).await;
            let error: Box<dyn std::error::Error> = error.into();
            // Escaped: a handler's error often quotes what the client sent.
            let error = error.to_string();
            tracing::error!(target: "idempotency_actix", outcome = "rolled_back", error = %LogText(&error), "the response body failed; the transaction was rolled back");
            outcome(Outcome::RolledBack, StatusCode::INTERNAL_SERVER_ERROR);
            return After::Answer(Err(opaque_500("the response body failed")));
        }
        Err(_) => {
            sql::rollback(&tx.store, &mut conn).await;
            log_rollback("response too large");
            tracing::warn!(target: "idempotency_actix", outcome = "rolled_back", max_response_bytes = config.max_response_bytes, "a storable response is larger than max_response_bytes: in transactional mode it cannot be sent without being stored, so the transaction was rolled back; raise max_response_bytes for this route");
            // A keyless request is rolled back too: nothing may reach the client before
            // COMMIT, and `max_response_bytes` is what bounds the buffer that waits for it.
            let retry = if scope.is_some() {
                "a retry with the same key is safe"
            } else {
                "retrying is safe"
            };
            let problem = Problem::new(
                ProblemCode::ResponseTooLarge,
                format!(
                    "the response is larger than this route may send in transactional mode \
                     ({} bytes), so it was not committed; nothing was done and {retry}",
                    config.max_response_bytes
                ),
            );
            outcome(Outcome::RolledBack, problem.status());
            let response = http_req.into_parts_response(config.problem(problem));
            return After::Answer(Ok(response));
        }
    };
    let parts = ResponseParts {
        status,
        headers: head.headers(),
        body: &bytes,
    };
    if !config.store_if_keeps(&parts) {
        sql::rollback(&tx.store, &mut conn).await;
        log_rollback("rejected by store_if");
        outcome(Outcome::RolledBack, status);
        let response = ServiceResponse::new(http_req, head.set_body(BoxBody::new(bytes)));
        return After::Answer(Ok(response.map_into_right_body()));
    }
    // The handler must leave exactly the outer transaction open (its own savepoints closed),
    // or our COMMIT would only release a savepoint.
    let depth = AnsiTransactionManager::transaction_manager_status_mut(&mut *conn)
        .transaction_depth()
        .ok()
        .flatten()
        .map(|d| d.get());
    if depth != Some(1) {
        tracing::error!(target: "idempotency_actix", outcome = "commit_failed", depth, "the handler left the request's transaction at another depth (an open savepoint, or its own COMMIT/ROLLBACK): nothing is committed, the connection is discarded");
        drop(conn); // in a transaction: the pool closes it and PostgreSQL rolls back
        return After::Answer(commit_failed(
            flow,
            http_req,
            scope,
            report,
            "the handler's transaction was left in an unexpected state",
        ));
    }
    // A statement that failed while the handler carried on aborts the transaction (unless
    // rolled back to a savepoint), and PostgreSQL would answer COMMIT with a rollback, without
    // an error: the handler's response would go out for writes that never happened. A keyed
    // request's `complete` below is refused then; a keyless one is checked in its COMMIT's own
    // round trip (`check_and_commit`), whatever the handler did to the connection.
    if let Some((scope, token, opened)) = record {
        let stored = StoredResponse {
            status: status.as_u16(),
            headers: storable_headers(head.headers(), &config.deny_headers),
            body: bytes.clone(),
        };
        // `idempotency_complete` counts the TTL from `now()`, which in a transaction is its
        // start: a handler that ran longer than the TTL (its transaction may stay idle for
        // `renew_lease_up_to`) would commit a record already expired, and the retry would run
        // it again. The time since the transaction opened is added, so the record lives its
        // TTL from about now (a little longer, never shorter).
        let ttl = config.ttl.saturating_add(opened.elapsed());
        match sql::complete(&tx.store, &mut conn, scope, &token, &stored, ttl).await {
            Ok(WriteOutcome::Applied) => {}
            Ok(WriteOutcome::Stale) => {
                // Our own uncommitted row, which no other session can see, take over or
                // delete: gone only if the transaction that held it ended before its time, by
                // the handler (raw `ROLLBACK` or `COMMIT`, or diesel's own rollback or commit
                // followed by a new transaction: all unsupported, and the last two invisible to
                // the depth checks above); after a commit, its lease may have passed and the
                // key been taken over or purged. Part of what the handler wrote may be saved,
                // so the client must not be told that nothing was done and a retry is safe
                // (`COMMIT_FAILED`): an opaque 500, as for any other handler fault.
                sql::rollback(&tx.store, &mut conn).await;
                tracing::error!(target: "idempotency_actix", outcome = "rolled_back", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), "the reservation of this transaction was gone at complete: the handler ended the request's transaction itself (its own ROLLBACK or COMMIT; never do), so part of what it wrote may be saved outside it; answered 500 without storing the response");
                if let Some(report) = report {
                    report.outcome(
                        Outcome::RolledBack,
                        StatusCode::INTERNAL_SERVER_ERROR,
                        Some(scope),
                    );
                }
                return After::Answer(Err(opaque_500(
                    "the handler ended the request's transaction with its own SQL",
                )));
            }
            Err(error) => {
                sql::rollback(&tx.store, &mut conn).await;
                if sql::is_serialization_failure(&error) && may_retry {
                    return After::Retry(http_req);
                }
                let _ = sql::discard_if_altered(&tx.store, &mut conn, &error).await;
                // No COMMIT was sent: whatever happened, nothing was committed.
                tracing::error!(target: "idempotency_actix", outcome = "commit_failed", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), %error, "storing the response in the transaction failed; rolled back");
                return After::Answer(commit_failed(
                    flow,
                    http_req,
                    Some(scope),
                    report,
                    "storing the response failed",
                ));
            }
        }
    }
    let committed = if record.is_some() {
        sql::commit(&tx.store, &mut conn).await
    } else {
        sql::check_and_commit(&tx.store, &mut conn).await
    };
    match committed {
        Ok(()) => {
            if let Some(scope) = scope {
                tracing::debug!(target: "idempotency_actix", outcome = "stored", key = %LogText(&scope.key), tenant = %LogText(&scope.tenant), path = %LogText(&scope.path), status = status.as_u16(), "committed: handler's writes and the response");
            }
            outcome(Outcome::Stored, status);
            let response = ServiceResponse::new(http_req, head.set_body(BoxBody::new(bytes)));
            After::Answer(Ok(response.map_into_right_body()))
        }
        Err(CommitError::RolledBack {
            serialization: true,
            ..
        }) if may_retry => {
            sql::rollback(&tx.store, &mut conn).await;
            After::Retry(http_req)
        }
        Err(CommitError::RolledBack { error, .. }) => {
            sql::rollback(&tx.store, &mut conn).await;
            tracing::error!(target: "idempotency_actix", outcome = "commit_failed", key = scope.map(|s| tracing::field::display(LogText(&s.key))), %error, "COMMIT failed; the handler's writes and the reservation were rolled back");
            After::Answer(commit_failed(
                flow,
                http_req,
                scope,
                report,
                "COMMIT failed",
            ))
        }
        Err(CommitError::Unknown(why)) => {
            tracing::error!(target: "idempotency_actix", outcome = "commit_unknown", key = scope.map(|s| tracing::field::display(LogText(&s.key))), why, "the connection was lost during COMMIT: the outcome is unknown");
            // Only a keyed request can promise a safe retry: without a key, a retry of a
            // commit that happened runs the request a second time.
            let detail = if scope.is_some() {
                "the connection to the database was lost while committing this request, so \
                 whether it took effect is unknown; a retry with the same Idempotency-Key is \
                 safe: it returns the original response if the commit happened, and runs the \
                 request once if it did not"
            } else {
                "the connection to the database was lost while committing this request, so \
                 whether it took effect is unknown; check before retrying, or send an \
                 Idempotency-Key so that a retry is safe"
            };
            let problem = Problem::new(ProblemCode::CommitOutcomeUnknown, detail)
                .with_retry_after(config.retry_after);
            if let Some(report) = report {
                report.outcome(Outcome::CommitUnknown, problem.status(), scope);
            }
            After::Answer(Ok(http_req.into_parts_response(config.problem(problem))))
        }
    }
}

fn commit_failed<S, Svc, B>(
    flow: &Flow<S, Svc>,
    http_req: HttpRequest,
    scope: Option<&Scope>,
    report: Option<&Report>,
    why: &str,
) -> FlowResult<B> {
    let config = &flow.config;
    let detail = if scope.is_some() {
        format!(
            "{why}: the request's changes were rolled back, nothing was done; a retry with the \
             same Idempotency-Key is safe"
        )
    } else {
        format!("{why}: the request's changes were rolled back, nothing was done")
    };
    let problem =
        Problem::new(ProblemCode::CommitFailed, detail).with_retry_after(config.retry_after);
    if let Some(report) = report {
        report.outcome(Outcome::CommitFailed, problem.status(), scope);
    }
    Ok(http_req.into_parts_response(config.problem(problem)))
}

/// Turning a request and a response into the middleware's answer type.
trait IntoAnswer {
    fn into_parts_response<B>(
        self,
        response: HttpResponse,
    ) -> ServiceResponse<actix_web::body::EitherBody<B, BoxBody>>;
}

impl IntoAnswer for HttpRequest {
    fn into_parts_response<B>(
        self,
        response: HttpResponse,
    ) -> ServiceResponse<actix_web::body::EitherBody<B, BoxBody>> {
        ServiceResponse::new(self, response).map_into_right_body()
    }
}
