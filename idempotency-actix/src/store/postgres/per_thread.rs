//! A pool of each thread's own, for [`PostgresStore`](super::PostgresStore)s built with
//! [`PostgresStoreBuilder::pool_per_thread`](super::PostgresStoreBuilder::pool_per_thread).
//!
//! # Why
//! A diesel-async connection is driven by a task (tokio-postgres's connection future) on the
//! runtime it was opened on. An actix-web app builds its store in `main`, so every connection
//! of the shared pool is driven on the main thread while the requests run on the worker
//! threads, each on its own single-threaded runtime: every statement crosses threads twice
//! (to the connection's task and back), two wake-ups and usually two context switches, and the
//! main thread does the socket work of every worker. A pool whose connections were opened on
//! the worker's own runtime keeps a request's statements on its thread. Measured with
//! `bench/load.sh` (`docs/benchmarks.md`, "Where the connections are driven").
//!
//! # How
//! The first call on a thread builds that thread's pool on the thread's runtime (bb8 opens its
//! connections from tasks of the runtime it is called on); later calls on the thread use it.
//! A thread may outlive its runtime and run another (a test harness, `block_on` in a loop).
//! The connections driven by the old runtime are then dead; bb8 would notice that by itself
//! (diesel-async's checkout check sees the client closed) and open new ones, but the pool's
//! own background task (the reaper, which enforces the idle timeout and the maximum lifetime)
//! died with the old runtime. So each pool comes with a sentinel task on its runtime: once
//! the runtime is gone, so is the sentinel, and the next call on the thread builds a new pool.
//!
//! # Fair
//! A connection put back into a bb8 pool wakes one waiting request, but a request that asks
//! before that one runs takes the connection first, and the woken one queues again at the
//! back. On a worker's single thread that is the rule, not a race: the request that just put
//! the connection back asks for its next statement in the same poll. Under load a request can
//! be passed over again and again, up to the connection timeout (a spurious 503). So each
//! thread's pool has a queue in front of it, a Tokio semaphore with one permit per connection,
//! which hands out permits in the order they were asked for: at most as many requests as the
//! pool has connections reach it, and a newcomer waits behind everyone already waiting. The
//! permit goes back after the connection (see [`Checkout`]). The wait for both is bounded by
//! the store's connection timeout, as bb8's own wait is.
//!
//! Only on a current-thread runtime (actix-web's workers, `#[tokio::test]`): on a
//! multi-threaded Tokio runtime a task may run on any of its threads, so a pool per thread
//! would only split the connections; there, and outside any runtime, the shared pool serves.
//!
//! The thread holds its pools, so they close when it exits; a store dropped before the thread
//! leaves its pool there until the thread next looks up a pool of any store.
//!
//! Home-made: bb8 (like deadpool) shares one pool between threads, which is the crossing this
//! avoids; no pool crate keeps a pool per runtime thread.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use diesel_async::pooled_connection::PoolError;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Semaphore;

use super::pool::Checkout;
use super::PgPool;

/// Builds one thread's pool (on the runtime it is called on).
pub(super) type MakePool = dyn Fn() -> PgPool + Send + Sync;

/// The per-thread pools of one store.
pub(super) struct PoolPerThread {
    /// Tells this store's entries from other stores' in a thread's list.
    id: u64,
    /// Connections in each thread's pool: the permits of its queue.
    size: u32,
    make: Box<MakePool>,
    /// Dropped with the store: threads drop their pools of stores that are gone.
    alive: Arc<()>,
}

/// One store's pool on this thread.
struct Entry {
    /// [`PoolPerThread::id`].
    store: u64,
    /// [`PoolPerThread::alive`].
    alive: Weak<()>,
    pool: ThreadPool,
    /// Closed once the runtime the pool was built on has shut down (its sentinel task, which
    /// holds the receiver, is dropped with it).
    runtime: tokio::sync::oneshot::Sender<()>,
}

/// One thread's pool and the queue in front of it (see "Fair" above).
#[derive(Clone)]
pub(super) struct ThreadPool {
    pool: PgPool,
    turns: Arc<Semaphore>,
}

impl ThreadPool {
    /// A connection, in turn; `TimedOut` after `timeout` (the queue's wait included).
    pub(super) async fn get(
        &self,
        timeout: Duration,
    ) -> Result<Checkout, bb8::RunError<PoolError>> {
        let in_turn = async {
            // The semaphore is never closed, so this is never `None`; if it were, the
            // checkout would still be bb8's, only without the queue.
            let turn = Arc::clone(&self.turns).acquire_owned().await.ok();
            let conn = self.pool.get_owned().await?;
            Ok(Checkout::new(conn, turn))
        };
        tokio::time::timeout(timeout, in_turn)
            .await
            .unwrap_or(Err(bb8::RunError::TimedOut))
    }
}

thread_local! {
    /// This thread's pools, one per store.
    static POOLS: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

impl PoolPerThread {
    pub(super) fn new(size: u32, make: Box<MakePool>) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            size,
            make,
            alive: Arc::new(()),
        }
    }

    /// This thread's pool, built now if it has none (or only one of a runtime that has shut
    /// down); `None` outside a current-thread runtime or while the thread is exiting (the
    /// shared pool serves).
    pub(super) fn get(&self) -> Option<ThreadPool> {
        let runtime = Handle::try_current().ok()?;
        if runtime.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return None;
        }
        // Pools to drop once the list is no longer borrowed (a pool's drop closes connections).
        let mut gone = Vec::new();
        let pool = POOLS
            .try_with(|pools| {
                let mut pools = pools.borrow_mut();
                // Pools of stores that are gone go at every lookup (a scan of a store or two):
                // a store rebuilt by the app must not leave its pools open on every worker.
                if pools.iter().any(|e| e.alive.strong_count() == 0) {
                    let (keep, stale): (Vec<_>, Vec<_>) = std::mem::take(&mut *pools)
                        .into_iter()
                        .partition(|e| e.alive.strong_count() > 0);
                    *pools = keep;
                    gone.extend(stale);
                }
                if let Some(i) = pools.iter().position(|e| e.store == self.id) {
                    if !pools[i].runtime.is_closed() {
                        return pools[i].pool.clone();
                    }
                    // Built on a runtime that has shut down: its connections are dead.
                    gone.push(pools.swap_remove(i));
                }
                let pool = ThreadPool {
                    pool: (self.make)(),
                    turns: Arc::new(Semaphore::new(self.size as usize)),
                };
                let (runtime_alive, sentinel) = tokio::sync::oneshot::channel::<()>();
                // Lives as long as the runtime (or until the entry is dropped).
                runtime.spawn(async move {
                    let _ = sentinel.await;
                });
                pools.push(Entry {
                    store: self.id,
                    alive: Arc::downgrade(&self.alive),
                    pool: pool.clone(),
                    runtime: runtime_alive,
                });
                pool
            })
            .ok();
        drop(gone);
        pool
    }
}
