//! Stopping a server without cutting the work the middleware runs past its clients.
//!
//! From the reservation on, a request's work runs on a task of its own (C21), so that a client
//! that hangs up cannot cut the handler between its effect and the stored record. Two kinds of
//! such tasks can outlive their client: a handler whose client reset its connection, and the
//! background retry of a `complete` (or `release`) that failed after the client had its answer
//! (C16). actix-web's own graceful stop does not know them: each worker waits for its *open
//! connections* (up to `shutdown_timeout`) and then drops its runtime with every task on it.
//! A worker whose last client has gone stops at once, so a stop during a deploy cut such a
//! handler mid-run (its card charged, its record still a reservation) or dropped the retry
//! that would have stored a delivered response; either way the reservation was left to its
//! lease, and the client's retry after it, on the next instance, ran the handler again.
//!
//! This module counts those tasks (process-wide: every `Idempotency` built in the process,
//! whichever worker built it) and stops a server only once they have ended:
//!
//! ```no_run
//! use std::time::Duration;
//! use actix_web::{web, App, HttpResponse, HttpServer};
//! use idempotency_actix::{shutdown, store::MemoryStore, Idempotency};
//!
//! #[actix_web::main]
//! async fn main() -> std::io::Result<()> {
//!     let store = MemoryStore::new();
//!     let server = HttpServer::new(move || {
//!         App::new()
//!             .wrap(Idempotency::new(store.clone()))
//!             .route("/payments", web::post().to(|| async { HttpResponse::Created().finish() }))
//!     })
//!     .disable_signals() // SIGINT and SIGTERM are handled below instead
//!     .bind("127.0.0.1:8080")?
//!     .run();
//!     shutdown::stop_on_signal(server.handle(), Duration::from_secs(60));
//!     server.await
//! }
//! ```
//!
//! [`stop_gracefully`] (what [`stop_on_signal`] runs on the first SIGINT or SIGTERM) stops
//! accepting connections, waits up to its limit for the counted work to end, then asks actix
//! for its own graceful stop, which waits for the connections still open. Why a limit: the
//! background retries last until their lease ends while the store stays down, and a deploy
//! must not hang on a dead database; work cut at the limit is cut as by a crash (its
//! reservation is left to its lease, C16). A second signal skips what is left of the wait and
//! stops at once.
//!
//! **The whole stop lasts up to the limit plus actix's `shutdown_timeout`** (30 s by default):
//! after the wait, actix's graceful stop still waits for the connections left open (a request
//! outside the middleware's count, a client sending its body slowly or not at all). Keep the sum
//! below what your orchestrator allows before it kills (Kubernetes'
//! `terminationGracePeriodSeconds`, 30 s by default), and the limit above your slowest handler:
//! the example uses 20 s for the wait and `HttpServer::shutdown_timeout(8)`. A handler longer
//! than the limit whose client is still connected is then waited for by actix up to its own
//! timeout, and cut after it (found by review, 2026-12-05: 39 s and 50 s stops before the
//! example set both).
//!
//! Counted: a request's work from its reservation on, while it runs on a task of its own
//! (whether its client is still connected or not), and the background retries of a `complete`
//! and of a `release` (C16; the second was not counted until a review of 2026-12-06 found that
//! a stop then left the key of a response that was not stored held, answering the client's
//! corrected retry 409 until the lease ended). Not counted: the stores' own background
//! give-backs of a reservation a failed reserve may have made, which no client was told
//! about (each leaves the key to its lease, answering 409 meanwhile, and never runs anything
//! twice); and a streamed response's last bytes waiting for a slow client once the response is
//! stored or given up (too large to store: the rest of its body). The idempotent work is done:
//! actix's graceful stop waits for that connection, and a client cut there gets a failed body,
//! never one that looks whole unless it already had every byte its `Content-Length` declares.
//! (Until reviews of 2026-12-06, for a stored response, and 2026-12-07, for one too large to
//! store, such a client held the wait for its whole limit.)
//!
//! What stays open: after the wait, a request that arrives on a connection that was already
//! open (keep-alive) and whose client then hangs up mid-handler can still be cut when actix
//! stops the worker. Shorten `HttpServer::keep_alive` or drain the instance at the load
//! balancer first to close that window. And nothing here helps a process that is killed
//! (SIGKILL, a crash): that is the lease's job.
//!
//! Home-made because no crate offers it: actix-web's graceful stop counts connections, not
//! tasks, and the count has to be taken where the tasks are spawned.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_web::dev::ServerHandle;
use tokio::sync::Notify;

