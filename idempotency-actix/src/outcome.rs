//! What the middleware did with each keyed request ([`Outcome`]), as metrics and as a hook.
//!
//! # Metrics
//! Recorded through the [`metrics`](https://docs.rs/metrics) facade: nothing is exported until
//! the application installs a recorder (e.g. `metrics-exporter-prometheus`), and without one
//! the calls cost next to nothing. Label values are bounded sets: never a key, a tenant or a
//! raw path (the route is the router's pattern, `/payments/{id}`, or `unmatched`).
//! Each worker resolves its metric handles on its first keyed request and keeps them, so
//! install the recorder before the server starts serving (as every exporter's setup does);
//! handles taken before any recorder exists stay no-ops.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | [`REQUESTS_TOTAL`] | counter | `outcome`, `method`, `route`, `store` | keyed requests (and refused keyless ones when a key is required), one outcome each: [`Outcome::as_str`] |
//! | [`STORE_CALL_SECONDS`] | histogram | `op` (`reserve`, `complete`, `release`), `store` | duration of each store call, failed ones included |
//! | [`RESERVATIONS_HELD`] | gauge | `store` | requests holding a reservation right now (a drop guard keeps it right when a request's task is cut) |
//! | [`COMPLETE_RETRIES_TOTAL`] | counter | `result` (`started`, `succeeded`, `stale`, `given_up`), `store` | the after-handler retries of a failed `complete` (C16) |
//!
//! # Hook
//! [`IdempotencyBuilder::on_outcome`](crate::IdempotencyBuilder::on_outcome) takes a callback
//! that receives every [`OutcomeEvent`], for audit logs or billing. It is called synchronously
//! on the request's task, so keep it cheap and hand real work off (a channel, a spawned task).
//! A panicking hook is caught and logged, and the request goes on as if there were no hook; in
//! a binary built with `panic = "abort"` nothing can be caught, so there a panicking hook ends
//! the process like any other panic.

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::http::{Method, StatusCode};
use metrics::{Counter, Gauge, Histogram, SharedString};

use crate::problem::ProblemCode;
use crate::store::Scope;

/// Counter of keyed requests by outcome.
pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";
/// Histogram of store call durations, in seconds.
pub const STORE_CALL_SECONDS: &str = "idempotency_store_call_seconds";
/// Gauge of requests holding a reservation right now.
pub const RESERVATIONS_HELD: &str = "idempotency_reservations_held";
/// Counter of the after-handler `complete` retries.
pub const COMPLETE_RETRIES_TOTAL: &str = "idempotency_complete_retries_total";

/// What happened to one keyed request. The handler ran for exactly the outcomes whose
/// [`ran_handler`](Self::ran_handler) is true.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its response was stored (a miss).
    Stored,
    /// The handler ran and its response was not stored (not 2xx, too large, `store_if`, or a
    /// handler error); the key was released.
    NotStored,
    /// The stored response was replayed.
    Replay,
    /// 409: the first request with the key is still running.
    Conflict,
    /// 422: the key was used for a different request.
    Mismatch,
    /// 400: the key is malformed or too long.
    InvalidKey,
    /// 400: no key, and one is required.
    MissingKey,
    /// 413: the body is too large to fingerprint.
    PayloadTooLarge,
    /// 400: a tenant source is configured and the request has no tenant (C23).
    MissingTenant,
    /// 503: the store failed before the handler; it did not run.
    StoreUnavailable,
    /// The store failed before the handler and `fail_open` let the request run unprotected.
    FailOpen,
    /// The handler ran, but its lease had been taken over: its response was not stored.
    Stale,
    /// The handler ran and storing its response failed; retried until the lease ends (C16).
    CompleteFailed,
    /// The handler ran and its streamed body failed after the head was sent.
    BodyError,
    /// 406: the stored response's encoding is not acceptable to the retry.
    ReplayNotAcceptable,
    /// The handler panicked; the reservation was left to its lease.
    HandlerPanic,
    /// Transactional mode: the handler ran and its transaction was rolled back (a response
    /// that is not stored, a handler error, a response over `max_response_bytes`): neither its
    /// writes nor the reservation remain.
    RolledBack,
    /// Transactional mode: COMMIT (or the response's write before it) failed; everything was
    /// rolled back and the client got `COMMIT_FAILED`.
    CommitFailed,
    /// Transactional mode: the connection was lost during COMMIT; the client got
    /// `COMMIT_OUTCOME_UNKNOWN`.
    CommitUnknown,
}

