//! Anthropic's Messages API end to end over real sockets (issue 25): the key, the
//! engine's usage feeding the realized hit rate, a stream that breaks ending with
//! Anthropic's `error` event, errors in Anthropic's shape, `x-api-key`, and
//! `count_tokens` taking no queue place. The official client's view is in
//! `tests/clients/anthropic_check.py` (run by `.ci/run`).

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const FAST: [&str; 4] = ["--decode-ms-per-token", "1", "--prefill-us-per-token", "0"];

fn messages(system: &str, turns: &[&str], stream: bool, max_tokens: u32) -> Value {
    let msgs: Vec<Value> = turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": [{"type": "text", "text": t}]})
        })
        .collect();
    json!({"model": "mock", "max_tokens": max_tokens, "stream": stream,
           "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
           "messages": msgs})
}

/// The events of an SSE body: `(event type, data)`.
fn events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let kind = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or("");
            let data = e
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or("null");
            (
                kind.to_string(),
                serde_json::from_str(data).unwrap_or(Value::Null),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_conversation_over_messages_stays_home_and_its_cache_reads_are_counted() {
    let engines: Vec<Proc> = (0..4).map(|i| engine(&format!("e{i}"), &FAST)).collect();
    let lb = balancer(&config(&engines.iter().collect::<Vec<_>>(), "", ""));
    let system = format!("You are a coding agent. {}", "Rule. ".repeat(400));
    let mut turns: Vec<String> = vec![];
    let mut nodes = vec![];
    for t in 0..4 {
        turns.push(format!("step {t}: {}", "read the file ".repeat(30)));
        let refs: Vec<&str> = turns.iter().map(String::as_str).collect();
        let r = post_json(
            &lb.url("/v1/messages"),
            &messages(&system, &refs, false, 4),
            &[],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["type"], "message");
        nodes.push(r.header("x-prefixlb-node").to_string());
        turns.push(v["content"][0]["text"].as_str().unwrap().to_string());
    }
    assert!(nodes.iter().all(|n| *n == nodes[0]), "one home: {nodes:?}");
    // The engine's `cache_read_input_tokens` and `input_tokens` reach the metrics: the
    // prompt is their sum, and the later turns found their history.
    let page = lb.admin_url("/metrics");
    let prompt = sum_metric(&page, "prefixlb_prompt_tokens_total").await;
    let cached = sum_metric(&page, "prefixlb_cached_prompt_tokens_total").await;
    let engine_prompt = metric(
        &engines_url(&engines, &nodes[0]),
        "vllm:prefix_cache_queries_total",
    )
    .await;
    let engine_cached = metric(
        &engines_url(&engines, &nodes[0]),
        "vllm:prefix_cache_hits_total",
    )
    .await;
    assert_eq!((prompt, cached), (engine_prompt, engine_cached));
    assert!(cached > 0.5 * prompt, "{cached} of {prompt}");
}

/// The metrics page of the engine behind node `n<i>`.
fn engines_url(engines: &[Proc], node: &str) -> String {
    let i: usize = node.trim_start_matches('n').parse().unwrap();
    engines[i].url("/metrics")
}

#[tokio::test]
async fn a_messages_stream_that_breaks_ends_with_an_anthropic_error_event() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "", ""));
    set_fault(&e, "reset", 0).await;
    let r = post_json(
        &lb.url("/v1/messages"),
        &messages("s", &["hi"], true, 16),
        &[],
    )
    .await;
    assert_eq!(r.status, 200);
    let ev = events(&r.text());
    let kinds: Vec<&str> = ev.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{kinds:?}");
    assert!(kinds.contains(&"content_block_delta"), "{kinds:?}");
    let (kind, last) = ev.last().unwrap();
    assert_eq!(kind, "error", "{kinds:?}");
    assert_eq!(last["type"], "error");
    assert_eq!(last["error"]["type"], "api_error");
    assert!(last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("mid-stream"));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
    // Before the first token the same failure is failed over or answered as a whole
    // Anthropic error: with the one engine erroring, its own 500 (no other engine to
    // ask), in Anthropic's shape.
    set_fault(&e, "error", 0).await;
    let r = post_json(
        &lb.url("/v1/messages"),
        &messages("s", &["hi"], true, 16),
        &[],
    )
    .await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], "api_error");
    // With the engine gone the error is ours (a 502, or a 503 once its breaker has
    // opened), in Anthropic's shape too.
    drop(e);
    let r = post_json(
        &lb.url("/v1/messages"),
        &messages("s", &["hi"], true, 16),
        &[],
    )
    .await;
    let kind = match r.status.as_u16() {
        502 => "api_error",
        503 => "overloaded_error",
        other => panic!("{other}: {}", r.text()),
    };
    assert_eq!(r.json()["type"], "error");
    assert_eq!(r.json()["error"]["type"], kind, "{}", r.text());
}

