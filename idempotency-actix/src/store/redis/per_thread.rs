//! A connection of each thread's own, for [`RedisStore`](super::RedisStore)s made by
//! [`connect`](super::RedisStoreBuilder::connect) (see
//! [`RedisStoreBuilder::connection_per_thread`](super::RedisStoreBuilder::connection_per_thread)).
//!
//! # Why
//! A multiplexed connection is served by a task of the runtime it was made on. An actix-web app
//! makes its store in `main`, so that task runs on the main thread while requests run on the
//! worker threads: every command crossed threads twice (to the connection's task and back),
//! two wake-ups and usually two context switches. A connection made on the worker's own
//! runtime keeps a request's commands on its thread. Measured with `bench/redis.sh` (paired
//! rounds, medians): the raw anchor with a connection per worker does 1.22x the misses and
//! 1.19x the replays of the same anchor over one shared connection; the store 1.05-1.12x the
//! misses and 1.17-1.34x the replays it did over one shared connection (`docs/redis.md`).
//!
//! # How
//! The first call on a thread starts making that thread's connection on the thread's runtime
//! and goes on over the shared connection; later calls on the thread use the new one once it
//! is ready. No request waits for a connection to be made, and a thread whose connection could
//! not be made tries again at most once a second, meanwhile using the shared one.
//!
//! A connection dies with the runtime it was made on. A thread may outlive its runtime and run
//! another (a test harness, `block_on` in a loop), so each connection comes with a sentinel
//! task on that runtime: once the runtime is gone, so is the sentinel, and the next call on the
//! thread makes a new connection instead of sending into a dead one.
//!
//! A connection that did not answer a call in time is marked silent ([`ThreadSlot::went_silent`],
//! from whichever thread noticed), and the next call on its thread makes a new one the same way
//! (module `connections` says why a silent connection is replaced).
//!
//! The thread holds its connections, so they close when it exits (a short-lived thread, such
//! as one of Tokio's blocking pool, leaves nothing behind); a store dropped before the thread
//! leaves its connection there until the thread next looks up a connection of any store.
//!
//! Home-made: neither the redis crate nor a pool crate offers a connection per runtime thread
//! (bb8 and deadpool share one pool between threads, which is the crossing this avoids).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

/// How long a thread waits after a failed attempt before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The per-thread connections of one store.
pub(super) struct PerThread {
    /// Tells this store's entries from other stores' in a thread's list.
    id: u64,
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// Bound on one attempt to connect.
    timeout: Duration,
    /// Dropped with the store: threads drop their connections of stores that are gone.
    alive: Arc<()>,
}

/// One thread's connection, made or being made.
struct Slot {
    ready: OnceLock<Ready>,
    attempt: Mutex<Attempt>,
    /// A call over the connection got no answer in time: make another.
    silent: AtomicBool,
    /// When the connection was last replaced for reaching a replica
    /// (`Connections::reached_a_replica`).
    replica_seen: Mutex<Option<Instant>>,
}

/// Which thread's connection a call went over, to mark it silent.
pub(super) struct ThreadSlot(Arc<Slot>);

impl ThreadSlot {
    /// The call got no answer in time: its thread makes a new connection at its next call.
    pub(super) fn went_silent(&self) {
        self.0.silent.store(true, Ordering::Relaxed);
    }

    /// When this thread's connection was last replaced for reaching a replica.
    pub(super) fn replica_seen(&self) -> &Mutex<Option<Instant>> {
        &self.0.replica_seen
    }

    /// Whether the connection is already marked for replacement.
    pub(super) fn is_silent(&self) -> bool {
        self.0.silent.load(Ordering::Relaxed)
    }
}

struct Ready {
    conn: ConnectionManager,
    /// Closed once the runtime the connection was made on has shut down (its sentinel task,
    /// which holds the receiver, is dropped with it).
    alive: tokio::sync::oneshot::Sender<()>,
}

#[derive(Default)]
struct Attempt {
    running: bool,
    not_before: Option<Instant>,
}

/// One store's connection on this thread.
struct Entry {
    /// [`PerThread::id`].
    store: u64,
    /// [`PerThread::alive`].
    alive: Weak<()>,
    slot: Arc<Slot>,
}

