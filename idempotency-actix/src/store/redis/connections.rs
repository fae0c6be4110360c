//! The connections a [`RedisStore`](super::RedisStore)'s calls go over: the shared ones, taken
//! in turn, and each thread's own (module `per_thread`); and the replacement of one that
//! stopped answering.
//!
//! # Why a silent connection is replaced
//! A connection can stop answering while its socket stays open: a half-open path (a NAT or
//! firewall entry lost, an address moved in a failover), a stalled peer. The redis crate's
//! `ConnectionManager` reconnects after errors that say the connection is gone (a reset, a
//! closed socket), not after a response timeout. So every later call went down the same dead
//! connection and timed out too: the middleware's retries of `complete` and the lease
//! renewals all failed until the lease ended, and the client's retry through another
//! instance (or another worker, with a connection per thread) then ran the handler a second
//! time, though Redis answered new connections all along. Now a call that gets no answer in
//! time marks its connection silent: a new one is made in the background, and calls go on over
//! the old one until it is ready (PostgreSQL's store likewise closes a connection whose
//! statement timed out). If Redis itself is frozen the new connection fails or is just as
//! silent, and the next timeout makes another: one attempt at a time per connection. Calls sent
//! on the old connection before it was replaced time out later; they name the connection they
//! used (a generation per slot), so they do not replace its working successor.
//!
//! A replacement is made on the runtime the store was made on (a connection is driven by a
//! task of the runtime it was made on, and the worker whose call noticed the silence may stop
//! before the app); once that runtime has ended (a store made on a temporary runtime), on the
//! caller's, as the redis crate itself reconnects.
//!
//! Only stores made by `RedisStoreBuilder::connect` replace connections (they have the client to
//! make more). A store over the app's own connection (`from_connection`, `with_connection`) or
//! the cluster client keeps what it was given.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::per_thread::{PerThread, ThreadSlot};

/// The connections of one store (shared by its clones).
pub(super) struct Connections<C> {
    /// Never empty; calls take them in turn. Each with its generation: how often it was
    /// replaced.
    shared: Box<[RwLock<(C, u64)>]>,
    /// Per shared connection: a replacement is being made (one attempt at a time).
    remaking: Box<[AtomicBool]>,
    /// Per shared connection: when it was last replaced for reaching a replica.
    replica_seen: Box<[Mutex<Option<Instant>>]>,
    /// Which shared connection the next call takes.
    next: AtomicUsize,
    /// Each thread's own connection (`RedisStoreBuilder::connection_per_thread`).
    per_thread: Option<PerThread>,
    /// How to make a shared connection anew; `None`: they are the app's own.
    remake: Option<Remake>,
}

/// What a store made by `connect` needs to make its shared connections again.
pub(super) struct Remake {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// Bound on one attempt.
    timeout: Duration,
    /// The runtime the store was made on (see the module docs).
    runtime: tokio::runtime::Handle,
    /// Closed once that runtime has ended (its sentinel task, which holds the receiver, is
    /// dropped with it).
    runtime_alive: tokio::sync::oneshot::Sender<()>,
}

impl Remake {
    /// For a store made on the current runtime (`None` outside one: nothing can be remade).
    pub(super) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        timeout: Duration,
    ) -> Option<Self> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (runtime_alive, sentinel) = tokio::sync::oneshot::channel::<()>();
        runtime.spawn(async move {
            let _ = sentinel.await;
        });
        Some(Self {
            client,
            config,
            timeout,
            runtime,
            runtime_alive,
        })
    }

    /// Where to make a replacement: the store's runtime while it runs, else the caller's.
    fn runtime(&self) -> Option<tokio::runtime::Handle> {
        if self.runtime_alive.is_closed() {
            tokio::runtime::Handle::try_current().ok()
        } else {
            Some(self.runtime.clone())
        }
    }
}

/// Clears a slot's `remaking` flag however the attempt ends, also when its runtime drops it
/// unpolled.
struct Remaking<C: Clone + Send + Sync + 'static> {
    connections: Arc<Connections<C>>,
    slot: usize,
}

impl<C: Clone + Send + Sync + 'static> Drop for Remaking<C> {
    fn drop(&mut self) {
        self.connections.remaking[self.slot].store(false, Ordering::Release);
    }
}

/// A connection lent to one call, and where it came from.
pub(super) struct Picked<C> {
    pub(super) conn: C,
    pub(super) origin: Origin,
}

/// Where a [`Picked`] connection came from: what to replace if it goes silent.
pub(super) enum Origin {
    /// A shared slot, and its generation when the call took it.
    Shared(usize, u64),
    Thread(ThreadSlot),
}

