//! The first-packet probe: a stream is committed to the client only once the engine
//! has said something a client can use: its first generated output, a clean finish
//! with no output (`finish_reason` set: EOS as the first token, `max_tokens: 0`), or an
//! error that is the client's own (a 4xx in an SSE error event). Until then its head
//! and SSE events are held (at most [`MAX_HELD_BYTES`]); a role-only chunk, comments
//! and keep-alives are not output. Failures: error (SSE error event, broken body,
//! too much held), timeout (nothing usable within `first_token_timeout` of sending),
//! no_content (the stream ended with no output and no `finish_reason`).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::time::Instant;

use super::sse::{SseEvent, SseScanner};
use super::upstream::EngineBody;

/// Most bytes held before the first output; more is an engine fault (a real engine
/// sends a role chunk or two, never a megabyte of nothing).
pub const MAX_HELD_BYTES: usize = 1 << 20;

/// Why a stream was not committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeFailure {
    /// An SSE error event, a broken body, or too much held.
    Error(String),
    /// No output before the deadline.
    Timeout,
    /// The stream ended (or said `[DONE]`) without output or a `finish_reason`.
    NoContent,
}

/// What committed a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// Generated output (its TTFT is a latency sample of the node).
    Output,
    /// A clean finish with no output: a valid answer.
    Finished,
    /// An error event that blames the request (a 4xx code): the client's to read.
    ClientError,
}

impl Commit {
    pub fn as_str(self) -> &'static str {
        match self {
            Commit::Output => "output",
            Commit::Finished => "finished",
            Commit::ClientError => "client_error",
        }
    }
}

/// A stream that said something usable: every byte received so far (the held events)
/// and the rest of the body.
pub struct Committed {
    pub held: Bytes,
    pub rest: EngineBody,
    /// Upstream send → the committing event.
    pub ttft: Duration,
    pub by: Commit,
}

/// Reads `body` until an event commits it, holding everything, or fails.
pub async fn first_packet(
    mut body: EngineBody,
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
        if held.len() + data.len() > MAX_HELD_BYTES {
            return Err(ProbeFailure::Error(format!(
                "more than {MAX_HELD_BYTES} bytes before the first token"
            )));
        }
        held.extend_from_slice(&data);
        let mut verdict = None;
        events.push_with(&data, |block| {
            if verdict.is_some() {
                return;
            }
            let Some(event) = block.event else {
                return;
            };
            match classify(&event) {
                Event::Output => verdict = Some(Ok(Commit::Output)),
                Event::ClientError => verdict = Some(Ok(Commit::ClientError)),
                Event::Error(msg) => verdict = Some(Err(ProbeFailure::Error(msg))),
                Event::Finished => verdict = Some(Ok(Commit::Finished)),
                Event::Done => verdict = Some(Err(ProbeFailure::NoContent)),
                Event::Nothing => {}
            }
        });
        match verdict {
            Some(Ok(by)) => return Ok(committed(held, body, sent, by)),
            Some(Err(failure)) => return Err(failure),
            None => {}
        }
    }
}

fn committed(held: BytesMut, rest: EngineBody, sent: Instant, by: Commit) -> Committed {
    Committed {
        held: held.freeze(),
        rest,
        ttft: sent.elapsed(),
        by,
    }
}

/// What an event says.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Generated output: chat content, reasoning, tool calls, completions text,
    /// responses-API deltas, SGLang text.
    Output,
    /// A choice finished (`finish_reason` set) with no output in this event.
    Finished,
    /// An error caused by the request (4xx).
    ClientError,
    /// An error of the engine's.
    Error(String),
    /// `[DONE]`.
    Done,
    /// Nothing yet: a role-only chunk, usage, metadata.
    Nothing,
}

/// Classifies one SSE event.
pub fn classify(event: &SseEvent) -> Event {
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
        let e = &v["error"];
        if is_client_error(e) {
            return Event::ClientError;
        }
        let msg = e["message"].as_str().or(e.as_str()).unwrap_or(data);
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
        if output {
            return Event::Output;
        }
        if choices.iter().any(|c| !c["finish_reason"].is_null()) {
            return Event::Finished;
        }
        return Event::Nothing;
    }
    // `/v1/responses` streams typed events; SGLang's `/generate` streams `text`.
    let typed_delta =
        v["type"].as_str().is_some_and(|t| t.ends_with(".delta")) && nonempty_str(&v["delta"]);
    if typed_delta || nonempty_str(&v["text"]) {
        return Event::Output;
    }
    if v["meta_info"]["finish_reason"].is_object() || v["type"] == "response.completed" {
        return Event::Finished;
    }
    anthropic(&v)
}

