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
//! | [`STORE_CALL_SECONDS`] | histogram | `op` (`reserve`, `complete`, `release`, `renew_lease`), `store` | duration of each store call, failed ones included |
//! | [`RESERVATIONS_HELD`] | gauge | `store` | requests holding a reservation right now (a drop guard keeps it right when a request's task is cut) |
//! | [`COMPLETE_RETRIES_TOTAL`] | counter | `result` (`started`, `succeeded`, `stale`, `given_up`, `over_bound`, `panicked`), `store` | the after-handler retries of a failed `complete` (C16) |
//! | [`RELEASE_RETRIES_TOTAL`] | counter | `result` (`started`, `succeeded`, `stale`, `given_up`, `over_bound`, `panicked`), `store` | the background retries of a failed `release` of a response that is not stored (C16) |
//! | [`LEASE_RENEWALS_TOTAL`] | counter | `result` (`renewed`, `failed`, `lost`, `limit`), `store` | lease renewals while a handler runs (C9); `lost`: the reservation was taken over or released under a running handler; `limit`: the handler outlived `renew_lease_up_to` |
//!
//! # Hook
//! [`IdempotencyBuilder::on_outcome`](crate::IdempotencyBuilder::on_outcome) takes a callback
//! that receives every [`OutcomeEvent`], for audit logs or billing. It is called synchronously
//! on the request's task, so keep it cheap and hand real work off (a channel, a spawned task).
//! A panicking hook is caught and logged, and the request goes on as if there were no hook; in
//! a binary built with `panic = "abort"` nothing can be caught, so there a panicking hook ends
//! the process like any other panic.

use std::cell::{OnceCell, RefCell};
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
/// Counter of the background `release` retries.
pub const RELEASE_RETRIES_TOTAL: &str = "idempotency_release_retries_total";
/// Counter of lease renewals while handlers run.
pub const LEASE_RENEWALS_TOTAL: &str = "idempotency_lease_renewals_total";

/// What happened to one keyed request. The handler ran for exactly the outcomes whose
/// [`ran_handler`](Self::ran_handler) is true.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its response was stored (a miss).
    Stored,
    /// The handler ran and its response was not stored (not 2xx, too large, `store_if`, or a
    /// handler error); the key was released (or, for a streamed body read for nobody but the
    /// record that outlived its key's last lease, left to that lease).
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
    /// The handler panicked; the reservation was left to its lease (in transactional mode,
    /// rolled back). Also counted for a request `fail_open` let through, which had none: a
    /// panic is a panic, whatever protected the request.
    HandlerPanic,
    /// Transactional mode: the handler ran and its transaction was rolled back (a response
    /// that is not stored, a handler error, a response over `max_response_bytes`): neither its
    /// writes nor the reservation remain. Also a run rolled back by a serialization failure
    /// (the retry option) whose next claim answered instead of running it again (the key
    /// taken meanwhile: 409; the store down: 503): the status says what the client got. And,
    /// with a 500, a handler that ended the request's transaction itself (unsupported): what
    /// it wrote outside the request's transaction may remain.
    RolledBack,
    /// Transactional mode: COMMIT (or the response's write before it) failed; everything was
    /// rolled back and the client got `COMMIT_FAILED`.
    CommitFailed,
    /// Transactional mode: the connection was lost during COMMIT; the client got
    /// `COMMIT_OUTCOME_UNKNOWN`.
    CommitUnknown,
    /// Wait mode: the client left while its request waited for the first one with its key;
    /// nothing ran, nothing was sent (reported with status 499, "client closed request").
    Abandoned,
    /// 400 `INVALID_BODY`: the request's body could not be read (the client reset the
    /// connection mid-upload, a malformed chunked encoding): nothing was reserved, nothing ran.
    RequestBodyError,
    /// 400 `SCOPE_TOO_LONG`: tenant, method, path and key together are longer than the store
    /// can record; nothing was reserved, nothing ran.
    ScopeTooLong,
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
            Self::Abandoned => "abandoned",
            Self::RequestBodyError => "request_body_error",
            Self::ScopeTooLong => "scope_too_long",
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
            ProblemCode::InvalidBody => Self::RequestBodyError,
            ProblemCode::FingerprintMismatch => Self::Mismatch,
            ProblemCode::Conflict => Self::Conflict,
            ProblemCode::StorageUnavailable => Self::StoreUnavailable,
            ProblemCode::MissingTenant => Self::MissingTenant,
            ProblemCode::ReplayNotAcceptable => Self::ReplayNotAcceptable,
            ProblemCode::ResponseTooLarge => Self::RolledBack,
            ProblemCode::CommitFailed => Self::CommitFailed,
            ProblemCode::CommitOutcomeUnknown => Self::CommitUnknown,
            ProblemCode::ScopeTooLong => Self::ScopeTooLong,
            ProblemCode::InvalidKey | ProblemCode::KeyTooLong => Self::InvalidKey,
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