#[tokio::test]
async fn x_api_key_is_a_key_on_messages_only_and_errors_take_the_apis_shape() {
    let e = engine("e0", &FAST);
    let text = config(&[&e], "", "").replace(
        "[[pools]]",
        "[auth]\napi_keys_env = \"MESSAGES_KEYS\"\n[[pools]]",
    );
    let (lb, _log) = balancer_logged(&text, "warn", &[("MESSAGES_KEYS", "sk-one")]);
    let body = messages("s", &["hi"], false, 2);
    let ok = post_json(&lb.url("/v1/messages"), &body, &[("x-api-key", "sk-one")]).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    let bearer = post_json(
        &lb.url("/v1/messages"),
        &body,
        &[("authorization", "Bearer sk-one")],
    )
    .await;
    assert_eq!(bearer.status, 200);
    let wrong = post_json(&lb.url("/v1/messages"), &body, &[("x-api-key", "sk-two")]).await;
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.json()["error"]["type"], "authentication_error");
    assert_eq!(wrong.json()["type"], "error");
    // The chat API takes only `Authorization`, and answers in OpenAI's shape.
    let chat = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hi")], false, 2),
        &[("x-api-key", "sk-one")],
    )
    .await;
    assert_eq!(chat.status, 401);
    assert_eq!(chat.json()["error"]["code"], "invalid_api_key");
    // An unknown model: 404 `not_found_error`; a body without messages: 400.
    let mut other = body.clone();
    other["model"] = json!("nope");
    let r = post_json(&lb.url("/v1/messages"), &other, &[("x-api-key", "sk-one")]).await;
    assert_eq!(
        (r.status.as_u16(), r.json()["error"]["type"].clone()),
        (404, json!("not_found_error"))
    );
    let r = post_json(
        &lb.url("/v1/messages"),
        &json!({"model": "mock", "max_tokens": 1}),
        &[("x-api-key", "sk-one")],
    )
    .await;
    assert_eq!(
        (r.status.as_u16(), r.json()["error"]["type"].clone()),
        (400, json!("invalid_request_error"))
    );
}

#[tokio::test]
async fn count_tokens_answers_at_once_while_every_slot_is_taken() {
    // One long stream holds the only slot.
    let (_e, lb, held) = only_slot_held("/v1/messages", &messages("s", &["long"], true, 200)).await;
    let started = std::time::Instant::now();
    let r = post_json(
        &lb.url("/v1/messages/count_tokens"),
        &messages("s", &["count me"], false, 1),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["input_tokens"].as_u64().unwrap() > 0);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it did not queue behind the stream"
    );
    assert_eq!(r.header("x-prefixlb-route"), "primary");
    // Counting prefills nothing: its `input_tokens` are no prompt tokens served (the
    // stream still running has not reported its own yet).
    let page = lb.admin_url("/metrics");
    assert_eq!(sum_metric(&page, "prefixlb_prompt_tokens_total").await, 0.0);
    drop(held);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}
