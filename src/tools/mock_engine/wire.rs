//! The OpenAI wire format as `mock-engine` speaks it: request bodies parsed into a
//! [`Job`], answers encoded as vLLM does (JSON completions, SSE chunks with a role-only
//! first chunk and an optional usage chunk), JSON errors, and the channel-fed body
//! that carries a stream.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::proxy::body::{full, BodyError, BoxBody};
use crate::tools::engine_model::Prompt;

/// Which completion API a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Text,
    /// Anthropic's Messages API.
    Messages,
    /// OpenAI's Responses API.
    Responses,
    /// SGLang's native `/generate`.
    Generate,
}

/// A parsed generation request.
pub(super) struct Job {
    pub(super) kind: Kind,
    pub(super) model: String,
    pub(super) prompt: Prompt,
    pub(super) max_tokens: usize,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// `"mock_timestamps": true`: each chunk carries `emitted_us` (µs since the Unix
    /// epoch), so a client can measure per-chunk delivery latency.
    pub(super) timestamps: bool,
    /// The first tool's function name, when the request offers `tools`: a stream
    /// then calls it instead of writing text.
    pub(super) tool: Option<String>,
    /// A chat message has an image part (`image_url`): this text-only engine answers
    /// it with llama.cpp's 500.
    pub(super) image: bool,
    /// Responses API: the response it continues (`previous_response_id`).
    pub(super) previous_response: Option<String>,
    /// Responses API: the response is kept in the engine's store (`store`, default on).
    pub(super) store: bool,
    /// Responses API: its conversation as prompt text, without `instructions` (what a
    /// later response continues); the earlier responses' put before it by the engine.
    pub(super) conversation: String,
    /// Responses API: the id its response gets.
    pub(super) response_id: String,
    /// The data-parallel rank that runs it (its KV cache and prefill lane).
    pub(super) rank: usize,
    /// `/generate`: the rank its body names (`routed_dp_rank`).
    pub(super) routed_dp_rank: Option<i64>,
    /// The prompt came as token ids.
    pub(super) token_ids: bool,
    /// What its `kv_transfer_params` ask (vLLM's disaggregated prefill).
    pub(super) transfer: super::kv_transfer::Transfer,
    /// The bootstrap its body names (SGLang's disaggregated serving).
    pub(super) bootstrap: Option<super::kv_transfer::Bootstrap>,
    /// Its `x-request-id` header.
    pub(super) request_id: Option<String>,
}

pub(super) fn parse_job(body: &[u8], kind: Kind, default_model: &str) -> Result<Job, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let mut image = false;
    let mut conversation = String::new();
    let text = match kind {
        Kind::Chat => {
            let messages = v["messages"].as_array().ok_or("'messages' is required")?;
            let mut text = String::new();
            image = messages.iter().any(|m| {
                m["content"]
                    .as_array()
                    .is_some_and(|parts| parts.iter().any(|p| p["type"] == "image_url"))
            });
            for m in messages {
                push_message(&mut text, m["role"].as_str().unwrap_or(""), &m["content"]);
            }
            text
        }
        Kind::Messages => super::anthropic::prompt_text(&v)?,
        Kind::Responses => {
            conversation = super::responses::input_text(&v)?;
            super::responses::instructions(&v) + &conversation
        }
        Kind::Generate => super::sglang::prompt_text(&v)?,
        Kind::Text => match &v["prompt"] {
            Value::String(s) => s.clone(),
            Value::Array(items) => items.first().map(|p| p.to_string()).unwrap_or_default(),
            _ => return Err("'prompt' is required".into()),
        },
    };
    let max_tokens = match kind {
        Kind::Generate => super::sglang::max_new_tokens(&v),
        _ => v["max_completion_tokens"]
            .as_u64()
            .or_else(|| v["max_tokens"].as_u64())
            .or_else(|| v["max_output_tokens"].as_u64())
            .unwrap_or(16) as usize,
    };
    let ids = token_ids(kind, &v);
    Ok(Job {
        kind,
        token_ids: ids.is_some(),
        model: v["model"].as_str().unwrap_or(default_model).to_string(),
        prompt: ids.map_or_else(|| Prompt::from_text(&text), |ids| Prompt::from_ids(&ids)),
        max_tokens,
        stream: v["stream"].as_bool().unwrap_or(false),
        timestamps: v["mock_timestamps"].as_bool().unwrap_or(false),
        include_usage: v["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(false),
        tool: v["tools"][0]["function"]["name"]
            .as_str()
            .or(v["tools"][0]["name"].as_str())
            .map(str::to_string),
        image,
        previous_response: v["previous_response_id"].as_str().map(str::to_string),
        store: v["store"].as_bool().unwrap_or(true),
        conversation,
        response_id: String::new(),
        rank: 0,
        routed_dp_rank: super::sglang::routed_dp_rank(&v),
        transfer: super::kv_transfer::Transfer::of(&v),
        bootstrap: super::kv_transfer::Bootstrap::of(&v),
        request_id: None,
    })
}