/// The status reported for [`Outcome::Abandoned`]: 499, "client closed request" (nginx's),
/// for a request that got no response.
pub(crate) fn client_closed() -> StatusCode {
    StatusCode::from_u16(499).unwrap_or(StatusCode::REQUEST_TIMEOUT)
}

/// The number of [`Outcome`] variants (one counter handle each per route).
const OUTCOMES: usize = Outcome::ScopeTooLong as usize + 1;

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
    /// One entry per (method, route pattern): bounded by the app's routes. Hashed with
    /// hashbrown's default (foldhash), not std's SipHash: the keys are the app's own patterns
    /// and method labels, which no client chooses, so there is no flooding to resist, and
    /// SipHash was about 900 instructions of every keyed request (a sixth of the middleware's
    /// own work on a memory replay).
    routes: RefCell<hashbrown::HashMap<RouteKey, Rc<RouteCounters>>>,
}

/// The method label and the route pattern (`None`: unmatched).
type RouteKey = (&'static str, Option<String>);

/// The per-store handles: call durations and the held-reservations gauge.
struct StoreMeters {
    reserve: Histogram,
    complete: Histogram,
    release: Histogram,
    renew_lease: Histogram,
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
    RenewLease,
}

impl Meters {
    pub(crate) fn new(store: &'static str) -> Self {
        Self {
            store,
            calls: OnceCell::new(),
            routes: RefCell::new(hashbrown::HashMap::new()),
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
                renew_lease: op("renew_lease"),
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
            Op::RenewLease => &calls.renew_lease,
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
            counters,
            // The clock is read only for the hook's `elapsed`.
            hook: hook.map(|hook| (hook, Instant::now())),
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
    counters: Rc<RouteCounters>,
    /// The hook, and when the request started (for its `elapsed`).
    hook: Option<(Arc<Hook>, Instant)>,
}

impl Report {
    /// Count `outcome` and tell the hook.
    pub(crate) fn outcome(&self, outcome: Outcome, status: StatusCode, scope: Option<&Scope>) {
        self.counters.count(outcome);
        let Some((hook, started)) = &self.hook else {
            return;
        };
        let event = OutcomeEvent {
            scope,
            outcome,
            status,
            elapsed: started.elapsed(),
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

/// Count one step of the background `release` retry (review, 2026-12-06: it had no metric, so
/// a release given up, which leaves the key answering 409 for the rest of its lease, showed
/// only in the log).
pub(crate) fn release_retry(result: &'static str, store: &'static str) {
    metrics::counter!(RELEASE_RETRIES_TOTAL, "result" => result, "store" => store).increment(1);
}

/// Count one lease renewal by its result.
pub(crate) fn lease_renewal(result: &'static str, store: &'static str) {
    metrics::counter!(LEASE_RENEWALS_TOTAL, "result" => result, "store" => store).increment(1);
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

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use metrics_util::MetricKind;

    use super::*;

    /// Every outcome, once. The match in [`expected`] fails to compile when a variant is
    /// added, so this list cannot silently miss one.
    const ALL: [Outcome; OUTCOMES] = [
        Outcome::Stored,
        Outcome::NotStored,
        Outcome::Replay,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::InvalidKey,
        Outcome::MissingKey,
        Outcome::PayloadTooLarge,
        Outcome::MissingTenant,
        Outcome::StoreUnavailable,
        Outcome::FailOpen,
        Outcome::Stale,
        Outcome::CompleteFailed,
        Outcome::BodyError,
        Outcome::ReplayNotAcceptable,
        Outcome::HandlerPanic,
        Outcome::RolledBack,
        Outcome::CommitFailed,
        Outcome::CommitUnknown,
        Outcome::Abandoned,
        Outcome::RequestBodyError,
        Outcome::ScopeTooLong,
    ];

    /// The documented label of each outcome and whether its handler ran.
    fn expected(outcome: Outcome) -> (&'static str, bool) {
        match outcome {
            Outcome::Stored => ("stored", true),
            Outcome::NotStored => ("not_stored", true),
            Outcome::Replay => ("replay", false),
            Outcome::Conflict => ("conflict", false),
            Outcome::Mismatch => ("mismatch", false),
            Outcome::InvalidKey => ("invalid_key", false),
            Outcome::MissingKey => ("missing_key", false),
            Outcome::PayloadTooLarge => ("payload_too_large", false),
            Outcome::MissingTenant => ("missing_tenant", false),
            Outcome::StoreUnavailable => ("store_unavailable", false),
            Outcome::FailOpen => ("fail_open", true),
            Outcome::Stale => ("stale", true),
            Outcome::CompleteFailed => ("complete_failed", true),
            Outcome::BodyError => ("body_error", true),
            Outcome::ReplayNotAcceptable => ("replay_not_acceptable", false),
            Outcome::HandlerPanic => ("handler_panic", true),
            Outcome::RolledBack => ("rolled_back", true),
            Outcome::CommitFailed => ("commit_failed", true),
            Outcome::CommitUnknown => ("commit_unknown", true),
            Outcome::Abandoned => ("abandoned", false),
            Outcome::RequestBodyError => ("request_body_error", false),
            Outcome::ScopeTooLong => ("scope_too_long", false),
        }
    }

    /// Every metric recorded so far (one read: the recorder resets counters it reports).
    pub(crate) type Metrics = Vec<(
        metrics_util::CompositeKey,
        Option<metrics::Unit>,
        Option<SharedString>,
        DebugValue,
    )>;

    pub(crate) fn read(snapshotter: &Snapshotter) -> Metrics {
        snapshotter.snapshot().into_vec()
    }

    /// The value of metric `name` of `kind` whose labels are exactly `labels`.
    pub(crate) fn value<'m>(
        metrics: &'m Metrics,
        kind: MetricKind,
        name: &str,
        labels: &[(&str, &str)],
    ) -> Option<&'m DebugValue> {
        metrics
            .iter()
            .find(|(key, _, _, _)| {
                let mut have: Vec<(&str, &str)> = key
                    .key()
                    .labels()
                    .map(|label| (label.key(), label.value()))
                    .collect();
                have.sort_unstable();
                let mut want = labels.to_vec();
                want.sort_unstable();
                key.kind() == kind && key.key().name() == name && have == want
            })
            .map(|(_, _, _, value)| value)
    }

    fn scope() -> Scope {
        Scope {
            tenant: "acct_1".into(),
            method: "POST".into(),
            path: "/payments".into(),
            key: "k1".into(),
        }
    }

    #[test]
    fn every_outcome_has_a_distinct_snake_case_label() {
        let mut labels = Vec::new();
        for outcome in ALL {
            let (label, _) = expected(outcome);
            assert_eq!(outcome.as_str(), label);
            assert!(
                label.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{label}"
            );
            labels.push(label);
        }
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), OUTCOMES, "two outcomes share a label");
        // The counter array is indexed by the discriminant: each variant has its own slot.
        for (index, outcome) in ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, index);
        }
    }

    #[test]
    fn ran_handler_is_true_exactly_for_the_outcomes_after_the_handler() {
        for outcome in ALL {
            assert_eq!(outcome.ran_handler(), expected(outcome).1, "{outcome:?}");
        }
        // The answers the middleware makes itself never ran the handler, apart from the
        // transactional ones (the handler ran and was rolled back).
        assert!(!Outcome::Replay.ran_handler());
        assert!(Outcome::FailOpen.ran_handler());
    }

    #[test]
    fn every_problem_maps_to_its_outcome() {
        for (code, outcome) in [
            (ProblemCode::MissingKey, Outcome::MissingKey),
            (ProblemCode::InvalidKey, Outcome::InvalidKey),
            (ProblemCode::KeyTooLong, Outcome::InvalidKey),
            (ProblemCode::ScopeTooLong, Outcome::ScopeTooLong),
            (ProblemCode::PayloadTooLarge, Outcome::PayloadTooLarge),
            (ProblemCode::FingerprintMismatch, Outcome::Mismatch),
            (ProblemCode::Conflict, Outcome::Conflict),
            (ProblemCode::StorageUnavailable, Outcome::StoreUnavailable),
            (ProblemCode::MissingTenant, Outcome::MissingTenant),
            (
                ProblemCode::ReplayNotAcceptable,
                Outcome::ReplayNotAcceptable,
            ),
            (ProblemCode::ResponseTooLarge, Outcome::RolledBack),
            (ProblemCode::CommitFailed, Outcome::CommitFailed),
            (ProblemCode::CommitOutcomeUnknown, Outcome::CommitUnknown),
        ] {
            assert_eq!(Outcome::of_problem(code), outcome, "{code}");
            // A problem answered before the handler never counts as a run, except the
            // transactional ones, which answer after it.
            let after_handler = matches!(
                code,
                ProblemCode::ResponseTooLarge
                    | ProblemCode::CommitFailed
                    | ProblemCode::CommitOutcomeUnknown
            );
            assert_eq!(
                Outcome::of_problem(code).ran_handler(),
                after_handler,
                "{code}"
            );
        }
    }

    #[test]
    fn methods_are_a_bounded_label_set() {
        for (method, label) in [
            (Method::POST, "POST"),
            (Method::PATCH, "PATCH"),
            (Method::PUT, "PUT"),
            (Method::DELETE, "DELETE"),
            (Method::GET, "GET"),
            (Method::HEAD, "other"),
            (Method::OPTIONS, "other"),
            (Method::TRACE, "other"),
            (Method::CONNECT, "other"),
        ] {
            assert_eq!(method_label(&method), label, "{method}");
        }
        let custom = Method::from_bytes(b"PURGE").unwrap_or(Method::OPTIONS);
        assert_eq!(custom.as_str(), "PURGE");
        assert_eq!(method_label(&custom), "other");
    }

    #[test]
    fn outcomes_are_counted_per_route_with_bounded_labels() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let meters = Meters::new("memory");
        metrics::with_local_recorder(&recorder, || {
            let route = meters.report(&Method::POST, Some("/payments/{id}".into()), None);
            route.outcome(Outcome::Stored, StatusCode::CREATED, Some(&scope()));
            route.outcome(Outcome::Replay, StatusCode::CREATED, Some(&scope()));
            route.outcome(Outcome::Replay, StatusCode::CREATED, None);
            // A second request on the same route reuses its counters.
            meters
                .report(&Method::POST, Some("/payments/{id}".into()), None)
                .outcome(Outcome::Replay, StatusCode::CREATED, None);
            meters
                .report(
                    &Method::from_bytes(b"PURGE").unwrap_or(Method::HEAD),
                    None,
                    None,
                )
                .outcome(Outcome::InvalidKey, StatusCode::BAD_REQUEST, None);
            meters.report(&Method::PATCH, None, None).outcome(
                Outcome::MissingKey,
                StatusCode::BAD_REQUEST,
                None,
            );
        });
        assert_eq!(
            meters.routes.borrow().len(),
            3,
            "one entry per (method, route)"
        );
        let metrics = read(&snapshotter);
        let count = |outcome: &str, method: &str, route: &str| match value(
            &metrics,
            MetricKind::Counter,
            REQUESTS_TOTAL,
            &[
                ("outcome", outcome),
                ("method", method),
                ("route", route),
                ("store", "memory"),
            ],
        ) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("not a counter: {other:?}"),
        };
        assert_eq!(count("stored", "POST", "/payments/{id}"), 1);
        assert_eq!(count("replay", "POST", "/payments/{id}"), 3);
        assert_eq!(count("invalid_key", "other", "unmatched"), 1);
        assert_eq!(count("missing_key", "PATCH", "unmatched"), 1);
        assert_eq!(count("stored", "PATCH", "unmatched"), 0);
        // Nothing else: no key, tenant or raw path ever becomes a label.
        let requests = metrics
            .iter()
            .filter(|(key, ..)| key.key().name() == REQUESTS_TOTAL)
            .count();
        assert_eq!(requests, 4, "{metrics:?}");
    }

    #[test]
    fn the_hook_sees_every_outcome_and_a_panicking_hook_is_contained() {
        /// What the hook saw of one event.
        type Seen = (Outcome, StatusCode, Option<Scope>);
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let sink = Arc::clone(&seen);
        let hook: Arc<Hook> = Arc::new(move |event: &OutcomeEvent<'_>| {
            if let Ok(mut seen) = sink.lock() {
                seen.push((event.outcome, event.status, event.scope.cloned()));
            }
        });
        let meters = Meters::new("memory");
        let report = meters.report(&Method::POST, Some("/p".into()), Some(hook));
        report.outcome(Outcome::Stored, StatusCode::CREATED, Some(&scope()));
        report
            .clone()
            .outcome(Outcome::MissingTenant, StatusCode::BAD_REQUEST, None);
        let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
        assert_eq!(
            seen,
            vec![
                (Outcome::Stored, StatusCode::CREATED, Some(scope())),
                (Outcome::MissingTenant, StatusCode::BAD_REQUEST, None),
            ]
        );

        // A hook that panics is caught; the report goes on and counts the outcome.
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let panicking: Arc<Hook> = Arc::new(move |_: &OutcomeEvent<'_>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            panic!("hook failure");
        });
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let meters = Meters::new("memory");
        metrics::with_local_recorder(&recorder, || {
            let report = meters.report(&Method::POST, None, Some(panicking));
            report.outcome(Outcome::Replay, StatusCode::OK, None);
            report.outcome(Outcome::Replay, StatusCode::OK, None);
        });
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
        let metrics = read(&snapshotter);
        assert!(matches!(
            value(
                &metrics,
                MetricKind::Counter,
                REQUESTS_TOTAL,
                &[
                    ("outcome", "replay"),
                    ("method", "POST"),
                    ("route", "unmatched"),
                    ("store", "memory"),
                ],
            ),
            Some(DebugValue::Counter(2))
        ));
    }

    #[tokio::test]
    async fn store_calls_held_reservations_and_complete_retries_are_recorded() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let meters = Meters::new("postgres");
        let (held_a, held_b) = metrics::with_local_recorder(&recorder, || {
            // Resolve the handles while the recorder is installed; they keep using it.
            for op in [Op::Reserve, Op::Complete, Op::Release] {
                let _ = meters.histogram(op);
            }
            complete_retry("started", "postgres");
            complete_retry("given_up", "postgres");
            complete_retry("given_up", "postgres");
            lease_renewal("renewed", "postgres");
            lease_renewal("lost", "postgres");
            lease_renewal("renewed", "postgres");
            (meters.held(), meters.held())
        });
        let answer = timed(meters.histogram(Op::Reserve), async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            42
        })
        .await;
        assert_eq!(answer, 42);
        let failed: Result<(), &str> =
            timed(meters.histogram(Op::Release), async { Err("x") }).await;
        assert_eq!(
            failed,
            Err("x"),
            "a failed call is timed and passed through"
        );
        drop(held_a);

        let metrics = read(&snapshotter);
        let histogram = |op: &str| match value(
            &metrics,
            MetricKind::Histogram,
            STORE_CALL_SECONDS,
            &[("op", op), ("store", "postgres")],
        ) {
            Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.0).collect(),
            None => Vec::new(),
            Some(other) => panic!("not a histogram: {other:?}"),
        };
        let reserve: Vec<f64> = histogram("reserve");
        assert_eq!(reserve.len(), 1, "{reserve:?}");
        assert!((0.015..10.0).contains(&reserve[0]), "{reserve:?}");
        assert_eq!(histogram("release").len(), 1);
        assert!(histogram("complete").is_empty());
        match value(
            &metrics,
            MetricKind::Gauge,
            RESERVATIONS_HELD,
            &[("store", "postgres")],
        ) {
            // Two taken, one dropped.
            Some(DebugValue::Gauge(held)) => assert_eq!(held.0, 1.0),
            other => panic!("{other:?}"),
        }
        let retries = |result: &str| match value(
            &metrics,
            MetricKind::Counter,
            COMPLETE_RETRIES_TOTAL,
            &[("result", result), ("store", "postgres")],
        ) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("not a counter: {other:?}"),
        };
        assert_eq!(retries("started"), 1);
        assert_eq!(retries("given_up"), 2);
        assert_eq!(retries("succeeded"), 0);
        let renewals = |result: &str| match value(
            &metrics,
            MetricKind::Counter,
            LEASE_RENEWALS_TOTAL,
            &[("result", result), ("store", "postgres")],
        ) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            Some(other) => panic!("not a counter: {other:?}"),
        };
        assert_eq!(renewals("renewed"), 2);
        assert_eq!(renewals("lost"), 1);
        assert_eq!(renewals("failed"), 0);

        // The debugging recorder zeroes a gauge when it is read, so the next read is the
        // change since: dropping the last guard takes exactly one off.
        drop(held_b);
        let metrics = read(&snapshotter);
        match value(
            &metrics,
            MetricKind::Gauge,
            RESERVATIONS_HELD,
            &[("store", "postgres")],
        ) {
            Some(DebugValue::Gauge(change)) => assert_eq!(change.0, -1.0),
            other => panic!("{other:?}"),
        }
    }
}
