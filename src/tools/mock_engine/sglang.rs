//! SGLang's native `POST /generate` as `mock-engine` speaks it: the prompt as `text` or
//! as token ids (`input_ids`, a token each), `sampling_params.max_new_tokens` (SGLang's default 128), `stream`,
//! and the data-parallel rank in the body's `routed_dp_rank` (SGLang reads no rank
//! header on this endpoint). The answer is `{"text", "meta_info"}`: whole, or as SSE
//! events each carrying the text so far, the last with its `finish_reason` object,
//! then `data: [DONE]`. `meta_info` counts `prompt_tokens`, `completion_tokens` and
//! `cached_tokens`, as SGLang does.

use bytes::Bytes;
use serde_json::{json, Value};

use super::wire::token_text;

/// SGLang's `max_new_tokens` when `sampling_params` does not say.
const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

/// The prompt text of a `/generate` body (token ids are read apart, one token each).
pub(super) fn prompt_text(v: &Value) -> Result<String, String> {
    match (&v["text"], &v["input_ids"]) {
        (Value::String(text), _) => Ok(text.clone()),
        (_, Value::Array(_)) => Ok(String::new()),
        _ => Err("Either text or input_ids should be provided.".into()),
    }
}

pub(super) fn max_new_tokens(v: &Value) -> usize {
    v["sampling_params"]["max_new_tokens"]
        .as_u64()
        .unwrap_or(DEFAULT_MAX_NEW_TOKENS) as usize
}

/// The rank the body asks for (`routed_dp_rank`); `None` when it names none.
pub(super) fn routed_dp_rank(v: &Value) -> Option<i64> {
    v["routed_dp_rank"].as_i64()
}

/// SGLang's 400 for a rank the server does not have.
pub(super) fn rank_out_of_range(rank: i64, ranks: usize) -> String {
    format!("routed_dp_rank={rank} out of range [0, {ranks})")
}

/// The text of the first `n` tokens.
pub(super) fn text_of(n: usize) -> String {
    (0..n).map(token_text).collect()
}

/// An answer, or a stream's event, with `completion` tokens of text; `finished`
/// gives `meta_info` its `finish_reason` object.
pub(super) fn answer(prompt: usize, completion: usize, cached: usize, finished: bool) -> Value {
    let finish_reason = if finished {
        json!({"type": "length", "length": completion})
    } else {
        Value::Null
    };
    json!({
        "text": text_of(completion),
        "meta_info": {
            "id": "mock-generate",
            "finish_reason": finish_reason,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": cached,
        },
    })
}

/// One SSE event.
pub(super) fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_is_text_or_token_ids() {
        assert_eq!(prompt_text(&json!({"text": "hi"})).unwrap(), "hi");
        assert!(prompt_text(&json!({"input_ids": [1, 2]})).is_ok());
        assert!(prompt_text(&json!({"sampling_params": {}})).is_err());
    }

    #[test]
    fn an_answer_counts_its_tokens_in_meta_info() {
        let a = answer(100, 3, 64, true);
        assert_eq!(a["text"], text_of(3));
        assert_eq!(a["meta_info"]["prompt_tokens"], 100);
        assert_eq!(a["meta_info"]["cached_tokens"], 64);
        assert_eq!(a["meta_info"]["finish_reason"]["type"], "length");
        assert!(answer(100, 1, 0, false)["meta_info"]["finish_reason"].is_null());
    }
}
