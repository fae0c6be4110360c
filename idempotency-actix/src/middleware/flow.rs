//! One covered request on its way through the contract: the checks on the request's own
//! future, then everything from the reservation on detached from it (C21, see [`super`] and
//! [`detach`](super::detach)).

use std::error::Error as StdError;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use actix_service::Service;
use actix_web::body::{BodySize, BoxBody, EitherBody, MessageBody};
use actix_web::dev::ResponseHead;
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::error::PayloadError;
use actix_web::http::header::{self, HeaderMap};
use actix_web::http::{StatusCode, Version};
use actix_web::{Error, HttpMessage, HttpRequest, HttpResponse};
use bytes::{Bytes, BytesMut};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::detach::detach;
use super::forward;
use super::renewal::{Renewal, Reservation};
use super::replay::{replay, storable_headers};
use crate::config::{saturating_deadline, Config, ResponseParts};
use crate::fingerprint::{is_json_content_type, Fingerprint};
use crate::key::{parse_key, IdempotencyKey, KeyError};
use crate::log_text::LogText;
use crate::outcome::{self, Meters, Op, Outcome, Report};
use crate::problem::{Problem, ProblemCode};
use crate::store::{
    IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
    WriteOutcome,
};

/// How many renewals may try to confirm a reservation that was answered slowly
/// ([`Flow::confirm`]) before it is given back: a store whose every answer takes a third of a
/// lease cannot hold one for a handler.
const CONFIRMATIONS: usize = 3;

/// Longest pause between two looks at a running request in wait mode.
pub(super) const MAX_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// What the middleware answers with, on either side of the task boundary.
pub(super) type FlowResult<B> = Result<ServiceResponse<EitherBody<B, BoxBody>>, Error>;

/// How a streamed body's wait for its next chunk ended.
enum Waited<T> {
    Next(T),
    /// The client made room, and what waited for it moved.
    ClientMoved,
    /// The client hung up meanwhile.
    ClientGone,
    /// The key's last lease ended, and nobody but the record was waiting for the body.
    KeyGone,
    /// A declared body's last bytes were held for its end long enough.
    LetLastBytesGo,
}

/// How long a declared body's last bytes wait for its end before the client gets them anyway.
/// They are held so that a client with the whole response finds it stored (`forward`), which
/// takes the stream's end: a stream may do work after its last chunk (commit what the bytes
/// announce), and its end, error or extra bytes decide whether the response is stored. Past
/// this, a stream that keeps its end waiting (a channel whose sender a background task keeps)
/// is still read for the record, but its client, which without the middleware would have had
/// the whole response, no longer waits: a review (2026-12-07) found it waiting for ever.
const LAST_BYTES_HELD_AT_MOST: Duration = Duration::from_secs(1);

/// Ready at `at`, never without one.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Where the task sends the answer, dropped unread when the client is gone; and how a waiting
/// request (wait mode) learns that its client left.
///
/// On HTTP/1 a client that leaves (a reset; a close, see `wait_for_in_flight`) makes actix drop
/// the request's future, which holds the receiving end: [`Self::is_closed`]. On HTTP/2 it does
/// not: actix-http runs each stream's service future on a task of its own and never drops it,
/// not on `RST_STREAM` nor when the connection goes. What does see it is the request's own body
/// stream, read to its end before the key is reserved: polled again, it answers "no more data"
/// while the stream lives and an error once the client reset it or the connection is gone
/// (`tests/tests/http2.rs` pins this). So an HTTP/2 request in wait mode keeps that stream here,
/// and [`Self::is_closed`] polls it, without a waker (it wakes no one once ended): the wait
/// loops ask at every turn, at most `MAX_POLL_INTERVAL` apart, and right after winning the key.
pub(super) struct Answer<B> {
    sender: oneshot::Sender<FlowResult<B>>,
    /// The HTTP/2 request's body stream, read to its end (wait mode only).
    stream: Option<Payload>,
    /// The stream said the client is gone (kept: it need not say it twice).
    gone: bool,
}

impl<B> Answer<B> {
    fn new(sender: oneshot::Sender<FlowResult<B>>, stream: Option<Payload>) -> Self {
        Self {
            sender,
            stream,
            gone: false,
        }
    }

    /// Send the answer; whether anybody was there to take it.
    pub(super) fn send(self, result: FlowResult<B>) -> bool {
        self.sender.send(result).is_ok()
    }

    /// Answer a request whose client left while it waited (its outcome, `abandoned`, already
    /// reported): a bodiless 499 that nobody reads. Sent rather than left unsent because on
    /// HTTP/2 actix keeps polling the request's future after the client reset its stream (see
    /// above), and that future takes a work that ended without an answer for a panic
    /// (`Pending::answer`). Review, 2026-12-06: before, this was reported a second time, as a
    /// false `handler_panic` with an ERROR line saying a key was held when nothing was reserved.
    pub(super) fn abandoned(self, req: ServiceRequest) {
        let response = HttpResponse::new(crate::outcome::client_closed());
        let _ = self.send(Ok(req.into_response(response).map_into_right_body()));
    }

    /// Whether the client is gone, as far as can be seen now.
    pub(super) fn is_closed(&mut self) -> bool {
        if !self.gone {
            if let Some(stream) = self.stream.as_mut() {
                self.gone = matches!(stream.next().now_or_never(), Some(Some(Err(_))));
            }
        }
        self.gone || self.sender.is_closed()
    }

    /// Until the receiving end is dropped (HTTP/1's "client gone"; see [`Self::is_closed`] for
    /// HTTP/2).
    pub(super) async fn closed(&mut self) {
        self.sender.closed().await;
    }
}

/// What the request's own future keeps while its detached work runs: where the answer comes
/// from. (Awaited by `run` itself, not by an `async fn` of its own: that future would hold it
/// twice, in every keyed request's future.)
struct Pending<B> {
    answered: oneshot::Receiver<FlowResult<B>>,
}

impl<B> Pending<B> {
    /// The response, from what the work answered.
    fn answer(self, answered: Result<FlowResult<B>, oneshot::error::RecvError>) -> FlowResult<B> {
        match answered {
            Ok(result) => result,
            // The work ended without an answer: the handler panicked (reported by
            // [`Panicked`], where it happened), or the worker stopped. The client gets an
            // opaque 500.
            Err(_) => Err(opaque_500("the request's task ended without a response")),
        }
    }
}

/// How a keyed request's work reports that it panicked ([`detach`]'s `on_panic`): from the
/// work's side, because the request's future may be gone (HTTP/1 drops it when the client
/// resets) and then nothing reported the panic (review, 2026-12-06). The reservation stays
/// until the lease ends (its effects may exist), or in transactional mode is rolled back with
/// them.
pub(super) struct Panicked {
    /// The request's span (the work runs in it too).
    span: tracing::Span,
    report: Report,
    /// What a panic leaves behind, for the log ([`Config::what_a_panic_leaves`]).
    on_panic: &'static str,
    /// The scope, for the `on_outcome` hook (cloned only when there is one).
    panic_scope: Option<Box<Scope>>,
}

impl Panicked {
    fn report(self) {
        let _in_span = self.span.enter();
        tracing::error!(target: "idempotency_actix", outcome = "handler_panic", left = self.on_panic, "the request's task ended without a response");
        self.report.outcome(
            Outcome::HandlerPanic,
            StatusCode::INTERNAL_SERVER_ERROR,
            self.panic_scope.as_deref(),
        );
    }
}

/// The path of a request's scope (C3): the value the handler sees, in one spelling, so one key
/// never runs once per spelling of the same request.
///
/// `matched` is the path as actix's router sees it: percent-escapes decoded once, except
/// `%2F`, `%2B` and `%25`, which it keeps as sent (decoding `/` would change which route
/// matches), and a `%` that starts no escape, kept as it is. The path extractor then decodes
/// whatever escapes are left, so `a%2Fb` and `a%2fb`, `a+b` and `a%2Bb`, `100%` and `100%25`,
/// and even `%%34%31` (the router leaves `%41`) and `A` reach a handler as the same value.
/// So the scope decodes what the router left, as the extractor does (invalid UTF-8 as U+FFFD,
/// as the extractor gives it), and then escapes only `%` and the control characters (a NUL,
/// which PostgreSQL's `text` refuses): every `%` in the result starts an escape, so no two
/// values share a spelling. `%2F` is decoded too: `/items/a%2Fb` then shares its record with
/// the route `/items/a/b` (and a tail parameter `{path:.*}` gets `a/b` either way). Erring
/// towards one record is the safe side: two requests on one record with one key get a replay
/// or a 422 (the fingerprint takes the path as sent), never a second run.
///
/// Runs of `/` are merged and a trailing `/` dropped (except the root's) for the same reason:
/// `NormalizePath` wrapped inside `Idempotency` rewrites `/pay/` and `//pay` to `/pay` after the
/// scope was taken, and the three spellings reached one handler as three records, three runs.
fn scope_path(matched: &str) -> String {
    if !matched.bytes().any(|b| b == b'%' || b.is_ascii_control()) {
        return merge_slashes(matched.to_owned());
    }
    let bytes = matched.as_bytes();
    let mut path = Vec::with_capacity(bytes.len() + 8);
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes[i] {
            // Two hex digits, nothing else (`from_str_radix` would take `+1`).
            b'%' => match bytes.get(i + 1..i + 3) {
                Some(&[hi, lo]) => hex_digit(hi).zip(hex_digit(lo)).map(|(h, l)| h << 4 | l),
                _ => None,
            },
            _ => None,
        };
        let byte = match escaped {
            Some(decoded) => {
                i += 3;
                decoded
            }
            // Not an escape (a lone `%` the router kept): the handler sees `%`.
            None => {
                i += 1;
                bytes[i - 1]
            }
        };
        if byte == b'%' || byte.is_ascii_control() {
            path.extend_from_slice(format!("%{byte:02X}").as_bytes());
        } else {
            path.push(byte);
        }
    }
    merge_slashes(String::from_utf8_lossy(&path).into_owned())
}

