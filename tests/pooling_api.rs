//! vLLM's pooling and tokenizer endpoints over real sockets, served with no
//! `extra_paths`: `/v1/rerank` (`/rerank`, `/v2/rerank`), `/score` (`/v1/score`),
//! `/pooling` and `/classify` reach the pool their `model` names, as embeddings do;
//! `/tokenize` and `/detokenize` take no queue place, as `count_tokens` does.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

const RERANKER: &str = "BAAI/bge-reranker-v2-m3";

#[tokio::test]
async fn every_pooling_endpoint_reaches_its_model_s_pool() {
    let chat = engine("chat", &["--decode-ms-per-token", "0"]);
    let rerank: Vec<Proc> = (0..2)
        .map(|i| engine(&format!("r{i}"), &["--model", RERANKER]))
        .collect();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [[pools]]\nname = \"chat\"\nmodels = [\"mock\"]\ndefault = true\n\
         [[pools.nodes]]\nid = \"c0\"\nurl = \"http://{}\"\n\
         [[pools]]\nname = \"rerank\"\nmodels = [\"{RERANKER}\"]\n\
         [[pools.nodes]]\nid = \"r0\"\nurl = \"http://{}\"\n\
         [[pools.nodes]]\nid = \"r1\"\nurl = \"http://{}\"\n",
        chat.addr, rerank[0].addr, rerank[1].addr
    );
    let lb = balancer(&config);
    let documents = json!(["a cache", "a ring", "a breaker"]);
    let cases = [
        (
            "/v1/rerank",
            json!({"model": RERANKER, "query": "what keeps prefixes?", "documents": documents}),
        ),
        (
            "/rerank",
            json!({"model": RERANKER, "query": "q", "documents": documents}),
        ),
        (
            "/v2/rerank",
            json!({"model": RERANKER, "query": "q", "documents": documents}),
        ),
        (
            "/score",
            json!({"model": RERANKER, "text_1": "q", "text_2": ["a", "b"]}),
        ),
        (
            "/v1/score",
            json!({"model": RERANKER, "text_1": "q", "text_2": "a"}),
        ),
        ("/pooling", json!({"model": RERANKER, "input": ["a", "b"]})),
        ("/classify", json!({"model": RERANKER, "input": "a"})),
        (
            "/tokenize",
            json!({"model": RERANKER, "prompt": "three words here"}),
        ),
        ("/detokenize", json!({"model": RERANKER, "tokens": [1, 2]})),
    ];
    for (path, body) in &cases {
        let r = post_json(&lb.url(path), body, &[]).await;
        // The mock engine answers 404 for a model it does not serve: a request in the
        // wrong pool would say so.
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert!(r.header("x-prefixlb-node").starts_with('r'), "{path}");
    }
    let r = post_json(&lb.url("/v1/rerank"), &cases[0].1, &[]).await;
    assert_eq!(r.json()["results"].as_array().unwrap().len(), 3);
    let r = post_json(&lb.url("/tokenize"), &cases[7].1, &[]).await;
    assert_eq!(r.json()["count"], 3);

    let mut served = 0.0;
    for e in &rerank {
        served += metric(&e.url("/metrics"), "mock_engine_pooling_requests_total").await;
    }
    assert_eq!(served, cases.len() as f64 + 2.0);
    let r = call("GET", &lb.url("/v1/rerank"), &[], "").await;
    assert_eq!(r.status, 405);
    let r = call(
        "POST",
        &lb.url("/score"),
        &[("content-type", "text/plain")],
        "q",
    )
    .await;
    assert_eq!(r.status, 415);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn tokenize_answers_at_once_while_every_slot_is_taken() {
    // One long stream holds the only slot.
    let (_e, lb, held) = only_slot_held(
        "/v1/chat/completions",
        &chat(&[("user", "long")], true, 200),
    )
    .await;
    let started = std::time::Instant::now();
    let r = post_json(
        &lb.url("/tokenize"),
        &json!({"model": "mock", "prompt": "count me"}),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["count"], 2);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it did not queue behind the stream"
    );
    // A rerank is load: it queues for the slot (here, past its own short deadline).
    let r = post_json(
        &lb.url("/v1/rerank"),
        &json!({"model": "mock", "query": "q", "documents": ["a"]}),
        &[("x-request-timeout", "0.3")],
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "queue_timeout");
    drop(held);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}