/// The work in flight, process-wide.
static UNFINISHED: Unfinished = Unfinished {
    count: AtomicUsize::new(0),
    ended: Notify::const_new(),
};

struct Unfinished {
    count: AtomicUsize,
    /// Notified whenever the count drops to zero.
    ended: Notify,
}

/// One unit of counted work: counted from [`track`] until dropped (with its task, whether the
/// task ended or its runtime dropped it).
#[must_use = "the work is counted only while this is alive"]
pub(crate) struct Tracked(());

/// Count one unit of work until the returned guard is dropped. Take it before spawning the
/// task and move it into the task, so that no moment exists in which the work runs uncounted.
pub(crate) fn track() -> Tracked {
    UNFINISHED.count.fetch_add(1, Ordering::SeqCst);
    Tracked(())
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if UNFINISHED.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            UNFINISHED.ended.notify_waiters();
        }
    }
}

/// The number of counted tasks right now (see the module docs): requests' work from their
/// reservation on, running on tasks of their own, and background retries of a `complete` or a
/// `release`.
pub fn unfinished_work() -> usize {
    UNFINISHED.count.load(Ordering::SeqCst)
}

/// Wait until no counted work is left, or `within` has passed; `true` when none is left.
pub async fn work_finished(within: Duration) -> bool {
    let waited = tokio::time::timeout(within, async {
        loop {
            let ended = UNFINISHED.ended.notified();
            tokio::pin!(ended);
            // Registered before the count is read, so a drop to zero between the read and the
            // wait is not missed.
            ended.as_mut().enable();
            if unfinished_work() == 0 {
                return;
            }
            ended.await;
        }
    })
    .await;
    waited.is_ok()
}

/// Stop `server` without cutting counted work: stop accepting connections, wait up to
/// `within` for the work to end ([`work_finished`]), then ask actix for its graceful stop
/// (which waits for the open connections, up to `HttpServer::shutdown_timeout`). Completes
/// when the server has stopped. Logs at `warn` how much work the limit cut.
pub async fn stop_gracefully(server: &ServerHandle, within: Duration) {
    server.pause().await;
    finish_then_stop(server, within, std::future::pending()).await;
}

/// Wait for the counted work (up to `within`), then ask actix for its graceful stop; if `skip`
/// completes first (a second signal), stop at once instead: actix's graceful stop would wait
/// for the very connections the operator has just asked not to wait for (up to its
/// `shutdown_timeout`), and once begun it cannot be turned into an immediate one.
async fn finish_then_stop(
    server: &ServerHandle,
    within: Duration,
    skip: impl std::future::Future<Output = ()>,
) {
    let left = unfinished_work();
    if left > 0 {
        tracing::info!(target: "idempotency_actix", unfinished = left, "stopping: waiting for idempotent work in flight to end");
    }
    let (finished, skipped) = tokio::select! {
        finished = work_finished(within) => (finished, false),
        () = skip => (unfinished_work() == 0, true),
    };
    if !finished {
        tracing::warn!(target: "idempotency_actix", unfinished = unfinished_work(), "stopping with idempotent work still in flight: its reservations are left to their leases");
    }
    server.stop(!skipped).await;
}

/// On the first SIGINT or SIGTERM (Ctrl-C only, off Unix), run [`stop_gracefully`] with
/// `within`; a second signal during that wait stops the server at once (actix's forced stop:
/// open connections are closed, work still in flight is cut as by a crash and left to its
/// lease). A signal after the wait, during actix's own graceful stop, is not acted on: that
/// stop is bounded by `HttpServer::shutdown_timeout` (30 s by default). Spawns a task on
/// the current runtime (actix's, or any Tokio runtime) and returns at once. Build the server
/// with `HttpServer::disable_signals()`, or actix stops it on the first signal by itself.
///
/// # Panics
/// When called outside a Tokio runtime (`#[actix_web::main]` provides one).
pub fn stop_on_signal(server: ServerHandle, within: Duration) {
    tokio::spawn(async move {
        let Ok(mut signals) = StopSignals::install() else {
            return;
        };
        signals.next().await;
        server.pause().await;
        finish_then_stop(&server, within, signals.next()).await;
    });
}