/// `path` with each run of `/` made one and a trailing `/` dropped (`/` itself stays).
fn merge_slashes(path: String) -> String {
    if !(path.contains("//") || path.len() > 1 && path.ends_with('/')) {
        return path;
    }
    let mut merged = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && merged.ends_with('/')) {
            merged.push(c);
        }
    }
    if merged.len() > 1 && merged.ends_with('/') {
        merged.pop();
    }
    merged
}

/// The value of one hex digit.
fn hex_digit(c: u8) -> Option<u8> {
    char::from(c)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

/// Hand the request to the next service untouched.
pub(super) async fn pass_through<Svc, B>(service: Rc<Svc>, req: ServiceRequest) -> FlowResult<B>
where
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
{
    Ok(service.call(req).await?.map_into_left_body())
}

/// One covered request on its way through the contract.
pub(super) struct Flow<S, Svc> {
    pub(super) service: Rc<Svc>,
    pub(super) store: Arc<S>,
    pub(super) config: Arc<Config>,
    /// This worker's metric handles.
    pub(super) meters: Rc<Meters>,
    /// Room for background retries, shared by the middleware's workers
    /// ([`MAX_BACKGROUND_RETRIES`]).
    pub(super) retries: Arc<tokio::sync::Semaphore>,
}

impl<S, Svc, B> Flow<S, Svc>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    /// Check the request (key, tenant, body), then hand it to [`Self::settle`], detached.
    pub(super) async fn run(self, mut req: ServiceRequest) -> FlowResult<B> {
        // Matched where it is made: bound across the awaits below, the key's `Result` (72
        // bytes) would take room in every request's future.
        let key = match self.key_of(&req) {
            Ok(key) => key,
            Err(problem) => {
                let report = self.report(&req);
                return Ok(self.refuse(req, problem, &report, None));
            }
        };
        let Some(key) = key else {
            #[cfg(feature = "postgres")]
            if let Some(tx) = self.config.transactional.clone() {
                // A plain transaction for the handler's IdempotentTx, without a record. Boxed:
                // awaited in place, its state (312 bytes) set the size of every request's
                // future, keyed or not, in every mode (`docs/benchmarks.md`, "Futures by
                // the kilobyte"); this path runs a database transaction anyway.
                return Box::pin(super::transactional::run_keyless(self, tx, req)).await;
            }
            return pass_through(self.service, req).await;
        };
        let report = self.report(&req);
        let tenant = match self.tenant_of(&req) {
            Ok(tenant) => tenant,
            Err(problem) => {
                tracing::info!(target: "idempotency_actix", outcome = "missing_tenant", path = %LogText(req.path()), "keyed request without a tenant refused");
                return Ok(self.refuse(req, problem, &report, None));
            }
        };
        let (body, stream) = match read_body(&mut req, self.config.max_body_bytes).await {
            Ok(read) => read,
            Err(problem) => return Ok(self.refuse(req, problem, &report, None)),
        };
        let (work, panicked, mut pending) = self.start(req, key, tenant, body, stream, report);
        detach(work, move || panicked.report()).await;
        let answered = (&mut pending.answered).await;
        pending.answer(answered)
    }

    /// The report of a keyed request: its route's counters and the `on_outcome` hook.
    fn report(&self, req: &ServiceRequest) -> Report {
        self.meters.report(
            req.method(),
            req.match_pattern(),
            self.config.on_outcome.clone(),
        )
    }

    /// Take the request's scope and fingerprint and build its detached work (no `.await`:
    /// nothing here can be cut short). A plain function, not part of `run`'s body, so that
    /// what it moves into the work (the request, the scope, the body) takes no room in
    /// `run`'s future, which every keyed request allocates (`docs/benchmarks.md`, "Futures
    /// by the kilobyte").
    fn start(
        self,
        mut req: ServiceRequest,
        key: String,
        tenant: String,
        body: Bytes,
        stream: Payload,
        report: Report,
    ) -> (
        impl Future<Output = ()> + Unpin + 'static,
        Panicked,
        Pending<B>,
    ) {
        // Only a waiting request needs to know whether its client left (see `Answer`).
        let stream = (req.version() == Version::HTTP_2 && self.config.wait_for_in_flight.is_some())
            .then_some(stream);
        let scope = Scope {
            tenant,
            method: req.method().as_str().to_owned(),
            // The path as the router sees it, one spelling per route and parameters.
            path: scope_path(req.match_info().as_str()),
            key,
        };
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json_content_type);
        // The fingerprint takes the path as sent: only the same bytes replay (another spelling
        // of the same route gets 422, never another request's response).
        let fingerprint =
            Fingerprint::of_request(&scope.method, req.path(), req.query_string(), json, &body);
        // A cheap copy (reference-counted): transactional mode re-runs the request from it
        // after a serialization failure.
        req.set_payload(Payload::from(body.clone()));

        // From here on nothing may be cut short by the client: the task owns the request.
        // One span per keyed request carries its scope, so no event repeats it. At ERROR level
        // so the fields reach the store-failure events even when only errors are logged.
        let span = tracing::error_span!(
            target: "idempotency_actix",
            "idempotency",
            key = %LogText(&scope.key),
            tenant = %LogText(&scope.tenant),
            method = %LogText(&scope.method),
            path = %LogText(&scope.path),
        );
        let on_panic = self.config.what_a_panic_leaves();
        // The hook learns which key a panic left held; cloned only for a hook.
        let panic_scope = self
            .config
            .on_outcome
            .is_some()
            .then(|| Box::new(scope.clone()));
        let (answer, answered) = oneshot::channel();
        let answer = Answer::new(answer, stream);
        let work = self.settle(req, scope, fingerprint, body, report.clone(), answer);
        let panicked = Panicked {
            span: span.clone(),
            report,
            on_panic,
            panic_scope,
        };
        (work.instrument(span), panicked, Pending { answered })
    }

    /// Reserve, run the handler, store or release, and answer; detached from the request.
    ///
    /// Returned on the heap by a plain function on purpose: built inside `run`'s `async` body,
    /// the work's state (kilobytes) would also take room in `run`'s own future, and be copied
    /// with it, on every request (`docs/benchmarks.md`, "Futures by the kilobyte").
    fn settle(
        self,
        req: ServiceRequest,
        scope: Scope,
        fingerprint: Fingerprint,
        body: Bytes,
        report: Report,
        answer: Answer<B>,
    ) -> Pin<Box<impl Future<Output = ()> + 'static>> {
        Box::pin(async move {
            if let Some(problem) = self.too_long_to_record(&scope) {
                tracing::info!(target: "idempotency_actix", outcome = "scope_too_long", "keyed request refused: its scope is longer than the store can record");
                let _ = answer.send(Ok(self.refuse(req, problem, &report, Some(&scope))));
                return;
            }
            #[cfg(feature = "postgres")]
            if let Some(tx) = self.config.transactional.clone() {
                let keyed = super::transactional::Keyed {
                    scope,
                    fingerprint,
                    report,
                };
                // Boxed: its state is the largest of any path, and would size every request's.
                let keyed = Box::pin(super::transactional::settle_keyed(
                    self, tx, req, keyed, body, answer,
                ));
                keyed.await;
                return;
            }
            let _ = body;
            let mut answer = answer;
            let (token, reserved_at) = match self.reserve(&scope, &fingerprint, &mut answer).await {
                Ok(reserved) => reserved,
                Err(Decision::Refuse(problem)) => {
                    let _ = answer.send(Ok(self.refuse(req, problem, &report, Some(&scope))));
                    return;
                }
                Err(Decision::Replay(stored)) => {
                    let response = match replay(stored, &req, &self.config.deny_headers) {
                        Ok(response) => {
                            report.outcome(Outcome::Replay, response.status(), Some(&scope));
                            req.into_response(response).map_into_right_body()
                        }
                        Err(problem) => {
                            tracing::info!(target: "idempotency_actix", outcome = "replay_not_acceptable", "stored response encoded in a way this retry does not accept");
                            self.refuse(req, problem, &report, Some(&scope))
                        }
                    };
                    let _ = answer.send(Ok(response));
                    return;
                }
                Err(Decision::Abandoned) => {
                    tracing::info!(target: "idempotency_actix", outcome = "abandoned", "the client left while waiting for the first request with this key; nothing was run");
                    report.outcome(Outcome::Abandoned, outcome::client_closed(), Some(&scope));
                    answer.abandoned(req);
                    return;
                }
                Err(Decision::PassThrough) => {
                    // Unprotected here, so the key the handler forwards downstream (a payment
                    // provider's own idempotency key) is the only protection left (C17).
                    req.extensions_mut()
                        .insert(IdempotencyKey(scope.key.clone()));
                    let result = pass_through(Rc::clone(&self.service), req).await;
                    report.outcome(Outcome::FailOpen, status_of(&result), Some(&scope));
                    let _ = answer.send(result);
                    return;
                }
            };
            let _held = self.meters.held();
            req.extensions_mut()
                .insert(IdempotencyKey(scope.key.clone()));
            req.extensions_mut().insert(super::KeyHeld);
            let mut renewal = Renewal::new(Reservation {
                store: &self.store,
                meters: &self.meters,
                scope: &scope,
                token,
                lease: self.config.lock_timeout,
                limit: self.config.lease_renewal_limit,
                reserved_at,
            });
            let result = renewal.during(self.service.call(req)).await;
            self.finish(&scope, token, result, &report, answer, renewal)
                .await;
        })
    }

    /// The key of the request, `None` if it has none and none is required.
    fn key_of(&self, req: &ServiceRequest) -> Result<Option<String>, Problem> {
        let mut values = req.headers().get_all(&self.config.header_name);
        let Some(value) = values.next() else {
            return if self.config.required {
                Err(Problem::new(
                    ProblemCode::MissingKey,
                    format!(
                        "send a unique {} header with this request",
                        self.config.header_name
                    ),
                ))
            } else {
                Ok(None)
            };
        };
        let parsed = if values.next().is_some() {
            Err(KeyError::Repeated)
        } else {
            parse_key(value.as_bytes(), self.config.max_key_len)
        };
        parsed
            .map(Some)
            .map_err(|e| Problem::new(e.code(), format!("{}: {e}", self.config.header_name)))
    }

    /// The tenant of a keyed request (C3, C23): `""` (global) when no source is configured; a
    /// configured source that yields nothing (or `""`) refuses the request unless the user opted
    /// into the global scope.
    fn tenant_of(&self, req: &ServiceRequest) -> Result<String, Problem> {
        if self.config.tenant.is_none() {
            return Ok(String::new());
        }
        let missing = || {
            Problem::new(
                ProblemCode::MissingTenant,
                "the tenant of this request could not be determined, so its Idempotency-Key \
                 cannot be scoped; the request was not processed",
            )
        };
        // A source that panicked never falls back to the global scope, whatever the opt-in.
        let Ok(found) = self.config.tenant_of(req) else {
            return Err(missing());
        };
        match found.filter(|tenant| !tenant.is_empty()) {
            Some(tenant) => Ok(tenant),
            None if self.config.missing_tenant_uses_global_scope => Ok(String::new()),
            None => Err(missing()),
        }
    }

    /// The refusal of a scope longer than the store can record (C3): a final 400, decided
    /// here rather than by a store error that every retry would meet again (and that a
    /// `fail_open` endpoint must not let through unprotected).
    fn too_long_to_record(&self, scope: &Scope) -> Option<Problem> {
        let max = self.store.max_scope_bytes()?;
        let len = scope.byte_len();
        (len > max).then(|| {
            Problem::new(
                ProblemCode::ScopeTooLong,
                format!(
                    "this request's scope (tenant, method, path and key) adds up to {len} \
                     bytes, and at most {max} can be recorded; nothing was run. Use a shorter \
                     path or key"
                ),
            )
        })
    }

    /// Reserve the key, or decide the response without running the handler. With the token
    /// comes the instant the successful call was made, no later than the store started the
    /// lease (the first renewal is due a third of a lease after it).
    ///
    /// In wait mode (`wait_for_in_flight`) a request whose client leaves while it waits stops
    /// waiting (`Abandoned`): run later, for nobody, it would be a second charge when the client
    /// retried with a new key meanwhile. And once the store said the key is in flight, a store
    /// error is never failed open: the first request may still be running.
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        answer: &mut Answer<B>,
    ) -> Result<(ReservationToken, Instant), Decision> {
        let config = &self.config;
        let wait_until = config
            .wait_for_in_flight
            .map(|wait| saturating_deadline(Instant::now(), wait));
        let mut pause = Duration::from_millis(10);
        let mut seen_in_flight = false;
        // Slow reservations found taken over by their confirmation: a store that keeps
        // answering that late (its record gone each time) is given up on, not polled for ever.
        let mut lost_while_answered = 0;
        loop {
            if seen_in_flight && answer.is_closed() {
                return Err(Decision::Abandoned);
            }
            let called = Instant::now();
            let outcome = outcome::timed(
                self.meters.histogram(Op::Reserve),
                self.store.reserve(scope, fingerprint, config.lock_timeout),
            )
            .await;
            match outcome {
                // A waiter whose client left while this call was on its way: the key is its
                // now, but nobody is there to answer: given back at once, not run for nobody.
                Ok(ReserveOutcome::Reserved { token }) if seen_in_flight && answer.is_closed() => {
                    tracing::info!(target: "idempotency_actix", outcome = "abandoned", "the client left while its request waited; releasing the key it then got, nothing was run");
                    self.release_quietly(scope, &token).await;
                    return Err(Decision::Abandoned);
                }
                // The lease counts from when the store applied it, after `called`. An answer
                // that took a third of the lease or more (a database that stalled after
                // applying it, a slow network back) may have come after the lease ended, and
                // a request with this body may have taken the key over meanwhile: confirm the
                // reservation before anything runs (time audit, 2026-12-06).
                Ok(ReserveOutcome::Reserved { token })
                    if called.elapsed() >= config.lock_timeout / 3 =>
                {
                    match self.confirm(scope, &token).await? {
                        // A waiter whose client left during the confirmation: as above.
                        Some(_) if seen_in_flight && answer.is_closed() => {
                            tracing::info!(target: "idempotency_actix", outcome = "abandoned", "the client left while its request waited; releasing the key it then got, nothing was run");
                            self.release_quietly(scope, &token).await;
                            return Err(Decision::Abandoned);
                        }
                        Some(held_from) => {
                            tracing::debug!(target: "idempotency_actix", outcome = "miss", "reserved (confirmed after a slow answer); running the handler");
                            return Ok((token, held_from));
                        }
                        // Someone else's now: answered as the key stands (409, or wait).
                        None if lost_while_answered + 1 < CONFIRMATIONS => {
                            lost_while_answered += 1;
                            seen_in_flight = true;
                            continue;
                        }
                        None => {
                            tracing::error!(target: "idempotency_actix", outcome = "store_error", "the store answered every reservation of this key after it was lost; nothing was run");
                            let error = StoreError::unavailable(
                                "the store answers too slowly to hold a lease",
                            );
                            return Err(self.store_failed(&error));
                        }
                    }
                }
                Ok(ReserveOutcome::Reserved { token }) => {
                    tracing::debug!(target: "idempotency_actix", outcome = "miss", "reserved; running the handler");
                    return Ok((token, called));
                }
                Ok(ReserveOutcome::Completed {
                    fingerprint: stored,
                    ..
                })
                | Ok(ReserveOutcome::InFlight {
                    fingerprint: stored,
                    ..
                }) if stored != *fingerprint => {
                    tracing::info!(target: "idempotency_actix", outcome = "mismatch", "key reused for a different request");
                    return Err(Decision::Refuse(Problem::fingerprint_mismatch()));
                }
                // A status no handler can answer with: a damaged record (a foreign writer, a
                // custom store's bug). Refused like any other unreadable record, never
                // replayed as some other status (review, 2026-12-06: it went out as 200 OK).
                Ok(ReserveOutcome::Completed { response, .. })
                    if StatusCode::from_u16(response.status).is_err() =>
                {
                    tracing::error!(target: "idempotency_actix", outcome = "store_error", status = response.status, "the stored response's status is not an HTTP status; not replayed, nothing was run");
                    let error =
                        StoreError::Backend("a stored status that is not an HTTP status".into());
                    return Err(self.store_failed(&error));
                }
                Ok(ReserveOutcome::Completed { response, .. }) => {
                    tracing::debug!(target: "idempotency_actix", outcome = "replay", status = response.status, "replaying the stored response");
                    return Err(Decision::Replay(response));
                }
                Ok(ReserveOutcome::InFlight { .. }) => {
                    seen_in_flight = true;
                    let now = Instant::now();
                    if let Some(until) = wait_until.filter(|until| *until > now) {
                        tokio::select! {
                            () = tokio::time::sleep(pause.min(until - now)) => {}
                            () = answer.closed() => return Err(Decision::Abandoned),
                        }
                        pause = (pause * 2).min(MAX_POLL_INTERVAL);
                        continue;
                    }
                    tracing::info!(target: "idempotency_actix", outcome = "conflict", "the first request with this key is still running");
                    return Err(Decision::Refuse(
                        Problem::new(
                            ProblemCode::Conflict,
                            "the first request with this key is still being processed; retry after it finishes",
                        )
                        .with_retry_after(config.retry_after),
                    ));
                }
                Err(error) => {
                    tracing::error!(target: "idempotency_actix", outcome = "store_error", fail_open = config.fail_open, %error, "could not reserve the key");
                    // Fail open only when the store could not answer about this key: not once
                    // it said the key is in flight, nor for an error about this request itself
                    // (`Backend`: a value the store cannot record), which a client could choose
                    // to make to go unprotected.
                    let store_is_down = !matches!(error, StoreError::Backend(_));
                    if config.fail_open && store_is_down && !seen_in_flight {
                        return Err(Decision::PassThrough);
                    }
                    return Err(self.store_failed(&error));
                }
            }
        }
    }

    /// After the handler: store or release, and send the response on; `renewal` keeps the
    /// lease while a streamed body is produced. Also how transactional mode finishes a request
    /// whose handler ended its transaction itself.
    ///
    /// A plain function returning an `async move` block, not an `async fn`: an `async fn`
    /// moves its arguments from the future's fields into locals of its own, so its state held
    /// each of them twice (the response, the answer, the renewal: 344 bytes) in the work of
    /// every keyed request.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn would hold its arguments twice (see above)"
    )]
    pub(super) fn finish<'a>(
        &'a self,
        scope: &'a Scope,
        token: ReservationToken,
        result: Result<ServiceResponse<B>, Error>,
        report: &'a Report,
        answer: Answer<B>,
        mut renewal: Renewal<'a, S>,
    ) -> impl Future<Output = ()> + 'a {
        async move {
            let response = match result {
                Ok(response) if self.config.stores_status(response.status()) => response,
                Ok(response) => {
                    renewal.stop();
                    let status = response.status();
                    self.release(scope, &token, status.as_str()).await;
                    report.outcome(Outcome::NotStored, status, Some(scope));
                    let _ = answer.send(Ok(response.map_into_left_body()));
                    return;
                }
                Err(error) => {
                    renewal.stop();
                    self.release(scope, &token, "handler error").await;
                    let status = error.as_response_error().status_code();
                    report.outcome(Outcome::NotStored, status, Some(scope));
                    let _ = answer.send(Err(error));
                    return;
                }
            };
            let max = self.config.max_response_bytes;
            let (request, response) = response.into_parts();
            let (head, body) = response.into_parts();
            let status = head.status();
            if matches!(body.size(), BodySize::Sized(len) if len > max as u64) {
                renewal.stop();
                self.release_too_large(scope, &token).await;
                report.outcome(Outcome::NotStored, status, Some(scope));
                let response = ServiceResponse::new(request, head.set_body(body));
                let _ = answer.send(Ok(response.map_into_left_body()));
                return;
            }
            let bytes = match body.try_into_bytes() {
                // One buffer (most handlers): store it, then send it.
                Ok(bytes) => bytes,
                // A stream declared empty (or bodiless): actix writes such a body with the head and
                // never polls it, so the client holds the whole response at once, and an immediate
                // retry must replay it (C24). Stored as the empty body the client gets, before the
                // head goes out; the stream itself is dropped unread, as actix would leave it (one
                // that stays open, a long poll, must not hold the answer back).
                Err(body) if matches!(body.size(), BodySize::Sized(0) | BodySize::None) => {
                    drop(body);
                    Bytes::new()
                }
                Err(body) => {
                    // Boxed: a streamed body is rare; its state need not size every request's.
                    let stream =
                        self.stream(scope, token, request, head, body, answer, renewal, report);
                    let stream = Box::pin(stream);
                    if let Some(outcome) = stream.await {
                        report.outcome(outcome, status, Some(scope));
                    }
                    return;
                }
            };
            // Pinned here, in this statement: `storing` says why.
            let hold_until = renewal.hold_until();
            let outcome = renewal
                .storing(pin!(self.store_or_release(
                    scope,
                    &token,
                    head.head(),
                    &bytes,
                    hold_until
                )))
                .await;
            report.outcome(outcome, status, Some(scope));
            let response = ServiceResponse::new(request, head.set_body(BoxBody::new(bytes)));
            let _ = answer.send(Ok(response.map_into_right_body()));
        }
    }

    /// A streamed body (C24): send the head now, forward every chunk as it comes while keeping
    /// a copy up to the limit, store the copy when the stream ends, and only then end the
    /// client's body. See the module docs of [`super`] for backpressure and a vanished client.
    /// The lease is renewed while the body is produced; the client's pace holds it up only
    /// once nothing is kept for the record (`forward`).
    #[allow(clippy::too_many_arguments)] // one request's parts, each used once
    async fn stream(
        &self,
        scope: &Scope,
        token: ReservationToken,
        request: HttpRequest,
        head: HttpResponse<()>,
        body: B,
        answer: Answer<B>,
        mut renewal: Renewal<'_, S>,
        report: &Report,
    ) -> Option<Outcome> {
        let max = self.config.max_response_bytes;
        let stored_head = StoredHead::of(head.head());
        // A body that declares its length must yield exactly that: actix cuts a longer one
        // short for the client and fails a shorter one, so either would be stored as a
        // response nobody was sent. Its last bytes wait for its end (`LAST_BYTES_HELD_AT_MOST`).
        let declared = match body.size() {
            BodySize::Sized(n) => Some(n),
            BodySize::Stream => stated_length(head.head(), request.version()),
            BodySize::None => None,
        };
        let mut total = 0u64;
        let (sender, forwarded) = forward::channel(body.size(), declared);
        let response = ServiceResponse::new(request, head.set_body(BoxBody::new(forwarded)));
        let mut client = answer
            .send(Ok(response.map_into_right_body()))
            .then(|| forward::Client::new(sender));
        let mut copy: Option<BodyCopy> = Some(BodyCopy::default());
        let mut read = 0usize;
        // On the heap, so that the rest of a body too large to store can move to a task of its
        // own (`forward_rest`).
        let mut body = Box::pin(body);
        let hold_until = renewal.hold_until();
        // When the client gets a declared body's last bytes without waiting for its end
        // (`LAST_BYTES_HELD_AT_MOST`); set once every declared byte is read.
        let mut let_go_at: Option<Instant> = None;
        loop {
            let next = loop {
                // A body that panics is caught here: the client's connection must be aborted (a
                // chunked body that just ended would look complete) and the outcome counted.
                let reading = renewal.during(next_chunk(body.as_mut()));
                let waited = match &mut client {
                    // Meanwhile the client's backlog moves as it makes room, and a client that
                    // leaves while the stream is quiet is noticed now, not when the next chunk
                    // comes (which may be never).
                    Some(client) => tokio::select! {
                        biased;
                        next = reading => Waited::Next(next),
                        progress = client.progress() => match progress {
                            Ok(()) => Waited::ClientMoved,
                            Err(_) => Waited::ClientGone,
                        },
                        () = until(let_go_at) => Waited::LetLastBytesGo,
                    },
                    // Read for nobody but the record, a body is read no longer than its key is
                    // held: an endless stream whose client left is not pulled for days.
                    None => match tokio::time::timeout_at(hold_until.into(), reading).await {
                        Ok(next) => Waited::Next(next),
                        Err(_) => Waited::KeyGone,
                    },
                };
                match waited {
                    Waited::Next(next) => break next,
                    Waited::ClientMoved => {}
                    Waited::LetLastBytesGo => {
                        let_go_at = None;
                        if let Some(client) = &client {
                            client.let_last_bytes_go();
                        }
                    }
                    // Nobody listens, and nothing is kept for the record (over the limit).
                    Waited::ClientGone if copy.is_none() => return Some(Outcome::NotStored),
                    Waited::ClientGone => client = None,
                    Waited::KeyGone => {
                        renewal.stop();
                        tracing::warn!(target: "idempotency_actix", outcome = "not_stored", "the client is gone and the streamed response did not end before its key's last lease (renew_lease_up_to): stopped reading it; reservation left to its lease");
                        return Some(Outcome::NotStored);
                    }
                }
            };
            let Some(next) = next else {
                renewal.stop();
                tracing::error!(target: "idempotency_actix", outcome = "body_error", "response body panicked after its head was sent; connection aborted, reservation left to its lease");
                if let Some(client) = client {
                    client.fail();
                }
                return Some(Outcome::BodyError);
            };
            if let Some(Ok(chunk)) = &next {
                total = total.saturating_add(chunk.len() as u64);
                if declared == Some(total) && !chunk.is_empty() {
                    let_go_at = Some(Instant::now() + LAST_BYTES_HELD_AT_MOST);
                }
            }
            let over = declared.is_some_and(|n| total > n);
            if over || (next.is_none() && declared.is_some_and(|n| total < n)) {
                renewal.stop();
                tracing::error!(target: "idempotency_actix", outcome = "body_error", declared = declared.unwrap_or_default(), read = total, "response body's length differs from its declared Content-Length; connection aborted, reservation left to its lease");
                if let Some(client) = client {
                    client.fail();
                }
                return Some(Outcome::BodyError);
            }
            match next {
                None => break,
                // Nothing to keep or forward; and an empty chunk would end a chunked body for
                // the client (actix-http's HTTP/1 encoder writes its terminator for one).
                Some(Ok(chunk)) if chunk.is_empty() => {}
                Some(Ok(chunk)) => {
                    let mut went_over = false;
                    if let Some(kept) = copy.as_mut() {
                        read = read.saturating_add(chunk.len());
                        if read > max {
                            went_over = true;
                        } else {
                            kept.push(&chunk);
                        }
                    }
                    if went_over {
                        copy = None;
                        renewal.stop();
                        tracing::warn!(target: "idempotency_actix", outcome = "not_stored", max_response_bytes = max, "streamed response too large to store; releasing the key");
                        self.release_quietly(scope, &token).await;
                        // The rest goes to the client at its pace, on a task a graceful stop
                        // does not wait for: nothing of it is kept, and the key is free. Here,
                        // a client that stopped reading held the stop for its whole limit
                        // (review, 2026-12-07; `shutdown` says what is counted).
                        if let Some(client) = client.take() {
                            let mut unreported = Unreported(Some((
                                report.clone(),
                                stored_head.status,
                                scope.clone(),
                            )));
                            let rest = async move {
                                let outcome =
                                    forward_rest(body, client, chunk, declared, total).await;
                                unreported.report(outcome);
                            };
                            // In the request's span, as its log lines are.
                            actix_rt::spawn(rest.in_current_span());
                            return None; // reported by that task
                        }
                    }
                    if let Some(to) = &mut client {
                        // While the response may be stored, the client's pace must not hold
                        // up the record (`forward`); after that, the client sets the pace.
                        let sent = match copy {
                            Some(_) => to.offer(chunk),
                            None => to.send(chunk).await,
                        };
                        if sent.is_err() {
                            client = None; // the client is gone: keep reading, stop forwarding
                        }
                    }
                    if client.is_none() && copy.is_none() {
                        return Some(Outcome::NotStored); // nobody listens, nothing left to store
                    }
                }
                Some(Err(error)) => {
                    let error: Box<dyn StdError> = error.into();
                    // The handler ran, so its effects may exist: keep the reservation until its
                    // lease ends rather than invite a second execution (C16). The detail stays
                    // in the log; the client's connection is aborted.
                    renewal.stop();
                    // Escaped: a handler's error often quotes what the client sent.
                    let error = error.to_string();
                    tracing::error!(target: "idempotency_actix", outcome = "body_error", error = %LogText(&error), "response body failed after its head was sent; connection aborted, reservation left to its lease");
                    if let Some(client) = client {
                        client.fail();
                    }
                    return Some(Outcome::BodyError);
                }
            }
        }
        let outcome = match copy {
            Some(kept) => {
                let body = kept.into_bytes();
                let head = stored_head.as_head();
                // Pinned here, in this statement: `storing` says why. Bound, not the block's
                // value: the future borrows this block's locals.
                let hold_until = renewal.hold_until();
                let outcome = renewal
                    .storing(pin!(
                        self.store_or_release(scope, &token, &head, &body, hold_until)
                    ))
                    .await;
                outcome
            }
            None => {
                renewal.stop();
                Outcome::NotStored
            }
        };
        if let Some(client) = client {
            // The end of the body reaches the client after the record is stored. What the
            // client had no room for while the record was kept waits for it on a task of its
            // own, not counted for a graceful stop (`shutdown`): the idempotent work is done,
            // and a client that reads slowly or not at all held the stop for its whole limit
            // (review, 2026-12-06). A worker's stop that cuts the task fails the client's body
            // (`forward`), so a cut response never looks whole; its retry is replayed when the
            // response was stored.
            if client.has_backlog() {
                actix_rt::spawn(client.finish());
            } else {
                client.finish().await;
            }
        }
        Some(outcome)
    }

    /// Store a complete response, or release the key when it is too large or `store_if` says no.
    /// `hold_until`: when the reservation's last lease may end (its renewal's bound), which a
    /// background retry of the `complete` keeps to.
    async fn store_or_release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        head: &ResponseHead,
        body: &Bytes,
        hold_until: Instant,
    ) -> Outcome {
        let config = &self.config;
        if body.len() > config.max_response_bytes {
            self.release_too_large(scope, token).await;
            return Outcome::NotStored;
        }
        let parts = ResponseParts {
            status: head.status,
            headers: &head.headers,
            body,
        };
        if !config.store_if_keeps(&parts) {
            self.release(scope, token, "rejected by store_if").await;
            return Outcome::NotStored;
        }
        let stored = StoredResponse {
            status: head.status.as_u16(),
            headers: storable_headers(&head.headers, &config.deny_headers),
            body: body.clone(),
        };
        self.complete(scope, token, &stored, hold_until).await
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        stored: &StoredResponse,
        hold_until: Instant,
    ) -> Outcome {
        let call = self.store.complete(scope, token, stored, self.config.ttl);
        match outcome::timed(self.meters.histogram(Op::Complete), call).await {
            Ok(WriteOutcome::Applied) => {
                tracing::debug!(target: "idempotency_actix", outcome = "stored", status = stored.status, "response stored");
                Outcome::Stored
            }
            Ok(WriteOutcome::Stale) => {
                tracing::warn!(target: "idempotency_actix", outcome = "stale", "the lease ended and another request took the key over; this response was not stored");
                Outcome::Stale
            }
            Err(error) => {
                tracing::error!(target: "idempotency_actix", outcome = "store_error", %error, "could not store the response; retrying until the lease ends, the reservation stays meanwhile");
                self.retry_complete(scope.clone(), *token, stored.clone(), hold_until);
                Outcome::CompleteFailed
            }
        }
    }

    /// After a failed `complete` (C16): keep trying in the background until the lease ends,
    /// so a store that comes back in time still records the response the client got, and a
    /// retry replays it instead of running the handler again. Fenced by the token: once the
    /// key was taken over the write is stale and changes nothing. Between tries it renews the
    /// lease, within the bound the handler's own renewals had (`hold_until`: up to
    /// `renew_lease_up_to` after the reservation), so a store that still answers renewals
    /// while its completions fail (its responses table locked, a statement that times out)
    /// keeps the key this request's: a duplicate gets 409 meanwhile, then the replay, instead
    /// of taking the key over once the lease it had ended. Tries then come every third of a
    /// lease at most, as renewals do.
    fn retry_complete(
        &self,
        scope: Scope,
        token: ReservationToken,
        stored: StoredResponse,
        hold_until: Instant,
    ) {
        let store = Arc::clone(&self.store);
        let ttl = self.config.ttl;
        let lease = self.config.lock_timeout;
        let until = saturating_deadline(Instant::now(), lease);
        let longest = (lease / 3).max(LONGEST_RETRY_PAUSE);
        let name = store.name();
        let Some(room) = retry_room(&self.retries) else {
            outcome::complete_retry("over_bound", name);
            tracing::error!(target: "idempotency_actix", outcome = "store_error", bound = MAX_BACKGROUND_RETRIES, "gave up storing the response: too many background retries already; the reservation stays until its lease ends, and a retry after that runs the handler again");
            return;
        };
        let histogram = self.meters.histogram(Op::Complete).clone();
        outcome::complete_retry("started", name);
        let retry = async move {
            let _room = room;
            let done = until_the_lease_ends(until, longest, |lease_ends| {
                let (store, scope, token, stored) = (&store, &scope, &token, &stored);
                let histogram = &histogram;
                async move {
                    let call = outcome::timed(histogram, store.complete(scope, token, stored, ttl));
                    let (answer, renewed) =
                        renewing_while(store, scope, token, lease, (lease_ends, hold_until), call)
                            .await;
                    let Some(answer) = answer else {
                        tracing::warn!(target: "idempotency_actix", outcome = "store_error", "storing the response again got no answer long after the lease ended; giving up on it");
                        return Attempt::Again(renewed);
                    };
                    match answer {
                        Ok(WriteOutcome::Applied) => {
                            tracing::info!(target: "idempotency_actix", outcome = "stored", status = stored.status, "response stored after the store recovered");
                            outcome::complete_retry("succeeded", name);
                            Attempt::Done
                        }
                        Ok(WriteOutcome::Stale) => {
                            // Taken over, or an earlier attempt that "failed" had been applied
                            // (its reply lost): the store cannot tell them apart after completion.
                            outcome::complete_retry("stale", name);
                            tracing::warn!(target: "idempotency_actix", outcome = "stale", "gave up storing the response: the reservation is no longer this request's (taken over after the lease, or lost with a database crash)");
                            Attempt::Done
                        }
                        Err(error) => {
                            tracing::debug!(target: "idempotency_actix", outcome = "store_error", %error, "storing the response failed again; retrying until the lease ends");
                            let after = keep_lease(&**store, scope, token, lease, hold_until).await;
                            Attempt::Again(renewed.max(after))
                        }
                    }
                }
            });
            if !done.await {
                outcome::complete_retry("given_up", name);
                tracing::error!(target: "idempotency_actix", outcome = "store_error", "gave up storing the response: the lease ended; a retry will run the handler again");
            }
        };
        spawn_tracked(retry.in_current_span(), move || {
            outcome::complete_retry("panicked", name);
            tracing::error!(target: "idempotency_actix", outcome = "store_error", "gave up storing the response: the store panicked; a retry after the lease runs the handler again");
        });
    }

    async fn release(&self, scope: &Scope, token: &ReservationToken, reason: &str) {
        tracing::info!(target: "idempotency_actix", outcome = "not_stored", reason, "response not stored; releasing the key");
        self.release_quietly(scope, token).await;
    }

    /// Release a key whose response is over `max_response_bytes`, at `warn` as for a streamed
    /// one: every retry of such a response runs the handler again, which an operator must see
    /// even with the target filtered at `warn` (docs/security.md).
    async fn release_too_large(&self, scope: &Scope, token: &ReservationToken) {
        let max = self.config.max_response_bytes;
        tracing::warn!(target: "idempotency_actix", outcome = "not_stored", max_response_bytes = max, "response too large to store; releasing the key");
        self.release_quietly(scope, token).await;
    }

    /// A reservation whose answer came slowly (see [`Self::reserve`]), before anything runs:
    /// `Some(instant)` while it is held, with the instant its lease now counts from (no later
    /// than the store started it); `None` when it was taken over before it was answered.
    ///
    /// Confirmed by a renewal, fenced by the token. The renewal's own answer is held to the
    /// same rule as the reservation's: one that took a third of the lease or more may also
    /// have come after the lease it set had ended, so it is confirmed again, up to
    /// [`CONFIRMATIONS`] renewals. A store that cannot renew cannot confirm: its reservation
    /// is given back (503), since the handler would run with less than the two thirds of a
    /// lease a prompt answer leaves it, and a retry just after the lease would run it again.
    async fn confirm(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<Option<Instant>, Decision> {
        let lease = self.config.lock_timeout;
        if self.store.renews_leases() {
            for _ in 0..CONFIRMATIONS {
                let renewed = Instant::now();
                let call = self.store.renew_lease(scope, token, lease);
                match outcome::timed(self.meters.histogram(Op::RenewLease), call).await {
                    Ok(WriteOutcome::Applied) if renewed.elapsed() < lease / 3 => {
                        return Ok(Some(renewed));
                    }
                    // Answered slowly too: held at least until it was applied, so confirm
                    // again.
                    Ok(WriteOutcome::Applied) => {}
                    Ok(WriteOutcome::Stale) => {
                        tracing::warn!(target: "idempotency_actix", outcome = "stale", "the reservation came back after its lease and had been taken over meanwhile; not run");
                        return Ok(None);
                    }
                    Err(error) => {
                        tracing::error!(target: "idempotency_actix", outcome = "store_error", %error, "could not confirm a reservation that came back slowly; given back, nothing was run");
                        return Err(self.give_back(scope, token, &error).await);
                    }
                }
            }
            tracing::error!(target: "idempotency_actix", outcome = "store_error", "every renewal confirming a slow reservation came back slowly too; given back, nothing was run");
        } else {
            tracing::error!(target: "idempotency_actix", outcome = "store_error", "the store answered the reservation after a third of its lease (lock_timeout) or more, and cannot renew it to confirm it; given back, nothing was run");
        }
        let error = StoreError::unavailable("the store answers too slowly to hold a lease");
        Err(self.give_back(scope, token, &error).await)
    }

    /// Release a reservation nothing ran for, and refuse the request as the store's failure
    /// (503 with `Retry-After`).
    async fn give_back(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        error: &StoreError,
    ) -> Decision {
        self.release_quietly(scope, token).await;
        self.store_failed(error)
    }

    /// The refusal of a request the store failed before anything ran: 503
    /// `STORAGE_UNAVAILABLE` with `Retry-After`.
    fn store_failed(&self, error: &StoreError) -> Decision {
        Decision::Refuse(
            Problem::new(ProblemCode::StorageUnavailable, unavailable_detail(error))
                .with_retry_after(self.config.retry_after),
        )
    }

    /// Release without the "not stored" line (the caller logged its own reason).
    async fn release_quietly(&self, scope: &Scope, token: &ReservationToken) {
        let call = self.store.release(scope, token);
        match outcome::timed(self.meters.histogram(Op::Release), call).await {
            Ok(WriteOutcome::Applied) => {}
            Ok(WriteOutcome::Stale) => {
                tracing::warn!(target: "idempotency_actix", outcome = "stale", "the reservation was taken over before it could be released");
            }
            Err(error) => {
                tracing::error!(target: "idempotency_actix", outcome = "store_error", %error, "could not release the key; retrying until the lease ends, the reservation stays meanwhile");
                self.retry_release(scope.clone(), *token);
            }
        }
    }

    /// After a failed `release`: keep trying in the background until the lease ends, as for
    /// `complete` (C16). The client was told its request was not kept and may retry with the
    /// same key (C10); without this, one failed `DELETE` held the key, answering 409, for the
    /// rest of the lease although the store was back a moment later. Fenced by the token: a
    /// release only removes this request's own reservation, never a takeover or a record.
    fn retry_release(&self, scope: Scope, token: ReservationToken) {
        let store = Arc::clone(&self.store);
        let lease = self.config.lock_timeout;
        let until = saturating_deadline(Instant::now(), lease);
        let histogram = self.meters.histogram(Op::Release).clone();
        let name = store.name();
        let Some(room) = retry_room(&self.retries) else {
            outcome::release_retry("over_bound", name);
            tracing::error!(target: "idempotency_actix", outcome = "store_error", bound = MAX_BACKGROUND_RETRIES, "gave up releasing the key: too many background retries already; it is held until its lease ends");
            return;
        };
        outcome::release_retry("started", name);
        let retry = async move {
            let _room = room;
            let done = until_the_lease_ends(until, LONGEST_RETRY_PAUSE, |lease_ends| {
                let (store, scope, token, histogram) = (&store, &scope, &token, &histogram);
                async move {
                    let call = outcome::timed(histogram, store.release(scope, token));
                    // Not renewed here, so the lease ends at `lease_ends`.
                    let abandon = saturating_deadline(lease_ends, unanswered_limit(lease));
                    let Ok(answer) = tokio::time::timeout_at(abandon.into(), call).await else {
                        tracing::warn!(target: "idempotency_actix", outcome = "store_error", "releasing the key again got no answer long after the lease ended; giving up on it");
                        return Attempt::Again(None);
                    };
                    match answer {
                        Ok(WriteOutcome::Applied) => {
                            outcome::release_retry("succeeded", name);
                            tracing::info!(target: "idempotency_actix", outcome = "released", "key released after the store recovered");
                            Attempt::Done
                        }
                        // Released by an attempt whose reply was lost, or taken over: nothing of
                        // this request's is left to release.
                        Ok(WriteOutcome::Stale) => {
                            outcome::release_retry("stale", name);
                            Attempt::Done
                        }
                        // The lease is not renewed here: once it ends the key is free anyway,
                        // which is what the release is for.
                        Err(error) => {
                            tracing::debug!(target: "idempotency_actix", outcome = "store_error", %error, "releasing the key failed again; retrying until the lease ends");
                            Attempt::Again(None)
                        }
                    }
                }
            });
            if !done.await {
                outcome::release_retry("given_up", name);
                tracing::error!(target: "idempotency_actix", outcome = "store_error", "gave up releasing the key: its lease ended, so a retry takes it over");
            }
        };
        // Counted by `shutdown` like the retry of a `complete` (C21 names both): dropped by a
        // stop, it leaves the key to its lease, answering the client's corrected retry 409 for
        // the rest of it, which is what C16 retries to avoid. A store that stays down does not
        // hold the stop: its wait has a limit.
        spawn_tracked(retry.in_current_span(), move || {
            outcome::release_retry("panicked", name);
            tracing::error!(target: "idempotency_actix", outcome = "store_error", "gave up releasing the key: the store panicked; it is held until its lease ends");
        });
    }

    /// Answer with a problem instead of running the handler, and report it.
    fn refuse(
        &self,
        req: ServiceRequest,
        problem: Problem,
        report: &Report,
        scope: Option<&Scope>,
    ) -> ServiceResponse<EitherBody<B, BoxBody>> {
        report.outcome(Outcome::of_problem(problem.code), problem.status(), scope);
        req.into_response(self.config.problem(problem))
            .map_into_right_body()
    }
}

