//! Body types shared by the balancer, the admin listener and `mock-engine`: one
//! [`BoxBody`] alias, `full()`/`empty()` helpers, and a channel-fed body for streams.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};
use tokio::sync::mpsc;

/// The error type every response body may end with.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The one response body type.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BodyError>;

/// A complete body.
pub fn full(bytes: impl Into<Bytes>) -> BoxBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> BoxBody {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A body fed by a channel: each message is sent as one frame as soon as it arrives.
/// The sender sees `send` fail once the receiver (the connection) is gone, which is how
/// a producer learns that its client disconnected.
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl ChannelBody {
    /// A body and its sender; `depth` chunks may be queued before `send` waits.
    pub fn new(depth: usize) -> (mpsc::Sender<Bytes>, ChannelBody) {
        let (tx, rx) = mpsc::channel(depth);
        (tx, ChannelBody { rx })
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.rx
            .poll_recv(cx)
            .map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
