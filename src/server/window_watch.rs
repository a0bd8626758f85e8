//! A response stream that HTTP/2's flow control holds. hyper asks a response body for
//! its next frame only when the stream's window has room, so a client that keeps its
//! connection alive (it answers pings, its socket takes writes) but never opens one
//! stream's window would hold that stream's engine sequence and node slot until it
//! left. [`WindowWatch`] notes when it handed hyper a frame and has not been asked for
//! the next since; one timer per stream drops the body it wraps (the engine's stream
//! and the slot, as when a client leaves) once that wait reaches `idle_stream_timeout`.
//! The stream ends in an error, which hyper sends as a reset, when it is next asked
//! for a frame. A body that waits on its engine is not watched here: that is the
//! relay's own silence limit. HTTP/1.1 has the same limit on its socket writes
//! ([`super::h1::conn`]).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::proxy::body::BodyError;

/// A response body whose frames a stalled HTTP/2 window stops taking for longer than
/// `stall` loses its inner body.
pub struct WindowWatch<B> {
    shared: Arc<Shared<B>>,
    stall: Duration,
    /// The stall timer, started with the first frame handed over.
    timer: Option<AbortHandle>,
}

struct Shared<B> {
    /// `None` once the timer dropped it.
    body: Mutex<Option<B>>,
    start: Instant,
    /// When a frame was handed to hyper with no ask for the next since, in
    /// nanoseconds after `start` (0: hyper is asking, or has asked, for the next).
    owed_since: AtomicU64,
}

impl<B> Shared<B> {
    fn owed_since(&self) -> Option<Instant> {
        match self.owed_since.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(self.start + Duration::from_nanos(ns)),
        }
    }

    fn owe_from(&self, now: Instant) {
        let ns = now.saturating_duration_since(self.start).as_nanos() as u64;
        // At least 1 ns: 0 is "nothing owed".
        self.owed_since.store(ns.max(1), Ordering::Relaxed);
    }
}

/// What the stall timer does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    /// The stream has waited for its window the whole limit: drop its body.
    Stalled,
    /// Look again then.
    At(Instant),
}

/// The timer's decision at `now`, for a stream that owes hyper nothing (`None`) or
/// was last handed a frame at `owed_since` and not asked again.
fn look(owed_since: Option<Instant>, now: Instant, stall: Duration) -> Look {
    match owed_since {
        None => Look::At(now + stall),
        Some(since) if now.saturating_duration_since(since) >= stall => Look::Stalled,
        Some(since) => Look::At(since + stall),
    }
}

impl<B> WindowWatch<B> {
    pub fn new(body: B, stall: Duration) -> Self {
        WindowWatch {
            shared: Arc::new(Shared {
                body: Mutex::new(Some(body)),
                start: Instant::now(),
                owed_since: AtomicU64::new(0),
            }),
            stall,
            timer: None,
        }
    }
}

impl<B: Send + 'static> WindowWatch<B> {
    fn start_timer(&mut self) {
        let shared = Arc::downgrade(&self.shared);
        let stall = self.stall;
        self.timer = Some(tokio::spawn(watch(shared, stall)).abort_handle());
    }
}

/// The stall timer of one stream: it ends with the stream, or when it drops the body.
async fn watch<B>(shared: Weak<Shared<B>>, stall: Duration) {
    let mut at = Instant::now() + stall;
    loop {
        tokio::time::sleep_until(at).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // Decided under the lock: a poll that races the timer holds it, and asks first.
        let mut body = shared.body.lock();
        match look(shared.owed_since(), Instant::now(), stall) {
            Look::At(next) => at = next,
            Look::Stalled => {
                let stalled = body.take();
                drop(body);
                drop(stalled);
                tracing::debug!(
                    ?stall,
                    "an HTTP/2 stream's window stayed shut: its engine stream is dropped"
                );
                return;
            }
        }
    }
}

impl<B> Drop for WindowWatch<B> {
    fn drop(&mut self) {
        if let Some(timer) = &self.timer {
            timer.abort();
        }
    }
}

/// The error a stalled stream ends with.
#[derive(Debug, thiserror::Error)]
#[error("the client's HTTP/2 window stayed shut for {0:?}")]
struct WindowShut(Duration);

impl<B> Body for WindowWatch<B>
where
    B: Body<Data = Bytes, Error = BodyError> + Unpin + Send + 'static,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        this.shared.owed_since.store(0, Ordering::Relaxed);
        let poll = {
            let mut body = this.shared.body.lock();
            let Some(body) = body.as_mut() else {
                return Poll::Ready(Some(Err(WindowShut(this.stall).into())));
            };
            let poll = Pin::new(body).poll_frame(cx);
            if let Poll::Ready(Some(Ok(_))) = &poll {
                this.shared.owe_from(Instant::now());
            }
            poll
        };
        if this.timer.is_none() && matches!(poll, Poll::Ready(Some(Ok(_)))) {
            this.start_timer();
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.shared
            .body
            .lock()
            .as_ref()
            .is_some_and(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.shared
            .body
            .lock()
            .as_ref()
            .map_or_else(SizeHint::default, |b| b.size_hint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(120);

    #[test]
    fn a_stream_hyper_is_asking_is_looked_at_a_whole_limit_later() {
        let now = Instant::now();
        assert_eq!(look(None, now, STALL), Look::At(now + STALL));
    }

    #[test]
    fn a_frame_not_asked_after_is_a_stall_at_the_limit_from_its_handing_over() {
        let since = Instant::now();
        assert_eq!(
            look(Some(since), since + STALL / 2, STALL),
            Look::At(since + STALL)
        );
        assert_eq!(look(Some(since), since + STALL, STALL), Look::Stalled);
        assert_eq!(look(Some(since), since + STALL * 3, STALL), Look::Stalled);
    }
}