/// The most background retries of a failed `complete` or `release` (C16) one `Idempotency`
/// value and its clones keep at once. Built inside `HttpServer::new`'s factory, as usual, it is
/// one value per worker: N workers keep up to N times this many (a review, 2026-12-06, found
/// "its workers together" here, which holds only when the value is built once, outside the
/// factory, and cloned into it). Each holds its response until it ends, a lease or more (renewing, up to
/// `renew_lease_up_to`); during a brownout in which every write fails they would otherwise
/// pile up by the hundreds a second, hold the memory of every response, and send their tries
/// into the pool live requests need. Past the bound a failed write is not retried: its key is
/// held until its lease ends (C16's remaining window), an error line says so, and the
/// retry metric counts `over_bound`. 4,096 responses of the default 1 MiB limit are 4 GiB at
/// most; most are far smaller. Per middleware, so a brownout of one store does not take the
/// room of another's.
pub const MAX_BACKGROUND_RETRIES: usize = 4096;

/// Room for one more background retry in `room`, held until it ends; `None` when it holds
/// [`MAX_BACKGROUND_RETRIES`] already.
fn retry_room(room: &Arc<tokio::sync::Semaphore>) -> Option<tokio::sync::OwnedSemaphorePermit> {
    Arc::clone(room).try_acquire_owned().ok()
}

