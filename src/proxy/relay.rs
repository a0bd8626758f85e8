//! The relayed response body: the engine's body passed through frame by frame (no
//! buffering, no coalescing) with the node's [`Reservation`] attached, so the slot is
//! held exactly until the stream ends, fails, or the client leaves (the body is dropped,
//! which drops the upstream exchange and makes the engine abort the sequence).

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use crate::balance::Reservation;
use crate::body::BodyError;

pub struct RelayBody {
    inner: Incoming,
    reservation: Option<Reservation>,
}

impl RelayBody {
    pub fn new(inner: Incoming, reservation: Reservation) -> Self {
        RelayBody {
            inner,
            reservation: Some(reservation),
        }
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match frame {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            Some(Err(e)) => {
                // The engine broke the stream: free the slot now, not when hyper
                // gets around to dropping us.
                self.reservation = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            None => {
                self.reservation = None;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
