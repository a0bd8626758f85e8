//! A response stream that HTTP/2's flow control holds. hyper asks a response body for
//! its next frame only when the stream's window has room, so a client that keeps its
//! connection alive (it answers pings, its socket takes writes) but never opens one
//! stream's window would hold that stream's engine sequence and node slot until it
//! left. A watched body notes when it handed hyper a frame and has not been asked for
//! the next since; one timer per connection ([`Windows`]) drops such a body (the
//! engine's stream and the slot, as when a client leaves) once that wait reaches
//! `idle_stream_timeout`; the stream ends in an error, which hyper sends as a reset,
//! when it is next asked for a frame. A body that waits on its engine is not watched
//! here: that is the relay's own silence limit. HTTP/1.1 has the same limit on its
//! socket writes ([`super::h1::conn`]).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::proxy::body::{BodyError, BoxBody};

/// One HTTP/2 connection's watched streams and the one timer that looks at them,
/// started with the first stream that has more than one frame to give.
#[derive(Clone)]
pub struct Windows(Arc<Registry>);

struct Registry {
    stall: Duration,
    /// The connection's start: its streams' clock readings are kept after it.
    start: Instant,
    streams: Mutex<Streams>,
}

#[derive(Default)]
struct Streams {
    next: u64,
    watched: HashMap<u64, Weak<Shared>>,
    timer: Option<AbortHandle>,
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(timer) = &self.streams.get_mut().timer {
            timer.abort();
        }
    }
}

impl Windows {
    /// The registry of a connection whose streams may wait `stall` for their window.
    pub fn new(stall: Duration) -> Windows {
        Windows(Arc::new(Registry {
            stall,
            start: Instant::now(),
            streams: Mutex::default(),
        }))
    }

    /// `body`, watched from its first frame handed over that is not its last.
    pub fn watch(&self, body: BoxBody) -> BoxBody {
        WindowWatch {
            shared: Arc::new(Shared {
                body: Mutex::new(Some(body)),
                start: self.0.start,
                owed_since: AtomicU64::new(0),
            }),
            windows: self.clone(),
            id: None,
        }
        .boxed_unsync()
    }

    fn register(&self, shared: &Arc<Shared>) -> u64 {
        let mut streams = self.0.streams.lock();
        let id = streams.next;
        streams.next += 1;
        streams.watched.insert(id, Arc::downgrade(shared));
        if streams.timer.is_none() {
            let registry = Arc::downgrade(&self.0);
            let stall = self.0.stall;
            streams.timer = Some(tokio::spawn(watch(registry, stall)).abort_handle());
        }
        id
    }
}

/// The connection's stall timer: it ends with the connection.
async fn watch(registry: Weak<Registry>, stall: Duration) {
    let mut at = Instant::now() + stall;
    loop {
        tokio::time::sleep_until(at).await;
        let Some(registry) = registry.upgrade() else {
            return;
        };
        let now = Instant::now();
        at = now + stall;
        let stalled: Vec<Arc<Shared>> = {
            let streams = registry.streams.lock();
            let mut stalled = Vec::new();
            for shared in streams.watched.values().filter_map(Weak::upgrade) {
                match look(shared.owed_since(), now, stall) {
                    Look::Stalled => stalled.push(shared),
                    Look::At(next) => at = at.min(next),
                }
            }
            stalled
        };
        for shared in stalled {
            shared.drop_if_stalled(stall);
        }
    }
}

/// A stream's body and when it last handed hyper a frame, shared with the timer.
struct Shared {
    /// `None` once the timer dropped it.
    body: Mutex<Option<BoxBody>>,
    /// Its connection's start.
    start: Instant,
    /// When a frame was handed to hyper with no ask for the next since, in
    /// nanoseconds after `start` (0: hyper is asking, or has asked, for the next).
    owed_since: AtomicU64,
}

impl Shared {
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

    /// Drops the body if it still waits for its window. Decided under the body's lock:
    /// a poll that races the timer holds it, and asks first.
    fn drop_if_stalled(&self, stall: Duration) {
        let mut body = self.body.lock();
        if look(self.owed_since(), Instant::now(), stall) != Look::Stalled {
            return;
        }
        let stalled = body.take();
        // Nothing is owed by a stream with no body: the timer leaves it be.
        self.owed_since.store(0, Ordering::Relaxed);
        drop(body);
        drop(stalled);
        tracing::debug!(
            ?stall,
            "an HTTP/2 stream's window stayed shut: its engine stream is dropped"
        );
    }
}