/// Spawn the background retry of a `complete` or a `release` (C16), counted until it ends so
/// that a graceful stop waits for it (`crate::shutdown`): dropped, the first leaves a delivered
/// response unstored, and the client's retry after the lease runs the handler again; the second
/// leaves the key held, answering 409, until the lease ends.
/// A panic in it (a store's bug) is caught and reported by `on_panic`, so that every retry
/// that starts is counted as ended somehow.
fn spawn_tracked(
    retry: impl std::future::Future<Output = ()> + Send + 'static,
    on_panic: impl FnOnce() + Send + 'static,
) {
    let tracked = crate::shutdown::track();
    // The request's span, so the panic's log line names its key like the retry's own lines.
    let span = tracing::Span::current();
    tokio::spawn(async move {
        let _tracked = tracked;
        if AssertUnwindSafe(retry).catch_unwind().await.is_err() {
            span.in_scope(on_panic);
        }
    });
}

/// The longest pause between two tries of a background retry, unless a lease renewed by it
/// allows longer.
const LONGEST_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// Call `attempt` after pauses doubling from 100 ms to `longest`, each at most half of what is left
/// before `until` (the lease's end, after which the key is anyone's; later when an attempt
/// renewed the lease), until it answers [`Attempt::Done`] or less than 10 ms is left; whether
/// it got done. Each attempt is given the lease's end as it stands, and gives up on a store
/// call still unanswered [`unanswered_limit`] after it. The background retries of `complete`
/// and `release` (C16). Halving what is left keeps a short lease retried: with the shortest
/// the builder accepts (100 ms), a first pause of 100 ms left no attempt at all, and a retry
/// after the lease ran the handler again.
async fn until_the_lease_ends<F, Fut>(mut until: Instant, longest: Duration, mut attempt: F) -> bool
where
    F: FnMut(Instant) -> Fut,
    Fut: std::future::Future<Output = Attempt>,
{
    const LAST_CHANCE: Duration = Duration::from_millis(10);
    let mut pause = Duration::from_millis(100);
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left < LAST_CHANCE {
            return false;
        }
        tokio::time::sleep(pause.min(left / 2)).await;
        pause = (pause * 2).min(longest);
        match attempt(until).await {
            Attempt::Done => return true,
            Attempt::Again(Some(renewed)) => until = until.max(renewed),
            Attempt::Again(None) => {}
        }
    }
}

