//! Each pooled connection's own lifetime: a deadline drawn at random from the last tenth of
//! the builder's `max_lifetime`, so connections opened together are not closed together.
//!
//! bb8 (0.9) closes a connection once it is older than the pool's `max_lifetime`, the same
//! age for all. Connections opened together (the pool's `min_idle` at start, or a burst) are
//! then closed together, and their replacements are opened together again: once per lifetime
//! every request waits while the whole pool reconnects (measured in `docs/benchmarks.md`,
//! "Connections closed together": with connections that take 1 s to open, p99.9 942-952 ms,
//! and 53 ms with this module). HikariCP's answer is a random variation of each connection's
//! lifetime; bb8 has none and keeps each connection's birth to itself, and diesel-async's
//! connection has no room for ours, so this module puts the deadline where a connection does
//! carry a value of our own: its diesel [`Instrumentation`]. [`Lifetime`] takes the place of the one diesel installed and forwards
//! every event to a new instance of diesel's default instrumentation, so an app's query
//! logging set up through diesel's default keeps working.
//!
//! The pool's checkout check ([`is_over`]) then fails a connection past its deadline, and bb8
//! closes it and takes (or opens) another, as for a broken one. bb8's own `max_lifetime` stays
//! set to the full lifetime: every deadline is at or before it, so it only closes connections
//! that were not checked out after their deadline (idle ones, at its reaper's next round) and
//! any connection whose instrumentation an app replaced. In bb8's statistics a connection
//! closed at its own deadline counts as `connections_closed_invalid` (a failed checkout check),
//! not as `connections_closed_max_lifetime`.
//!
//! Why a tenth: wide enough that the reconnections of a whole pool are seconds or minutes
//! apart (3 minutes for the default 30), narrow enough that a connection still lives at least
//! nine tenths of what the user asked for (5 % more reconnections on average).

use std::hash::BuildHasher;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::connection::{get_default_instrumentation, Instrumentation, InstrumentationEvent};
use diesel_async::{AsyncConnection, AsyncPgConnection};

use super::transactional::SerializationWatch;

/// The part of `max_lifetime` over which connections' deadlines are spread.
const SPREAD: f64 = 0.1;

/// A connection's deadline, riding on its instrumentation slot; forwards every event to
/// diesel's default instrumentation (a new instance of what it replaced).
///
/// It also holds transactional mode's serialization-failure watch while a request that may be
/// re-run holds the connection: a connection has one instrumentation slot, and the watch used to take it for the rest of the
/// connection's life, which ended its own deadline (and the forwarding) for good.
struct Lifetime {
    deadline: Instant,
    forward: Option<Box<dyn Instrumentation>>,
    /// Serialization failures of the transactional request that holds the connection.
    serialization_watch: Option<Arc<SerializationWatch>>,
}

impl Instrumentation for Lifetime {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        if let Some(watch) = &self.serialization_watch {
            watch.on_event(&event);
        }
        if let Some(forward) = &mut self.forward {
            forward.on_connection_event(event);
        }
    }
}

/// Give a newly opened connection its deadline: a random point in the last tenth of
/// `max_lifetime` from now. A lifetime too long to add to the clock gives no deadline (bb8's
/// check then stands alone).
pub(super) fn give(conn: &mut AsyncPgConnection, max_lifetime: Duration) {
    let born = Instant::now();
    let Some(deadline) = born.checked_add(jittered(max_lifetime, random_fraction())) else {
        return;
    };
    conn.set_instrumentation(Lifetime {
        deadline,
        forward: get_default_instrumentation(),
        serialization_watch: None,
    });
}

/// Point the serialization-failure watch of `conn` at `watch` (the previous request's watch, if any, is
/// dropped). `false` when the connection has no [`Lifetime`] (a pool this module did
/// not configure): the caller then installs a watch of its own in the slot.
pub(super) fn watch_serialization_failures(
    conn: &mut AsyncPgConnection,
    watch: Arc<SerializationWatch>,
) -> bool {
    // As in `is_over`: no query future of this connection is alive here.
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        match conn.instrumentation().downcast_mut::<Lifetime>() {
            Some(lifetime) => {
                lifetime.serialization_watch = Some(watch);
                true
            }
            None => false,
        }
    }))
    .unwrap_or(false)
}

