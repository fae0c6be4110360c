//! The client's side of a streamed response (C24): a body fed, chunk by chunk, by the task that
//! drives the handler's own body (see the module docs of [`super`]).
//!
//! At most [`CHANNEL_CHUNKS`] chunks wait in the channel for the client. Two ways to hand one
//! over ([`Client`]): while the response may still be stored, [`Client::offer`] never waits,
//! because the record must not depend on how fast the client reads (a client that stops
//! reading would otherwise hold the handler's body, and with it the key, until renewal gave up
//! and a retry ran the handler again); what the client has no room for yet is appended to one
//! backlog buffer (bounded by `max_response_bytes`, the copy's own limit; one buffer, so tiny
//! chunks cost no per-chunk overhead) and handed over as the client makes room. Once the
//! response cannot be stored (over the limit), [`Client::send`] waits for room (backpressure on
//! the handler's stream).
//!
//! Home-made because it is a few lines over Tokio's channel and semaphore: actix's
//! `BodyStream` would need `tokio-stream` for the same adapter, and its error type would carry
//! the handler's error text to the connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, MessageBody};
use bytes::{Bytes, BytesMut};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// How many chunks may wait in the channel between the task and a slow client. Small: it
/// bounds the memory and the per-chunk overhead a slow client costs.
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

/// What the channel carries: an item, the task's word that the body's last bytes may go
/// before its end, or its word that the body is complete.
enum Message {
    Item(Item),
    LetLastBytesGo,
    End,
}

/// A message on its way, with the room it takes (an item takes one of [`CHANNEL_CHUNKS`]; the
/// end or a failure none): the room is freed when the client takes it.
type Queued = (Message, Option<OwnedSemaphorePermit>);

/// The task's end of the channel.
pub(super) struct Sender {
    chunks: mpsc::UnboundedSender<Queued>,
    /// [`CHANNEL_CHUNKS`] permits, one per item waiting for the client.
    room: Arc<Semaphore>,
}

impl Sender {
    /// Queue `item` once the client has room for it.
    pub(super) async fn send(&self, item: Item) -> Result<(), Gone> {
        let room = self.room().await?;
        self.put(room, item)
    }

    /// Room for one item, once the client has taken enough; `Gone` when it is gone.
    async fn room(&self) -> Result<OwnedSemaphorePermit, Gone> {
        if self.chunks.is_closed() {
            return Err(Gone);
        }
        // The semaphore is never closed. A client that goes away while this waits drops its
        // queue, and with it the permits, so the wait ends and the `put` reports it.
        Arc::clone(&self.room)
            .acquire_owned()
            .await
            .map_err(|_| Gone)
    }

    /// Room for one item now, if the client has any.
    fn room_now(&self) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.room).try_acquire_owned().ok()
    }

    fn put(&self, room: OwnedSemaphorePermit, item: Item) -> Result<(), Gone> {
        self.chunks
            .send((Message::Item(item), Some(room)))
            .map_err(|_| Gone)
    }

    /// Fail the client's body (the connection is aborted once it gets there).
    pub(super) fn fail(self) {
        let _ = self.chunks.send((Message::Item(Err(BodyFailed)), None));
    }

    /// A declared body's last bytes go to the client as they come, no longer held for its end
    /// ([`Forwarded`]): the record will not be stored, or the stream keeps its end waiting.
    fn let_last_bytes_go(&self) {
        let _ = self.chunks.send((Message::LetLastBytesGo, None));
    }

    /// The body is complete (the record is stored, or will not be): the client gets its end.
    /// A sender dropped without this (the task cut by a worker's stop, or a panic) fails the
    /// client's body instead, so a cut response never looks whole.
    pub(super) fn finish(self) {
        let _ = self.chunks.send((Message::End, None));
    }

    /// Wait until the client is gone (its body dropped).
    pub(super) async fn gone(&self) {
        self.chunks.closed().await;
    }
}

/// The task's side of a client's body: the channel, and the backlog of bytes the client had
/// no room for while the response was being kept for the record.
pub(super) struct Client {
    sender: Sender,
    backlog: BytesMut,
}

impl Client {
    /// The client behind `sender`.
    pub(super) fn new(sender: Sender) -> Self {
        Client {
            sender,
            backlog: BytesMut::new(),
        }
    }

