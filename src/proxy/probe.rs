//! The first-packet probe: a stream is committed to the client only once the engine
//! has produced its first real output. Until then its headers and SSE events are held;
//! a role-only chunk, comments and keep-alives are not output. Outcomes: success
//! (commit), error (SSE error event or a broken body), timeout (no output within
//! `first_token_timeout` of sending), no_content (the stream ended without output).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;
use tokio::time::Instant;

/// Why a stream was not committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeFailure {
    /// An SSE error event, or the body broke.
    Error(String),
    /// No output before the deadline.
    Timeout,
    /// The stream ended (or said `[DONE]`) without output.
    NoContent,
}

/// A stream that produced output: every byte received so far (the held events, the
/// first output among them) and the rest of the body.
pub struct Committed {
    pub held: Bytes,
    pub rest: Incoming,
    /// Upstream send → first output event.
    pub ttft: Duration,
}

/// Reads `body` until its first output event, holding everything, or fails.
pub async fn first_packet(
    mut body: Incoming,
    sent: Instant,
    deadline: Instant,
) -> Result<Committed, ProbeFailure> {
    let mut held = BytesMut::new();
    let mut events = SseScanner::default();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(ProbeFailure::Timeout),
            Ok(None) => return Err(ProbeFailure::NoContent),
            Ok(Some(Err(e))) => return Err(ProbeFailure::Error(format!("stream broke: {e}"))),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        held.extend_from_slice(&data);
        for event in events.push(&data) {
            match classify(&event) {
                Event::Output => {
                    return Ok(Committed {
                        held: held.freeze(),
                        rest: body,
                        ttft: sent.elapsed(),
                    })
                }
                Event::Error(msg) => return Err(ProbeFailure::Error(msg)),
                Event::Done => return Err(ProbeFailure::NoContent),
                Event::Nothing => {}
            }
        }
    }
}

/// One SSE event: its `event:` type (if any) and its data lines joined by `\n`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    pub kind: String,
    pub data: String,
}

/// An incremental SSE parser: events may be split across chunks or share one; lines
/// end in LF, CRLF or CR; comments (`:` lines) and empty keep-alives are skipped.
#[derive(Debug, Default)]
pub struct SseScanner {
    line: Vec<u8>,
    /// The previous chunk ended in CR: a leading LF belongs to it.
    after_cr: bool,
    current: SseEvent,
    has_data: bool,
}

impl SseScanner {
    /// Feeds bytes; returns the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for &b in bytes {
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                continue;
            }
            match b {
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(event) = self.line_done(&line) {
                        out.push(event);
                    }
                }
                _ => self.line.push(b),
            }
        }
        out
    }

    fn line_done(&mut self, line: &[u8]) -> Option<SseEvent> {
        if line.is_empty() {
            // Blank line: dispatch, unless nothing was gathered (a keep-alive).
            return std::mem::take(&mut self.has_data).then(|| std::mem::take(&mut self.current));
        }
        if line[0] == b':' {
            return None;
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (&*text, ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.current.kind = value.to_string(),
            _ => {}
        }
        None
    }
}

enum Event {
    Output,
    Error(String),
    Done,
    Nothing,
}

/// What an event says: generated output (chat content, reasoning, tool calls,
/// completions text, responses-API deltas, SGLang text), an error, the end, or
/// nothing yet (a role-only chunk, usage, metadata).
fn classify(event: &SseEvent) -> Event {
    let data = event.data.trim();
    if data == "[DONE]" {
        return Event::Done;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return if event.kind == "error" {
            Event::Error(data.to_string())
        } else {
            Event::Nothing
        };
    };
    if event.kind == "error" || v.get("error").is_some_and(|e| !e.is_null()) {
        let msg = v["error"]["message"]
            .as_str()
            .or(v["error"].as_str())
            .unwrap_or(data);
        return Event::Error(msg.to_string());
    }
    let nonempty_str = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    let nonempty_arr = |v: &Value| v.as_array().is_some_and(|a| !a.is_empty());
    if let Some(choices) = v["choices"].as_array() {
        let output = choices.iter().any(|c| {
            let d = &c["delta"];
            nonempty_str(&d["content"])
                || nonempty_str(&d["reasoning_content"])
                || nonempty_str(&d["reasoning"])
                || nonempty_arr(&d["tool_calls"])
                || nonempty_str(&c["text"])
        });
        return if output {
            Event::Output
        } else {
            Event::Nothing
        };
    }
    // `/v1/responses` streams typed events; SGLang's `/generate` streams `text`.
    let typed_delta =
        v["type"].as_str().is_some_and(|t| t.ends_with(".delta")) && nonempty_str(&v["delta"]);
    if typed_delta || nonempty_str(&v["text"]) {
        return Event::Output;
    }
    Event::Nothing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    #[test]
    fn events_split_across_chunks_and_sharing_chunks() {
        let mut s = SseScanner::default();
        assert!(s.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            data(&s.push(b":1}\n\ndata: 2\n\ndata: 3\n")),
            vec!["{\"a\":1}", "2"]
        );
        assert_eq!(data(&s.push(b"\n")), vec!["3"]);
    }

    #[test]
    fn crlf_cr_comments_keepalives_and_multiline_data() {
        let mut s = SseScanner::default();
        let out = s.push(b": ping\r\n\r\ndata: a\r\ndata: b\r\n\r\n\r\nevent: error\rdata: x\r");
        assert_eq!(data(&out), vec!["a\nb"]);
        let out = s.push(b"\n\r\n");
        assert_eq!(
            out,
            vec![SseEvent {
                kind: "error".into(),
                data: "x".into()
            }]
        );
    }

    fn kind(data: &str) -> &'static str {
        match classify(&SseEvent {
            kind: String::new(),
            data: data.into(),
        }) {
            Event::Output => "output",
            Event::Error(_) => "error",
            Event::Done => "done",
            Event::Nothing => "nothing",
        }
    }

    #[test]
    fn only_generated_output_counts() {
        assert_eq!(
            kind(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#),
            "nothing"
        );
        assert_eq!(
            kind(r#"{"choices":[{"delta":{"content":"Hi"}}]}"#),
            "output"
        );
        assert_eq!(
            kind(r#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#),
            "output"
        );
        assert_eq!(
            kind(r#"{"choices":[{"delta":{"reasoning":"hmm"}}]}"#),
            "output"
        );
        assert_eq!(
            kind(r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#),
            "output"
        );
        assert_eq!(kind(r#"{"choices":[{"text":" once"}]}"#), "output");
        assert_eq!(
            kind(r#"{"choices":[],"usage":{"prompt_tokens":3}}"#),
            "nothing"
        );
        assert_eq!(
            kind(r#"{"type":"response.output_text.delta","delta":"x"}"#),
            "output"
        );
        assert_eq!(kind(r#"{"type":"response.created"}"#), "nothing");
        assert_eq!(kind(r#"{"error":{"message":"oom"}}"#), "error");
        assert_eq!(kind("[DONE]"), "done");
        assert_eq!(kind("not json"), "nothing");
    }
}
