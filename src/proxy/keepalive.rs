//! SSE keep-alives (`server.sse_keepalive`): a stream the client has had nothing of
//! for that long gets an SSE comment, `: keep-alive`, which every SSE client skips
//! and which keeps an idle-timing hop between the client and the balancer (a cloud
//! load balancer's 60 s, nginx's `proxy_read_timeout`) from cutting a healthy
//! request while it waits in the queue or through a cold prefill.
//!
//! Before the first token nothing has gone to the client: the first keep-alive
//! commits the stream, a `200` head of `text/event-stream` with no `x-prefixlb-*`
//! headers (the node is not chosen for good yet). The request goes on as before
//! (queue, attempts, failover), and what it ends in follows the comments: the engine's
//! stream, or, for an answer that is not a stream (an error status, a refusal), one
//! SSE error event in the API's shape carrying that answer's error. Mid-stream
//! comments are [`RelayBody`](super::relay::RelayBody)'s.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderName, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use prometheus::IntCounter;
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use super::body::{BodyError, BoxBody};
use super::error::anthropic_kind;
use crate::clip::clip;
use crate::telemetry::metrics::RequestMetrics;

/// The comment sent.
pub const COMMENT: &[u8] = b": keep-alive\n\n";

/// The most of an answer that is not a stream read into its error event.
const MAX_ERROR_BYTES: usize = 64 * 1024;

/// Told once a request is placed as a stream and admitted by its tenant's rate limits
/// (only a stream may be committed early), with the headers an early head carries.
#[derive(Debug, Default)]
pub struct StreamSeen {
    seen: AtomicBool,
    told: Notify,
    headers: Mutex<Vec<(HeaderName, HeaderValue)>>,
}

impl StreamSeen {
    /// The request is a stream; `headers` go into its head if it is committed early.
    pub fn set(&self, headers: Vec<(HeaderName, HeaderValue)>) {
        *self.headers.lock() = headers;
        self.seen.store(true, Ordering::Release);
        // One waiter at most; its permit is kept if it is not waiting yet.
        self.told.notify_one();
    }

    /// Returns once the request is known to be a stream.
    async fn wait(&self) {
        while !self.seen.load(Ordering::Acquire) {
            self.told.notified().await;
        }
    }
}

/// The response to a request whose answer is `answer`: the answer itself if it comes
/// within `every` (or never turns out to be a stream); else a stream committed with a
/// keep-alive once `every` has passed and the request is placed as a stream and
/// admitted by its tenant's rate limits, then one every `every` until the answer.
pub async fn answer<F>(
    every: Duration,
    anthropic: bool,
    seen: Arc<StreamSeen>,
    metrics: &RequestMetrics,
    answer: F,
) -> Response<BoxBody>
where
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let mut answer = Box::pin(answer);
    let due = Instant::now() + every;
    let quiet_stream = async {
        tokio::time::sleep_until(due).await;
        seen.wait().await;
    };
    tokio::select! {
        biased;
        resp = &mut answer => return resp,
        () = quiet_stream => {}
    }
    let sent = metrics.sse_keepalives("waiting");
    let mut resp = committed(every, sent, Box::pin(then(answer, anthropic)));
    resp.headers_mut()
        .extend(std::mem::take(&mut *seen.headers.lock()));
    resp
}