/// Whether `conn` is past its deadline. A connection without one (opened by a pool this
/// module did not configure, or whose instrumentation an app replaced) never is.
pub(super) fn is_over(conn: &mut AsyncPgConnection, now: Instant) -> bool {
    // diesel-async panics here if a query future of this connection is still alive. At
    // checkout none can be (each borrows the connection), short of an app leaking one with
    // `mem::forget`; then the connection just keeps bb8's lifetime.
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        conn.instrumentation()
            .downcast_ref::<Lifetime>()
            .is_some_and(|lifetime| now >= lifetime.deadline)
    }))
    .unwrap_or(false)
}

/// `max_lifetime` shortened by `fraction` (0 to 1) of its last tenth.
fn jittered(max_lifetime: Duration, fraction: f64) -> Duration {
    let cut = max_lifetime.as_secs_f64() * SPREAD * fraction.clamp(0.0, 1.0);
    max_lifetime.saturating_sub(Duration::try_from_secs_f64(cut).unwrap_or(Duration::ZERO))
}

/// A number in [0, 1) that differs from call to call. std's `RandomState` is randomly keyed
/// (per thread, then stepped per call), which is all a spread of deadlines needs; a random
/// number crate would be a dependency for this one line.
fn random_fraction() -> f64 {
    let bits = std::hash::RandomState::new().hash_one(Instant::now());
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// The checkout check's error for a connection past its deadline. Not a fault: the error sink
/// ignores it, so it is never reported as the reason a later request timed out.
#[derive(Debug, thiserror::Error)]
#[error("the connection reached its lifetime and was closed")]
pub(super) struct Retired;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_falls_in_the_last_tenth_of_the_lifetime() {
        let life = Duration::from_secs(1800);
        assert_eq!(jittered(life, 0.0), life);
        assert_eq!(jittered(life, 1.0), Duration::from_secs(1620));
        assert_eq!(jittered(life, 0.5), Duration::from_secs(1710));
        // Out-of-range fractions and lifetimes stay in range instead of panicking.
        assert_eq!(jittered(life, 7.0), Duration::from_secs(1620));
        assert_eq!(jittered(life, f64::NAN), life);
        assert!(jittered(Duration::MAX, 1.0) < Duration::MAX);
        assert_eq!(jittered(Duration::ZERO, 0.5), Duration::ZERO);
    }

    #[test]
    fn the_serialization_watch_shares_the_slot_with_the_deadline() {
        use diesel::pg::Pg;
        use diesel::result::{DatabaseErrorKind, Error};

        let watch = Arc::new(SerializationWatch::default());
        let mut lifetime = Lifetime {
            deadline: Instant::now(),
            forward: None,
            serialization_watch: Some(Arc::clone(&watch)),
        };
        let query = diesel::select(diesel::dsl::sql::<diesel::sql_types::Integer>("1"));
        let shown = diesel::debug_query::<Pg, _>(&query);
        let other =
            Error::DatabaseError(DatabaseErrorKind::UniqueViolation, Box::new(String::new()));
        lifetime.on_connection_event(InstrumentationEvent::finish_query(&shown, Some(&other)));
        lifetime.on_connection_event(InstrumentationEvent::finish_query(&shown, None));
        assert!(!watch.serialization_failed(), "only 40001 counts");
        let failure = Error::DatabaseError(
            DatabaseErrorKind::SerializationFailure,
            Box::new(String::new()),
        );
        lifetime.on_connection_event(InstrumentationEvent::finish_query(&shown, Some(&failure)));
        assert!(watch.serialization_failed());
    }

    #[test]
    fn fractions_are_in_range_and_differ() {
        let draws: Vec<f64> = (0..64).map(|_| random_fraction()).collect();
        assert!(draws.iter().all(|f| (0.0..1.0).contains(f)), "{draws:?}");
        let mut distinct = draws.clone();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        assert!(distinct.len() > 60, "{draws:?}");
        // Spread over the range, not bunched in one corner of it.
        assert!(draws.iter().any(|f| *f < 0.25) && draws.iter().any(|f| *f > 0.75));
    }
}
