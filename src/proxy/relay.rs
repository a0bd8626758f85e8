//! The relayed response body: the engine's body passed through frame by frame with
//! the request's [`Ticket`] attached, so its slot is held exactly until the body ends,
//! fails, or the client leaves (the body is dropped, which drops the upstream exchange
//! and makes the engine abort the sequence).
//!
//! A committed SSE stream is framed by the shared [`SseScanner`]: each complete event
//! goes to the client as soon as its last byte arrives (no coalescing), and the bytes
//! of an unfinished event wait for the rest of it (a client cannot use half an event).
//! So when the engine breaks the stream or stays silent for `idle_stream_timeout`, the
//! client gets a final `data: {"error": …}` event that no half-sent event can garble,
//! and a clean end; the node is blamed. A plain body that stalls that long is cut (the
//! client sees the connection fail, an explicit error at the HTTP level) and the node
//! is blamed too. Usage-only events the balancer asked for are dropped whole.
//!
//! On the way through, the engine's `usage` numbers are picked out of the bytes (no
//! JSON parse); when the body ends the request is counted and logged once, and its
//! ticket finished: the pool learns from it.

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use memchr::memmem::Finder;
use tokio::time::{Instant, Sleep};

use super::body::BodyError;
use super::now;
use super::sse::{Block, SseScanner};
use super::upstream::EngineBody;
use crate::routing::decision::{Ticket, Usage};
use crate::routing::route::Route;
use crate::telemetry::metrics::{NodeSeries, TenantTokens};
use crate::telemetry::outcome::RequestOutcome;
use prometheus::IntCounter;

/// What is known of a request when its response body ends: counted and logged once,
/// and its ticket finished (the pool learns from it when it succeeded).
pub struct RequestLog {
    /// The metric series of its pool and node.
    pub series: &'static NodeSeries,
    pub route: Route,
    pub attempts: u32,
    pub status: u16,
    /// The outcome if the body ends normally (from the status, or the probe's verdict).
    pub outcome: RequestOutcome,
    pub started: Instant,
    pub ttft: Option<Duration>,
    /// Where it went (its pool and node name it in metrics and the log) and its slot.
    pub ticket: Ticket,
    /// Its tenant's token budget, charged an estimate at admission: corrected to what
    /// the engine reports when it ends.
    pub charge: Option<super::tenant::Charge>,
    /// Its tenant's token counters, when the config tells tenants apart.
    pub tenant_tokens: Option<TenantTokens>,
    /// The pool learns from it when it succeeds, and its prompt tokens are counted
    /// (not a `count_tokens`'s, nor a stored response's read again, nor an audio
    /// upload's: see [`Api::teaches`](crate::routing::facts::Api::teaches)).
    pub teaches: bool,
    /// Its trace spans (the request's, the answering attempt's): they end with it.
    pub spans: [tracing::Span; 2],
    /// Its id (`x-request-id`), as the engine got it.
    pub id: Option<http::HeaderValue>,
}

impl RequestLog {
    /// Counts, logs and finishes the request, which ended at `now`.
    fn complete(self, outcome: RequestOutcome, usage: &UsageScan, now: Instant) {
        let duration = now.saturating_duration_since(self.started);
        // The slot goes back first, then the pool learns from a request that succeeded.
        if outcome == RequestOutcome::Success && self.teaches {
            let tokens = |n: Option<u64>| n.unwrap_or(0).min(u64::from(u32::MAX)) as u32;
            let reported = Usage {
                prompt_tokens: tokens(usage.prompt_tokens()),
                cached_tokens: tokens(usage.cached_tokens()),
            };
            self.ticket.finish(reported, self.ttft, now.into_std());
        } else {
            drop(self.ticket);
        }
        if let (Some(charge), Some(prompt)) = (&self.charge, usage.prompt_tokens()) {
            charge.settle(prompt + usage.completion.unwrap_or(0));
        }
        if let Some(tenant) = &self.tenant_tokens {
            // Prompt tokens as the node's are counted: not those a count was asked of.
            let (prompt, cached) = match self.teaches {
                true => (usage.prompt_tokens(), usage.cached_tokens()),
                false => (None, None),
            };
            let n = |v: Option<u64>| v.unwrap_or(0);
            tenant.count(n(prompt), n(cached), n(usage.completion));
        }
        let (pool_name, node) = self.series.names();
        self.series.observe_request(outcome, duration);
        // A `count_tokens` answer's `input_tokens` were counted, not prefilled.
        if let (Some(prompt), true) = (usage.prompt_tokens(), self.teaches) {
            self.series
                .count_tokens(prompt, usage.cached_tokens().unwrap_or(0));
        }
        crate::telemetry::traces::record_end(
            &self.spans,
            crate::telemetry::traces::Ending {
                status: self.status,
                outcome: outcome.as_str(),
                ttft: self.ttft,
                input_tokens: usage.prompt_tokens(),
                cached_tokens: usage.cached_tokens(),
                output_tokens: usage.completion,
            },
        );
        tracing::info!(
            pool = pool_name,
            node,
            request_id = self.id.as_ref().map(super::request_id::text),
            route = %self.route.label(),
            attempts = self.attempts,
            status = self.status,
            outcome = outcome.as_str(),
            ttft_ms = self.ttft.map(|t| t.as_millis() as u64),
            duration_ms = duration.as_millis() as u64,
            prompt_tokens = usage.prompt_tokens(),
            cached_tokens = usage.cached_tokens(),
            "request"
        );
    }
}

