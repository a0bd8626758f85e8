//! The relayed response body: the engine's body passed through frame by frame (no
//! buffering, no coalescing) with the node's [`Reservation`] attached, so the slot is
//! held exactly until the stream ends, fails, or the client leaves (the body is dropped,
//! which drops the upstream exchange and makes the engine abort the sequence).
//!
//! A committed SSE stream is also watched: if the engine breaks it, or stays silent
//! for `idle_stream_timeout`, the client gets a final `data: {"error": …}` event and a
//! clean end instead of a silent truncation, and the failure counts against the node.
//!
//! On the way through, the engine's `usage` numbers are picked out of the bytes (no
//! JSON parse), and when the body ends the request is counted and logged once.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use memchr::memmem::Finder;
use tokio::time::{Instant, Sleep};

use crate::balance::Reservation;
use crate::body::BodyError;
use crate::breaker::{BreakerSettings, Outcome};
use crate::metrics::Metrics;

/// Watches a committed stream for breaks and silences.
struct StreamWatch {
    idle: Duration,
    timer: Pin<Box<Sleep>>,
    settings: Arc<BreakerSettings>,
    /// Drop usage-only events: the balancer asked for them, the client did not.
    strip_usage: bool,
}

/// What is known of a request when its response body ends: counted and logged once.
pub struct Finish {
    pub metrics: Arc<Metrics>,
    pub pool: String,
    pub node: String,
    pub route: String,
    pub attempts: u32,
    pub status: u16,
    pub started: Instant,
    pub ttft: Option<Duration>,
}

impl Finish {
    fn complete(self, outcome: &str, usage: &UsageScan) {
        let duration = self.started.elapsed();
        self.metrics
            .observe_request(&self.pool, &self.node, outcome, duration);
        if let Some(prompt) = usage.prompt {
            self.metrics
                .prompt_tokens
                .with_label_values(&[&self.node])
                .inc_by(prompt);
            let cached = usage.cached.unwrap_or(0);
            self.metrics
                .cached_prompt_tokens
                .with_label_values(&[&self.node])
                .inc_by(cached);
        }
        tracing::info!(
            pool = %self.pool,
            node = %self.node,
            route = %self.route,
            attempts = self.attempts,
            status = self.status,
            outcome,
            ttft_ms = self.ttft.map(|t| t.as_millis() as u64),
            duration_ms = duration.as_millis() as u64,
            prompt_tokens = usage.prompt,
            cached_tokens = usage.cached,
            "request"
        );
    }
}

pub struct RelayBody {
    /// Bytes read before the stream was committed, sent first.
    held: Option<Bytes>,
    inner: Incoming,
    reservation: Option<Reservation>,
    watch: Option<StreamWatch>,
    finish: Option<Finish>,
    usage: UsageScan,
    ended: bool,
}

impl RelayBody {
    /// A body passed through as it is.
    pub fn plain(inner: Incoming, reservation: Reservation, finish: Finish) -> Self {
        RelayBody {
            held: None,
            inner,
            reservation: Some(reservation),
            watch: None,
            finish: Some(finish),
            usage: UsageScan::default(),
            ended: false,
        }
    }

    /// A committed SSE stream: `held` first, then the rest, watched.
    pub fn stream(
        held: Bytes,
        inner: Incoming,
        reservation: Reservation,
        finish: Finish,
        idle: Duration,
        settings: Arc<BreakerSettings>,
        strip_usage: bool,
    ) -> Self {
        let mut usage = UsageScan::default();
        usage.feed(&held);
        let held = if strip_usage {
            strip_usage_events(held)
        } else {
            held
        };
        RelayBody {
            held: Some(held),
            inner,
            reservation: Some(reservation),
            watch: Some(StreamWatch {
                idle,
                timer: Box::pin(tokio::time::sleep(idle)),
                settings,
                strip_usage,
            }),
            finish: Some(finish),
            usage,
            ended: false,
        }
    }

    fn end(&mut self, outcome: &str) {
        self.ended = true;
        self.reservation = None;
        if let Some(f) = self.finish.take() {
            f.complete(outcome, &self.usage);
        }
    }