/// SIGINT and SIGTERM (Ctrl-C only, off Unix), listened to from when they are installed to when
/// they are dropped. Installed once for both the first and the second signal: listeners made
/// anew for the second one heard only signals sent after they were made, so a second signal
/// sent while the first was being acted on (an orchestrator that sends SIGTERM twice) was lost,
/// and the stop waited out `within` (review, 2026-12-06). Off Unix a listener is still made
/// for each Ctrl-C (tokio's portable `ctrl_c`), so there a second one sent in that moment can
/// be missed. Two identical signals sent before the first is seen are one signal (the operating
/// system merges them).
struct StopSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// An error when the handlers cannot be installed (logged: the server then runs until it
    /// is stopped another way).
    fn install() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::SignalKind;
            Self::listening(SignalKind::terminate(), SignalKind::interrupt())
        }
        #[cfg(not(unix))]
        {
            Ok(Self {})
        }
    }

    /// Listening to `term` and `int` (the tests use other signals: a handler installed for
    /// SIGTERM stays for the life of the process, which would then ignore it).
    #[cfg(unix)]
    fn listening(
        term: tokio::signal::unix::SignalKind,
        int: tokio::signal::unix::SignalKind,
    ) -> std::io::Result<Self> {
        use tokio::signal::unix::signal;
        let installed = signal(term).and_then(|term| Ok((term, signal(int)?)));
        match installed {
            Ok((term, int)) => Ok(Self { term, int }),
            Err(error) => {
                tracing::error!(target: "idempotency_actix", %error, "could not install the SIGTERM/SIGINT handlers; the server will not stop on a signal");
                Err(error)
            }
        }
    }

    /// The next signal; never, when they can no longer be received.
    async fn next(&mut self) {
        #[cfg(unix)]
        {
            let received = tokio::select! {
                received = self.term.recv() => received,
                received = self.int.recv() => received,
            };
            if received.is_none() {
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        {
            if let Err(error) = tokio::signal::ctrl_c().await {
                tracing::error!(target: "idempotency_actix", %error, "could not install the Ctrl-C handler; the server will not stop on a signal");
                std::future::pending::<()>().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second signal sent after the first was received and before the wait for the second
    /// began is not lost (review, 2026-12-06: the listeners for the second were made after it,
    /// and never heard it). With SIGUSR1 and SIGUSR2 in place of SIGTERM and SIGINT, sent to
    /// this test process: their handlers stay installed once made, and this process must still
    /// stop on SIGTERM and Ctrl-C.
    #[cfg(unix)]
    #[actix_rt::test]
    async fn a_second_signal_sent_while_the_first_is_acted_on_is_heard() {
        use tokio::signal::unix::SignalKind;
        let mut signals =
            StopSignals::listening(SignalKind::user_defined1(), SignalKind::user_defined2())
                .expect("handlers");
        let term = || {
            let sent = std::process::Command::new("kill")
                .args(["-USR1", &std::process::id().to_string()])
                .status()
                .is_ok_and(|status| status.success());
            assert!(sent, "kill -USR1");
        };
        term();
        tokio::time::timeout(Duration::from_secs(5), signals.next())
            .await
            .expect("the first signal");
        term(); // while the first is acted on: nobody waits on `next` yet
        tokio::time::timeout(Duration::from_secs(5), signals.next())
            .await
            .expect("the second signal was lost");
    }

    // One test touches the process-wide count: the unit tests run in parallel, and other
    // tests of this crate spawn tracked work.
    #[actix_rt::test]
    async fn the_wait_ends_when_the_last_tracked_work_ends() {
        let first = track();
        let second = track();
        assert!(unfinished_work() >= 2);
        assert!(
            !work_finished(Duration::from_millis(50)).await,
            "finished with work in flight"
        );
        let waiting = actix_rt::spawn(work_finished(Duration::from_secs(10)));
        drop(first);
        actix_rt::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "finished with one unit left");
        drop(second);
        // Other tests' work may still be in flight; the wait ends once all of it has.
        assert!(waiting.await.unwrap_or(false), "the wait missed the end");
    }
}
