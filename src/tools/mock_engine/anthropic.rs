//! Anthropic's Messages wire format as `mock-engine` speaks it (what vLLM, SGLang and
//! llama.cpp's server answer on `/v1/messages`): the prompt rendered as the chat API's
//! is (`system` first, then `role \n text \n` per message), so both APIs find the same
//! prefixes cached; answers as a `message` object or as typed SSE events
//! (`message_start` … `message_stop`, with a `ping`), usage with the cache's reads apart
//! from the uncached input, and errors as `{"type": "error", "error": {…}}`.

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::wire::{json_response, Job};
use crate::proxy::body::BoxBody;

/// The prompt text of a Messages body.
pub(super) fn prompt_text(v: &Value) -> Result<String, String> {
    let messages = v["messages"].as_array().ok_or("messages: Field required")?;
    let mut text = String::new();
    if !v["system"].is_null() {
        text.push_str("system\n");
        push_blocks(&mut text, &v["system"]);
        text.push('\n');
    }
    for m in messages {
        text.push_str(m["role"].as_str().unwrap_or(""));
        text.push('\n');
        push_blocks(&mut text, &m["content"]);
        text.push('\n');
    }
    Ok(text)
}

/// Content as text: a string, or blocks (text; a tool call's name and input; a tool
/// result's content).
fn push_blocks(text: &mut String, content: &Value) {
    match content {
        Value::String(s) => text.push_str(s),
        Value::Array(blocks) => {
            for b in blocks {
                match b["type"].as_str() {
                    Some("tool_use") => {
                        text.push_str(b["name"].as_str().unwrap_or(""));
                        text.push_str(&b["input"].to_string());
                    }
                    Some("tool_result") => push_blocks(text, &b["content"]),
                    _ => text.push_str(b["text"].as_str().unwrap_or("")),
                }
            }
        }
        _ => {}
    }
}

/// Anthropic's usage: `input_tokens` leaves out what the cache held.
pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "input_tokens": prompt - cached.min(prompt), "output_tokens": completion,
        "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
    })
}

/// A whole answer: `content` as one text block, or a call of the job's tool.
pub(super) fn message(job: &Job, content: &str, usage: Value) -> Value {
    let (blocks, stop) = match &job.tool {
        Some(tool) => (
            json!([{"type": "tool_use", "id": "toolu_mock", "name": tool, "input": {"x": 1}}]),
            "tool_use",
        ),
        None => (json!([{"type": "text", "text": content}]), "max_tokens"),
    };
    json!({
        "id": "msg_mock", "type": "message", "role": "assistant", "model": job.model,
        "content": blocks, "stop_reason": stop, "stop_sequence": null, "usage": usage,
    })
}

/// One SSE event.
pub(super) fn event(v: &Value) -> Bytes {
    let kind = v["type"].as_str().unwrap_or("message");
    Bytes::from(format!("event: {kind}\ndata: {v}\n\n"))
}

/// The opening of a stream: `message_start` (with the prompt's usage) and a `ping`.
pub(super) fn opening(job: &Job, usage: Value) -> [Bytes; 2] {
    [
        event(&json!({"type": "message_start", "message": {
            "id": "msg_mock", "type": "message", "role": "assistant", "model": job.model,
            "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage,
        }})),
        event(&json!({"type": "ping"})),
    ]
}

/// A text block's opening.
pub(super) fn text_start() -> Bytes {
    event(
        &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    )
}

/// One token of text.
pub(super) fn text_delta(text: &str) -> Bytes {
    event(
        &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
    )
}

/// A streamed call of `tool` (input `{"x": 1}` in two pieces), its block closed.
pub(super) fn tool_events(tool: &str) -> [Bytes; 4] {
    let delta = |piece: &str| {
        event(
            &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": piece}}),
        )
    };
    [
        event(
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "toolu_mock", "name": tool, "input": {}}}),
        ),
        delta("{\"x\""),
        delta(": 1}"),
        event(&json!({"type": "content_block_stop", "index": 0})),
    ]
}

/// The end of a stream: the open block closed (`text`), the stop reason with the
/// output's usage, `message_stop`.
pub(super) fn closing(stop: &str, output_tokens: usize, text: bool) -> Vec<Bytes> {
    let mut out = Vec::with_capacity(3);
    if text {
        out.push(event(&json!({"type": "content_block_stop", "index": 0})));
    }
    out.push(event(&json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": output_tokens}})));
    out.push(event(&json!({"type": "message_stop"})));
    out
}

/// An error event inside a stream.
pub(super) fn error_event(kind: &str, message: &str) -> Bytes {
    event(&json!({"type": "error", "error": {"type": kind, "message": message}}))
}

/// An error answer in Anthropic's shape.
pub(super) fn error(status: StatusCode, message: &str) -> Response<BoxBody> {
    let kind = crate::proxy::anthropic_error_kind(status);
    json_response(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message}}),
    )
}