impl Outcome {
    /// The `outcome` label: `stored`, `not_stored`, `replay`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::NotStored => "not_stored",
            Self::Replay => "replay",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::InvalidKey => "invalid_key",
            Self::MissingKey => "missing_key",
            Self::PayloadTooLarge => "payload_too_large",
            Self::MissingTenant => "missing_tenant",
            Self::StoreUnavailable => "store_unavailable",
            Self::FailOpen => "fail_open",
            Self::Stale => "stale",
            Self::CompleteFailed => "complete_failed",
            Self::BodyError => "body_error",
            Self::ReplayNotAcceptable => "replay_not_acceptable",
            Self::HandlerPanic => "handler_panic",
            Self::RolledBack => "rolled_back",
            Self::CommitFailed => "commit_failed",
            Self::CommitUnknown => "commit_unknown",
        }
    }

    /// Whether the handler ran for this outcome.
    pub fn ran_handler(self) -> bool {
        matches!(
            self,
            Self::Stored
                | Self::NotStored
                | Self::FailOpen
                | Self::Stale
                | Self::CompleteFailed
                | Self::BodyError
                | Self::HandlerPanic
                | Self::RolledBack
                | Self::CommitFailed
                | Self::CommitUnknown
        )
    }

    /// The outcome of a problem the middleware answered with.
    pub(crate) fn of_problem(code: ProblemCode) -> Self {
        match code {
            ProblemCode::MissingKey => Self::MissingKey,
            ProblemCode::PayloadTooLarge => Self::PayloadTooLarge,
            ProblemCode::FingerprintMismatch => Self::Mismatch,
            ProblemCode::Conflict => Self::Conflict,
            ProblemCode::StorageUnavailable => Self::StoreUnavailable,
            ProblemCode::MissingTenant => Self::MissingTenant,
            ProblemCode::ReplayNotAcceptable => Self::ReplayNotAcceptable,
            ProblemCode::ResponseTooLarge => Self::RolledBack,
            ProblemCode::CommitFailed => Self::CommitFailed,
            ProblemCode::CommitOutcomeUnknown => Self::CommitUnknown,
            _ => Self::InvalidKey,
        }
    }
}

/// One outcome, as the [hook](crate::IdempotencyBuilder::on_outcome) sees it.
#[derive(Debug)]
#[non_exhaustive]
pub struct OutcomeEvent<'a> {
    /// The record's scope; `None` when the request never got one (an invalid key, a missing
    /// tenant, a body too large).
    pub scope: Option<&'a Scope>,
    /// What happened.
    pub outcome: Outcome,
    /// The status the client was answered with (for a streamed or failed body, the status of
    /// its head; 500 for a panic).
    pub status: StatusCode,
    /// From the middleware receiving the request to the outcome (for a streamed response, to
    /// the end of the stream).
    pub elapsed: Duration,
}

