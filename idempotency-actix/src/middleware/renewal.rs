//! Keeping a running handler's key (C9): lease renewal while the handler runs.
//!
//! A reservation's lease (`lock_timeout`) is what lets a retry take over the key of a holder
//! that crashed. Alone it cannot tell a crashed holder from a slow one: a payment handler
//! waiting longer than the lease for its provider would be run a second time by the client's
//! retry. So while the handler runs, a heartbeat renews the lease every third of it through
//! [`IdempotencyStore::renew_lease`], fenced by the token. A process that dies stops renewing,
//! and its key is free one lease later, as before. Renewal ends `renew_lease_up_to` after the
//! reservation, its last lease ending exactly then, so a hung handler frees its key too.
//!
//! The heartbeat is a task of its own, started only when the handler does not finish on its
//! first poll: a handler that answers at once (most replays never get here; a quick miss on
//! `MemoryStore`) costs no task, no timer and no copy of the scope. A handler that answers at
//! once with a streamed body it produces slowly (C24) starts it the first time a chunk is not
//! ready: the key is held until the body has ended (a slow client does not hold the body up:
//! see `forward`). It
//! goes on while the response is stored ([`Renewal::storing`]: a `complete` stuck on one
//! connection must not outlast the lease) and stops once it is (or just before the key is
//! released, or left to its lease): a renewal still on its way may then land after the record
//! was completed, and its `Stale` answer is not reported as a lost lease. A renewal in
//! flight is never cut short (a store call dropped halfway can leave a pooled connection
//! behind a statement nobody reads): each runs on a task of its own, and ends after the
//! heartbeat if it must.
//!
//! Renewals are paced from the start of the last one that succeeded. One that fails is tried
//! again soon (a tenth of the interval), not a whole interval later: with the default 60 s
//! lease, two failures a full interval apart would already lose the key to a store blip of
//! half a minute. One that does not answer within that tenth gets a companion, up to three in
//! flight: a call stuck on one half-dead connection (until the store's own timeout, 7 s with
//! `PostgresStore`'s defaults) used to hold every later renewal back while the lease ran out,
//! and a retry ran the handler again with the database answering everything else. It runs on
//! the worker's thread, beside the handler: a handler that blocks that thread (synchronous I/O
//! without `web::block`) starves it like every other request on the worker.

use std::cell::Cell;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use metrics::Histogram;
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::config::saturating_deadline;
use crate::outcome::{self, Meters, Op};
use crate::store::{IdempotencyStore, ReservationToken, Scope, WriteOutcome};

/// The shortest pause between two renewals, whatever the lease: a lease of a few
/// milliseconds must not turn the heartbeat into a busy loop against the store.
const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// A lease shorter than this is not renewed: with renewals at least [`MIN_INTERVAL`] apart it
/// would end between two of them anyway.
const MIN_RENEWED_LEASE: Duration = Duration::from_millis(30);

/// What the heartbeat needs to renew one reservation: its own copy of a [`Reservation`].
struct Lease<S> {
    store: Arc<S>,
    /// `idempotency_store_call_seconds{op="renew_lease"}`.
    timer: Histogram,
    scope: Scope,
    token: ReservationToken,
    /// The lease each renewal grants (`lock_timeout`).
    lease: Duration,
    /// How long after the reservation renewal goes on (`renew_lease_up_to`).
    limit: Duration,
    /// When the key was reserved.
    reserved_at: Instant,
    /// Set while the response is being stored: a renewal that finds the record no longer in
    /// flight then met the request's own `complete`, not a takeover.
    storing: Rc<Cell<bool>>,
}

/// The reservation a request holds, borrowed from it until a heartbeat needs its own copy.
pub(super) struct Reservation<'a, S> {
    pub(super) store: &'a Arc<S>,
    /// This worker's metric handles (renewals are timed like every store call).
    pub(super) meters: &'a Meters,
    pub(super) scope: &'a Scope,
    pub(super) token: ReservationToken,
    /// The lease each renewal grants (`lock_timeout`).
    pub(super) lease: Duration,
    /// How long after the reservation renewal goes on (`renew_lease_up_to`).
    pub(super) limit: Duration,
    /// When the key was reserved.
    pub(super) reserved_at: Instant,
}

