//! The one request body type of every listener, [`RequestBody`]: an HTTP/2 stream's
//! body as hyper reads it, or an HTTP/1.1 body from the balancer's own server
//! (`server::h1`): whole when it came with its head (most do), or handed over through
//! a [`BodyPipe`] as the connection reads it.
//!
//! The pipe holds one chunk at a time and is read on demand: the connection reads
//! the socket for a body only while the handler is waiting for it, so a handler that
//! stops reading stops the upload, and one that never reads (a 401, a 404) never
//! makes the connection read a body for nobody.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use parking_lot::Mutex;

use super::body::BodyError;

/// A request body, whichever server read its head.
#[derive(Debug)]
pub enum RequestBody {
    /// An HTTP/2 stream's body.
    Hyper(Incoming),
    /// A body that came whole with its head, or none (`None`).
    Whole(Option<Bytes>),
    /// A body still arriving; its length if it was declared.
    Arriving(BodyReceiver, Option<u64>),
}

impl RequestBody {
    pub fn empty() -> RequestBody {
        RequestBody::Whole(None)
    }
}

impl From<Incoming> for RequestBody {
    fn from(body: Incoming) -> Self {
        RequestBody::Hyper(body)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            RequestBody::Hyper(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|frame| frame.map(|f| f.map_err(BodyError::from))),
            RequestBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            RequestBody::Arriving(pipe, _) => pipe
                .poll_chunk(cx)
                .map(|chunk| chunk.map(|c| c.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Hyper(body) => body.is_end_stream(),
            RequestBody::Whole(bytes) => bytes.is_none(),
            RequestBody::Arriving(..) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Hyper(body) => body.size_hint(),
            RequestBody::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            RequestBody::Arriving(_, Some(n)) => SizeHint::with_exact(*n),
            RequestBody::Arriving(_, None) => SizeHint::default(),
        }
    }
}

/// What the two ends of a pipe share.
#[derive(Debug, Default)]
struct Pipe {
    /// The chunk handed over and not yet taken.
    chunk: Option<Result<Bytes, BodyError>>,
    /// The reader polled and found nothing: the connection should read.
    wanted: bool,
    /// The body has ended (after `chunk` is taken).
    ended: bool,
    /// The reader has gone.
    dropped: bool,
    reader: Option<Waker>,
    writer: Option<Waker>,
}

/// A new pipe: the connection's end, and the body's.
pub fn body_pipe() -> (BodyPipe, BodyReceiver) {
    let shared = Arc::new(Mutex::new(Pipe::default()));
    (BodyPipe(shared.clone()), BodyReceiver(shared))
}

/// The connection's end of a body's pipe. Dropped before [`BodyPipe::end`], the body
/// ends in an error (the client's connection closed, or broke the framing).
#[derive(Debug)]
pub struct BodyPipe(Arc<Mutex<Pipe>>);

/// The reader has dropped its end: no more of the body is wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderGone;

impl BodyPipe {
    /// Ready once the reader is waiting for a chunk and none is held.
    pub fn poll_wanted(&self, cx: &mut Context<'_>) -> Poll<Result<(), ReaderGone>> {
        let mut pipe = self.0.lock();
        if pipe.dropped {
            return Poll::Ready(Err(ReaderGone));
        }
        if pipe.wanted && pipe.chunk.is_none() {
            return Poll::Ready(Ok(()));
        }
        if !pipe
            .writer
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            pipe.writer = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Hands over a chunk (call after [`BodyPipe::poll_wanted`] was ready).
    pub fn send(&self, chunk: Bytes) {
        self.hand_over(Some(Ok(chunk)), false);
    }

    /// The body has ended whole.
    pub fn end(self) {
        self.hand_over(None, true);
    }

    /// The body ends in `error`.
    pub fn fail(self, error: BodyError) {
        self.hand_over(Some(Err(error)), true);
    }

    fn hand_over(&self, chunk: Option<Result<Bytes, BodyError>>, ended: bool) {
        let reader = {
            let mut pipe = self.0.lock();
            if chunk.is_some() {
                pipe.chunk = chunk;
            }
            pipe.ended |= ended;
            pipe.wanted = false;
            pipe.reader.take()
        };
        if let Some(w) = reader {
            w.wake();
        }
    }
}

impl Drop for BodyPipe {
    fn drop(&mut self) {
        let ended = self.0.lock().ended;
        if !ended {
            self.hand_over(
                Some(Err(
                    "the client's connection ended before the request body did".into(),
                )),
                true,
            );
        }
    }
}

/// The body's end of a pipe.
#[derive(Debug)]
pub struct BodyReceiver(Arc<Mutex<Pipe>>);

impl BodyReceiver {
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        let writer = {
            let mut pipe = self.0.lock();
            if let Some(chunk) = pipe.chunk.take() {
                return Poll::Ready(Some(chunk));
            }
            if pipe.ended {
                return Poll::Ready(None);
            }
            pipe.wanted = true;
            if !pipe
                .reader
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                pipe.reader = Some(cx.waker().clone());
            }
            pipe.writer.take()
        };
        if let Some(w) = writer {
            w.wake();
        }
        Poll::Pending
    }
}

impl Drop for BodyReceiver {
    fn drop(&mut self) {
        let writer = {
            let mut pipe = self.0.lock();
            pipe.dropped = true;
            pipe.writer.take()
        };
        if let Some(w) = writer {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_pipe_hands_over_chunks_as_they_are_wanted_and_ends_whole() {
        let (pipe, receiver) = body_pipe();
        let body = RequestBody::Arriving(receiver, Some(6));
        let reader = tokio::spawn(async move { body.collect().await.map(|c| c.to_bytes()) });
        for part in ["abc", "def"] {
            std::future::poll_fn(|cx| pipe.poll_wanted(cx))
                .await
                .unwrap();
            pipe.send(Bytes::from_static(part.as_bytes()));
        }
        std::future::poll_fn(|cx| pipe.poll_wanted(cx))
            .await
            .unwrap();
        pipe.end();
        assert_eq!(
            reader.await.unwrap().unwrap(),
            Bytes::from_static(b"abcdef")
        );
    }

    #[tokio::test]
    async fn a_pipe_dropped_early_ends_the_body_in_an_error_and_a_dropped_body_is_seen() {
        let (pipe, receiver) = body_pipe();
        let mut body = RequestBody::Arriving(receiver, None);
        drop(pipe);
        let frame = body.frame().await.expect("an error, not the end");
        assert!(frame.is_err());

        let (pipe, receiver) = body_pipe();
        drop(receiver);
        let wanted = std::future::poll_fn(|cx| pipe.poll_wanted(cx)).await;
        assert_eq!(wanted, Err(ReaderGone));
    }
}