/// What the stall timer does with a stream when it fires.
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

/// A response body whose frames a shut HTTP/2 window stops taking for longer than
/// the connection's limit loses its inner body.
struct WindowWatch {
    shared: Arc<Shared>,
    windows: Windows,
    /// Its place in the connection's registry, from the first frame handed over that
    /// is not the last.
    id: Option<u64>,
}

impl Drop for WindowWatch {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.windows.0.streams.lock().watched.remove(&id);
        }
    }
}

/// The error a stalled stream ends with.
#[derive(Debug, thiserror::Error)]
#[error("the client's HTTP/2 window stayed shut for {0:?}")]
struct WindowShut(Duration);

impl Body for WindowWatch {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        let mut more = false;
        this.shared.owed_since.store(0, Ordering::Relaxed);
        let poll = {
            let mut body = this.shared.body.lock();
            let Some(body) = body.as_mut() else {
                return Poll::Ready(Some(Err(WindowShut(this.windows.0.stall).into())));
            };
            let poll = Pin::new(&mut *body).poll_frame(cx);
            if let Poll::Ready(Some(Ok(_))) = &poll {
                this.shared.owe_from(Instant::now());
                // A body that has handed over its last frame is done with: hyper drops
                // it (and with it the engine's stream and the slot) whatever the
                // window, so only a body with more to come is watched.
                more = !body.is_end_stream();
            }
            poll
        };
        if more && this.id.is_none() {
            this.id = Some(this.windows.register(&this.shared));
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
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicBool;

    /// A body that answers its polls from a script (`None`: pending) and says when it
    /// is dropped.
    struct Scripted {
        polls: VecDeque<Option<&'static str>>,
        dropped: Arc<AtomicBool>,
    }

    impl Drop for Scripted {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::Relaxed);
        }
    }

    impl Body for Scripted {
        type Data = Bytes;
        type Error = BodyError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
            match self.polls.pop_front() {
                Some(Some(text)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from(text))))),
                Some(None) => Poll::Pending,
                None => Poll::Ready(None),
            }
        }
    }

    fn scripted(polls: &[Option<&'static str>]) -> (BoxBody, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        let body = Scripted {
            polls: polls.iter().copied().collect(),
            dropped: dropped.clone(),
        };
        (body.boxed_unsync(), dropped)
    }

    fn poll(body: &mut BoxBody) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        Pin::new(body).poll_frame(&mut Context::from_waker(std::task::Waker::noop()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_frame_hyper_does_not_ask_past_drops_the_body_at_the_limit() {
        let windows = Windows::new(STALL);
        let (inner, dropped) = scripted(&[Some("data: 1\n\n"), Some("data: 2\n\n")]);
        let mut body = windows.watch(inner);
        assert!(poll(&mut body).is_ready());
        // hyper does not ask again: the window is shut.
        tokio::time::sleep(STALL - Duration::from_secs(1)).await;
        assert!(!dropped.load(Ordering::Relaxed), "dropped before the limit");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(dropped.load(Ordering::Relaxed), "kept past the limit");
        // Asked again, the stream ends in an error (hyper resets it).
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Err(_)))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_waiting_on_its_engine_is_left_be() {
        let windows = Windows::new(STALL);
        let (inner, dropped) = scripted(&[Some("data: 1\n\n"), None, Some("data: 2\n\n")]);
        let mut body = windows.watch(inner);
        assert!(poll(&mut body).is_ready());
        // hyper asks for the next at once; the engine has nothing yet.
        assert!(poll(&mut body).is_pending());
        tokio::time::sleep(STALL * 3).await;
        assert!(
            !dropped.load(Ordering::Relaxed),
            "a silent engine is the relay's limit"
        );
        assert!(matches!(poll(&mut body), Poll::Ready(Some(Ok(_)))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_last_frame_is_not_watched() {
        let windows = Windows::new(STALL);
        let mut body = windows.watch(crate::proxy::body::full("{}"));
        assert!(poll(&mut body).is_ready());
        assert!(body.is_end_stream());
        assert!(
            windows.0.streams.lock().timer.is_none(),
            "a timer for one frame"
        );
        drop(body);
        let (inner, _) = scripted(&[Some("a"), Some("b")]);
        let mut body = windows.watch(inner);
        assert!(poll(&mut body).is_ready());
        assert_eq!(windows.0.streams.lock().watched.len(), 1);
        drop(body);
        assert!(
            windows.0.streams.lock().watched.is_empty(),
            "a dropped stream stays watched"
        );
    }

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