    /// Hand `chunk` over without waiting: into the channel if the client has room and no
    /// backlog waits before it, else onto the backlog.
    pub(super) fn offer(&mut self, chunk: Bytes) -> Result<(), Gone> {
        if self.backlog.is_empty() {
            if let Some(room) = self.sender.room_now() {
                return self.sender.put(room, Ok(chunk));
            }
        }
        if self.sender.chunks.is_closed() {
            return Err(Gone);
        }
        self.backlog.extend_from_slice(&chunk);
        Ok(())
    }

    /// Hand `chunk` over once the client has room for it, the backlog first.
    pub(super) async fn send(&mut self, chunk: Bytes) -> Result<(), Gone> {
        self.send_backlog().await?;
        self.sender.send(Ok(chunk)).await
    }

    /// Wait until the backlog moves into room the client made (`Ok`), or the client is gone
    /// (`Err`); with no backlog, only for the client to go. Cancel-safe: the backlog moves
    /// only in the poll that gets the room.
    pub(super) async fn progress(&mut self) -> Result<(), Gone> {
        if self.backlog.is_empty() {
            self.sender.gone().await;
            return Err(Gone);
        }
        let room = self.sender.room().await?;
        let backlog = self.backlog.split().freeze();
        self.sender.put(room, Ok(backlog))
    }

    /// Whether bytes wait for room the client has not made yet ([`Client::finish`] waits for
    /// it).
    pub(super) fn has_backlog(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// See [`Sender::let_last_bytes_go`]: after the backlog, whenever it moves (the order
    /// does not matter: the body lets go of its last bytes whenever they come).
    pub(super) fn let_last_bytes_go(&self) {
        self.sender.let_last_bytes_go();
    }

    /// The body failed: abort the client's connection (its backlog is moot).
    pub(super) fn fail(self) {
        self.sender.fail();
    }

    /// The body is complete: the backlog (waiting for the client's room), then its end.
    pub(super) async fn finish(mut self) {
        if self.send_backlog().await.is_ok() {
            self.sender.finish();
        }
    }

    async fn send_backlog(&mut self) -> Result<(), Gone> {
        if self.backlog.is_empty() {
            return Ok(());
        }
        let backlog = self.backlog.split().freeze();
        self.sender.send(Ok(backlog)).await
    }
}

/// The body the client reads: the chunks the task forwards, ending when the task says it is
/// complete ([`Sender::finish`], after the record is stored) or failing (the connection is
/// aborted) when the task sends [`BodyFailed`] or goes away without finishing.
///
/// A body of unknown length ends for the client with its end marker, which comes with
/// [`Sender::finish`]. A body whose length is declared (its size, or a `Content-Length` its
/// handler states for a stream, `flow::stated_length`) ends for the client at its last byte,
/// so the chunk that completes it is held until then: either way a client that has the whole
/// response can retry at once and get the replay, not a 409. Held no longer than the task
/// says ([`Client::let_last_bytes_go`]): for a response that will not be stored, and for a
/// stream that has yielded every declared byte but keeps its end waiting (`flow`), which
/// without the middleware the client would have had whole already.
pub(super) struct Forwarded {
    chunks: mpsc::UnboundedReceiver<Queued>,
    /// The handler body's own size, so a sized stream keeps its `Content-Length`.
    size: BodySize,
    /// Whether the body's length is declared, so its last chunk is held.
    declared: bool,
    /// Bytes of a declared body not yet passed on.
    left: u64,
    /// The chunk that completes a declared body, until the task is done.
    last: Option<Bytes>,
    /// The task let the last bytes go ([`Message::LetLastBytesGo`]): no longer held.
    let_go: bool,
    /// Ended: finished by the task, or failed.
    ended: bool,
}

/// A fresh channel: the sender for the task, the body for the response, which reports the
/// handler body's `size` and ends for the client after `declared` bytes when its length is
/// declared.
pub(super) fn channel(size: BodySize, declared: Option<u64>) -> (Sender, Forwarded) {
    let (chunks_in, chunks) = mpsc::unbounded_channel();
    let sender = Sender {
        chunks: chunks_in,
        room: Arc::new(Semaphore::new(CHANNEL_CHUNKS)),
    };
    let body = Forwarded {
        chunks,
        size,
        declared: declared.is_some(),
        left: declared.unwrap_or(0),
        last: None,
        let_go: false,
        ended: false,
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
            // The message's room (if it took any) is freed here, as the client takes it.
            let message = match this.chunks.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some((message, _room))) => message,
                Poll::Ready(None) if this.ended => return Poll::Ready(None),
                // The task went away without finishing the body: never let that look whole.
                Poll::Ready(None) => {
                    this.ended = true;
                    this.last = None;
                    return Poll::Ready(Some(Err(BodyFailed)));
                }
            };
            let chunk = match message {
                Message::End => {
                    this.ended = true;
                    return Poll::Ready(this.last.take().map(Ok));
                }
                Message::LetLastBytesGo => {
                    this.let_go = true;
                    match this.last.take() {
                        Some(held) => return Poll::Ready(Some(Ok(held))),
                        None => continue,
                    }
                }
                Message::Item(Ok(chunk)) if this.declared => chunk,
                Message::Item(Ok(chunk)) => return Poll::Ready(Some(Ok(chunk))),
                Message::Item(Err(failed)) => {
                    this.ended = true;
                    return Poll::Ready(Some(Err(failed)));
                }
            };
            if chunk.is_empty() && this.last.is_some() {
                // An empty chunk after the last bytes (a body that yields one before its end)
                // must not push them out early.
                continue;
            }
            let len = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
            this.left = this.left.saturating_sub(len);
            if this.left > 0 || this.let_go {
                return Poll::Ready(Some(Ok(chunk)));
            }
            // The body's last bytes: held until the task is done (see above). A handler that
            // sends more than its size is cut by actix anyway.
            match this.last.take() {
                Some(held) => {
                    this.last = Some(chunk);
                    return Poll::Ready(Some(Ok(held)));
                }
                None => this.last = Some(chunk),
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
        let (sender, body) = channel(BodySize::Sized(11), Some(11));
        assert_eq!(
            body.size(),
            BodySize::Sized(11),
            "the handler's size is kept"
        );
        for chunk in ["hello", " ", "world"] {
            assert!(sender.send(Ok(Bytes::from(chunk))).await.is_ok());
        }
        sender.finish();
        match to_bytes(body).await {
            Ok(bytes) => assert_eq!(bytes, Bytes::from_static(b"hello world")),
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn a_sized_body_gives_its_last_bytes_only_once_the_task_is_done() {
        let (sender, mut body) = channel(BodySize::Sized(6), Some(6));
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
        sender.finish();
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"def")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(next(&mut body).await, Some(None)), "then the end");
    }

