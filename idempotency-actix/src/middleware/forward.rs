//! The client's side of a streamed response (C24): a body fed, chunk by chunk, by the task that
//! drives the handler's own body (see the module docs of [`super`]).
//!
//! Two ways to hand a chunk over. While the response may still be stored, [`Sender::push`]
//! never waits for the client: the record must not depend on how fast the client reads (a
//! client that stops reading would otherwise hold the handler's body, and with it the key,
//! until renewal gave up and a retry ran the handler again). The chunks it queues are the
//! ones the copy for the record holds anyway, so a slow client costs no more memory than the
//! copy (`max_response_bytes`). Once the response cannot be stored (over the limit),
//! [`Sender::send`] waits until the client has room (backpressure on the handler's stream).
//!
//! Home-made because it is a few lines over Tokio's channel and semaphore: actix's
//! `BodyStream` would need `tokio-stream` for the same adapter, its error type would carry the
//! handler's error text to the connection, and no channel crate offers "bounded for some
//! sends, not for others".

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use bytes::Bytes;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// How many chunks [`Sender::send`] lets wait between the task and a slow client. Small: it
/// bounds the memory a slow client costs once nothing is kept for the record.
pub(super) const CHANNEL_CHUNKS: usize = 16;

/// The client is gone: its body was dropped.
#[derive(Debug)]
pub(super) struct Gone;

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

/// An item on its way, with the room it takes (none for one [`Sender::push`] queued past the
/// bound): the room is freed when the client takes the item.
type Queued = (Item, Option<OwnedSemaphorePermit>);

/// The task's end of the channel.
pub(super) struct Sender {
    chunks: mpsc::UnboundedSender<Queued>,
    /// [`CHANNEL_CHUNKS`] permits, one per item waiting for the client.
    room: Arc<Semaphore>,
}

impl Sender {
    /// Queue `item` at once, whatever the client's pace.
    pub(super) fn push(&self, item: Item) -> Result<(), Gone> {
        let room = Arc::clone(&self.room).try_acquire_owned().ok();
        self.chunks.send((item, room)).map_err(|_| Gone)
    }

    /// Queue `item` once the client has room for it.
    pub(super) async fn send(&self, item: Item) -> Result<(), Gone> {
        if self.chunks.is_closed() {
            return Err(Gone);
        }
        // The semaphore is never closed. A client that goes away while this waits drops its
        // queue, and with it the permits, so the wait ends and the send reports it.
        let room = Arc::clone(&self.room).acquire_owned().await.ok();
        self.chunks.send((item, room)).map_err(|_| Gone)
    }
}

/// The body the client reads: the chunks the task forwards, ending when the task drops its
/// sender (after the record is stored) or sends [`BodyFailed`] (the connection is aborted).
///
/// A body of unknown length ends for the client with its end marker, which comes when the
/// sender is dropped. A sized body (`Content-Length`) ends for the client at its last byte, so
/// the chunk that completes it is held until the sender is dropped: either way a client that
/// has the whole response can retry at once and get the replay, not a 409.
pub(super) struct Forwarded {
    chunks: mpsc::UnboundedReceiver<Queued>,
    /// The handler body's own size, so a sized stream keeps its `Content-Length`.
    size: BodySize,
    /// Bytes of a sized body not yet passed on.
    left: u64,
    /// The chunk that completes a sized body, until the task is done.
    last: Option<Bytes>,
}

