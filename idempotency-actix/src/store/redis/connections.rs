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
//! silent, and the next timeout makes another: one attempt at a time per connection.
//!
//! Only stores made by `RedisStoreBuilder::connect` replace connections (they have the client to
//! make more). A store over the app's own connection (`from_connection`, `with_connection`) or
//! the cluster client keeps what it was given.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::per_thread::{PerThread, ThreadSlot};

/// The connections of one store (shared by its clones).
pub(super) struct Connections<C> {
    /// Never empty; calls take them in turn.
    shared: Box<[RwLock<C>]>,
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
    /// The runtime the store was made on: a connection is driven by a task of the runtime it
    /// is made on, and the worker whose call noticed the silence may stop before the app.
    runtime: tokio::runtime::Handle,
    /// One attempt at a time per shared connection.
    remaking: Box<[AtomicBool]>,
}

impl Remake {
    /// For a store made on the current runtime (`None` outside one: nothing can be remade).
    pub(super) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        timeout: Duration,
    ) -> Option<Self> {
        Some(Self {
            client,
            config,
            timeout,
            runtime: tokio::runtime::Handle::try_current().ok()?,
            remaking: Box::new([]),
        })
    }
}

/// A connection lent to one call, and where it came from.
pub(super) struct Picked<C> {
    pub(super) conn: C,
    pub(super) origin: Origin,
}

/// Where a [`Picked`] connection came from: what to replace if it goes silent.
pub(super) enum Origin {
    Shared(usize),
    Thread(ThreadSlot),
}

impl<C> Connections<C>
where
    C: Clone + Send + Sync + 'static,
{
    /// Over `shared` (not empty: every constructor of the store gives at least one), with each
    /// thread's own connection if `per_thread` is given
    /// (only where `C` is `ConnectionManager`), remade after a silence if `remake` is given.
    pub(super) fn new(
        shared: Vec<C>,
        per_thread: Option<PerThread>,
        remake: Option<Remake>,
    ) -> Self {
        let remake = remake.map(|remake| Remake {
            remaking: shared.iter().map(|_| AtomicBool::new(false)).collect(),
            ..remake
        });
        Self {
            shared: shared.into_iter().map(RwLock::new).collect(),
            next: AtomicUsize::new(0),
            per_thread,
            remake,
        }
    }

    /// The first shared connection (a clone).
    pub(super) fn first(&self) -> C {
        self.shared_at(0)
    }

    fn shared_at(&self, i: usize) -> C {
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
        Picked {
            conn: self.shared_at(i),
            origin: Origin::Shared(i),
        }
    }

    /// A call over `origin`'s connection got no answer in time: replace the connection.
    pub(super) fn went_silent(self: &Arc<Self>, origin: &Origin) {
        let i = match origin {
            Origin::Thread(slot) => return slot.went_silent(),
            Origin::Shared(i) => *i,
        };
        let Some(remake) = &self.remake else {
            return;
        };
        if remake.remaking[i].swap(true, Ordering::AcqRel) {
            return;
        }
        let this = Arc::clone(self);
        let (client, config) = (remake.client.clone(), remake.config.clone());
        let timeout = remake.timeout;
        remake.runtime.spawn(async move {
            let made =
                tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, config))
                    .await;
            // Otherwise Redis itself is unreachable or silent: the next silence tries again.
            if let Ok(Ok(Some(conn))) = made.map(|made| made.map(as_store_conn::<C>)) {
                *this.shared[i]
                    .write()
                    .unwrap_or_else(PoisonError::into_inner) = conn;
                tracing::warn!("a Redis connection gave no answer in time and was replaced");
            }
            if let Some(remake) = &this.remake {
                remake.remaking[i].store(false, Ordering::Release);
            }
        });
    }
}

/// `conn` as the store's connection type, which it is wherever one is made here (stores made
/// by `connect`, whose `C` is `ConnectionManager`).
fn as_store_conn<C: 'static>(conn: ConnectionManager) -> Option<C> {
    let mut conn = Some(conn);
    (&mut conn as &mut dyn Any)
        .downcast_mut::<Option<C>>()
        .and_then(Option::take)
}