/// The silence limit of a relayed body: `idle_stream_timeout` after the last frame;
/// and for a stream with `sse_keepalive`, when its next keep-alive is due.
struct Idle {
    after: Duration,
    deadline: Instant,
    /// Keep-alives, when the stream has them.
    keepalive: Option<Beat>,
    /// Armed only when the engine first makes us wait.
    timer: Option<Pin<Box<Sleep>>>,
}

/// A stream's keep-alives: one after each `every` of silence, the next due at `due`,
/// each counted in `sent`.
pub struct Beat {
    every: Duration,
    due: Instant,
    sent: IntCounter,
}

impl Beat {
    /// Keep-alives every `every` from now, counted in `sent`.
    pub fn new(every: Duration, sent: IntCounter) -> Beat {
        Beat {
            every,
            due: Instant::now() + every,
            sent,
        }
    }
}

/// What a silence of the engine calls for.
#[derive(Debug, PartialEq, Eq)]
enum Silence {
    /// Nothing yet (a wake-up is registered).
    Wait,
    /// A keep-alive to the client.
    KeepAlive,
    /// The end: the engine has been silent for `idle_stream_timeout`.
    TooLong,
}

impl Idle {
    /// The limit of a body whose last frame came at `now`.
    fn new(after: Duration, now: Instant) -> Self {
        Idle {
            after,
            deadline: now + after,
            keepalive: None,
            timer: None,
        }
    }

    fn progressed(&mut self) {
        let now = Instant::now();
        self.deadline = now + self.after;
        if let Some(beat) = &mut self.keepalive {
            beat.due = now + beat.every;
        }
    }

    /// What the silence calls for now (registers a wake-up if nothing).
    fn silence(&mut self, cx: &mut Context<'_>) -> Silence {
        let wake = match &self.keepalive {
            Some(beat) => beat.due.min(self.deadline),
            None => self.deadline,
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(wake)));
        if timer.deadline() != wake {
            timer.as_mut().reset(wake);
        }
        if timer.as_mut().poll(cx).is_pending() {
            return Silence::Wait;
        }
        let now = Instant::now();
        match &mut self.keepalive {
            _ if now >= self.deadline => Silence::TooLong,
            Some(beat) => {
                beat.due = now + beat.every;
                beat.sent.inc();
                Silence::KeepAlive
            }
            None => Silence::TooLong,
        }
    }
}

/// A committed SSE stream's framing.
struct SseRelay {
    scanner: SseScanner,
    /// Drop usage-only events: the balancer asked for them, the client did not.
    strip_usage: bool,
    /// Anthropic's Messages stream: a failure ends it with an `event: error`.
    anthropic: bool,
}

impl SseRelay {
    /// The complete events among `data` (and bytes held before), ready to send; empty
    /// when `data` only continued an unfinished event.
    fn forward(&mut self, data: &Bytes) -> Bytes {
        let strip = self.strip_usage;
        let mut first: Option<Bytes> = None;
        let mut joined: Option<BytesMut> = None;
        self.scanner.push_with(data, |block| {
            if strip && is_usage_only(&block) {
                return;
            }
            match (&mut joined, first.take()) {
                (Some(j), _) => j.extend_from_slice(&block.raw),
                (None, None) => first = Some(block.raw),
                (None, Some(f)) => {
                    let mut j = BytesMut::with_capacity(f.len() + block.raw.len());
                    j.extend_from_slice(&f);
                    j.extend_from_slice(&block.raw);
                    joined = Some(j);
                }
            }
        });
        match joined {
            Some(j) => j.freeze(),
            None => first.unwrap_or_default(),
        }
    }
}

