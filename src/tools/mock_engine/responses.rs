//! OpenAI's Responses API as `mock-engine` speaks it (what vLLM answers on
//! `/v1/responses`): the prompt rendered as the chat API's is (`instructions` first,
//! then `role \n text \n` per input item), answers as a `response` object or as typed
//! SSE events (`response.created` … `response.completed`, each with its
//! `sequence_number`), usage as `input_tokens` (the cache's hits included) with
//! `input_tokens_details.cached_tokens`, and the engine's own response store: a
//! response created with `store` (the default) can be read (`GET`), deleted (`DELETE`)
//! and continued (`previous_response_id`, whose conversation is put before the new
//! input, as vLLM does), on this engine only. An id it does not hold gets vLLM's 404.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use parking_lot::Mutex;
use serde_json::{json, Value};

use super::wire::{json_response, now, push_message, Job};
use crate::proxy::body::BoxBody;

/// Most responses an engine keeps (the oldest are not evicted in order: any one goes).
const MAX_STORED: usize = 100_000;

/// What a `previous_response_id` request reads of an earlier response: its
/// conversation (input items and output, as prompt text) and the answer as it was sent.
#[derive(Clone)]
pub(super) struct Stored {
    pub(super) conversation: String,
    pub(super) response: Value,
}

/// The engine's response store.
#[derive(Default)]
pub(super) struct Store {
    responses: Mutex<HashMap<String, Stored>>,
    made: AtomicU64,
}

impl Store {
    /// A new response id: `resp_` and 32 hex digits, as vLLM's, from this engine's id
    /// and a counter (nothing in it names the engine).
    pub(super) fn new_id(&self, engine: &str) -> String {
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        let a = xxhash_rust::xxh3::xxh3_64_with_seed(engine.as_bytes(), n);
        let b = xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), a);
        format!("resp_{a:016x}{b:016x}")
    }

    pub(super) fn get(&self, id: &str) -> Option<Stored> {
        self.responses.lock().get(id).cloned()
    }

    pub(super) fn put(&self, id: String, stored: Stored) {
        let mut responses = self.responses.lock();
        if responses.len() >= MAX_STORED {
            if let Some(any) = responses.keys().next().cloned() {
                responses.remove(&any);
            }
        }
        responses.insert(id, stored);
    }

    /// `GET`, `DELETE` or `POST …/cancel` of `/v1/responses/{id}`.
    pub(super) fn serve(&self, method: &Method, rest: &str) -> Response<BoxBody> {
        let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
        let found = self.get(id);
        match (method, action, found) {
            (_, _, None) => not_found(id),
            (&Method::GET, "", Some(s)) => json_response(StatusCode::OK, &s.response),
            (&Method::DELETE, "", Some(_)) => {
                self.responses.lock().remove(id);
                json_response(
                    StatusCode::OK,
                    &json!({"id": id, "object": "response", "deleted": true}),
                )
            }
            // vLLM's answer: only a background response can be cancelled.
            (&Method::POST, "cancel", Some(_)) => error(
                StatusCode::BAD_REQUEST,
                "Cannot cancel a synchronous response.",
            ),
            _ => error(StatusCode::NOT_FOUND, &format!("no route for {rest}")),
        }
    }
}

/// vLLM's answer for a response id it does not hold.
pub(super) fn not_found(id: &str) -> Response<BoxBody> {
    error(
        StatusCode::NOT_FOUND,
        &format!("Response with id '{id}' not found."),
    )
}

fn error(status: StatusCode, msg: &str) -> Response<BoxBody> {
    json_response(
        status,
        &json!({"error": {"message": msg, "type": "invalid_request_error", "param": "response_id", "code": status.as_u16()}}),
    )
}

/// The prompt text of a Responses body, without the `instructions` (they come first,
/// and are not carried into a later response): `input` as a string, or its items.
pub(super) fn input_text(v: &Value) -> Result<String, String> {
    let mut text = String::new();
    match &v["input"] {
        input @ Value::String(_) => push_message(&mut text, "user", input),
        Value::Array(items) => {
            for item in items {
                // A tool's output item has its text in `output`.
                let content = match &item["content"] {
                    Value::Null => &item["output"],
                    content => content,
                };
                push_message(&mut text, item["role"].as_str().unwrap_or("user"), content);
            }
        }
        _ => return Err("'input' is required".into()),
    }
    Ok(text)
}

/// `instructions` as prompt text (empty when there are none).
pub(super) fn instructions(v: &Value) -> String {
    match v["instructions"].as_str() {
        Some(s) => format!("system\n{s}\n"),
        None => String::new(),
    }
}

/// The Responses API's usage: `input_tokens` counts the cache's hits too.
pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    })
}

/// A `response` object: `status` "completed" with `text` as its one message (and
/// `usage`), or "in_progress" with no output yet.
pub(super) fn response(job: &Job, id: &str, text: Option<&str>, usage: Value) -> Value {
    let output = match text {
        Some(t) => json!([message(id, t, "completed")]),
        None => json!([]),
    };
    json!({
        "id": id, "object": "response", "created_at": now(), "model": job.model,
        "status": if text.is_some() { "completed" } else { "in_progress" },
        "output": output, "usage": usage,
        "previous_response_id": job.previous_response, "store": job.store,
        "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
    })
}

fn message(id: &str, text: &str, status: &str) -> Value {
    json!({
        "id": item_id(id), "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// The typed events of a stream, numbered.
pub(super) struct Events {
    next: u64,
}

impl Events {
    pub(super) fn new() -> Events {
        Events { next: 0 }
    }

    /// One SSE event of `kind` with `fields`.
    pub(super) fn event(&mut self, kind: &str, mut fields: Value) -> Bytes {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.next);
        self.next += 1;
        Bytes::from(format!("event: {kind}\ndata: {fields}\n\n"))
    }

    /// What comes before the first token: the response created and in progress, its
    /// message and text part added.
    pub(super) fn opening(&mut self, job: &Job, id: &str) -> [Bytes; 4] {
        let r = response(job, id, None, Value::Null);
        let item = message(id, "", "in_progress");
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        [
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
            self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            ),
            self.event(
                "response.content_part.added",
                json!({"item_id": item["id"], "output_index": 0, "content_index": 0, "part": part}),
            ),
        ]
    }

    pub(super) fn delta(&mut self, id: &str, text: &str) -> Bytes {
        self.event(
            "response.output_text.delta",
            json!({"item_id": item_id(id), "output_index": 0, "content_index": 0, "delta": text}),
        )
    }

    /// What follows the last token: the text, part and item done, then the response
    /// completed with its usage.
    pub(super) fn closing(&mut self, completed: &Value) -> [Bytes; 4] {
        let item = &completed["output"][0];
        let text = &item["content"][0]["text"];
        [
            self.event(
                "response.output_text.done",
                json!({"item_id": item["id"], "output_index": 0, "content_index": 0, "text": text}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": item["id"], "output_index": 0, "content_index": 0, "part": item["content"][0]}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ),
            self.event("response.completed", json!({"response": completed})),
        ]
    }
}

/// The id of a response's message: `msg_` and the response's own suffix.
fn item_id(response: &str) -> String {
    format!("msg_{}", response.strip_prefix("resp_").unwrap_or(response))
}