pub(crate) type Hook = dyn Fn(&OutcomeEvent<'_>) + Send + Sync;

/// The number of [`Outcome`] variants (one counter handle each per route).
const OUTCOMES: usize = Outcome::CommitUnknown as usize + 1;

/// The metric handles of one worker, resolved once and reused.
///
/// Why: the `metrics` macros build a key (name and labels) and look it up in the recorder on
/// every call; with a real recorder that was about 5 % of a memory-store miss (five lookups a
/// request). A handle is an `Arc` around the recorder's own atomic, so keeping it makes each
/// recording an atomic add. Handles are resolved on a worker's first keyed request (not when
/// the app is built), so a recorder installed before the server starts serving is the one
/// used; `metrics` handles taken before any recorder is installed stay no-ops, which is the
/// facade's documented behaviour.
pub(crate) struct Meters {
    store: &'static str,
    calls: OnceCell<StoreMeters>,
    /// One entry per (method, route pattern): bounded by the app's routes.
    routes: RefCell<HashMap<RouteKey, Rc<RouteCounters>>>,
}

/// The method label and the route pattern (`None`: unmatched).
type RouteKey = (&'static str, Option<String>);

/// The per-store handles: call durations and the held-reservations gauge.
struct StoreMeters {
    reserve: Histogram,
    complete: Histogram,
    release: Histogram,
    held: Gauge,
}

/// The outcome counters of one (method, route), each resolved on its first use.
struct RouteCounters {
    method: &'static str,
    route: SharedString,
    store: &'static str,
    by_outcome: [OnceCell<Counter>; OUTCOMES],
}

/// A store call, for [`STORE_CALL_SECONDS`]'s `op` label.
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Reserve,
    Complete,
    Release,
}

impl Meters {
    pub(crate) fn new(store: &'static str) -> Self {
        Self {
            store,
            calls: OnceCell::new(),
            routes: RefCell::new(HashMap::new()),
        }
    }

    fn calls(&self) -> &StoreMeters {
        self.calls.get_or_init(|| {
            let store = self.store;
            let op = |op: &'static str| metrics::histogram!(STORE_CALL_SECONDS, "op" => op, "store" => store);
            StoreMeters {
                reserve: op("reserve"),
                complete: op("complete"),
                release: op("release"),
                held: metrics::gauge!(RESERVATIONS_HELD, "store" => store),
            }
        })
    }

    /// The histogram of one store call (a handle: clone it into a task that outlives this one).
    pub(crate) fn histogram(&self, op: Op) -> &Histogram {
        let calls = self.calls();
        match op {
            Op::Reserve => &calls.reserve,
            Op::Complete => &calls.complete,
            Op::Release => &calls.release,
        }
    }

    /// Count one held reservation for as long as the guard lives.
    pub(crate) fn held(&self) -> Held {
        let gauge = self.calls().held.clone();
        gauge.increment(1.0);
        Held { gauge }
    }

    /// The report of one request: its route's counters, the hook, the start time.
    pub(crate) fn report(
        &self,
        method: &Method,
        route: Option<String>,
        hook: Option<Arc<Hook>>,
    ) -> Report {
        let key = (method_label(method), route);
        let existing = self.routes.borrow().get(&key).cloned();
        let counters = existing.unwrap_or_else(|| {
            let counters = Rc::new(RouteCounters {
                method: key.0,
                route: key
                    .1
                    .as_ref()
                    .map_or(SharedString::const_str("unmatched"), |route| {
                        SharedString::from_owned(route.clone())
                    }),
                store: self.store,
                by_outcome: std::array::from_fn(|_| OnceCell::new()),
            });
            self.routes.borrow_mut().insert(key, Rc::clone(&counters));
            counters
        });
        Report {
            started: Instant::now(),
            counters,
            hook,
        }
    }
}

impl RouteCounters {
    fn count(&self, outcome: Outcome) {
        self.by_outcome[outcome as usize]
            .get_or_init(|| {
                metrics::counter!(
                    REQUESTS_TOTAL,
                    "outcome" => outcome.as_str(),
                    "method" => self.method,
                    "route" => self.route.clone(),
                    "store" => self.store,
                )
            })
            .increment(1);
    }
}

/// Reports the outcome of one request: counts it and calls the hook. Cheap to clone (the
/// request's future keeps one to report a panicked task).
#[derive(Clone)]
pub(crate) struct Report {
    started: Instant,
    counters: Rc<RouteCounters>,
    hook: Option<Arc<Hook>>,
}

impl Report {
    /// Count `outcome` and tell the hook.
    pub(crate) fn outcome(&self, outcome: Outcome, status: StatusCode, scope: Option<&Scope>) {
        self.counters.count(outcome);
        let Some(hook) = &self.hook else {
            return;
        };
        let event = OutcomeEvent {
            scope,
            outcome,
            status,
            elapsed: self.started.elapsed(),
        };
        if catch_unwind(AssertUnwindSafe(|| hook(&event))).is_err() {
            tracing::error!(target: "idempotency_actix", outcome = outcome.as_str(), "the on_outcome hook panicked; the request went on without it");
        }
    }
}

/// Time one store call into its [`STORE_CALL_SECONDS`] histogram.
pub(crate) async fn timed<T>(
    histogram: &Histogram,
    call: impl std::future::Future<Output = T>,
) -> T {
    let started = Instant::now();
    let result = call.await;
    histogram.record(started.elapsed().as_secs_f64());
    result
}

/// Counts one held reservation in [`RESERVATIONS_HELD`] for as long as it lives.
pub(crate) struct Held {
    gauge: Gauge,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}

/// Count one step of the after-handler `complete` retry.
pub(crate) fn complete_retry(result: &'static str, store: &'static str) {
    metrics::counter!(COMPLETE_RETRIES_TOTAL, "result" => result, "store" => store).increment(1);
}

/// The method as a label (a bounded set: other methods are `other`).
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::POST => "POST",
        Method::PATCH => "PATCH",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::GET => "GET",
        _ => "other",
    }
}