/// A prompt given as token ids, one token each: a completions `prompt` of ids (or the
/// first of a batch of them), or SGLang's `input_ids` when there is no `text`.
fn token_ids(kind: Kind, v: &Value) -> Option<Vec<u64>> {
    let ids = |v: &Value| -> Option<Vec<u64>> { v.as_array()?.iter().map(Value::as_u64).collect() };
    match kind {
        Kind::Text => ids(&v["prompt"]).or_else(|| ids(&v["prompt"][0])),
        Kind::Generate if v["text"].is_null() => ids(&v["input_ids"]),
        _ => None,
    }
}

/// A message as prompt text: `role \n text \n`, its text a string or the text of its
/// parts.
pub(super) fn push_message(text: &mut String, role: &str, content: &Value) {
    text.push_str(role);
    text.push('\n');
    match content {
        Value::String(s) => text.push_str(s),
        Value::Array(parts) => {
            for p in parts {
                text.push_str(p["text"].as_str().unwrap_or(""));
            }
        }
        _ => {}
    }
    text.push('\n');
}

/// The deltas of a streamed call of `tool` (arguments `{"x": 1}` in three pieces).
pub(super) fn tool_call_deltas(tool: &str) -> [Value; 3] {
    [
        json!({"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": tool, "arguments": ""}}]}),
        json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\""}}]}),
        json!({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
    ]
}

