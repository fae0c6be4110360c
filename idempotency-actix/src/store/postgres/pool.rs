//! The pool's error sink: bb8 tells a waiter only "timed out"; this keeps the reason.

use std::sync::{Arc, Mutex};

use diesel_async::pooled_connection::PoolError;
use diesel_async::AsyncPgConnection;

/// Remembers the last connection error, because bb8 only reports "timed out" to the waiter.
#[derive(Debug, Clone)]
pub(super) struct LastErrorSink(pub(super) Arc<Mutex<Option<String>>>);

impl bb8::ErrorSink<PoolError> for LastErrorSink {
    fn sink(&self, error: PoolError) {
        tracing::debug!(%error, "idempotency store: database connection failed");
        if let Ok(mut last) = self.0.lock() {
            *last = Some(error.to_string());
        }
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<PoolError>> {
        Box::new(self.clone())
    }
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
