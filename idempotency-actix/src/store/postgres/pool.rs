//! What the store gets from its pools: a [`Checkout`], and the error sink that keeps the
//! reason bb8 does not give a waiter (it only says "timed out").

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use diesel_async::pooled_connection::bb8::PooledConnection;
use diesel_async::pooled_connection::PoolError;
use diesel_async::AsyncPgConnection;
use tokio::sync::OwnedSemaphorePermit;

/// A connection checked out for one statement (or one transactional request), with its turn
/// in the queue of a thread's pool when it came from one (`per_thread.rs`, "Fair").
pub(crate) struct Checkout {
    conn: PooledConnection<'static, AsyncPgConnection>,
    /// Dropped after `conn` (fields drop in declaration order): the connection is back in its
    /// pool before the next in line is let through to take it.
    _turn: Option<OwnedSemaphorePermit>,
}

impl Checkout {
    pub(super) fn new(
        conn: PooledConnection<'static, AsyncPgConnection>,
        turn: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Self { conn, _turn: turn }
    }
}

impl Deref for Checkout {
    type Target = AsyncPgConnection;

    fn deref(&self) -> &AsyncPgConnection {
        &self.conn
    }
}

impl DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        &mut self.conn
    }
}

/// Remembers the last connection error, because bb8 only reports "timed out" to the waiter.
#[derive(Debug, Clone)]
pub(super) struct LastErrorSink(pub(super) Arc<Mutex<Option<String>>>);

impl bb8::ErrorSink<PoolError> for LastErrorSink {
    fn sink(&self, error: PoolError) {
        if is_retirement(&error) {
            return;
        }
        tracing::debug!(%error, "idempotency store: database connection failed");
        if let Ok(mut last) = self.0.lock() {
            *last = Some(error.to_string());
        }
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<PoolError>> {
        Box::new(self.clone())
    }
}

/// A connection closed at its own deadline (`lifetime.rs`) is routine, not a connection error.
fn is_retirement(error: &PoolError) -> bool {
    matches!(
        error,
        PoolError::QueryError(diesel::result::Error::QueryBuilderError(inner))
            if inner.is::<super::lifetime::Retired>()
    )
}

/// A new connection succeeded: the last error no longer explains anything, so a later timeout
/// (say, pool exhaustion) is not blamed on an outage that is over.
impl bb8::CustomizeConnection<AsyncPgConnection, PoolError> for LastErrorSink {
    fn on_acquire<'a>(
        &'a self,
        _connection: &'a mut AsyncPgConnection,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), PoolError>> + Send + 'a>>
    {
        if let Ok(mut last) = self.0.lock() {
            *last = None;
        }
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use bb8::ErrorSink;

    use super::*;
    use crate::store::postgres::lifetime::Retired;

    fn query_builder_error(error: impl std::error::Error + Send + Sync + 'static) -> PoolError {
        PoolError::QueryError(diesel::result::Error::QueryBuilderError(Box::new(error)))
    }

    /// A connection closed at its own deadline is not an outage: a later "timed out" must not
    /// be explained by it. Any other error is still kept.
    #[test]
    fn a_retired_connection_is_not_remembered_as_the_last_error() {
        let sink = LastErrorSink(Arc::new(Mutex::new(None)));
        sink.sink(query_builder_error(Retired));
        assert_eq!(*sink.0.lock().unwrap(), None);
        sink.sink(query_builder_error(std::fmt::Error));
        assert!(sink.0.lock().unwrap().is_some());
        *sink.0.lock().unwrap() = None;
        sink.sink(PoolError::QueryError(
            diesel::result::Error::BrokenTransactionManager,
        ));
        assert!(sink.0.lock().unwrap().is_some());
    }
}