fn committed(
    every: Duration,
    sent: IntCounter,
    waiting: Pin<Box<dyn Future<Output = Then> + Send>>,
) -> Response<BoxBody> {
    let body = Early {
        state: State::Waiting(waiting),
        sent,
        // Due at once: the client has had nothing for `every` already.
        ping: Box::pin(tokio::time::sleep_until(Instant::now())),
        every,
    };
    let mut resp = Response::new(body.boxed_unsync());
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// What follows the keep-alives.
enum Then {
    /// The engine's stream.
    Stream(BoxBody),
    /// One error event, then the end.
    Event(Bytes),
}

async fn then(answer: impl Future<Output = Response<BoxBody>>, anthropic: bool) -> Then {
    let resp = answer.await;
    let status = resp.status();
    if status.is_success() && super::forward::is_event_stream(resp.headers()) {
        return Then::Stream(resp.into_body());
    }
    let mut body = resp.into_body();
    let mut read = BytesMut::new();
    while read.len() < MAX_ERROR_BYTES {
        match body.frame().await {
            Some(Ok(frame)) => read.extend_from_slice(frame.data_ref().map_or(&[][..], |d| d)),
            _ => break,
        }
    }
    Then::Event(error_event(status, &read, anthropic))
}

/// The SSE error event that stands for an answer (`status`, `body`) that cannot follow
/// a stream already begun: OpenAI's `data: {"error": …}`, or Anthropic's `event:
/// error`. A body already in that shape (the balancer's own errors, an engine's
/// OpenAI-shaped one) is sent as it is; any other is wrapped, its text the message.
pub fn error_event(status: StatusCode, body: &[u8], anthropic: bool) -> Bytes {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let shaped = parsed.as_ref().is_some_and(|v| match anthropic {
        true => v["type"] == "error" && v["error"].is_object(),
        false => v["error"].is_object(),
    });
    let data = match (shaped, parsed) {
        (true, Some(v)) => v,
        (_, parsed) => {
            let n = status.as_u16();
            let said = parsed
                .as_ref()
                .and_then(|v| v["message"].as_str().or_else(|| v["error"].as_str()))
                .map(str::to_string)
                .or_else(|| (!body.is_empty()).then(|| clip(&String::from_utf8_lossy(body))));
            let message = match (status.is_success(), said) {
                (true, _) => format!("the engine answered the stream with a whole response (HTTP {n}), after the stream began"),
                (false, Some(said)) => format!("{said} (HTTP {n}, after the stream began)"),
                (false, None) => format!("HTTP {n}, after the stream began"),
            };
            match anthropic {
                true => {
                    json!({"type": "error", "error": {"type": anthropic_kind(status), "message": message}})
                }
                false => {
                    json!({"error": {"message": message, "type": "upstream_error", "code": status.as_u16()}})
                }
            }
        }
    };
    let event = match anthropic {
        true => format!("event: error\ndata: {data}\n\n"),
        false => format!("data: {data}\n\n"),
    };
    Bytes::from(event)
}

enum State {
    Waiting(Pin<Box<dyn Future<Output = Then> + Send>>),
    Relaying(BoxBody),
    Last(Bytes),
    Done,
}

/// A stream committed before its answer: keep-alives until it comes, then the answer.
struct Early {
    state: State,
    /// When the next keep-alive is due, while waiting.
    ping: Pin<Box<Sleep>>,
    every: Duration,
    sent: IntCounter,
}

impl Body for Early {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                State::Waiting(waiting) => match waiting.as_mut().poll(cx) {
                    Poll::Ready(Then::Stream(body)) => this.state = State::Relaying(body),
                    Poll::Ready(Then::Event(event)) => this.state = State::Last(event),
                    Poll::Pending => {
                        if this.ping.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let next = Instant::now() + this.every;
                        this.ping.as_mut().reset(next);
                        this.sent.inc();
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(COMMENT)))));
                    }
                },
                State::Relaying(body) => {
                    let frame = Pin::new(body).poll_frame(cx);
                    if let Poll::Ready(None) = frame {
                        this.state = State::Done;
                    }
                    return frame;
                }
                State::Last(_) => {
                    let State::Last(event) = std::mem::replace(&mut this.state, State::Done) else {
                        unreachable!("matched above")
                    };
                    return Poll::Ready(Some(Ok(Frame::data(event))));
                }
                State::Done => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, State::Done)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(event: &Bytes, anthropic: bool) -> Value {
        let text = std::str::from_utf8(event).unwrap();
        let prefix = if anthropic {
            "event: error\ndata: "
        } else {
            "data: "
        };
        let json = text
            .strip_prefix(prefix)
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn an_answer_in_the_apis_shape_is_sent_as_it_is() {
        let ours =
            br#"{"error":{"message":"no node","type":"service_unavailable","code":"no_capacity"}}"#;
        let event = error_event(StatusCode::SERVICE_UNAVAILABLE, ours, false);
        assert_eq!(
            data(&event, false),
            serde_json::from_slice::<Value>(ours).unwrap()
        );
        let theirs = br#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#;
        let event = error_event(StatusCode::SERVICE_UNAVAILABLE, theirs, true);
        assert_eq!(
            data(&event, true),
            serde_json::from_slice::<Value>(theirs).unwrap()
        );
    }

    #[test]
    fn any_other_answer_is_wrapped_with_its_status_and_message() {
        // vLLM's older error shape: a message at the top.
        let vllm =
            br#"{"object":"error","message":"too long","type":"BadRequestError","code":400}"#;
        let v = data(&error_event(StatusCode::BAD_REQUEST, vllm, false), false);
        assert_eq!(
            v["error"]["message"],
            "too long (HTTP 400, after the stream began)"
        );
        assert_eq!(v["error"]["code"], 400);
        let v = data(
            &error_event(StatusCode::BAD_GATEWAY, b"upstream broke", true),
            true,
        );
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "api_error");
        assert_eq!(
            v["error"]["message"],
            "upstream broke (HTTP 502, after the stream began)"
        );
        // An OpenAI-shaped body is not Anthropic's shape: wrapped, its message kept.
        let openai = br#"{"error":"busy"}"#;
        let v = data(
            &error_event(StatusCode::TOO_MANY_REQUESTS, openai, true),
            true,
        );
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(
            v["error"]["message"],
            "busy (HTTP 429, after the stream began)"
        );
        let v = data(
            &error_event(StatusCode::OK, br#"{"choices":[]}"#, false),
            false,
        );
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("whole response"),
            "{v}"
        );
        let v = data(
            &error_event(StatusCode::INTERNAL_SERVER_ERROR, b"", false),
            false,
        );
        assert_eq!(v["error"]["message"], "HTTP 500, after the stream began");
    }
}
