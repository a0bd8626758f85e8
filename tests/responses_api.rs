//! The Responses API's stored responses through the balancer, over real sockets to
//! real `mock-engine` processes (each keeps the responses it answers in its own memory,
//! as vLLM does): a conversation chained by `previous_response_id` stays on the engine
//! that holds it, `GET`/`DELETE /v1/responses/{id}` and `…/cancel` reach that engine,
//! a response no table here knows is found by asking each engine in turn, and an
//! engine holding a response that cannot be reached is named in a clear error.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use serde_json::{json, Value};

/// A turn's own text: long enough to be keyed apart from every other.
fn said(conversation: usize, turn: usize) -> String {
    format!("conversation {conversation}, turn {turn}: ").repeat(30)
}

/// `METHOD /v1/responses/{id}` and `action` after it, through `lb`, read whole.
async fn on_response(lb: &Proc, method: &str, id: &str, action: &str) -> Reply {
    let path = format!("/v1/responses/{id}{action}");
    call(method, &lb.url(&path), &[], Bytes::new()).await
}

/// `prefixlb_stored_response_requests_total` of pool `mock`: known, found, missing and
/// unavailable.
async fn lookups(lb: &Proc) -> [f64; 4] {
    let url = lb.admin_url("/metrics");
    let mut counts = [0.0; 4];
    for (count, holder) in counts
        .iter_mut()
        .zip(["known", "found", "missing", "unavailable"])
    {
        let name =
            format!("prefixlb_stored_response_requests_total{{holder=\"{holder}\",pool=\"mock\"}}");
        *count = metric(&url, &name).await;
    }
    counts
}

/// The first event of type `kind` in a Responses API stream's text.
fn event(text: &str, kind: &str) -> Value {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|v| v["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {text}"))
}

/// One `POST /v1/responses`: its reply, and for a stream the `response.completed`
/// event's response (what a plain answer is whole).
async fn respond(lb: &Proc, body: &Value) -> (Reply, Value) {
    let reply = post_json(&lb.url("/v1/responses"), body, &[]).await;
    if body["stream"] != json!(true) || reply.status != 200 {
        let v = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
        return (reply, v);
    }
    let completed = event(&reply.text(), "response.completed");
    (reply, completed["response"].clone())
}