/// The renewal of one request's lease, from the reservation until its response is about to
/// be stored (or its key released, or left to its lease). The heartbeat starts the first time
/// the work it watches does not finish on its first poll: the handler, and for a streamed
/// body each chunk read from it. Dropping this stops it.
pub(super) struct Renewal<'a, S> {
    /// What to renew, until the heartbeat starts.
    due: Option<Reservation<'a, S>>,
    /// The running heartbeat ends when this is dropped (its receiver sees it closed).
    running: Option<oneshot::Sender<()>>,
    /// When the last lease ends: `renew_lease_up_to` (or the first lease, if longer) after
    /// the reservation.
    hold_until: Instant,
    /// Whether the response is being stored ([`Self::storing`]).
    storing: bool,
    /// The same, shared with the heartbeat once it runs (see [`Lease::storing`]): made only
    /// then, so a request that needs no heartbeat allocates nothing for it.
    storing_shared: Option<Rc<Cell<bool>>>,
}

impl<'a, S: IdempotencyStore> Renewal<'a, S> {
    /// Renewal of `reservation`, not started yet.
    pub(super) fn new(reservation: Reservation<'a, S>) -> Self {
        // Without a heartbeat (a store that cannot renew, a lease too short to renew) the
        // key is held for its first lease only.
        let renewable = reservation.lease >= MIN_RENEWED_LEASE && reservation.store.renews_leases();
        let held = if renewable {
            reservation.limit.max(reservation.lease)
        } else {
            reservation.lease
        };
        Renewal {
            hold_until: saturating_deadline(reservation.reserved_at, held),
            due: Some(reservation),
            running: None,
            storing: false,
            storing_shared: None,
        }
    }

    /// Run `work` to its end, starting the heartbeat if it does not finish on its first poll.
    pub(super) async fn during<F: Future>(&mut self, work: F) -> F::Output {
        let mut work = pin!(work);
        poll_fn(|cx| {
            let poll = work.as_mut().poll(cx);
            if poll.is_pending() {
                if let Some(due) = self.due.take() {
                    self.running = heartbeat(Lease {
                        store: Arc::clone(due.store),
                        timer: due.meters.histogram(Op::RenewLease).clone(),
                        scope: due.scope.clone(),
                        token: due.token,
                        lease: due.lease,
                        limit: due.limit,
                        reserved_at: due.reserved_at,
                        storing: Rc::clone(
                            self.storing_shared.insert(Rc::new(Cell::new(self.storing))),
                        ),
                    });
                }
            }
            poll
        })
        .await
    }

    /// When the key's last lease ends, renewed or not.
    pub(super) fn hold_until(&self) -> Instant {
        self.hold_until
    }

    /// Store the response with `store` while renewals go on, then stop them. Storing gets no
    /// lease of its own otherwise: a `complete` stuck on one connection until the store's
    /// timeout (7 s with `PostgresStore`'s defaults) could outlast what is left of the lease,
    /// and a retry after it would run the handler again (found by review, 2026-12-04). A
    /// renewal that meets the stored record answers `Stale`, which is then no alarm.
    ///
    /// `store` comes pinned, in the caller's state: taken by value, the future was held three
    /// times in this one's (the argument, the pinned copy polled, the argument awaited on the
    /// other path), 1,152 bytes where 192 do, in the work of every keyed request
    /// (`docs/benchmarks.md`, "The storing future held three times").
    pub(super) async fn storing<F: Future>(&mut self, mut store: Pin<&mut F>) -> F::Output {
        self.storing = true;
        if let Some(shared) = &self.storing_shared {
            shared.set(true);
        }
        let first_due = self
            .due
            .as_ref()
            .map(|due| saturating_deadline(due.reserved_at, interval(due.lease)));
        let stored = match first_due {
            // The handler answered at once, so no heartbeat runs: start one only if storing
            // still goes on when the first renewal is due (a stuck call), not a task for
            // every request that stores at once.
            Some(first_due) => {
                // Most stores answer on the first poll (memory, cache): no timer for those.
                match poll_fn(|cx| Poll::Ready(store.as_mut().poll(cx))).await {
                    Poll::Ready(stored) => stored,
                    Poll::Pending => tokio::select! {
                        biased;
                        stored = &mut store => stored,
                        () = tokio::time::sleep_until(first_due.into()) => {
                            self.during(store).await
                        }
                    },
                }
            }
            // Renewing already (it goes on meanwhile), or nothing to renew.
            None => store.await,
        };
        self.stop();
        stored
    }