impl<C> Connections<C>
where
    C: Clone + Send + Sync + 'static,
{
    /// Over `shared` (not empty: every constructor of the store gives at least one), with each
    /// thread's own connection if `per_thread` is given (only where `C` is
    /// `ConnectionManager`), remade after a silence if `remake` is given.
    pub(super) fn new(
        shared: Vec<C>,
        per_thread: Option<PerThread>,
        remake: Option<Remake>,
    ) -> Self {
        Self {
            remaking: shared.iter().map(|_| AtomicBool::new(false)).collect(),
            replica_seen: shared.iter().map(|_| Mutex::new(None)).collect(),
            shared: shared.into_iter().map(|c| RwLock::new((c, 0))).collect(),
            next: AtomicUsize::new(0),
            per_thread,
            remake,
        }
    }

    /// The first shared connection (a clone).
    pub(super) fn first(&self) -> C {
        self.shared_at(0).0
    }

    /// Shared slot `i`'s connection (a clone) and its generation.
    fn shared_at(&self, i: usize) -> (C, u64) {
        self.shared[i]
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The connection for the next call: this thread's own if it has one ready, else each
    /// shared one in turn.
    pub(super) fn pick(&self) -> Picked<C> {
        if let Some((conn, slot)) = self.per_thread.as_ref().and_then(PerThread::get) {
            if let Some(conn) = as_store_conn::<C>(conn) {
                return Picked {
                    conn,
                    origin: Origin::Thread(slot),
                };
            }
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.shared.len();
        let (conn, generation) = self.shared_at(i);
        Picked {
            conn,
            origin: Origin::Shared(i, generation),
        }
    }

    /// A call over `origin`'s connection reached a replica (see `RedisStore::answer`): replace
    /// the connection, at most once a second per connection. Throttled, because a server
    /// demoted at the same address (the read-only fallbacks serve it) must not be reconnected
    /// to at every call; per connection, because after a failover every connection (one per
    /// thread, and the shared ones) reaches the demoted node, and one store-wide slot a second
    /// left the last of them failing the holders' completions and renewals for as many
    /// seconds as there were connections.
    pub(super) fn reached_a_replica(self: &Arc<Self>, origin: &Origin) {
        // A late answer over a connection already replaced (or marked) must not use up the
        // second its successor may need.
        let seen = match origin {
            Origin::Thread(slot) if slot.is_silent() => return,
            Origin::Thread(slot) => slot.replica_seen(),
            Origin::Shared(i, generation)
                if self.shared_at(*i).1 != *generation
                    || self.remaking[*i].load(Ordering::Acquire) =>
            {
                return
            }
            Origin::Shared(i, _) => &self.replica_seen[*i],
        };
        if first_this_second(seen) {
            self.went_silent(origin);
        }
    }

    /// A call over `origin`'s connection got no answer in time: replace the connection.
    pub(super) fn went_silent(self: &Arc<Self>, origin: &Origin) {
        let (i, silent) = match origin {
            Origin::Thread(slot) => return slot.went_silent(),
            Origin::Shared(i, generation) => (*i, *generation),
        };
        let Some(remake) = &self.remake else {
            return;
        };
        // Already replaced since the call took it: its successor is not the silent one.
        if self.shared_at(i).1 != silent || self.remaking[i].swap(true, Ordering::AcqRel) {
            return;
        }
        let remaking = Remaking {
            connections: Arc::clone(self),
            slot: i,
        };
        let Some(runtime) = remake.runtime() else {
            return; // `remaking` clears the flag
        };
        let (client, config) = (remake.client.clone(), remake.config.clone());
        let timeout = remake.timeout;
        runtime.spawn(async move {
            let made =
                tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, config))
                    .await;
            // Otherwise Redis itself is unreachable or silent: the next silence tries again.
            if let Ok(Ok(Some(conn))) = made.map(|made| made.map(as_store_conn::<C>)) {
                let mut slot = remaking.connections.shared[i]
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                *slot = (conn, silent.wrapping_add(1));
                drop(slot);
                tracing::warn!("a Redis connection gave no answer in time, or reached a replica, and was replaced");
            }
            drop(remaking);
        });
    }
}

/// Whether `last` is more than a second ago (or never), recording now if so.
fn first_this_second(last: &Mutex<Option<Instant>>) -> bool {
    let now = Instant::now();
    let mut last = last.lock().unwrap_or_else(PoisonError::into_inner);
    if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
        return false;
    }
    *last = Some(now);
    true
}

/// `conn` as the store's connection type, which it is wherever one is made here (stores made
/// by `connect`, whose `C` is `ConnectionManager`).
fn as_store_conn<C: 'static>(conn: ConnectionManager) -> Option<C> {
    let mut conn = Some(conn);
    (&mut conn as &mut dyn Any)
        .downcast_mut::<Option<C>>()
        .and_then(Option::take)
}