/// How long past the end of the lease (as renewed) a background retry still waits for a
/// store call: ten leases, at least 1 s and at most 60 s. Past it the call is dropped, with
/// what it holds (its copy of the response), and the retry gives up: the key is anyone's by
/// then. Before, a call that never returned (a custom store's bug, a lock waited for with no
/// timeout) held its retry, its response and its room under [`MAX_BACKGROUND_RETRIES`] for the
/// life of the process. Long enough that a store with working timeouts answers first and its
/// call is never cut off mid-flight (a `PostgresStore` statement dropped halfway would leave
/// its pooled connection behind a reply nobody reads; its worst case is its connection
/// timeout plus its query timeout, 7 s by default, within ten leases of 0.7 s and more).
fn unanswered_limit(lease: Duration) -> Duration {
    lease
        .saturating_mul(10)
        .clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// What one try of a background retry came to.
enum Attempt {
    /// Nothing left to do (done, or no longer this request's to do).
    Done,
    /// Try again; with the instant the lease now lasts until when the try renewed it.
    Again(Option<Instant>),
}

/// Await `call`, one try of a background retry, while renewing the lease as the heartbeat did
/// while the first try ran: at once (the heartbeat's last renewal may be a third of a lease
/// old, and the pause before this try up to half a lease), then every third of a lease, at most
/// [`MAX_RENEWALS_IN_FLIGHT`](super::renewal::MAX_RENEWALS_IN_FLIGHT) unanswered at once. The
/// call's answer (`None`, the call dropped, when it had none [`unanswered_limit`] after the
/// lease ended: `lease_ends` or a later renewal's end), and the latest instant a renewal made
/// the lease last until. A try stuck until the store's own timeout (7 s with `PostgresStore`'s
/// defaults) must not outlast the lease, or a duplicate takes the key over and runs the handler
/// again while the store would have renewed all along (review, 2026-12-06: the retry renewed
/// only after a try had failed). Renewals are fenced by the token: one that meets the stored
/// record changes nothing. Each runs on a task of its own, as the heartbeat's do, so one still
/// in flight when the try ends is not dropped halfway (a pooled connection left behind a
/// statement nobody reads). A `complete` that holds the record's row lock while it hangs
/// (PostgreSQL's, stuck on the responses table) keeps these renewals waiting behind it; they
/// help when the try hangs on its own connection.
async fn renewing_while<S: IdempotencyStore, F: Future>(
    store: &Arc<S>,
    scope: &Scope,
    token: &ReservationToken,
    lease: Duration,
    (lease_ends, hold_until): (Instant, Instant),
    call: F,
) -> (Option<F::Output>, Option<Instant>) {
    let every = super::renewal::interval(lease);
    let mut call = pin!(call);
    let mut renewals =
        futures_util::stream::FuturesUnordered::<tokio::task::JoinHandle<Option<Instant>>>::new();
    let mut renewed: Option<Instant> = None;
    let mut next = Instant::now();
    loop {
        tokio::select! {
            biased;
            answer = &mut call => return (Some(answer), renewed),
            Some(until) = renewals.next(), if !renewals.is_empty() => {
                // A renewal task that panicked (a store's bug) renewed nothing.
                renewed = renewed.max(until.ok().flatten());
            }
            () = tokio::time::sleep_until(
                saturating_deadline(
                    renewed.unwrap_or(lease_ends).max(lease_ends),
                    unanswered_limit(lease),
                )
                .into(),
            ) => return (None, renewed),
            () = tokio::time::sleep_until(next.into()),
                if renewals.len() < super::renewal::MAX_RENEWALS_IN_FLIGHT =>
            {
                let (store, scope, token) = (Arc::clone(store), scope.clone(), *token);
                renewals.push(tokio::spawn(async move {
                    keep_lease(&*store, &scope, &token, lease, hold_until).await
                }));
                next = saturating_deadline(Instant::now(), every);
            }
        }
    }
}

/// Renew the lease of a reservation whose response is being stored again, so that the key
/// stays this request's while the store answers renewals: the instant the renewed lease lasts
/// until at least (counted from when the renewal was sent; the store applied it later), or
/// `None` when the store does not renew, a whole lease from now would end past `hold_until`
/// (the handler's own renewals' bound; a shorter grant would shorten the lease held), or the
/// renewal failed or found the reservation gone (completed by an earlier try whose answer was
/// lost, or taken over: the next `complete` tells which). Fenced by the token.
async fn keep_lease<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    token: &ReservationToken,
    lease: Duration,
    hold_until: Instant,
) -> Option<Instant> {
    let sent = Instant::now();
    let renewed = saturating_deadline(sent, lease);
    if !store.renews_leases() || renewed > hold_until {
        return None;
    }
    // Its answer grants nothing once the lease it asks for has ended; it is still awaited that
    // long after ([`unanswered_limit`]), so that only a call that never returns is dropped.
    let abandon = saturating_deadline(renewed, unanswered_limit(lease));
    match tokio::time::timeout_at(abandon.into(), store.renew_lease(scope, token, lease)).await {
        Ok(Ok(WriteOutcome::Applied)) => Some(renewed),
        Ok(Ok(WriteOutcome::Stale) | Err(_)) | Err(_) => None,
    }
}