    /// Stop renewing: the response is about to be stored, or the key released or left to its
    /// lease. A renewal still on its way then answers `Stale` without a false alarm.
    pub(super) fn stop(&mut self) {
        self.due = None;
        self.running = None;
    }
}

/// Start the heartbeat of `lease`, or nothing when renewal is off, the store cannot renew, the
/// lease is too short to renew, or the first lease already reaches the limit.
fn heartbeat<S: IdempotencyStore>(lease: Lease<S>) -> Option<oneshot::Sender<()>> {
    if lease.limit <= lease.lease || lease.lease < MIN_RENEWED_LEASE || !lease.store.renews_leases()
    {
        return None;
    }
    let (running, stopped) = oneshot::channel::<()>();
    actix_rt::spawn(beat(lease, stopped).in_current_span());
    Some(running)
}

/// Renewal calls of one heartbeat in flight at once, at most. A call that hangs (a statement
/// stuck on one half-dead pooled connection: up to the store's own timeouts, 7 s for
/// `PostgresStore`'s defaults) must not keep the next one from being sent while the lease runs
/// out, the database being fine otherwise; and a store slow for every call must not be sent
/// an ever-growing number of them (each may hold a pooled connection).
pub(super) const MAX_RENEWALS_IN_FLIGHT: usize = 3;

/// How often a lease of `lease` is renewed: every third of it, never more often than
/// [`MIN_INTERVAL`].
pub(super) fn interval(lease: Duration) -> Duration {
    (lease / 3).max(MIN_INTERVAL)
}

/// What one renewal call answered, with when it was sent and the lease it asked for.
type Renewed = (Instant, Duration, Result<WriteOutcome, String>);

/// Renew `lease` until `stopped` closes, the limit is reached, or the reservation is lost.
///
/// Each call runs on a task of its own, so that it is never cut short, and the heartbeat does
/// not wait for it: if it has not answered a retry's pause after it was sent, the next one is
/// sent beside it (at most [`MAX_RENEWALS_IN_FLIGHT`]). Fenced by the token, and each granting
/// its lease from the store's own clock when it runs, a late call can only extend the
/// reservation it was sent for, never shorten it or touch another.
async fn beat<S: IdempotencyStore>(lease: Lease<S>, mut stopped: oneshot::Receiver<()>) {
    let interval = interval(lease.lease);
    let retry = (interval / 10).max(MIN_INTERVAL);
    let hold_until = saturating_deadline(lease.reserved_at, lease.limit);
    let name = lease.store.name();
    let lease = Rc::new(lease);
    let mut next = saturating_deadline(lease.reserved_at, interval);
    // When the latest call that renewed the lease was sent: older answers change nothing.
    let mut renewed_at: Option<Instant> = None;
    let mut in_flight = FuturesUnordered::new();
    loop {
        let answer: Renewed = tokio::select! {
            _ = &mut stopped => return,
            Some(answer) = in_flight.next(), if !in_flight.is_empty() => answer,
            () = tokio::time::sleep_until(tokio::time::Instant::from_std(next)),
                if in_flight.len() < MAX_RENEWALS_IN_FLIGHT => {
                let started = Instant::now();
                // The last renewal ends the lease at the limit, not past it; at the limit
                // itself the handler is still running (else `stopped` would have ended this).
                let grant = lease
                    .lease
                    .min(hold_until.saturating_duration_since(started));
                if grant.is_zero() {
                    outcome::lease_renewal("limit", name);
                    tracing::info!(target: "idempotency_actix", outcome = "lease_limit", "the handler is still running at renew_lease_up_to: its last lease has ended and is not renewed, so a retry may now take the key over");
                    return;
                }
                in_flight.push(send(Rc::clone(&lease), started, grant));
                // Unanswered by then, it gets a companion.
                next = saturating_deadline(started, retry);
                continue;
            }
        };
        let (started, grant, renewed) = answer;
        let latest = renewed_at.is_none_or(|at| started > at);
        let handler_done = !matches!(stopped.try_recv(), Err(oneshot::error::TryRecvError::Empty));
        match renewed {
            Ok(WriteOutcome::Applied) if latest => {
                renewed_at = Some(started);
                outcome::lease_renewal("renewed", name);
                tracing::debug!(target: "idempotency_actix", lease_ms = grant.as_millis(), "lease renewed");
                // After the last renewal (cut to end at the limit), wake at the limit.
                next = if grant < lease.lease {
                    hold_until
                } else {
                    saturating_deadline(started, interval)
                };
            }
            // An older call than one that already renewed: its lease ends sooner.
            Ok(WriteOutcome::Applied) => {}
            // Completed or released by the request itself a moment ago: nothing was lost.
            Ok(WriteOutcome::Stale) if handler_done || lease.storing.get() => return,
            Ok(WriteOutcome::Stale) => {
                outcome::lease_renewal("lost", name);
                tracing::warn!(target: "idempotency_actix", outcome = "lease_lost", "the handler is still running but its reservation was taken over or released (its lease ended while renewals failed, or an operator released it); its response will not be stored");
                return;
            }
            Err(error) if latest => {
                outcome::lease_renewal("failed", name);
                tracing::warn!(target: "idempotency_actix", outcome = "store_error", %error, "could not renew the lease; trying again shortly");
                next = next.min(saturating_deadline(Instant::now(), retry));
            }
            // An older call than one that already renewed: its failure changes nothing, and
            // is not counted (docs/operations.md; review, 2026-12-06: it was).
            Err(error) => {
                tracing::debug!(target: "idempotency_actix", outcome = "store_error", %error, "a renewal older than the last one that succeeded failed late; nothing to do");
            }
        }
        if handler_done {
            return;
        }
    }
}