#[tokio::test]
async fn a_conversation_of_stored_responses_stays_on_the_engine_that_holds_it() {
    let engines: Vec<Proc> = (0..4).map(|i| engine(&format!("e{i}"), &[])).collect();
    let lb = balancer(&config(&engines.iter().collect::<Vec<_>>(), "", ""));
    for c in 0..3 {
        let mut previous: Option<String> = None;
        let mut home: Option<String> = None;
        for turn in 0..6 {
            let mut body = json!({"model": "mock", "input": said(c, turn), "max_output_tokens": 4});
            // Streams and plain answers both teach where the response is.
            body["stream"] = json!(turn % 2 == 1);
            if let Some(p) = &previous {
                body["previous_response_id"] = json!(p);
            }
            let (reply, response) = respond(&lb, &body).await;
            assert_eq!(reply.status, 200, "turn {turn}: {}", reply.text());
            let node = reply.header("x-prefixlb-node").to_string();
            if let Some(h) = &home {
                assert_eq!(&node, h, "conversation {c} turn {turn} left its engine");
                // The engine put the stored conversation before the new input: it
                // found it in its cache.
                let cached = response["usage"]["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap();
                assert!(cached > 0, "turn {turn} found nothing cached: {response}");
            }
            home = Some(node);
            previous = Some(response["id"].as_str().unwrap().to_string());
        }
        let id = previous.unwrap();
        let home = home.unwrap();
        // The explanation of the next turn names the response, its engine, and that
        // engine as the choice.
        let next = json!({"model": "mock", "input": said(c, 9), "previous_response_id": id});
        let explained = post_json(
            &lb.admin_url("/admin/explain?path=/v1/responses"),
            &next,
            &[],
        )
        .await;
        let x = explained.json();
        assert_eq!(
            x["stored_response"],
            json!({"id": id, "held_by": home}),
            "{x}"
        );
        assert_eq!(x["choice"], json!(home), "{x}");
        // The response's own endpoints reach its engine.
        let got = on_response(&lb, "GET", &id, "").await;
        assert_eq!(got.status, 200, "{}", got.text());
        assert_eq!(got.json()["id"], json!(id));
        assert_eq!(got.header("x-prefixlb-node"), home);
        let cancelled = on_response(&lb, "POST", &id, "/cancel").await;
        // The engine's own answer: a response that was not a background one.
        assert_eq!(cancelled.status, 400, "{}", cancelled.text());
        assert!(
            cancelled.text().contains("synchronous"),
            "{}",
            cancelled.text()
        );
        let deleted = on_response(&lb, "DELETE", &id, "").await;
        assert_eq!(deleted.status, 200, "{}", deleted.text());
        assert_eq!(deleted.json()["deleted"], json!(true));
        // Deleted: no engine holds it now, and the client reads an engine's 404.
        let gone = on_response(&lb, "GET", &id, "").await;
        assert_eq!(gone.status, 404, "{}", gone.text());
        assert!(gone.text().contains("not found"), "{}", gone.text());
    }
    // Per conversation: 5 turns, a read, a cancel and a delete on the known engine;
    // the read after the delete found no engine holding it.
    assert_eq!(lookups(&lb).await, [24.0, 0.0, 3.0, 0.0]);
    // The Responses API's usage is counted like the others'.
    let metrics = lb.admin_url("/metrics");
    assert!(sum_metric(&metrics, "prefixlb_prompt_tokens_total").await > 0.0);
    assert!(sum_metric(&metrics, "prefixlb_cached_prompt_tokens_total").await > 0.0);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn a_response_no_table_knows_is_found_by_asking_each_engine_in_turn() {
    let engines: Vec<Proc> = (0..4).map(|i| engine(&format!("e{i}"), &[])).collect();
    // One attempt per request: asking an engine that answers "not here" spends none.
    let lb = balancer(&config(
        &engines.iter().collect::<Vec<_>>(),
        "",
        "max_attempts = 1",
    ));
    // Responses the balancer never saw (answered before a restart, or by another
    // replica): made on each engine directly.
    for (i, e) in engines.iter().enumerate() {
        let body = json!({"model": "mock", "input": said(9, i), "max_output_tokens": 2});
        let made = post_json(&e.url("/v1/responses"), &body, &[]).await;
        assert_eq!(made.status, 200);
        let id = made.json()["id"].as_str().unwrap().to_string();
        let next = json!({"model": "mock", "input": "and then?", "previous_response_id": id, "max_output_tokens": 2});
        let (reply, _) = respond(&lb, &next).await;
        assert_eq!(
            reply.status,
            200,
            "engine e{i}'s response: {}",
            reply.text()
        );
        assert_eq!(reply.header("x-prefixlb-node"), format!("n{i}"));
        // Found once, it is known: read straight from its engine.
        let got = on_response(&lb, "GET", &id, "").await;
        assert_eq!(got.status, 200, "{}", got.text());
        assert_eq!(got.header("x-prefixlb-node"), format!("n{i}"));
        assert_eq!(got.header("x-prefixlb-attempts"), "1");
    }
    // A response no engine holds: every engine is asked, says so, and the client
    // reads what the last one said.
    let mut asked_before = Vec::new();
    for e in &engines {
        asked_before.push(metric(&e.url("/metrics"), "mock_engine_http_requests_total").await);
    }
    let missing = json!({"model": "mock", "input": "hi", "previous_response_id": "resp_nowhere"});
    let (reply, body) = respond(&lb, &missing).await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert_eq!(
        body["error"]["message"],
        "Response with id 'resp_nowhere' not found."
    );
    let got = on_response(&lb, "GET", "resp_nowhere", "").await;
    assert_eq!(got.status, 404, "{}", got.text());
    let explain = lb.admin_url("/admin/explain?path=/v1/responses");
    let x = post_json(&explain, &missing, &[]).await.json();
    assert_eq!(
        x["stored_response"],
        json!({"id": "resp_nowhere", "held_by": null}),
        "{x}"
    );
    // Every engine was asked once for each, and none is blamed for it.
    for (e, before) in engines.iter().zip(asked_before) {
        let asked = metric(&e.url("/metrics"), "mock_engine_http_requests_total").await;
        assert_eq!(asked - before, 2.0, "engine {}", e.addr);
    }
    for i in 0..4 {
        let info = node_info(&lb, &format!("n{i}")).await;
        assert_eq!(info["state"], "closed", "{info}");
    }
    let failovers = sum_metric(&lb.admin_url("/metrics"), "prefixlb_failovers_total").await;
    assert_eq!(failovers, 0.0);
    // Each engine's response found by asking, then read where it was known; the one
    // nobody holds looked for twice.
    assert_eq!(lookups(&lb).await, [4.0, 4.0, 2.0, 0.0]);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn a_response_whose_engine_takes_no_requests_is_refused_by_name() {
    let engines: Vec<Proc> = (0..3).map(|i| engine(&format!("e{i}"), &[])).collect();
    let lb = balancer(&config(&engines.iter().collect::<Vec<_>>(), "", ""));
    let first = json!({"model": "mock", "input": said(1, 0), "max_output_tokens": 2});
    let (reply, response) = respond(&lb, &first).await;
    assert_eq!(reply.status, 200);
    let node = reply.header("x-prefixlb-node").to_string();
    let id = response["id"].as_str().unwrap().to_string();
    let drain = call(
        "POST",
        &lb.admin_url(&format!("/admin/nodes/{node}/drain")),
        &[],
        Bytes::new(),
    )
    .await;
    assert_eq!(drain.status, 200, "{}", drain.text());
    // Another engine would only answer 404: the client is told where the response is.
    let next =
        json!({"model": "mock", "input": "more", "previous_response_id": id, "stream": true});
    // Its explanation says so too: no other node is offered.
    let explain = lb.admin_url("/admin/explain?path=/v1/responses");
    let x = post_json(&explain, &next, &[]).await.json();
    assert_eq!(x["stored_response"]["held_by"], json!(node), "{x}");
    assert_eq!(
        (&x["choice"], &x["route"]),
        (&Value::Null, &json!("unavailable")),
        "{x}"
    );
    let (reply, body) = respond(&lb, &next).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert_eq!(body["error"]["code"], "stored_response_unavailable");
    assert_eq!(lookups(&lb).await, [0.0, 0.0, 0.0, 1.0]);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&id) && message.contains(&node),
        "{message}"
    );
    // Back in service, it serves the conversation again.
    let undrain = format!("/admin/nodes/{node}/undrain");
    call("POST", &lb.admin_url(&undrain), &[], Bytes::new()).await;
    let (reply, _) = respond(&lb, &next).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-node"), node);
    // A response answered as a stream is known by the id its first event gave.
    let created = event(&reply.text(), "response.created");
    let stream_id = created["response"]["id"].as_str().unwrap().to_string();
    let got = on_response(&lb, "GET", &stream_id, "").await;
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.header("x-prefixlb-node"), node);
    assert_eq!(got.header("x-prefixlb-attempts"), "1");
    assert_eq!(got.json()["previous_response_id"], json!(id));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn a_stored_response_s_stream_read_again_is_relayed_as_it_comes() {
    // An engine replaying a background response's events (`GET …?stream=true`, as
    // vLLM serves it): the first event at once, the last two seconds later.
    let chunk = |data: &str| format!("{:x}\r\n{data}\r\n", data.len());
    let created = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_bg\"},\"sequence_number\":1}\n\n";
    let completed = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_bg\"},\"sequence_number\":9}\n\n";
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let script = vec![
        (
            format!("{head}{}", chunk(created)).into_bytes(),
            Duration::from_secs(2),
        ),
        (
            format!("{}0\r\n\r\n", chunk(completed)).into_bytes(),
            Duration::ZERO,
        ),
    ];
    let addr = scripted_engine(script).await;
    let lb = balancer(&config_at(&[addr], ""));
    let started = std::time::Instant::now();
    let path = "/v1/responses/resp_bg?stream=true&starting_after=0";
    let resp = send("GET", &lb.url(path), &[], Bytes::new()).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = next_chunk(&mut body).await.expect("a first event");
    assert!(String::from_utf8_lossy(&first).contains("response.created"));
    let first_at = started.elapsed();
    let mut rest = Vec::new();
    while let Some(c) = next_chunk(&mut body).await {
        rest.extend_from_slice(&c);
    }
    assert!(String::from_utf8_lossy(&rest).contains("response.completed"));
    // Not held until the engine's last byte.
    assert!(
        first_at + Duration::from_secs(1) < started.elapsed(),
        "first event after {first_at:?}, the end after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn replicas_that_did_not_see_a_response_find_it_and_then_know_it() {
    // Two balancer replicas over the same engines, as behind an L4 load balancer: each
    // turn of a conversation goes to the other replica than the last.
    let engines: Vec<Proc> = (0..4).map(|i| engine(&format!("e{i}"), &[])).collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let replicas = [
        balancer(&config(&refs, "", "")),
        balancer(&config(&refs, "", "")),
    ];
    for c in 0..4 {
        let mut previous: Option<String> = None;
        let mut home: Option<String> = None;
        for turn in 0..6 {
            let lb = &replicas[turn % 2];
            let mut body = json!({"model": "mock", "input": said(c, turn), "max_output_tokens": 2});
            if let Some(p) = &previous {
                body["previous_response_id"] = json!(p);
            }
            let (reply, response) = respond(lb, &body).await;
            assert_eq!(
                reply.status,
                200,
                "conversation {c} turn {turn}: {}",
                reply.text()
            );
            let node = reply.header("x-prefixlb-node").to_string();
            assert!(
                home.as_ref().is_none_or(|h| *h == node),
                "turn {turn} left its engine"
            );
            home = Some(node);
            previous = Some(response["id"].as_str().unwrap().to_string());
        }
        // Either replica reads the last response from its engine (the one that did not
        // see it made finds it by asking).
        let id = previous.unwrap();
        for lb in &replicas {
            let got = on_response(lb, "GET", &id, "").await;
            assert_eq!(got.status, 200, "{}", got.text());
            assert_eq!(got.header("x-prefixlb-node"), home.as_deref().unwrap());
        }
    }
    for lb in &replicas {
        assert!(in_flight_settles(lb, Duration::from_secs(5)).await);
        assert_eq!(
            sum_metric(&lb.admin_url("/metrics"), "prefixlb_failovers_total").await,
            0.0
        );
    }
}