/// The outcome a task owes its request, reported once: by the task, or as a body error when a
/// worker's stop drops the task first (its client's body fails then), so that no request goes
/// uncounted.
struct Unreported(Option<(Report, StatusCode, Scope)>);

impl Unreported {
    fn report(&mut self, outcome: Outcome) {
        if let Some((report, status, scope)) = self.0.take() {
            report.outcome(outcome, status, Some(&scope));
        }
    }
}

impl Drop for Unreported {
    fn drop(&mut self) {
        self.report(Outcome::BodyError);
    }
}

/// The next item of a handler's streamed body: `None` if polling it panicked (the panic hook
/// printed it; the client's connection must then be aborted), else what it yielded.
fn next_chunk<B: MessageBody>(
    mut body: Pin<&mut B>,
) -> impl Future<Output = Option<Option<Result<Bytes, B::Error>>>> + '_ {
    std::future::poll_fn(move |cx| {
        match catch_unwind(AssertUnwindSafe(|| body.as_mut().poll_next(cx))) {
            Ok(poll) => poll.map(Some),
            Err(_) => Poll::Ready(None),
        }
    })
}

/// The rest of a streamed body too large to store, from `chunk` on, forwarded to `client` at
/// its pace (the key was released: nothing is kept). `total`: the body's bytes so far, `chunk`
/// included. Ends the client's body as `Flow::stream` does: at the stream's end, failed on an
/// error, a panic or a length that differs from the one declared. Its outcome: `NotStored`,
/// or `BodyError` when the body failed.
async fn forward_rest<B: MessageBody>(
    mut body: Pin<Box<B>>,
    mut client: forward::Client,
    chunk: Bytes,
    declared: Option<u64>,
    mut total: u64,
) -> Outcome {
    // Nothing is stored: a declared body's last bytes need not wait for its end.
    client.let_last_bytes_go();
    if client.send(chunk).await.is_err() {
        return Outcome::NotStored;
    }
    loop {
        let next = tokio::select! {
            biased;
            next = next_chunk(body.as_mut()) => next,
            progress = client.progress() => match progress {
                Ok(()) => continue,
                Err(_) => return Outcome::NotStored, // the client is gone, nothing kept
            },
        };
        let chunk = match next {
            Some(None) => break,
            Some(Some(Ok(chunk))) => chunk,
            Some(Some(Err(error))) => {
                let error: Box<dyn StdError> = error.into();
                let error = error.to_string();
                tracing::error!(target: "idempotency_actix", outcome = "body_error", error = %LogText(&error), "response body (too large to store, key released) failed after its head was sent; connection aborted");
                client.fail();
                return Outcome::BodyError;
            }
            None => {
                tracing::error!(target: "idempotency_actix", outcome = "body_error", "response body (too large to store, key released) panicked after its head was sent; connection aborted");
                client.fail();
                return Outcome::BodyError;
            }
        };
        total = total.saturating_add(chunk.len() as u64);
        if declared.is_some_and(|n| total > n) {
            break;
        }
        if !chunk.is_empty() && client.send(chunk).await.is_err() {
            return Outcome::NotStored;
        }
    }
    if declared.is_some_and(|n| total != n) {
        tracing::error!(target: "idempotency_actix", outcome = "body_error", declared = declared.unwrap_or_default(), read = total, "response body's length differs from its declared Content-Length; connection aborted");
        client.fail();
        return Outcome::BodyError;
    }
    client.finish().await;
    Outcome::NotStored
}

