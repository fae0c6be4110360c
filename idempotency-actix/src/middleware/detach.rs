//! Running the part of a request that must not be cut short (C21), without paying for a task
//! when it needs none.
//!
//! From the reservation on, a request's work must run to its end even when actix drops the
//! request's future (see [`super`]): it runs on a task of its own. A task costs an allocation,
//! a trip through the worker's scheduler and a wake-up of the request's future when the answer
//! is ready; for a request that never waits (a replay or a miss on `MemoryStore`, a replay from
//! `CachedStore`) that is most of what the middleware adds to it (`docs/benchmarks.md`).
//!
//! So [`detach`] first polls the work once, right here, on the request's own poll: if it is
//! done, no task is made. If it is not (it waits for the database, the network, a timer), it is
//! handed to a task at once, before the request's future returns. Between that first poll and
//! the spawn there is no `.await`, so there is no moment at which dropping the request's future
//! could cut the work: the guarantee is the same as spawning it first.
//!
//! The first poll registers the request's waker with whatever the work waits for; the task's
//! own first poll (right after the spawn) registers the task's waker, and by the `Future`
//! contract only the waker of the latest poll must be woken. A stray wake-up of the request's
//! future is harmless: it finds its answer not ready and waits again.
//!
//! A panic, in the first poll or on the task, is caught and reported by `on_panic` (the
//! caller's outcome for it) where it happens: the request's future may be gone by then (HTTP/1
//! drops it when the client resets; review, 2026-12-06: such a panic was counted nowhere). The
//! work is dropped, its answer's sender with it, and a request's future still there answers the
//! opaque 500 it gives for a work that ended without an answer.

use std::future::{poll_fn, Future};

use futures_util::FutureExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::Poll;

/// Run `work` to its end whatever happens to the caller: poll it once now, and if it is not
/// finished, spawn it on the worker's local task set. Completes on its first poll. `on_panic`
/// runs once if the work panics, wherever it was polled.
///
/// `work` is `Unpin`: a handle to a future on the heap (a `Pin<Box<_>>`, perhaps wrapped in a
/// span), because a polled future may not move, so the same allocation goes to the task. The
/// caller boxes the work outside any `async` body (see `Flow::settle`): the state machine
/// is kilobytes (every await point of the handler's path), and built inside the caller's future
/// it would also take room there and be copied on every move.
pub(super) async fn detach<F, P>(mut work: F, on_panic: P)
where
    F: Future<Output = ()> + Unpin + 'static,
    P: FnOnce() + 'static,
{
    let first = poll_fn(|cx| {
        Poll::Ready(catch_unwind(AssertUnwindSafe(|| {
            Pin::new(&mut work).poll(cx)
        })))
    })
    .await;
    match first {
        Ok(Poll::Ready(())) => {}
        Ok(Poll::Pending) => {
            // Counted until the task ends, so that a graceful stop waits for it (`shutdown`).
            let tracked = crate::shutdown::track();
            actix_rt::spawn(async move {
                let _tracked = tracked;
                if AssertUnwindSafe(work).catch_unwind().await.is_err() {
                    on_panic();
                }
            });
        }
        // The panic hook printed it; the work and its answer's sender are dropped, which a
        // caller still waiting answers as a work that ended without a response.
        Err(_) => on_panic(),
    }
}