thread_local! {
    /// This thread's connections, one per store.
    static SLOTS: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

impl PerThread {
    pub(super) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        timeout: Duration,
    ) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            client,
            config,
            timeout,
            alive: Arc::new(()),
        }
    }

    /// This thread's connection if it is ready; `None` otherwise (use the shared one), after
    /// starting to make it if no attempt runs and none failed in the last second. Outside a
    /// Tokio runtime, always `None`.
    pub(super) fn get(&self) -> Option<(ConnectionManager, ThreadSlot)> {
        let slot = self.slot()?;
        if let Some(ready) = slot.ready.get() {
            if !ready.alive.is_closed() && !slot.silent.load(Ordering::Relaxed) {
                let conn = ready.conn.clone();
                return Some((conn, ThreadSlot(slot)));
            }
            // Made on a runtime that has shut down, or silent: forget it, make another on
            // this thread's runtime. The new one inherits when a replica was last seen, or
            // each reconnection to a server demoted at the same address would be let through
            // at once by the next `READONLY` (`Connections::reached_a_replica`).
            let seen = *slot
                .replica_seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let fresh = self.replace()?;
            *fresh
                .replica_seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = seen;
            self.start(fresh);
            return None;
        }
        self.start(slot);
        None
    }

    /// This thread's slot for this store, made if there is none; `None` while the thread is
    /// exiting (its thread-locals are gone: the shared connection serves).
    fn slot(&self) -> Option<Arc<Slot>> {
        SLOTS
            .try_with(|slots| {
                let mut slots = slots.borrow_mut();
                if let Some(entry) = slots.iter().find(|e| e.store == self.id) {
                    return Arc::clone(&entry.slot);
                }
                // Connections of stores that are gone go now.
                slots.retain(|e| e.alive.strong_count() > 0);
                let slot = Arc::new(Slot {
                    ready: OnceLock::new(),
                    attempt: Mutex::new(Attempt::default()),
                    silent: AtomicBool::new(false),
                    replica_seen: Mutex::new(None),
                });
                slots.push(Entry {
                    store: self.id,
                    alive: Arc::downgrade(&self.alive),
                    slot: Arc::clone(&slot),
                });
                slot
            })
            .ok()
    }

    /// Give this thread a new slot for this store in place of the one it had.
    fn replace(&self) -> Option<Arc<Slot>> {
        SLOTS
            .try_with(|slots| slots.borrow_mut().retain(|e| e.store != self.id))
            .ok()?;
        self.slot()
    }

    /// Start making `slot`'s connection on this thread's runtime (none: nothing to do), unless an
    /// attempt runs or failed lately.
    fn start(&self, slot: Arc<Slot>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let Ok(mut attempt) = slot.attempt.lock() else {
                return;
            };
            let waiting = attempt.not_before.is_some_and(|t| Instant::now() < t);
            if attempt.running || waiting {
                return;
            }
            attempt.running = true;
        }
        let (client, config, timeout) = (self.client.clone(), self.config.clone(), self.timeout);
        // Ends the attempt however the task ends, also when its runtime drops it unfinished.
        let attempt = Running(slot);
        runtime.spawn(async move {
            let made =
                tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, config))
                    .await;
            match made {
                Ok(Ok(conn)) => {
                    let (alive, sentinel) = tokio::sync::oneshot::channel::<()>();
                    // Lives as long as the runtime (or until the slot is dropped).
                    tokio::spawn(async move {
                        let _ = sentinel.await;
                    });
                    let _ = attempt.0.ready.set(Ready { conn, alive });
                }
                // The shared connection reports an outage where it matters; this thread tries
                // again later.
                Ok(Err(_)) | Err(_) => attempt.failed(),
            }
        });
    }
}

/// An attempt to make a slot's connection, ended when dropped.
struct Running(Arc<Slot>);

impl Running {
    fn failed(&self) {
        if let Ok(mut attempt) = self.0.attempt.lock() {
            attempt.not_before = Some(Instant::now() + RETRY_AFTER);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(mut attempt) = self.0.attempt.lock() {
            attempt.running = false;
        }
    }
}
