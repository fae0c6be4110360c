//! Releasing, in the background, a reservation that a failed reserve may have made anyway:
//! the bounds and the schedule the shared stores (PostgreSQL, Redis) follow.
//!
//! A reserve whose answer never came (a timeout, a connection lost after sending) may still
//! have reserved the key: its write can be applied late (held up on its way to the server, or
//! waiting there on a lock), or applied just before the server crashed and be found again after
//! a restart (Redis with AOF). The caller answers 503 and runs nothing; without a release the key
//! would be held by nobody until the lease ends, and the client's retry of the same request told
//! 409 all that time. The release is fenced by that reserve's token, so it removes only what that
//! reserve made, and only while nobody else holds the key.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::saturating_deadline;
use crate::log_text::LogText;

/// Background release tasks one store keeps at once (about a kilobyte each).
pub(crate) const MAX_TASKS: usize = 4096;

/// The bound on one store's background release tasks, shared by its clones: during a brownout,
/// when every reserve fails, unbounded they would multiply the load on the failing server and
/// hold memory. Past it a reservation that a failed reserve may have made ends with its lease
/// (its retry is told 409 until then), and a warning says so. Nothing runs twice either way.
#[derive(Clone)]
pub(crate) struct Tasks(Arc<Semaphore>);

impl Tasks {
    /// Room for `max` tasks at once.
    pub(crate) fn new(max: usize) -> Self {
        Self(Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS))))
    }

    /// Room for one more task, held until the task ends; `None` (and a warning naming `key`)
    /// when all are taken.
    pub(crate) fn start(&self, key: &str) -> Option<OwnedSemaphorePermit> {
        let task = Arc::clone(&self.0).try_acquire_owned().ok();
        if task.is_none() {
            tracing::warn!(key = %LogText(key), "too many background releases pending: a reservation this failed reserve may have made is left to its lease");
        }
        task
    }
}

/// Call `release` until it answers that it released the reservation (`true`), for two leases
/// from now: a write that reaches the server up to a lease late makes a reservation that ends a
/// lease after that. First at doubling pauses from 100 ms, then every eighth of a lease, the last
/// try at the end: an orphan is freed within an eighth of a lease of its write, for about two
/// dozen tries per failed reserve.
pub(crate) async fn keep_trying<F, Fut>(lease: Duration, key: &str, mut release: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = saturating_deadline(Instant::now(), lease.saturating_mul(2));
    let longest = (lease / 8).max(Duration::from_millis(100));
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::time::sleep(pause).await;
        if release().await {
            tracing::info!(key = %LogText(key), "released a reservation made by a reserve that had failed (its answer came too late)");
            return;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        pause = pause.saturating_mul(2).min(longest).min(left);
    }
}