pub struct RelayBody {
    /// Bytes to send before reading on (the probe's held events, or the tail of a
    /// stream that ended without its final blank line).
    held: Option<Bytes>,
    /// The engine's body; its connection is handed back once it is read to its end.
    inner: EngineBody,
    idle: Idle,
    /// Set for committed SSE streams.
    sse: Option<SseRelay>,
    /// Until the body ends: what is counted then, with the request's ticket (its slot).
    log: Option<RequestLog>,
    usage: UsageScan,
    ended: bool,
}

impl RelayBody {
    /// A body passed through as it is (`held`: its first bytes, read already), cut after
    /// `idle` of silence (from `now`, when it commits).
    pub fn plain(
        held: Bytes,
        body: EngineBody,
        log: RequestLog,
        idle: Duration,
        now: Instant,
        anthropic: bool,
    ) -> Self {
        let mut usage = UsageScan::of(anthropic);
        usage.feed(&held);
        RelayBody {
            held: Some(held),
            inner: body,
            idle: Idle::new(idle, now),
            sse: None,
            log: Some(log),
            usage,
            ended: false,
        }
    }

    /// A committed SSE stream: the complete events of `held` first, then the rest, cut
    /// after `idle` of silence (from `now`, when it commits).
    pub fn stream(
        held: Bytes,
        body: EngineBody,
        log: RequestLog,
        idle: Duration,
        now: Instant,
        strip_usage: bool,
        anthropic: bool,
    ) -> Self {
        let mut usage = UsageScan::of(anthropic);
        usage.feed(&held);
        let mut sse = SseRelay {
            scanner: SseScanner::default(),
            strip_usage,
            anthropic,
        };
        let held = sse.forward(&held);
        RelayBody {
            held: Some(held),
            inner: body,
            idle: Idle::new(idle, now),
            sse: Some(sse),
            log: Some(log),
            usage,
            ended: false,
        }
    }

    /// With a keep-alive comment in each silence of `beat`'s interval (a stream's).
    pub fn keep_alive(mut self, beat: Option<Beat>) -> Self {
        self.idle.keepalive = beat.filter(|_| self.sse.is_some());
        self
    }

    fn end(&mut self, outcome: RequestOutcome) {
        self.ended = true;
        let now = Instant::now();
        self.inner.release(now);
        if let Some(log) = self.log.take() {
            log.complete(outcome, &self.usage, now);
        }
    }

    /// The engine failed after commit: blame it, and end the body, with an error
    /// event for a stream or a body error for a plain response.
    fn fail(&mut self, why: String) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        // A connection that broke, or went silent mid-body, carries nothing more:
        // `end` hands back only a body read to its end.
        if let Some(log) = &self.log {
            tracing::warn!(node = %log.ticket.node().id(), reason = %why, "response failed after commit");
            log.ticket.broke(now());
        }
        self.end(RequestOutcome::Interrupted);
        if self.sse.is_none() {
            return Poll::Ready(Some(Err(why.into())));
        }
        let message = format!("the engine failed mid-stream: {why}");
        let anthropic = self.sse.as_ref().is_some_and(|s| s.anthropic);
        let event = if anthropic {
            let event = serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}});
            format!("event: error\ndata: {event}\n\n")
        } else {
            let event = serde_json::json!({"error": {
                "message": message,
                "type": "upstream_error",
                "code": "stream_interrupted",
            }});
            format!("data: {event}\n\n")
        };
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
    }

    fn outcome(&self) -> RequestOutcome {
        self.log
            .as_ref()
            .map_or(RequestOutcome::Success, |l| l.outcome)
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        loop {
            if let Some(held) = self.held.take().filter(|h| !h.is_empty()) {
                // A plain body that arrived whole with its head may be dropped right after
                // these bytes: finish now.
                if self.sse.is_none() && !self.ended && self.inner.is_end_stream() {
                    let outcome = self.outcome();
                    self.end(outcome);
                }
                return Poll::Ready(Some(Ok(Frame::data(held))));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    self.idle.progressed();
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            self.usage.feed(&data);
                            match &mut self.sse {
                                Some(sse) => sse.forward(&data),
                                None => data,
                            }
                        }
                        Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
                    };
                    // A body of known length may be dropped right after its last
                    // byte, without ever being polled to its end: finish now.
                    if self.inner.is_end_stream() {
                        let outcome = self.outcome();
                        self.end(outcome);
                    }
                    if frame.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(frame))));
                }
                Poll::Ready(Some(Err(e))) => return self.fail(format!("the body broke ({e})")),
                Poll::Ready(None) => {
                    // An unfinished last event is passed on as the engine sent it.
                    self.held = self.sse.as_mut().map(|s| s.scanner.take_pending());
                    let outcome = self.outcome();
                    self.end(outcome);
                }
                Poll::Pending => match self.idle.silence(cx) {
                    Silence::Wait => return Poll::Pending,
                    Silence::KeepAlive => {
                        let comment = Bytes::from_static(super::keepalive::COMMENT);
                        return Poll::Ready(Some(Ok(Frame::data(comment))));
                    }
                    Silence::TooLong => {
                        let ms = self.idle.after.as_millis();
                        return self.fail(format!("no data for {ms} ms"));
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.held.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> SizeHint {
        if self.sse.is_some() {
            return SizeHint::default();
        }
        // The engine's body, and what was read of it already.
        let held = self.held.as_ref().map_or(0, |h| h.len() as u64);
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + held);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        // The client left before the end.
        if let Some(log) = self.log.take() {
            log.complete(RequestOutcome::Cancelled, &self.usage, Instant::now());
        }
    }
}