/// `POST /v1/embeddings`: 8 numbers per input, derived from its text; as a JSON array,
/// or with `encoding_format = "base64"` as the base64 of little-endian `f32`s (as vLLM
/// and OpenAI answer it; the openai Node client asks for it by default).
pub(super) fn embeddings(body: &[u8], default_model: &str) -> Result<Value, String> {
    use base64::Engine as _;
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let base64 = match v["encoding_format"].as_str() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(format!("unknown encoding_format '{other}'")),
    };
    let inputs: Vec<String> = match &v["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| i.to_string())
            })
            .collect(),
        _ => return Err("'input' is required".into()),
    };
    let mut tokens = 0;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            tokens += Prompt::from_text(text).tokens;
            let h = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
            let embedding: Vec<f64> = (0..8)
                .map(|k| ((h >> (k * 8)) & 0xFF) as f64 / 255.0 - 0.5)
                .collect();
            let embedding = if base64 {
                let bytes: Vec<u8> = embedding
                    .iter()
                    .flat_map(|x| (*x as f32).to_le_bytes())
                    .collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(embedding)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(json!({
        "object": "list",
        "data": data,
        "model": v["model"].as_str().unwrap_or(default_model),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

const WORDS: [&str; 8] = [
    " the", " cache", " holds", " every", " prefix", " we", " have", " seen",
];

pub(super) fn token_text(i: usize) -> &'static str {
    WORDS[i % WORDS.len()]
}

pub(super) fn sse_chunk(
    kind: Kind,
    model: &str,
    delta: Value,
    finish: Value,
    timestamps: bool,
) -> Bytes {
    let mut data = match kind {
        Kind::Chat => json!({
            "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        }),
        Kind::Text | Kind::Messages | Kind::Responses | Kind::Generate => json!({
            "id": "cmpl-mock", "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": 0, "text": delta.get("content").and_then(Value::as_str).unwrap_or(""), "logprobs": null, "finish_reason": finish}],
        }),
    };
    if timestamps {
        let us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        data["emitted_us"] = json!(us);
    }
    Bytes::from(format!("data: {data}\n\n"))
}

pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn json_response(status: StatusCode, v: &Value) -> Response<BoxBody> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

pub(super) fn text(status: StatusCode, s: &str) -> Response<BoxBody> {
    let mut resp = Response::new(full(s.to_string()));
    *resp.status_mut() = status;
    resp
}

pub(super) fn error(status: StatusCode, msg: &str) -> Response<BoxBody> {
    json_response(
        status,
        &json!({"error": {"message": msg, "type": "mock_engine_error", "code": status.as_u16()}}),
    )
}

/// Sent into a [`ChannelBody`], it ends the body with an error: hyper drops the
/// connection mid-body, as a crashed or reset engine does.
pub(super) const RESET: &[u8] = b"\0mock:reset\0";

/// A body fed by a channel: each message is sent as one frame as soon as it arrives.
/// The sender sees `send` fail once the receiver (the connection) is gone, which is how
/// a producer learns that its client disconnected.
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl ChannelBody {
    /// A body and its sender; `depth` chunks may be queued before `send` waits.
    pub fn new(depth: usize) -> (mpsc::Sender<Bytes>, ChannelBody) {
        let (tx, rx) = mpsc::channel(depth);
        (tx, ChannelBody { rx })
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.rx.poll_recv(cx).map(|chunk| {
            chunk.map(|b| {
                if b == RESET {
                    Err("injected fault: connection reset mid-stream".into())
                } else {
                    Ok(Frame::data(b))
                }
            })
        })
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// A non-streaming completion body (`finish_reason` "length": exactly `max_tokens`).
pub(super) fn completion(job: &Job, content: &str, usage: Value) -> Value {
    match job.kind {
        Kind::Chat => json!({
            "id": "chatcmpl-mock", "object": "chat.completion", "created": now(), "model": job.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}],
            "usage": usage,
        }),
        Kind::Text => json!({
            "id": "cmpl-mock", "object": "text_completion", "created": now(), "model": job.model,
            "choices": [{"index": 0, "text": content, "finish_reason": "length"}],
            "usage": usage,
        }),
        Kind::Messages => super::anthropic::message(job, content, usage),
        Kind::Responses => super::responses::response(job, &job.response_id, Some(content), usage),
        Kind::Generate => {
            let n = |v: &Value| v.as_u64().unwrap_or(0) as usize;
            let cached = n(&usage["prompt_tokens_details"]["cached_tokens"]);
            let (prompt, completion) = (n(&usage["prompt_tokens"]), n(&usage["completion_tokens"]));
            super::sglang::answer(prompt, completion, cached, true)
        }
    }
}

/// The final usage-only chunk of a stream that asked for it
/// (`stream_options.include_usage`).
pub(super) fn usage_chunk(job: &Job, usage: Value) -> Bytes {
    let object = match job.kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Text | Kind::Messages | Kind::Responses | Kind::Generate => "text_completion",
    };
    let data = json!({"id": "mock", "object": object, "created": now(), "model": job.model, "choices": [], "usage": usage});
    Bytes::from(format!("data: {data}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    #[test]
    fn token_ids_are_a_token_each_and_a_longer_list_extends_a_shorter_one() {
        let ids: Vec<u64> = (0..40).map(|i| 1000 + i).collect();
        let body = |ids: &[u64]| serde_json::to_vec(&json!({"prompt": ids})).unwrap();
        let short = parse_job(&body(&ids[..33]), Kind::Text, "m")
            .unwrap()
            .prompt;
        let long = parse_job(&body(&ids), Kind::Text, "m").unwrap().prompt;
        assert_eq!((short.tokens, long.tokens), (33, 40));
        assert_eq!(short.blocks.len(), 2);
        assert_eq!(short.blocks[..], long.blocks[..2]);
        let generate = serde_json::to_vec(&json!({"input_ids": &ids[..33]})).unwrap();
        let g = parse_job(&generate, Kind::Generate, "m").unwrap().prompt;
        assert_eq!(g.blocks, short.blocks, "the same ids, the same blocks");
        let batch = serde_json::to_vec(&json!({"prompt": [&ids[..33]]})).unwrap();
        assert_eq!(
            parse_job(&batch, Kind::Text, "m").unwrap().prompt.tokens,
            33
        );
    }

    #[test]
    fn embeddings_come_as_floats_or_as_base64_of_the_same_f32s() {
        let floats = embeddings(br#"{"input": ["a", "b"]}"#, "m").unwrap();
        let packed = embeddings(
            br#"{"input": ["a", "b"], "encoding_format": "base64"}"#,
            "m",
        )
        .unwrap();
        for i in 0..2 {
            let want: Vec<f32> = floats["data"][i]["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(packed["data"][i]["embedding"].as_str().unwrap())
                .unwrap();
            let got: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(got, want);
            assert_eq!(got.len(), 8);
        }
        assert!(embeddings(br#"{"input": "a", "encoding_format": "int8"}"#, "m").is_err());
    }
}
