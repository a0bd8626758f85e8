//! The relayed response body: the engine's body passed through frame by frame (no
//! buffering, no coalescing) with the node's [`Reservation`] attached, so the slot is
//! held exactly until the stream ends, fails, or the client leaves (the body is dropped,
//! which drops the upstream exchange and makes the engine abort the sequence).
//!
//! A committed SSE stream is also watched: if the engine breaks it, or stays silent
//! for `idle_stream_timeout`, the client gets a final `data: {"error": …}` event and a
//! clean end instead of a silent truncation, and the failure counts against the node.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::balance::Reservation;
use crate::body::BodyError;
use crate::breaker::{BreakerSettings, Outcome};

/// Watches a committed stream for breaks and silences.
struct StreamWatch {
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    settings: Arc<BreakerSettings>,
}

pub struct RelayBody {
    /// Bytes read before the stream was committed, sent first.
    held: Option<Bytes>,
    inner: Incoming,
    reservation: Option<Reservation>,
    watch: Option<StreamWatch>,
    ended: bool,
}

impl RelayBody {
    /// A body passed through as it is.
    pub fn plain(inner: Incoming, reservation: Reservation) -> Self {
        RelayBody {
            held: None,
            inner,
            reservation: Some(reservation),
            watch: None,
            ended: false,
        }
    }

    /// A committed SSE stream: `held` first, then the rest, watched.
    pub fn stream(
        held: Bytes,
        inner: Incoming,
        reservation: Reservation,
        idle: Duration,
        settings: Arc<BreakerSettings>,
    ) -> Self {
        RelayBody {
            held: Some(held),
            inner,
            reservation: Some(reservation),
            watch: Some(StreamWatch {
                idle,
                timer: Box::pin(tokio::time::sleep(idle)),
                settings,
            }),
            ended: false,
        }
    }

    /// Ends a watched stream with an error event; the node is blamed.
    fn fail(&mut self, why: String) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.ended = true;
        if let (Some(r), Some(w)) = (self.reservation.take(), &self.watch) {
            tracing::warn!(node = %r.node().id, reason = %why, "stream failed after commit; ending it with an error event");
            r.node().record(Outcome::Failure, None, false, &w.settings);
        }
        let event = serde_json::json!({"error": {
            "message": format!("the engine failed mid-stream: {why}"),
            "type": "upstream_error",
            "code": "stream_interrupted",
        }});
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
            "data: {event}\n\n"
        ))))))
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if let Some(held) = self.held.take() {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        if self.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(w) = &mut self.watch {
                    let next = Instant::now() + w.idle;
                    w.timer.as_mut().reset(next);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) if self.watch.is_some() => {
                self.fail(format!("the stream broke ({e})"))
            }
            Poll::Ready(Some(Err(e))) => {
                // A plain body cannot carry an error event: the client sees the
                // connection fail, which is an explicit error at the HTTP level.
                self.ended = true;
                self.reservation = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                self.ended = true;
                self.reservation = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let silent = match &mut self.watch {
                    Some(w) => w.timer.as_mut().poll(cx).is_ready().then_some(w.idle),
                    None => None,
                };
                match silent {
                    Some(idle) => self.fail(format!("no data for {} ms", idle.as_millis())),
                    None => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || (self.held.is_none() && self.watch.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        if self.watch.is_some() {
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}