/// The length a handler states for a stream of unknown size in a `Content-Length` header the
/// client is sent: always over HTTP/2, and over HTTP/1 when chunking is off (`no_chunking`;
/// with chunking actix drops the header). actix-http then writes the stream as it comes, and
/// the client reads the stated length, so it is the stream's declared length.
fn stated_length(head: &ResponseHead, version: Version) -> Option<u64> {
    if version != Version::HTTP_2 && head.chunked() {
        return None;
    }
    head.headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What to do instead of running the handler.
enum Decision {
    Refuse(Problem),
    Replay(StoredResponse),
    PassThrough,
    /// The client left while waiting for the first request (wait mode): nobody to answer.
    Abandoned,
}

/// The status and headers of a streamed response, kept for its record after its head was sent.
struct StoredHead {
    status: StatusCode,
    headers: HeaderMap,
}

impl StoredHead {
    fn of(head: &ResponseHead) -> Self {
        Self {
            status: head.status,
            headers: head.headers.clone(),
        }
    }

    fn as_head(&self) -> ResponseHead {
        let mut head = ResponseHead::new(self.status);
        head.headers = self.headers.clone();
        head
    }
}

/// The status a client gets for a result (an error's own status).
fn status_of<B>(result: &Result<ServiceResponse<B>, Error>) -> StatusCode {
    match result {
        Ok(response) => response.status(),
        Err(error) => error.as_response_error().status_code(),
    }
}

/// An empty 500 whose reason goes to the log, never to the client.
pub(super) fn opaque_500(reason: &'static str) -> Error {
    actix_web::error::InternalError::from_response(
        reason,
        HttpResponse::InternalServerError().finish(),
    )
    .into()
}

/// The copy of a streamed response body kept for its record: a body of one chunk (the common
/// case) is kept as that chunk, without a copy; from the second chunk on, the bytes are copied
/// into one buffer, as `read_body` does for requests. Found by review (2026-12-05): a list of
/// the handler's chunks cost about 110 bytes per 1-byte chunk (110 MiB for a 1 MiB body), and
/// each chunk sliced from a larger buffer kept that whole buffer alive (16-byte slices of 1 MiB
/// buffers held 67 MiB for a 1 KiB response), while `max_response_bytes` counted only lengths.
#[derive(Default)]
struct BodyCopy {
    first: Option<Bytes>,
    rest: BytesMut,
}

impl BodyCopy {
    fn push(&mut self, chunk: &Bytes) {
        if self.first.is_none() && self.rest.is_empty() {
            self.first = Some(chunk.clone());
            return;
        }
        if let Some(first) = self.first.take() {
            self.rest.reserve(first.len() + chunk.len());
            self.rest.extend_from_slice(&first);
        }
        self.rest.extend_from_slice(chunk);
    }

    fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.rest.freeze())
    }
}