/// Whether a block is a usage-only event (`"choices": []` with a `usage`): the chunk
/// `stream_options.include_usage` adds at the end of a stream.
fn is_usage_only(block: &Block) -> bool {
    let Some(event) = &block.event else {
        return false;
    };
    if USAGE.find(event.data.as_bytes()).is_none() {
        return false;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&event.data) else {
        return false;
    };
    v["usage"].is_object() && v["choices"].as_array().is_none_or(Vec::is_empty)
}

static USAGE: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
/// The end every usage field's name shares: one search finds them all, and the name
/// before it says which one it is.
static TOKENS_FIELD: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"_tokens\":"));
/// The longest name part before `_tokens` (`cache_creation_input`), and its quote.
const LONGEST_FIELD: usize = 21;

/// Picks the engine's usage out of response bytes without parsing them: OpenAI's
/// `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` (the
/// Responses API's `input_tokens`, `input_tokens_details.cached_tokens` and
/// `output_tokens`), or
/// Anthropic's `input_tokens`, `cache_read_input_tokens` and
/// `cache_creation_input_tokens`. The last value of each seen wins (the usage object
/// comes last). A 48-byte overlap catches a field split across two frames.
#[derive(Debug)]
pub struct UsageScan {
    pub prompt: Option<u64>,
    pub cached: Option<u64>,
    /// Anthropic's: the uncached input (cache reads and writes are counted apart).
    pub input: Option<u64>,
    pub cache_read: Option<u64>,
    pub cache_creation: Option<u64>,
    /// Output tokens: OpenAI's `completion_tokens`, Anthropic's `output_tokens`.
    pub completion: Option<u64>,
    /// The answer is Anthropic's: its fields are read, not OpenAI's.
    anthropic: bool,
    /// The last bytes of the previous frame (the first `tail_len`), kept in place so
    /// that scanning allocates nothing.
    tail: [u8; OVERLAP],
    tail_len: usize,
}

const OVERLAP: usize = 48;

impl UsageScan {
    /// A scan of an answer of Anthropic's API, or of OpenAI's.
    pub fn of(anthropic: bool) -> UsageScan {
        UsageScan {
            prompt: None,
            cached: None,
            input: None,
            cache_read: None,
            cache_creation: None,
            completion: None,
            anthropic,
            tail: [0; OVERLAP],
            tail_len: 0,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.tail_len > 0 {
            // The seam: the previous frame's tail, then this one's head.
            let mut seam = [0u8; 2 * OVERLAP];
            let head = &chunk[..chunk.len().min(OVERLAP)];
            seam[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
            seam[self.tail_len..self.tail_len + head.len()].copy_from_slice(head);
            self.scan(&seam[..self.tail_len + head.len()]);
        }
        self.scan(chunk);
        let last = &chunk[chunk.len().saturating_sub(OVERLAP)..];
        self.tail[..last.len()].copy_from_slice(last);
        self.tail_len = last.len();
    }

    /// Prompt tokens: OpenAI's count, else Anthropic's three parts (as Anthropic
    /// defines them, `input_tokens` leaves out what the cache read or wrote).
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.prompt.or_else(|| {
            let input = self.input?;
            Some(input + self.cache_read.unwrap_or(0) + self.cache_creation.unwrap_or(0))
        })
    }

    /// Prompt tokens the engine found in its cache.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.cached.or(self.cache_read)
    }