/// Anthropic's Messages stream: a text, thinking or tool-input delta, or a tool call
/// opening, is output; a stop reason (or `message_stop`) finishes; `message_start`,
/// `ping` and empty block openings are nothing yet.
fn anthropic(v: &Value) -> Event {
    let nonempty_str = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
    match v["type"].as_str() {
        Some("content_block_delta") => {
            let d = &v["delta"];
            if nonempty_str(&d["text"])
                || nonempty_str(&d["thinking"])
                || nonempty_str(&d["partial_json"])
            {
                return Event::Output;
            }
            Event::Nothing
        }
        Some("content_block_start") if v["content_block"]["type"] == "tool_use" => Event::Output,
        Some("content_block_start") if nonempty_str(&v["content_block"]["text"]) => Event::Output,
        Some("message_delta") if !v["delta"]["stop_reason"].is_null() => Event::Finished,
        Some("message_stop") => Event::Finished,
        _ => Event::Nothing,
    }
}

/// Whether an error object blames the request: a 4xx `code` (number or numeric
/// string) or an OpenAI client error `type`. 408 and 429 are the engine's state, not
/// the request's fault.
fn is_client_error(e: &Value) -> bool {
    let code = e["code"]
        .as_u64()
        .or_else(|| e["code"].as_str().and_then(|s| s.parse().ok()));
    if let Some(code) = code {
        return (400..500).contains(&code) && code != 408 && code != 429;
    }
    matches!(
        e["type"].as_str(),
        Some(
            "invalid_request_error"
                | "BadRequestError"
                | "NotFoundError"
                | "not_found_error"
                | "authentication_error"
                | "permission_error"
                | "request_too_large"
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(data: &str) -> Event {
        classify(&SseEvent {
            kind: String::new(),
            data: data.into(),
        })
    }

    #[test]
    fn only_generated_output_counts() {
        use Event::*;
        let cases = [
            (
                r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
                Nothing,
            ),
            (r#"{"choices":[{"delta":{"content":"Hi"}}]}"#, Output),
            (
                r#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#,
                Output,
            ),
            (r#"{"choices":[{"delta":{"reasoning":"hmm"}}]}"#, Output),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#,
                Output,
            ),
            (r#"{"choices":[{"text":" once"}]}"#, Output),
            (r#"{"choices":[],"usage":{"prompt_tokens":3}}"#, Nothing),
            (
                r#"{"type":"response.output_text.delta","delta":"x"}"#,
                Output,
            ),
            (r#"{"type":"response.created"}"#, Nothing),
            ("[DONE]", Done),
            ("not json", Nothing),
        ];
        for (data, want) in cases {
            assert_eq!(kind(data), want, "{data}");
        }
    }

    #[test]
    fn anthropic_events_read_like_their_openai_counterparts() {
        use Event::*;
        let cases = [
            (
                r#"{"type":"message_start","message":{"role":"assistant","content":[],"stop_reason":null,"usage":{"input_tokens":9}}}"#,
                Nothing,
            ),
            (
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                Nothing,
            ),
            (r#"{"type": "ping"}"#, Nothing),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
                Output,
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
                Output,
            ),
            (
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#,
                Output,
            ),
            (
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":""}}"#,
                Nothing,
            ),
            (
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":0}}"#,
                Finished,
            ),
            (r#"{"type":"message_stop"}"#, Finished),
            (
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}"#,
                ClientError,
            ),
            (
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
                Error("Overloaded".into()),
            ),
        ];
        for (data, want) in cases {
            assert_eq!(kind(data), want, "{data}");
        }
    }

    #[test]
    fn a_clean_finish_is_not_a_failure() {
        assert_eq!(
            kind(r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#),
            Event::Finished
        );
        assert_eq!(
            kind(r#"{"choices":[{"delta":{"content":""},"finish_reason":null}]}"#),
            Event::Nothing
        );
    }

    #[test]
    fn errors_say_whose_fault_they_are() {
        assert_eq!(
            kind(r#"{"error":{"message":"oom"}}"#),
            Event::Error("oom".into())
        );
        assert_eq!(
            kind(r#"{"error":{"message":"oom","code":500}}"#),
            Event::Error("oom".into())
        );
        for client in [
            r#"{"error":{"message":"too long","code":400}}"#,
            r#"{"error":{"message":"too long","code":"422"}}"#,
            r#"{"error":{"message":"bad","type":"BadRequestError"}}"#,
        ] {
            assert_eq!(kind(client), Event::ClientError, "{client}");
        }
        assert!(matches!(
            kind(r#"{"error":{"message":"busy","code":429}}"#),
            Event::Error(_)
        ));
    }
}
