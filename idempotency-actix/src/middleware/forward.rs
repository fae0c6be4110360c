//! The client's side of a streamed response (C24): a body fed, chunk by chunk, by the task that
//! drives the handler's own body (see the module docs of [`super`]).
//!
//! Home-made because it is a dozen lines over Tokio's bounded channel: actix's `BodyStream`
//! would need `tokio-stream` for the same adapter, and its error type would carry the
//! handler's error text to the connection.

use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use bytes::Bytes;
use tokio::sync::mpsc;

/// How many chunks may wait between the task and a slow client. Small: it bounds the memory a
/// slow client costs, and the task simply waits for room (backpressure on the handler's stream).
pub(super) const CHANNEL_CHUNKS: usize = 16;

/// Why the forwarded body ended early. Its text is all the connection ever sees: the handler's
/// error went to the log.
#[derive(Debug)]
pub(super) struct BodyFailed;

impl std::fmt::Display for BodyFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the response body failed")
    }
}

impl std::error::Error for BodyFailed {}

/// One item the task sends: a chunk, or the news that the handler's body failed.
pub(super) type Item = Result<Bytes, BodyFailed>;

/// The body the client reads: the chunks the task forwards, ending when the task drops its
/// sender (after the record is stored) or sends [`BodyFailed`] (the connection is aborted).
pub(super) struct Forwarded {
    pub(super) chunks: mpsc::Receiver<Item>,
    /// The handler body's own size, so a sized stream keeps its `Content-Length`.
    pub(super) size: BodySize,
}

/// A fresh channel: the sender for the task, the body for the response.
pub(super) fn channel(size: BodySize) -> (mpsc::Sender<Item>, Forwarded) {
    let (sender, chunks) = mpsc::channel(CHANNEL_CHUNKS);
    (sender, Forwarded { chunks, size })
}

impl MessageBody for Forwarded {
    type Error = BodyFailed;

    fn size(&self) -> BodySize {
        self.size
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        self.get_mut().chunks.poll_recv(cx)
    }
}