/// A fresh channel: the sender for the task, the body for the response.
pub(super) fn channel(size: BodySize) -> (Sender, Forwarded) {
    let (chunks_in, chunks) = mpsc::unbounded_channel();
    let sender = Sender {
        chunks: chunks_in,
        room: Arc::new(Semaphore::new(CHANNEL_CHUNKS)),
    };
    let left = match size {
        BodySize::Sized(n) => n,
        BodySize::None | BodySize::Stream => 0,
    };
    let body = Forwarded {
        chunks,
        size,
        left,
        last: None,
    };
    (sender, body)
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
        let this = self.get_mut();
        loop {
            // The item's room (if it took any) is freed here, as the client takes it.
            match this
                .chunks
                .poll_recv(cx)
                .map(|queued| queued.map(|(item, _room)| item))
            {
                Poll::Ready(Some(Ok(chunk))) if matches!(this.size, BodySize::Sized(_)) => {
                    if chunk.is_empty() && this.last.is_some() {
                        // An empty chunk after the last bytes (a body that yields one before
                        // its end) must not push them out early.
                        continue;
                    }
                    let len = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
                    this.left = this.left.saturating_sub(len);
                    if this.left > 0 {
                        return Poll::Ready(Some(Ok(chunk)));
                    }
                    // The body's last bytes: held until the task is done (see above). A
                    // handler that sends more than its size is cut by actix anyway.
                    match this.last.take() {
                        Some(held) => {
                            this.last = Some(chunk);
                            return Poll::Ready(Some(Ok(held)));
                        }
                        None => this.last = Some(chunk),
                    }
                }
                Poll::Ready(Some(item)) => return Poll::Ready(Some(item)),
                Poll::Ready(None) => return Poll::Ready(this.last.take().map(Ok)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use actix_web::body::to_bytes;

    use super::*;

    /// The next item of `body`, or `None` when none arrives within a short wait (pending).
    async fn next(body: &mut Forwarded) -> Option<Option<Item>> {
        let poll = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_next(cx));
        tokio::time::timeout(Duration::from_millis(50), poll)
            .await
            .ok()
    }

    #[tokio::test]
    async fn chunks_arrive_in_order_and_the_body_ends_when_the_sender_is_dropped() {
        let (sender, body) = channel(BodySize::Sized(11));
        assert_eq!(
            body.size(),
            BodySize::Sized(11),
            "the handler's size is kept"
        );
        for chunk in ["hello", " ", "world"] {
            assert!(sender.send(Ok(Bytes::from(chunk))).await.is_ok());
        }
        drop(sender);
        match to_bytes(body).await {
            Ok(bytes) => assert_eq!(bytes, Bytes::from_static(b"hello world")),
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn a_sized_body_gives_its_last_bytes_only_once_the_task_is_done() {
        let (sender, mut body) = channel(BodySize::Sized(6));
        assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"abc")),
            other => panic!("{other:?}"),
        }
        assert!(sender.send(Ok(Bytes::from_static(b"def"))).await.is_ok());
        assert!(
            next(&mut body).await.is_none(),
            "the chunk that completes the body waits while the record is being stored"
        );
        drop(sender);
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"def")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(next(&mut body).await, Some(None)), "then the end");
    }

    #[tokio::test]
    async fn an_empty_chunk_after_the_last_bytes_does_not_release_them() {
        let (sender, mut body) = channel(BodySize::Sized(3));
        assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
        assert!(sender.send(Ok(Bytes::new())).await.is_ok());
        assert!(
            next(&mut body).await.is_none(),
            "still held while the record is being stored"
        );
        drop(sender);
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"abc")),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_failed_sized_body_never_gives_its_held_bytes() {
        let (sender, body) = channel(BodySize::Sized(3));
        assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
        assert!(sender.send(Err(BodyFailed)).await.is_ok());
        drop(sender);
        assert!(to_bytes(body).await.is_err());
    }

    #[tokio::test]
    async fn a_body_waits_for_the_task_and_reports_each_chunk() {
        let (sender, mut body) = channel(BodySize::Stream);
        assert_eq!(body.size(), BodySize::Stream);
        assert!(
            next(&mut body).await.is_none(),
            "pending while nothing was sent"
        );
        assert!(sender.send(Ok(Bytes::from_static(b"a"))).await.is_ok());
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"a")),
            other => panic!("{other:?}"),
        }
        assert!(next(&mut body).await.is_none(), "pending again");
        drop(sender);
        assert!(
            matches!(next(&mut body).await, Some(None)),
            "the end of the body once the task is done"
        );
    }

    #[tokio::test]
    async fn a_failed_handler_body_fails_the_forwarded_body_with_a_fixed_message() {
        let (sender, body) = channel(BodySize::Stream);
        assert!(sender
            .send(Ok(Bytes::from_static(b"partial")))
            .await
            .is_ok());
        assert!(sender.send(Err(BodyFailed)).await.is_ok());
        drop(sender);
        match to_bytes(body).await {
            Ok(bytes) => panic!("a failed body was read whole: {bytes:?}"),
            // Only this fixed text reaches the connection, never the handler's error.
            Err(e) => assert_eq!(e.to_string(), "the response body failed"),
        }
        assert_eq!(BodyFailed.to_string(), "the response body failed");
        let as_error: &dyn std::error::Error = &BodyFailed;
        assert!(as_error.source().is_none());
        assert_eq!(format!("{BodyFailed:?}"), "BodyFailed");
    }

    /// Whether `send` of one more chunk waits (the client has no room for it).
    async fn send_waits(sender: &Sender) -> bool {
        let send = sender.send(Ok(Bytes::from_static(b"y")));
        tokio::time::timeout(Duration::from_millis(50), send)
            .await
            .is_err()
    }

    #[tokio::test]
    async fn send_waits_for_the_client_and_push_does_not() {
        let (sender, mut body) = channel(BodySize::Stream);
        for i in 0..CHANNEL_CHUNKS {
            assert!(
                sender.send(Ok(Bytes::from_static(b"x"))).await.is_ok(),
                "chunk {i} fits"
            );
        }
        assert!(send_waits(&sender).await, "a slow client makes send wait");
        // push queues whatever the client's pace (the response is being kept for the record).
        for _ in 0..3 * CHANNEL_CHUNKS {
            assert!(sender.push(Ok(Bytes::from_static(b"p"))).is_ok());
        }
        // Reading one of the bounded chunks makes room for one more send.
        assert!(matches!(next(&mut body).await, Some(Some(Ok(_)))));
        assert!(!send_waits(&sender).await, "room after one chunk was read");
        assert!(send_waits(&sender).await, "and for one only");
        // The client reads everything in order: 16 sent, 48 pushed, the one sent after.
        let mut read = Vec::new();
        while let Some(Some(Ok(chunk))) = next(&mut body).await {
            read.push(chunk);
        }
        assert_eq!(read.len(), CHANNEL_CHUNKS - 1 + 3 * CHANNEL_CHUNKS + 1);
        assert_eq!(read.last(), Some(&Bytes::from_static(b"y")));
    }

    #[tokio::test]
    async fn the_task_learns_when_the_client_is_gone() {
        let (sender, body) = channel(BodySize::Sized(1));
        drop(body);
        assert!(sender.send(Ok(Bytes::from_static(b"x"))).await.is_err());
        assert!(sender.push(Ok(Bytes::from_static(b"x"))).is_err());
    }
}
