//! `header_read_timeout` for a connection served by hyper (HTTP/2, handed over by
//! [`super::h1`] after its preface), kept as one lazy timer per connection. HTTP/1.1
//! connections keep theirs in [`super::h1::conn`].
//!
//! The connection records when it last went idle (a clock read when a response
//! ends), and one timer per connection ([`HeadWatch`], polled when a read has to
//! wait) checks that record when it fires: a connection idle for the whole limit has
//! its reads fail, and hyper closes it; any other is looked at again when its own
//! limit would run out. The limit runs from the connection's start, and again from
//! the end of each response, until the next request arrives; not while a request is
//! being answered; and once a connection has carried an HTTP/2 request, no longer at
//! all: HTTP/2 idles under its keep-alive pings. A connection that runs out of time
//! is closed without a 408.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::Version;
use tokio::time::{Instant, Sleep};

use crate::proxy::body::{BodyError, BoxBody};

/// What a connection's head timer reads: written by its requests, read when it fires.
#[derive(Debug)]
pub struct Activity {
    opened: Instant,
    /// A request came over HTTP/2.
    h2: AtomicBool,
    /// Requests being answered: from the service call to the end of the response body.
    answering: AtomicU32,
    /// When the last answer ended, in nanoseconds after `opened` (0: none yet).
    idle_since: AtomicU64,
}

/// What the timer does when it fires, decided from the connection's [`Activity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The limit has run out with no request head read: close the connection.
    Close,
    /// Fire again then.
    At(Instant),
    /// Never fire again (an HTTP/2 connection).
    Never,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            opened: Instant::now(),
            h2: AtomicBool::new(false),
            answering: AtomicU32::new(0),
            idle_since: AtomicU64::new(0),
        })
    }

    /// A request has arrived: it is answered until the guard is dropped (with the
    /// response body it is handed to, see [`Answer`]).
    pub fn answering(self: &Arc<Self>, version: Version) -> Answering {
        if version == Version::HTTP_2 {
            self.h2.store(true, Ordering::Relaxed);
        }
        self.answering.fetch_add(1, Ordering::Relaxed);
        Answering(self.clone())
    }

    /// When the limit runs out for a connection that is idle now, given `limit`.
    fn idle_deadline(&self, limit: Duration) -> Instant {
        self.opened + Duration::from_nanos(self.idle_since.load(Ordering::Relaxed)) + limit
    }

    /// What the timer does when it fires at `now`.
    pub fn next(&self, now: Instant, limit: Duration) -> Next {
        if self.h2.load(Ordering::Relaxed) {
            return Next::Never;
        }
        if self.answering.load(Ordering::Relaxed) > 0 {
            return Next::At(now + limit);
        }
        match self.idle_deadline(limit) {
            deadline if deadline <= now => Next::Close,
            deadline => Next::At(deadline),
        }
    }
}

/// The head timer of one connection, polled by its reads whenever one has to wait.
/// It is armed once and re-armed only when it fires (then [`Activity::next`] decides),
/// so a busy connection pays one poll of an armed timer per request, not a timer per
/// head.
#[derive(Debug)]
pub struct HeadWatch {
    activity: Arc<Activity>,
    limit: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl HeadWatch {
    pub fn new(activity: Arc<Activity>, limit: Duration) -> HeadWatch {
        HeadWatch {
            activity,
            limit,
            timer: None,
        }
    }

    /// Called when a read has to wait: ready once the connection has waited its limit
    /// for a request head (its reads should then fail, which closes it).
    pub fn poll_lapsed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let a = &self.activity;
        if a.h2.load(Ordering::Relaxed) {
            return Poll::Pending;
        }
        // Armed even while a request is answered: hyper may not read again when the
        // answer ends, and the timer's wake-up is what makes it read (and so look).
        let limit = self.limit;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(a.idle_deadline(limit))));
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            match a.next(Instant::now(), limit) {
                Next::Close => return Poll::Ready(()),
                Next::At(then) => timer.as_mut().reset(then),
                Next::Never => return Poll::Pending,
            }
        }
    }
}

/// A request being answered; dropped, it marks the connection idle from then.
#[derive(Debug)]
pub struct Answering(Arc<Activity>);

impl Drop for Answering {
    fn drop(&mut self) {
        let a = &self.0;
        let since = Instant::now().saturating_duration_since(a.opened);
        // At least 1 ns: 0 is "no answer yet" (the limit then runs from the start).
        let nanos = (since.as_nanos() as u64).max(1);
        a.idle_since.store(nanos, Ordering::Relaxed);
        a.answering.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that holds its request's [`Answering`] until hyper drops it, after
/// its last frame is written (or with the connection).
pub struct Answer {
    body: BoxBody,
    _answering: Answering,
}

impl Answer {
    pub fn new(body: BoxBody, answering: Answering) -> Answer {
        Answer {
            body,
            _answering: answering,
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(10);

    #[test]
    fn a_connection_that_never_asks_closes_at_the_limit_from_its_start() {
        let a = Activity::new();
        let start = a.opened;
        assert_eq!(a.next(start + LIMIT / 2, LIMIT), Next::At(start + LIMIT));
        assert_eq!(a.next(start + LIMIT, LIMIT), Next::Close);
    }

    #[test]
    fn the_limit_does_not_run_while_a_request_is_answered() {
        let a = Activity::new();
        let answering = a.answering(Version::HTTP_11);
        let late = a.opened + LIMIT * 5;
        assert_eq!(a.next(late, LIMIT), Next::At(late + LIMIT));
        drop(answering);
        // Idle from the end of the answer (just now): a full limit from then.
        let ended = a.idle_deadline(Duration::ZERO);
        assert!(ended >= a.opened);
        assert_eq!(a.next(ended + LIMIT / 2, LIMIT), Next::At(ended + LIMIT));
        assert_eq!(a.next(ended + LIMIT, LIMIT), Next::Close);
    }

    #[test]
    fn two_requests_in_flight_keep_it_busy_until_both_end() {
        let a = Activity::new();
        let (one, two) = (a.answering(Version::HTTP_11), a.answering(Version::HTTP_11));
        drop(one);
        let late = a.opened + LIMIT * 3;
        assert_eq!(a.next(late, LIMIT), Next::At(late + LIMIT));
        drop(two);
        assert_eq!(a.next(late, LIMIT), Next::Close);
    }

    #[test]
    fn an_http2_connection_is_left_to_its_keep_alive() {
        let a = Activity::new();
        drop(a.answering(Version::HTTP_2));
        assert_eq!(a.next(a.opened + LIMIT * 100, LIMIT), Next::Never);
    }

    #[test]
    fn the_answer_body_ends_the_answer_when_dropped() {
        let a = Activity::new();
        let body = Answer::new(
            crate::proxy::body::full("hi"),
            a.answering(Version::HTTP_11),
        );
        assert_eq!(a.answering.load(Ordering::Relaxed), 1);
        assert_eq!(body.size_hint().exact(), Some(2));
        drop(body);
        assert_eq!(a.answering.load(Ordering::Relaxed), 0);
        assert!(a.idle_since.load(Ordering::Relaxed) > 0);
    }
}
