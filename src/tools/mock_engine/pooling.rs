//! vLLM's pooling and tokenizer endpoints, in their answers' shapes: `/v1/rerank`
//! (`/rerank`, `/v2/rerank`), `/score` (`/v1/score`), `/pooling`, `/classify`,
//! `/tokenize` and `/detokenize`. Scores and vectors are made from a hash of the text,
//! so the same request gets the same answer; a model other than the engine's is 404,
//! as vLLM answers.

use serde_json::{json, Value};

use crate::tools::engine_model::Prompt;

/// The answer to `path` for `body`, or the status and message of an error.
pub(super) fn answer(path: &str, body: &[u8], model: &str) -> Result<Value, (u16, String)> {
    let v: Value = serde_json::from_slice(body).map_err(|e| (400, format!("invalid JSON: {e}")))?;
    let asked = v["model"].as_str().unwrap_or(model);
    if asked != model {
        return Err((404, format!("The model `{asked}` does not exist.")));
    }
    let texts = |key: &str| -> Vec<String> {
        match &v[key] {
            Value::String(s) => vec![s.clone()],
            Value::Array(items) => items
                .iter()
                .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_string))
                .collect(),
            _ => Vec::new(),
        }
    };
    let score = |text: &str| (xxhash_rust::xxh3::xxh3_64(text.as_bytes()) % 1000) as f64 / 1000.0;
    let tokens =
        |texts: &[String]| -> usize { texts.iter().map(|t| Prompt::from_text(t).tokens).sum() };
    let usage = |n: usize| json!({"prompt_tokens": n, "total_tokens": n});
    let answer = match path {
        "/v1/rerank" | "/rerank" | "/v2/rerank" => {
            let query = v["query"].as_str().unwrap_or_default().to_string();
            let documents = texts("documents");
            let results: Vec<Value> = documents
                .iter()
                .enumerate()
                .map(|(i, d)| json!({"index": i, "document": {"text": d}, "relevance_score": score(&format!("{query}\n{d}"))}))
                .collect();
            let n = tokens(&documents) + documents.len() * tokens(std::slice::from_ref(&query));
            json!({"id": "rerank-mock", "model": model, "results": results, "usage": {"total_tokens": n}})
        }
        "/v1/score" | "/score" => {
            let (first, second) = (texts("text_1"), texts("text_2"));
            let data: Vec<Value> = second
                .iter()
                .enumerate()
                .map(|(i, t)| json!({"index": i, "object": "score", "score": score(&format!("{}\n{t}", first.first().map_or("", String::as_str)))}))
                .collect();
            json!({"id": "score-mock", "object": "list", "model": model, "data": data, "usage": usage(tokens(&first) + tokens(&second))})
        }
        "/pooling" | "/classify" => {
            let inputs = texts("input");
            let data: Vec<Value> = inputs
                .iter()
                .enumerate()
                .map(|(i, t)| match path {
                    "/pooling" => json!({"index": i, "object": "pooling", "data": [score(t), 1.0 - score(t)]}),
                    _ => json!({"index": i, "label": if score(t) < 0.5 { "negative" } else { "positive" }, "probs": [1.0 - score(t), score(t)], "num_classes": 2}),
                })
                .collect();
            json!({"id": "pool-mock", "object": "list", "model": model, "data": data, "usage": usage(tokens(&inputs))})
        }
        "/tokenize" => {
            let text = v["prompt"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v["messages"].to_string());
            let ids: Vec<u64> = text
                .split_whitespace()
                .map(|w| xxhash_rust::xxh3::xxh3_64(w.as_bytes()) % 50_000)
                .collect();
            json!({"count": ids.len(), "max_model_len": 32_768, "tokens": ids})
        }
        "/detokenize" => {
            let ids = v["tokens"].as_array().map_or(0, Vec::len);
            json!({"prompt": vec!["tok"; ids].join(" ")})
        }
        _ => return Err((404, format!("no route for {path}"))),
    };
    Ok(answer)
}