    /// Ends a watched stream with an error event; the node is blamed.
    fn fail(&mut self, why: String) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if let (Some(r), Some(w)) = (&self.reservation, &self.watch) {
            tracing::warn!(node = %r.node().id, reason = %why, "stream failed after commit; ending it with an error event");
            r.node().record(Outcome::Failure, None, false, &w.settings);
        }
        self.end("interrupted");
        let event = serde_json::json!({"error": {
            "message": format!("the engine failed mid-stream: {why}"),
            "type": "upstream_error",
            "code": "stream_interrupted",
        }});
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
            "data: {event}\n\n"
        ))))))
    }

    fn outcome(&self) -> &'static str {
        match self.finish.as_ref().map(|f| f.status) {
            Some(400..=499) => "client_error",
            Some(500..) => "error",
            _ => "success",
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
        if let Some(held) = self.held.take() {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        if self.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match frame.into_data() {
                    Ok(data) => {
                        self.usage.feed(&data);
                        let strip = self.watch.as_ref().is_some_and(|w| w.strip_usage);
                        Frame::data(if strip {
                            strip_usage_events(data)
                        } else {
                            data
                        })
                    }
                    Err(frame) => frame,
                };
                if let Some(w) = &mut self.watch {
                    let next = Instant::now() + w.idle;
                    w.timer.as_mut().reset(next);
                }
                // A body of known length may be dropped right after its last byte,
                // without ever being polled to its end: finish now.
                if self.inner.is_end_stream() {
                    let outcome = self.outcome();
                    self.end(outcome);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) if self.watch.is_some() => {
                self.fail(format!("the stream broke ({e})"))
            }
            Poll::Ready(Some(Err(e))) => {
                // A plain body cannot carry an error event: the client sees the
                // connection fail, which is an explicit error at the HTTP level.
                self.end("interrupted");
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                let outcome = self.outcome();
                self.end(outcome);
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

impl Drop for RelayBody {
    fn drop(&mut self) {
        // The client left before the end.
        if let Some(f) = self.finish.take() {
            f.complete("cancelled", &self.usage);
        }
    }
}

static PROMPT_TOKENS: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"prompt_tokens\":"));
static CACHED_TOKENS: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"cached_tokens\":"));
static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));

/// Picks `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` out of
/// response bytes without parsing them: the last value of each seen wins (the usage
/// object comes last). A 48-byte overlap catches a field split across two frames.
#[derive(Debug, Default)]
pub struct UsageScan {
    pub prompt: Option<u64>,
    pub cached: Option<u64>,
    /// The last bytes of the previous frame, then the seam being scanned; reused, so
    /// scanning allocates nothing per frame.
    tail: Vec<u8>,
    seam: Vec<u8>,
}

const OVERLAP: usize = 48;

impl UsageScan {
    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.tail.is_empty() {
            let mut seam = std::mem::take(&mut self.seam);
            seam.clear();
            seam.extend_from_slice(&self.tail);
            seam.extend_from_slice(&chunk[..chunk.len().min(OVERLAP)]);
            self.scan(&seam);
            self.seam = seam;
        }
        self.scan(chunk);
        self.tail.clear();
        self.tail
            .extend_from_slice(&chunk[chunk.len().saturating_sub(OVERLAP)..]);
    }

    fn scan(&mut self, hay: &[u8]) {
        if let Some(n) = last_number(&PROMPT_TOKENS, hay) {
            self.prompt = Some(n);
        }
        if let Some(n) = last_number(&CACHED_TOKENS, hay) {
            self.cached = Some(n);
        }
    }
}

fn last_number(field: &Finder<'_>, hay: &[u8]) -> Option<u64> {
    let at = field.find_iter(hay).last()? + field.needle().len();
    let rest = &hay[at..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let len = rest[start..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    // A number cut by the end of the frame is read again, whole, from the seam.
    if start + len >= rest.len() {
        return None;
    }
    std::str::from_utf8(&rest[start..start + len])
        .ok()?
        .parse()
        .ok()
}

/// Removes usage-only events (`"choices":[]` with a `usage`) from SSE bytes.
fn strip_usage_events(data: Bytes) -> Bytes {
    if USAGE.find(&data).is_none() {
        return data;
    }
    let mut out = BytesMut::with_capacity(data.len());
    let mut rest = &data[..];
    while !rest.is_empty() {
        let end = memchr::memmem::find(rest, b"\n\n").map_or(rest.len(), |i| i + 2);
        let event = &rest[..end];
        let usage_only =
            USAGE.find(event).is_some() && memchr::memmem::find(event, b"\"choices\":[]").is_some();
        if !usage_only {
            out.extend_from_slice(event);
        }
        rest = &rest[end..];
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_in_json_and_sse_and_across_frames() {
        let mut u = UsageScan::default();
        u.feed(br#"{"choices":[],"usage":{"prompt_tokens":1234,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":1200}}}"#);
        assert_eq!((u.prompt, u.cached), (Some(1234), Some(1200)));
        let mut u = UsageScan::default();
        u.feed(b"data: {\"usage\": {\"prompt_tok");
        u.feed(b"ens\": 77, \"prompt_tokens_details\": {\"cached_tokens\": 6");
        u.feed(b"4}}}\n\n");
        assert_eq!((u.prompt, u.cached), (Some(77), Some(64)));
    }

    #[test]
    fn only_usage_only_events_are_stripped() {
        let content = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}]}\n\n";
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n";
        let done = "data: [DONE]\n\n";
        let out = strip_usage_events(Bytes::from(format!("{content}{usage}{done}")));
        assert_eq!(out, Bytes::from(format!("{content}{done}")));
        let plain =
            Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n");
        assert_eq!(strip_usage_events(plain.clone()), plain);
    }
}