    /// A stream whose handler states its length (`no_chunking`) ends for the client at its
    /// last stated byte as a sized body does, so that byte is held too (review, 2026-12-06:
    /// a client that read them all and retried at once got 409 while the record was stored).
    #[tokio::test]
    async fn a_stream_of_stated_length_gives_its_last_bytes_only_once_the_task_is_done() {
        let (sender, mut body) = channel(BodySize::Stream, Some(6));
        assert_eq!(body.size(), BodySize::Stream, "the handler's size is kept");
        assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
        assert!(matches!(next(&mut body).await, Some(Some(Ok(_)))));
        assert!(sender.send(Ok(Bytes::from_static(b"def"))).await.is_ok());
        assert!(
            next(&mut body).await.is_none(),
            "the stated length's last bytes wait while the record is being stored"
        );
        sender.finish();
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"def")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(next(&mut body).await, Some(None)), "then the end");
    }

    #[tokio::test]
    async fn an_empty_chunk_after_the_last_bytes_does_not_release_them() {
        let (sender, mut body) = channel(BodySize::Sized(3), Some(3));
        assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
        assert!(sender.send(Ok(Bytes::new())).await.is_ok());
        assert!(
            next(&mut body).await.is_none(),
            "still held while the record is being stored"
        );
        sender.finish();
        match next(&mut body).await {
            Some(Some(Ok(chunk))) => assert_eq!(chunk, Bytes::from_static(b"abc")),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_failed_sized_body_never_gives_its_held_bytes() {
        let (sender, body) = channel(BodySize::Sized(3), Some(3));
        assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
        assert!(sender.send(Err(BodyFailed)).await.is_ok());
        drop(sender);
        assert!(to_bytes(body).await.is_err());
    }

    #[tokio::test]
    async fn a_body_waits_for_the_task_and_reports_each_chunk() {
        let (sender, mut body) = channel(BodySize::Stream, None);
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
        sender.finish();
        assert!(
            matches!(next(&mut body).await, Some(None)),
            "the end of the body once the task is done"
        );
    }

    #[tokio::test]
    async fn a_failed_handler_body_fails_the_forwarded_body_with_a_fixed_message() {
        let (sender, body) = channel(BodySize::Stream, None);
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
    async fn send_waits_for_the_client() {
        let (sender, mut body) = channel(BodySize::Stream, None);
        for i in 0..CHANNEL_CHUNKS {
            assert!(
                sender.send(Ok(Bytes::from_static(b"x"))).await.is_ok(),
                "chunk {i} fits"
            );
        }
        assert!(send_waits(&sender).await, "a slow client makes send wait");
        // Reading one chunk makes room for one more send.
        assert!(matches!(next(&mut body).await, Some(Some(Ok(_)))));
        assert!(!send_waits(&sender).await, "room after one chunk was read");
        assert!(send_waits(&sender).await, "and for one only");
    }

    /// What a client has no room for waits in one buffer, without waiting for the client, and
    /// moves as one chunk when it makes room; everything arrives in order, then the end.
    #[tokio::test]
    async fn offer_never_waits_and_the_backlog_moves_as_room_frees() {
        let (sender, mut body) = channel(BodySize::Stream, None);
        let mut client = Client::new(sender);
        for _ in 0..CHANNEL_CHUNKS {
            assert!(client.offer(Bytes::from_static(b"x")).is_ok());
        }
        for _ in 0..1000 {
            assert!(client.offer(Bytes::from_static(b"p")).is_ok());
        }
        assert_eq!(
            client.backlog.len(),
            1000,
            "one buffer, not 1000 queued chunks"
        );
        let waits = tokio::time::timeout(Duration::from_millis(50), client.progress()).await;
        assert!(
            waits.is_err(),
            "the backlog moved while the client had no room"
        );
        assert!(matches!(next(&mut body).await, Some(Some(Ok(_)))));
        let moved = tokio::time::timeout(Duration::from_secs(1), client.progress()).await;
        assert!(matches!(moved, Ok(Ok(()))), "{moved:?}");
        assert!(client.backlog.is_empty());
        assert!(client.offer(Bytes::from_static(b"z")).is_ok());
        let reading = async {
            let mut read = Vec::new();
            while let Some(Some(Ok(chunk))) = next(&mut body).await {
                read.push(chunk);
            }
            (read, next(&mut body).await)
        };
        let ((read, after), ()) = tokio::join!(reading, client.finish());
        let mut expected = vec![Bytes::from_static(b"x"); CHANNEL_CHUNKS - 1];
        expected.push(Bytes::from(vec![b'p'; 1000]));
        expected.push(Bytes::from_static(b"z"));
        assert_eq!(read, expected);
        assert!(
            matches!(after, Some(None)),
            "the end after everything: {after:?}"
        );
    }

    /// A task cut before it finished the body (its worker stopped, or it panicked) fails the
    /// client's body: a chunked body would otherwise end with a valid terminator, and a sized
    /// one would give its held last bytes, as if the response were whole and stored.
    #[tokio::test]
    async fn a_body_whose_task_went_away_unfinished_fails() {
        for size in [BodySize::Sized(6), BodySize::Stream] {
            let declared = if size == BodySize::Stream {
                None
            } else {
                Some(6)
            };
            let (sender, mut body) = channel(size, declared);
            assert!(sender.send(Ok(Bytes::from_static(b"abc"))).await.is_ok());
            assert!(sender.send(Ok(Bytes::from_static(b"def"))).await.is_ok());
            drop(sender);
            let mut read = Vec::new();
            let end = loop {
                match next(&mut body).await {
                    Some(Some(Ok(chunk))) => read.push(chunk),
                    other => break other,
                }
            };
            assert!(
                matches!(end, Some(Some(Err(BodyFailed)))),
                "{size:?}: {end:?}"
            );
            if size == BodySize::Sized(6) {
                assert_eq!(
                    read,
                    [Bytes::from_static(b"abc")],
                    "the last bytes were given"
                );
            }
            assert!(matches!(next(&mut body).await, Some(None)), "then nothing");
        }
    }

    #[tokio::test]
    async fn the_task_learns_when_the_client_is_gone() {
        let (sender, body) = channel(BodySize::Sized(1), Some(1));
        drop(body);
        assert!(sender.send(Ok(Bytes::from_static(b"x"))).await.is_err());
        let gone = tokio::time::timeout(Duration::from_secs(1), sender.gone()).await;
        assert!(gone.is_ok(), "gone() did not see the client leave");
        let mut client = Client::new(sender);
        assert!(client.offer(Bytes::from_static(b"x")).is_err());
        let progress = tokio::time::timeout(Duration::from_secs(1), client.progress()).await;
        assert!(matches!(progress, Ok(Err(Gone))), "{progress:?}");
    }
}