/// One renewal call, sent at `started` for `grant`, on a task of its own: it runs to its end
/// even if the heartbeat stops meanwhile (a store call dropped halfway can leave a pooled
/// connection behind a statement nobody reads).
fn send<S: IdempotencyStore>(
    lease: Rc<Lease<S>>,
    started: Instant,
    grant: Duration,
) -> impl Future<Output = Renewed> {
    let call = actix_rt::spawn(
        async move {
            let call = lease.store.renew_lease(&lease.scope, &lease.token, grant);
            outcome::timed(&lease.timer, call).await
        }
        .in_current_span(),
    );
    async move {
        let renewed = match call.await {
            Ok(result) => result.map_err(|error| error.to_string()),
            Err(_) => Err("the renewal's task ended without an answer".to_owned()),
        };
        (started, grant, renewed)
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    use super::*;
    use crate::outcome::tests::{read, value};
    use crate::outcome::LEASE_RENEWALS_TOTAL;
    use crate::store::{Fingerprint, MemoryStore, ReserveOutcome};

    /// A handler still running at `renew_lease_up_to` is counted (`limit`) when its last lease
    /// ends, after renewals up to the limit, and its key is then free for a retry. The last
    /// renewal (its lease cut to end at the limit) used to end the heartbeat, so the limit was
    /// never reported.
    #[actix_rt::test]
    async fn a_handler_still_running_at_the_limit_is_reported() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _local = metrics::set_default_local_recorder(&recorder);
        let store = Arc::new(MemoryStore::new());
        let scope = Scope {
            tenant: "t".into(),
            method: "POST".into(),
            path: "/p".into(),
            key: "k".into(),
        };
        let fingerprint = Fingerprint([7; 32]);
        let lease = Duration::from_millis(200);
        let reserved_at = Instant::now();
        let Ok(ReserveOutcome::Reserved { token }) =
            store.reserve(&scope, &fingerprint, lease).await
        else {
            panic!("not reserved");
        };
        let (running, stopped) = oneshot::channel();
        let renewal = Lease {
            store: Arc::clone(&store),
            timer: Histogram::noop(),
            scope: scope.clone(),
            token,
            lease,
            limit: Duration::from_millis(600),
            reserved_at,
            storing: Rc::default(),
        };
        beat(renewal, stopped).await; // the handler (`running`) has not finished
        assert!(reserved_at.elapsed() >= Duration::from_millis(600));
        let metrics = read(&snapshotter);
        let count = |result: &str| match value(
            &metrics,
            MetricKind::Counter,
            LEASE_RENEWALS_TOTAL,
            &[("result", result), ("store", "memory")],
        ) {
            Some(DebugValue::Counter(n)) => *n,
            _ => 0,
        };
        assert_eq!(count("limit"), 1);
        assert!(count("renewed") >= 3, "renewed {}", count("renewed"));
        assert_eq!(count("lost") + count("failed"), 0);
        match store.reserve(&scope, &fingerprint, lease).await {
            Ok(ReserveOutcome::Reserved { .. }) => {}
            other => panic!("the key was held past the limit: {other:?}"),
        }
        drop(running);
    }

    /// A renewal that fails after a later one already renewed changes nothing and is not
    /// counted as `failed` (docs/operations.md: only the answers the renewal acted on are).
    #[actix_rt::test]
    async fn a_late_failure_of_an_older_renewal_is_not_counted() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _local = metrics::set_default_local_recorder(&recorder);
        // The first renewal fails 250 ms after it was sent; its companion renews meanwhile.
        let store = FirstRenewalHangs::new(Duration::from_millis(250));
        let scope = pay("late");
        let fingerprint = Fingerprint([7; 32]);
        let lease = Duration::from_millis(300);
        let reserved_at = Instant::now();
        let Ok(ReserveOutcome::Reserved { token }) =
            store.reserve(&scope, &fingerprint, lease).await
        else {
            panic!("not reserved");
        };
        let (running, stopped) = oneshot::channel();
        let renewal = Lease {
            store: Arc::clone(&store),
            timer: Histogram::noop(),
            scope: scope.clone(),
            token,
            lease,
            limit: Duration::from_millis(700),
            reserved_at,
            storing: Rc::default(),
        };
        beat(renewal, stopped).await;
        let metrics = read(&snapshotter);
        let count = |result: &str| match value(
            &metrics,
            MetricKind::Counter,
            LEASE_RENEWALS_TOTAL,
            &[("result", result), ("store", "custom")],
        ) {
            Some(DebugValue::Counter(n)) => *n,
            _ => 0,
        };
        assert!(count("renewed") >= 1, "renewed {}", count("renewed"));
        assert_eq!(
            count("failed"),
            0,
            "the late failure of the first call was counted"
        );
        drop(running);
    }

    /// A handler that does not finish on its first poll starts the heartbeat, whose renewals
    /// are timed in `idempotency_store_call_seconds{op="renew_lease"}` like every store call,
    /// and keep the key past its first lease; one that finishes at once starts nothing.
    #[actix_rt::test]
    async fn renewals_run_while_the_work_waits_and_are_timed() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _local = metrics::set_default_local_recorder(&recorder);
        let store = Arc::new(MemoryStore::new());
        let meters = Meters::new("memory");
        let scope = Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/p".into(),
            key: "timed".into(),
        };
        let fingerprint = Fingerprint([3; 32]);
        let lease = Duration::from_millis(90);
        let Ok(ReserveOutcome::Reserved { token }) =
            store.reserve(&scope, &fingerprint, lease).await
        else {
            panic!("not reserved");
        };
        let mut renewal = Renewal::new(Reservation {
            store: &store,
            meters: &meters,
            scope: &scope,
            token,
            lease,
            limit: Duration::from_secs(60),
            reserved_at: Instant::now(),
        });
        renewal.during(async {}).await;
        assert!(
            renewal.running.is_none(),
            "a finished handler started a heartbeat"
        );
        renewal
            .during(tokio::time::sleep(Duration::from_millis(400)))
            .await;
        assert!(
            matches!(
                store.reserve(&scope, &fingerprint, lease).await,
                Ok(ReserveOutcome::InFlight { .. })
            ),
            "the key was not kept past its first lease"
        );
        renewal.stop();
        let metrics = read(&snapshotter);
        let timed = match value(
            &metrics,
            MetricKind::Histogram,
            crate::outcome::STORE_CALL_SECONDS,
            &[("op", "renew_lease"), ("store", "memory")],
        ) {
            Some(DebugValue::Histogram(samples)) => samples.len(),
            _ => 0,
        };
        assert!(timed >= 3, "{timed} renewals timed");
    }

    /// Leases and limits at the clock's edge neither panic nor spin: a lease of 400 days
    /// renewed up to `Duration::MAX` sleeps (its first renewal is months away) and ends when
    /// the handler does.
    #[actix_rt::test]
    async fn extreme_leases_neither_panic_nor_spin() {
        let store = Arc::new(MemoryStore::new());
        let scope = Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/p".into(),
            key: "far".into(),
        };
        let lease = Duration::from_secs(400 * 24 * 3600);
        let Ok(ReserveOutcome::Reserved { token }) =
            store.reserve(&scope, &Fingerprint([1; 32]), lease).await
        else {
            panic!("not reserved");
        };
        let (running, stopped) = oneshot::channel();
        let renewal = Lease {
            store,
            timer: Histogram::noop(),
            scope,
            token,
            lease,
            limit: Duration::MAX,
            reserved_at: Instant::now(),
            storing: Rc::default(),
        };
        let beating = actix_rt::spawn(beat(renewal, stopped));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!beating.is_finished(), "the heartbeat ended on its own");
        drop(running);
        let ended = tokio::time::timeout(Duration::from_secs(5), beating).await;
        assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
    }

    /// A store whose first renewal hangs (one stuck pooled connection; with PostgresStore's
    /// defaults a call may take connection_timeout + query_timeout = 7 s before failing) while
    /// every other call works at once (found by review, 2026-12-04). The database is up the
    /// whole time and the handler alive; the heartbeat used to wait on the one call and send
    /// nothing else, the lease ran out, and a retry of the same request took the key over: a
    /// second run.
    struct FirstRenewalHangs {
        inner: MemoryStore,
        hang: Duration,
        renewals: std::sync::atomic::AtomicUsize,
    }

    impl IdempotencyStore for FirstRenewalHangs {
        async fn reserve(
            &self,
            scope: &Scope,
            fingerprint: &Fingerprint,
            lease: Duration,
        ) -> Result<ReserveOutcome, crate::store::StoreError> {
            self.inner.reserve(scope, fingerprint, lease).await
        }
        async fn complete(
            &self,
            scope: &Scope,
            token: &ReservationToken,
            response: &crate::store::StoredResponse,
            ttl: Duration,
        ) -> Result<WriteOutcome, crate::store::StoreError> {
            self.inner.complete(scope, token, response, ttl).await
        }
        async fn release(
            &self,
            scope: &Scope,
            token: &ReservationToken,
        ) -> Result<WriteOutcome, crate::store::StoreError> {
            self.inner.release(scope, token).await
        }
        async fn renew_lease(
            &self,
            scope: &Scope,
            token: &ReservationToken,
            lease: Duration,
        ) -> Result<WriteOutcome, crate::store::StoreError> {
            let n = self
                .renewals
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n == 0 {
                // A statement on a half-dead connection: no answer until the query timeout.
                tokio::time::sleep(self.hang).await;
                return Err(crate::store::StoreError::unavailable("query timeout"));
            }
            self.inner.renew_lease(scope, token, lease).await
        }
        fn renews_leases(&self) -> bool {
            true
        }
        async fn purge_expired(&self, grace: Duration) -> Result<u64, crate::store::StoreError> {
            self.inner.purge_expired(grace).await
        }
    }

    impl FirstRenewalHangs {
        /// A store whose first renewal takes `hang` to fail.
        fn new(hang: Duration) -> Arc<Self> {
            Arc::new(FirstRenewalHangs {
                inner: MemoryStore::new(),
                hang,
                renewals: std::sync::atomic::AtomicUsize::new(0),
            })
        }

        fn renewals(&self) -> usize {
            self.renewals.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// `key` on `POST /pay` in the global scope.
    fn pay(key: &str) -> Scope {
        Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/pay".into(),
            key: key.into(),
        }
    }

    /// Reserve `scope` for `lease` and its renewal (up to 600 s), not started yet.
    async fn reserved<'a>(
        store: &'a Arc<FirstRenewalHangs>,
        meters: &'a Meters,
        scope: &'a Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> (Renewal<'a, FirstRenewalHangs>, ReservationToken) {
        let reserved_at = Instant::now();
        let Ok(ReserveOutcome::Reserved { token }) = store.reserve(scope, fingerprint, lease).await
        else {
            panic!("not reserved");
        };
        let renewal = Renewal::new(Reservation {
            store,
            meters,
            scope,
            token,
            lease,
            limit: Duration::from_secs(600),
            reserved_at,
        });
        (renewal, token)
    }

    /// What a retry of the same request, 400 ms after the reservation, gets while the handler
    /// (700 ms) is still running and the first renewal takes `hang` to fail.
    async fn retry_while_first_renewal_hangs(
        hang: Duration,
    ) -> Result<ReserveOutcome, crate::store::StoreError> {
        // Scaled down 20x: a 6 s lease (interval 2 s) and a renewal stuck for PostgresStore's
        // default 2 s + 5 s become 300 ms and 350 ms.
        let store = FirstRenewalHangs::new(hang);
        let meters = Meters::new("memory");
        let scope = pay("hung");
        let fingerprint = Fingerprint([9; 32]);
        let lease = Duration::from_millis(300);
        let (mut renewal, _) = reserved(&store, &meters, &scope, &fingerprint, lease).await;
        // The handler: alive, waiting 700 ms for its payment provider. Meanwhile the client's
        // retry (same request, same key) arrives at 400 ms.
        let retry = {
            let store = Arc::clone(&store);
            let scope = scope.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(400)).await;
                store.reserve(&scope, &fingerprint, lease).await
            }
        };
        let (_, retried) = tokio::join!(
            renewal.during(tokio::time::sleep(Duration::from_millis(700))),
            retry
        );
        renewal.stop();
        retried
    }

    /// Control: the same failure answered at once is retried a tenth of an interval later and
    /// the key is kept.
    #[actix_rt::test]
    async fn a_quick_renewal_failure_keeps_the_key() {
        let retried = retry_while_first_renewal_hangs(Duration::ZERO).await;
        assert!(
            matches!(retried, Ok(ReserveOutcome::InFlight { .. })),
            "{retried:?}"
        );
    }

    #[actix_rt::test]
    async fn one_hung_renewal_does_not_lose_a_live_handlers_key() {
        let retried = retry_while_first_renewal_hangs(Duration::from_millis(350)).await;
        assert!(
            matches!(retried, Ok(ReserveOutcome::InFlight { .. })),
            "a live handler's key was taken over (second run) after one hung renewal: {retried:?}"
        );
    }

    /// A handler that answers at once starts no heartbeat; if storing its response then takes
    /// longer than the first renewal's due time (a `complete` stuck on one connection), the
    /// heartbeat starts and keeps the key past the first lease. A store that answers at once
    /// starts nothing.
    #[actix_rt::test]
    async fn storing_that_outlasts_the_first_renewal_keeps_the_key() {
        let store = FirstRenewalHangs::new(Duration::ZERO);
        let meters = Meters::new("memory");
        let scope = pay("storing");
        let fingerprint = Fingerprint([5; 32]);
        let lease = Duration::from_millis(150);
        for (storing_for, renewed) in [(Duration::ZERO, false), (Duration::from_millis(400), true)]
        {
            let before = store.renewals();
            let (mut renewal, token) = reserved(&store, &meters, &scope, &fingerprint, lease).await;
            // The handler answered at once: no heartbeat yet.
            renewal.during(std::future::ready(())).await;
            assert!(renewal.running.is_none());
            // What a retry of the same request gets at the end of storing.
            let retried = renewal
                .storing(pin!(async {
                    tokio::time::sleep(storing_for).await;
                    store.reserve(&scope, &fingerprint, lease).await
                }))
                .await;
            assert_eq!(
                store.renewals() > before,
                renewed,
                "storing for {storing_for:?}"
            );
            if renewed {
                // Past the first lease, the key is still this request's: the retry is refused
                // (in flight), not given the key to run the handler again.
                assert!(
                    matches!(retried, Ok(ReserveOutcome::InFlight { .. })),
                    "{retried:?}"
                );
            }
            let _ = store.release(&scope, &token).await;
        }
    }
}