pub(super) fn unavailable_detail(error: &StoreError) -> String {
    match error {
        StoreError::NotProvisioned { hint } => {
            format!(
                "the idempotency store is not provisioned ({hint}); the request was not processed"
            )
        }
        _ => "the idempotency store is unavailable; the request was not processed, retry later"
            .to_owned(),
    }
}

/// The most [`read_body`] reserves ahead on a client's `Content-Length` (the default
/// `max_body_bytes`).
const RESERVE_CAP: usize = 1 << 20;

/// Buffer the request body, or answer 413 (C14): checked against Content-Length first, then
/// against the bytes actually read, so a missing or lying Content-Length changes nothing. The
/// one place a body is buffered (keyed requests; transactional mode's keyless ones).
///
/// A body that arrives in one chunk (most small bodies: actix splits it off its read buffer)
/// is kept as that chunk, without a copy; only a second chunk starts a buffer, so many tiny
/// chunks cost their bytes, not an entry each.
///
/// Returns the body and the request's body stream, read to its end (see [`Answer`]).
pub(super) async fn read_body(
    req: &mut ServiceRequest,
    max: usize,
) -> Result<(Bytes, Payload), Problem> {
    let declared = declared_length(req);
    if declared.is_some_and(|len| len > max as u64) {
        return Err(too_large(max));
    }
    let mut payload = req.take_payload();
    let mut first: Option<Bytes> = None;
    let mut body = BytesMut::new();
    let mut read = 0usize;
    while let Some(chunk) = payload.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(PayloadError::Overflow) => return Err(too_large(max)),
            // A problem document like every other refusal (C13); the parser's own words stay
            // in the log, not in the answer.
            Err(error) => {
                tracing::info!(target: "idempotency_actix", outcome = "request_body_error", %error, "the request body could not be read");
                return Err(Problem::new(
                    ProblemCode::InvalidBody,
                    "the request body ended before its declared length, or its chunked \
                     encoding is malformed",
                ));
            }
        };
        read = read.saturating_add(chunk.len());
        if read > max {
            return Err(too_large(max));
        }
        if first.is_none() && body.is_empty() {
            first = Some(chunk);
            continue;
        }
        if let Some(first) = first.take() {
            // Room for the declared length, up to a cap: the header is the client's word, and
            // with a very large `max_body_bytes` reserving it whole could fail the process's
            // allocation before a second byte arrives. Past the cap the buffer grows as read.
            let declared = declared.map_or(read, |len| usize::try_from(len).unwrap_or(max));
            body.reserve(declared.min(max).min(RESERVE_CAP).max(read));
            body.extend_from_slice(&first);
        }
        body.extend_from_slice(&chunk);
    }
    Ok((first.unwrap_or_else(|| body.freeze()), payload))
}

fn too_large(max: usize) -> Problem {
    Problem::new(
        ProblemCode::PayloadTooLarge,
        format!("the body is larger than {max} bytes"),
    )
}

/// The request's `Content-Length`, if it has a valid one.
fn declared_length(req: &ServiceRequest) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

#[cfg(test)]
mod tests {
    use super::scope_path;

    #[test]
    fn a_scope_path_has_one_spelling_per_value_the_handler_sees() {
        for (matched, scope) in [
            ("/payments", "/payments"),
            // The escapes the router keeps: decoded as the extractor decodes them.
            ("/items/a%2fb", "/items/a/b"),
            ("/items/a%2Fb", "/items/a/b"),
            ("/items/a%2bb", "/items/a+b"),
            ("/items/a%2Bb", "/items/a+b"),
            ("/items/a+b", "/items/a+b"),
            ("/items/%25", "/items/%25"),
            // Escapes the router left behind (`%%34%31` reaches it as `%41`): decoded too.
            ("/items/%41", "/items/A"),
            ("/items/%C3%A9", "/items/\u{e9}"),
            ("/items/%FF", "/items/\u{fffd}"),
            // Not escapes: a lone `%` is `%25`, as `%25` itself is; never a panic.
            ("/items/%", "/items/%25"),
            ("/items/100%", "/items/100%25"),
            ("/items/100%25", "/items/100%25"),
            ("/items/%2", "/items/%252"),
            ("/items/%zz%", "/items/%25zz%25"),
            ("/items/%%2f", "/items/%25"),
            ("/items/%+1", "/items/%25+1"),
            // Control characters, decoded by the router or by us, are escaped.
            ("/items/a\u{0}b", "/items/a%00b"),
            ("/items/%00", "/items/%00"),
            ("/items/\u{1f}\u{7f}", "/items/%1F%7F"),
            ("/\u{e9}%2f\u{e9}", "/\u{e9}/\u{e9}"),
            // Runs of `/` merged, a trailing `/` dropped (`NormalizePath` inside the
            // middleware hands all of these to one handler), escaped ones too.
            ("/", "/"),
            ("//", "/"),
            ("/pay/", "/pay"),
            ("//pay", "/pay"),
            ("/a//b///", "/a/b"),
            ("/a/%2F/b", "/a/b"),
            ("/a%2F", "/a"),
        ] {
            assert_eq!(scope_path(matched), scope, "{matched}");
        }
    }
}