    fn scan(&mut self, hay: &[u8]) {
        // Only the API's own fields: a stream's every frame is searched, once.
        for at in TOKENS_FIELD.find_iter(hay) {
            let name_start = hay[at.saturating_sub(LONGEST_FIELD)..at]
                .iter()
                .rposition(|&b| b == b'"')
                .map(|q| at.saturating_sub(LONGEST_FIELD) + q + 1);
            let Some(name_start) = name_start else {
                continue; // cut by the frame's start: the seam has it whole
            };
            let field = match (self.anthropic, &hay[name_start..at]) {
                // The Responses API's `input_tokens` count the cache's hits too, as
                // `prompt_tokens` do.
                (false, b"prompt" | b"input") => &mut self.prompt,
                (false, b"cached") => &mut self.cached,
                (false, b"completion" | b"output") => &mut self.completion,
                (true, b"input") => &mut self.input,
                (true, b"cache_read_input") => &mut self.cache_read,
                (true, b"cache_creation_input") => &mut self.cache_creation,
                (true, b"output") => &mut self.completion,
                _ => continue,
            };
            if let Some(n) = number_at(&hay[at + TOKENS_FIELD.needle().len()..]) {
                *field = Some(n);
            }
        }
    }
}

/// The whole number at the start of `rest` (after any whitespace); `None` if there is
/// none, or if the end of `rest` may have cut it.
fn number_at(rest: &[u8]) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_in_json_and_sse_and_across_frames() {
        let mut u = UsageScan::of(false);
        u.feed(br#"{"choices":[],"usage":{"prompt_tokens":1234,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":1200}}}"#);
        assert_eq!((u.prompt, u.cached), (Some(1234), Some(1200)));
        let mut u = UsageScan::of(false);
        u.feed(b"data: {\"usage\": {\"prompt_tok");
        u.feed(b"ens\": 77, \"prompt_tokens_details\": {\"cached_tokens\": 6");
        u.feed(b"4}}}\n\n");
        assert_eq!((u.prompt, u.cached), (Some(77), Some(64)));
        // The Responses API's: `input_tokens` with the hits in them.
        let mut u = UsageScan::of(false);
        u.feed(br#"{"object":"response","usage":{"input_tokens":137,"input_tokens_details":{"cached_tokens":112},"output_tokens":3}}"#);
        assert_eq!(
            (u.prompt_tokens(), u.cached_tokens(), u.completion),
            (Some(137), Some(112), Some(3))
        );
        // Anthropic's: the input left uncached, the cache's reads and writes apart.
        let mut u = UsageScan::of(true);
        u.feed(b"event: message_start\ndata: {\"usage\":{\"input_tokens\":10,\"cache_creation_input_tokens\":5,\"cache_read_input_tok");
        u.feed(b"ens\":85,\"output_tokens\":1}}\n\n");
        assert_eq!(
            (u.prompt_tokens(), u.cached_tokens()),
            (Some(100), Some(85))
        );
    }

    fn relay(strip_usage: bool, chunks: &[&[u8]]) -> Vec<u8> {
        let mut sse = SseRelay {
            scanner: SseScanner::default(),
            strip_usage,
            anthropic: false,
        };
        let mut out = Vec::new();
        for c in chunks {
            out.extend_from_slice(&sse.forward(&Bytes::copy_from_slice(c)));
        }
        out
    }

    const CONTENT: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}]}\n\n";
    const USAGE_EVENT: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    #[test]
    fn only_usage_only_events_are_stripped() {
        let all = format!("{CONTENT}{USAGE_EVENT}{DONE}");
        assert_eq!(
            relay(true, &[all.as_bytes()]),
            format!("{CONTENT}{DONE}").as_bytes()
        );
        assert_eq!(relay(false, &[all.as_bytes()]), all.as_bytes());
    }

    #[test]
    fn a_stream_cut_at_every_byte_gives_the_client_the_same_events() {
        let all = format!("{CONTENT}{USAGE_EVENT}{CONTENT}{DONE}");
        let want = format!("{CONTENT}{CONTENT}{DONE}");
        let b = all.as_bytes();
        for i in 0..b.len() {
            for j in i..b.len() {
                assert_eq!(
                    relay(true, &[&b[..i], &b[i..j], &b[j..]]),
                    want.as_bytes(),
                    "cut at {i} and {j}"
                );
            }
        }
    }
}
