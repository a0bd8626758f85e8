//! Never a stalled stream: the first-packet probe, the TTFT breaker, shunting, canary
//! recovery, fallbacks, drain and graceful shutdown, over loopback against
//! `mock-engine` processes put into fault modes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn engines(n: usize, flags: &[&str]) -> Vec<Proc> {
    (0..n).map(|i| engine(&format!("e{i}"), flags)).collect()
}

fn refs(e: &[Proc]) -> Vec<&Proc> {
    e.iter().collect()
}

/// The engine behind node id `nK`.
fn engine_of<'a>(engines: &'a [Proc], node: &str) -> &'a Proc {
    &engines[node[1..].parse::<usize>().unwrap()]
}

const FAST: &[&str] = &["--decode-ms-per-token", "5", "--prefill-us-per-token", "0"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_empty_or_failing_primary_is_invisible_to_the_client() {
    let e = engines(4, FAST);
    let lb = balancer(&config_ext(
        &refs(&e),
        "[breaker]\nfailure_threshold = 100\n",
        "first_token_timeout = \"1500ms\"",
    ));
    for (i, mode) in ["stall", "empty", "error"].iter().enumerate() {
        let session = format!("conversation-{i}");
        let walk = walk_of(&lb, &session).await;
        set_fault(engine_of(&e, &walk[0]), mode, 0).await;
        let started = Instant::now();
        let reply = stream_chat(&lb, &session, 5).await;
        let took = started.elapsed();
        assert_eq!(reply.status, 200, "{mode}: {}", reply.text());
        assert_eq!(reply.header("x-prefixlb-attempts"), "2", "{mode}");
        assert_eq!(reply.header("x-prefixlb-node"), walk[1], "{mode}");
        // Headers and bytes come from the committed engine only.
        assert_eq!(
            reply.header("x-engine-id"),
            format!("e{}", &walk[1][1..]),
            "{mode}"
        );
        let text = reply.text();
        assert_eq!(
            text.matches("\"role\":\"assistant\"").count(),
            1,
            "{mode}: one role chunk only: {text}"
        );
        assert_eq!(text.matches("\"content\":\" ").count(), 5, "{mode}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{mode}");
        if *mode == "stall" {
            assert!(
                took >= Duration::from_millis(1500),
                "waited for first_token_timeout: {took:?}"
            );
        } else {
            assert!(
                took < Duration::from_millis(1500),
                "{mode} failed over at once: {took:?}"
            );
        }
        set_fault(engine_of(&e, &walk[0]), "ok", 0).await;
    }
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_failures_open_the_breaker_then_a_probe_and_the_canary_bring_it_back() {
    let e = engines(3, FAST);
    let sections =
        "[breaker]\nopen_for = \"1s\"\ncanary_step = \"300ms\"\n[health]\ninterval = \"60s\"\n";
    let lb = balancer(&config_ext(&refs(&e), sections, ""));
    let walk = walk_of(&lb, "k").await;
    let (primary, second) = (&walk[0], &walk[1]);
    set_fault(engine_of(&e, primary), "error", 0).await;
    for _ in 0..2 {
        let r = stream_chat(&lb, "k", 2).await;
        assert_eq!(
            (r.header("x-prefixlb-attempts"), r.header("x-prefixlb-node")),
            ("2", second.as_str())
        );
    }
    assert_eq!(node_info(&lb, primary).await["state"], "open");
    // Open: straight to the successor, no attempt on the primary.
    let r = stream_chat(&lb, "k", 2).await;
    assert_eq!(
        (r.header("x-prefixlb-attempts"), r.header("x-prefixlb-node")),
        ("1", second.as_str())
    );
    assert_eq!(r.header("x-prefixlb-route"), "spill:1");

    // Healthy again; after open_for one probe goes, and it succeeds.
    set_fault(engine_of(&e, primary), "ok", 0).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut on_primary = 0;
    for i in 0..40 {
        // Keys whose primary is this node, spread over the canary shares.
        let session = format!("k{i}");
        if walk_of(&lb, &session).await[0] != *primary {
            continue;
        }
        let r = stream_chat(&lb, &session, 1).await;
        assert_eq!(r.status, 200);
        if r.header("x-prefixlb-node") == primary {
            on_primary += 1;
        }
        if on_primary == 1 {
            break;
        }
    }
    assert_eq!(on_primary, 1, "the probe went to the recovered node");
    assert_eq!(node_info(&lb, primary).await["state"], "recovering");
    // After the ramp (4 × 300 ms) the next request closes it.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let r = stream_chat(&lb, "k", 1).await;
    assert_eq!(r.header("x-prefixlb-node"), primary.as_str());
    assert_eq!(node_info(&lb, primary).await["state"], "closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_400_is_passed_through_and_does_not_count() {
    let e = engines(2, &["--max-model-len", "4096"]);
    let lb = balancer(&config_ext(
        &refs(&e),
        "[breaker]\nfailure_threshold = 1\n",
        "",
    ));
    for _ in 0..3 {
        let r = post_json(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", "x")], true, 5000),
            &[("x-session-id", "big")],
        )
        .await;
        assert_eq!(r.status, 400);
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length"));
        assert_eq!(r.header("x-prefixlb-attempts"), "1");
    }
    for n in ["n0", "n1"] {
        assert_eq!(node_info(&lb, n).await["state"], "closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_every_engine_gives_the_request_is_passed_through_and_opens_no_breaker() {
    // An image sent to text-only engines: llama.cpp answers 500 (the mock does the
    // same). Before, the balancer failed it over to every engine, counted a failure on
    // each, and a client's two retries opened every breaker in the pool.
    let e = engines(3, FAST);
    let lb = balancer(&config_ext(
        &refs(&e),
        "[breaker]\nfailure_threshold = 2\n[health]\ninterval = \"60s\"\n",
        "",
    ));
    let image = json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
    for _ in 0..3 {
        let r = post_json(&lb.url("/v1/chat/completions"), &image, &[]).await;
        assert_eq!(r.status, 500, "{}", r.text());
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains("image input is not supported"),
            "the engine's own answer: {}",
            r.text()
        );
        assert_eq!(r.header("x-prefixlb-attempts"), "2");
    }
    for n in ["n0", "n1", "n2"] {
        assert_eq!(node_info(&lb, n).await["state"], "closed", "{n}");
    }
    let r = stream_chat(&lb, "after", 2).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-prefixlb-attempts"), "1");
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_no_other_engine_could_check_is_passed_through_and_blamed_once_per_request() {
    let e = engines(1, FAST);
    let lb = balancer(&config_ext(
        &refs(&e),
        "[breaker]\nfailure_threshold = 2\n[health]\ninterval = \"60s\"\n",
        "",
    ));
    let image = |question: &str| {
        json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    };
    // One request and a client's two retries: the engine's own answer, blamed once.
    for _ in 0..3 {
        let r = post_json(&lb.url("/v1/chat/completions"), &image("what?"), &[]).await;
        assert_eq!(r.status, 500, "{}", r.text());
        assert!(
            r.text().contains("image input is not supported"),
            "{}",
            r.text()
        );
        assert_eq!(r.header("x-prefixlb-attempts"), "1");
    }
    assert_eq!(node_info(&lb, "n0").await["state"], "closed");
    // A second failing request is a second failure in a row: the breaker still counts.
    let r = post_json(&lb.url("/v1/chat/completions"), &image("and this?"), &[]).await;
    assert_eq!(r.status, 500);
    assert_eq!(node_info(&lb, "n0").await["state"], "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_501_is_passed_through_and_does_not_count() {
    // llama.cpp started without `--embeddings` answers them 501: the request asks
    // for what the engine does not serve, which says nothing of its health.
    let e = engines(2, &["--no-embeddings"]);
    let lb = balancer(&config_ext(
        &refs(&e),
        "[breaker]\nfailure_threshold = 1\n",
        "",
    ));
    for _ in 0..3 {
        let r = post_json(
            &lb.url("/v1/embeddings"),
            &json!({"model": "mock", "input": "hi"}),
            &[],
        )
        .await;
        assert_eq!(r.status, 501, "{}", r.text());
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not support embeddings"));
        assert_eq!(r.header("x-prefixlb-attempts"), "1");
    }
    for n in ["n0", "n1"] {
        assert_eq!(node_info(&lb, n).await["state"], "closed", "{n}");
    }
    let r = stream_chat(&lb, "after", 2).await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream_ends_the_stream_with_an_error_event() {
    let mut e = engines(1, &["--decode-ms-per-token", "50"]);
    let lb = balancer(&config(&refs(&e), "", ""));
    let resp = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "tell me a long story")], true, 200),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    while text.matches("\"content\":\" ").count() < 3 {
        text.push_str(&String::from_utf8_lossy(
            &next_chunk(&mut body).await.unwrap(),
        ));
    }
    drop(e.remove(0)); // kill -9 the engine
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\":"), "{text}");
    assert!(last.contains("stream_interrupted"), "{last}");
    assert!(!text.contains("[DONE]"));
    assert!(
        eventually(Duration::from_secs(1), || async {
            in_flight(&lb).await[0].1 == 0
        })
        .await
    );
}

fn dead_node(id: &str) -> String {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    format!("[[pools.nodes]]\nid = \"{id}\"\nurl = \"http://{addr}\"\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_no_live_node_falls_back_or_answers_503_at_once() {
    let b = engine("b0", FAST);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[health]\ninterval = \"100ms\"\nunhealthy_after = 1\n\
         [[pools]]\nname = \"fast\"\nmodels = [\"small\"]\nfallbacks = [\"deep\"]\nsupports_thinking = false\n{}{}\
         [[pools]]\nname = \"deep\"\nmodels = [\"big\"]\n[[pools.nodes]]\nid = \"b0\"\nurl = \"http://{}\"\n\
         [[pools]]\nname = \"lonely\"\nmodels = [\"alone\"]\n{}",
        dead_node("a0"),
        dead_node("a1"),
        b.addr,
        dead_node("c0"),
    );
    let lb = balancer(&text);
    assert!(
        eventually(Duration::from_secs(3), || async {
            let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
            nodes["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|n| n["healthy"] == false)
                .count()
                == 3
        })
        .await
    );

    let body =
        json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let r = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-prefixlb-route"), "fallback:deep");
    assert_eq!(r.header("x-prefixlb-node"), "b0");
    assert_eq!(
        r.json()["model"],
        "big",
        "the body's model was rewritten for the fallback pool"
    );

    let started = Instant::now();
    let body = json!({"model": "alone", "messages": [{"role": "user", "content": "hi"}]});
    let r = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "no_available_node");
    assert!(r.headers.contains_key("retry-after"));
    assert!(started.elapsed() < Duration::from_millis(500));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_requests_skip_pools_without_thinking() {
    let a = engine("a0", FAST);
    let b = engine("b0", FAST);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [[pools]]\nname = \"fast\"\nmodels = [\"small\"]\nfallbacks = [\"deep\"]\nsupports_thinking = false\n[[pools.nodes]]\nid = \"a0\"\nurl = \"http://{}\"\n\
         [[pools]]\nname = \"deep\"\nmodels = [\"big\"]\n[[pools.nodes]]\nid = \"b0\"\nurl = \"http://{}\"\n",
        a.addr, b.addr
    );
    let lb = balancer(&text);
    let plain =
        json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let r = post_json(&lb.url("/v1/chat/completions"), &plain, &[]).await;
    assert_eq!(
        (r.header("x-prefixlb-node"), r.header("x-prefixlb-route")),
        ("a0", "primary")
    );
    let thinking = json!({"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "reasoning_effort": "high"});
    let r = post_json(&lb.url("/v1/chat/completions"), &thinking, &[]).await;
    assert_eq!(
        (r.header("x-prefixlb-node"), r.header("x-prefixlb-route")),
        ("b0", "fallback:deep")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_finishes_its_streams_and_takes_no_new_ones() {
    let e = engines(2, &["--decode-ms-per-token", "20"]);
    let lb = balancer(&config(&refs(&e), "", ""));
    let walk = walk_of(&lb, "d").await;
    let url = lb.url("/v1/chat/completions");
    let running = tokio::spawn(async move {
        post_json(
            &url,
            &chat(&[("user", "hello")], true, 40),
            &[("x-session-id", "d")],
        )
        .await
    });
    assert!(
        eventually(Duration::from_secs(2), || async {
            node_info(&lb, &walk[0]).await["in_flight"] == 1
        })
        .await
    );
    let r = call(
        "POST",
        &lb.admin_url(&format!("/admin/nodes/{}/drain", walk[0])),
        &[],
        "",
    )
    .await;
    assert_eq!(r.json()["draining"], true);
    let next = stream_chat(&lb, "d", 2).await;
    assert_eq!(
        next.header("x-prefixlb-node"),
        walk[1],
        "a drained node takes no new requests"
    );
    let first = running.await.unwrap();
    assert_eq!(first.header("x-prefixlb-node"), walk[0]);
    assert!(
        first.text().ends_with("data: [DONE]\n\n"),
        "the in-flight stream finished"
    );
    call(
        "POST",
        &lb.admin_url(&format!("/admin/nodes/{}/undrain", walk[0])),
        &[],
        "",
    )
    .await;
    assert_eq!(
        stream_chat(&lb, "d", 2).await.header("x-prefixlb-node"),
        walk[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_stream_in_flight_finish_then_exits_0() {
    let e = engines(1, &["--decode-ms-per-token", "30"]);
    let mut lb = balancer(&config(&refs(&e), "shutdown_grace = \"10s\"", ""));
    let url = lb.url("/v1/chat/completions");
    let running =
        tokio::spawn(
            async move { post_json(&url, &chat(&[("user", "hello")], true, 40), &[]).await },
        );
    assert!(
        eventually(Duration::from_secs(2), || async {
            in_flight(&lb).await[0].1 == 1
        })
        .await
    );
    let status = std::process::Command::new("kill")
        .args(["-TERM", &lb.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        eventually(Duration::from_secs(2), || async {
            call("GET", &lb.admin_url("/readyz"), &[], "").await.status == 503
        })
        .await,
        "/readyz turns 503 while draining"
    );
    let reply = running.await.unwrap();
    assert_eq!(reply.status, 200);
    assert!(
        reply.text().ends_with("data: [DONE]\n\n"),
        "{}",
        reply.text()
    );
    assert_eq!(lb.wait_exit(Duration::from_secs(5)), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_after_commit_ends_with_an_error_event() {
    // Tokens every 300 ms, but the balancer tolerates 100 ms of silence.
    let e = engines(
        1,
        &[
            "--decode-ms-per-token",
            "300",
            "--prefill-us-per-token",
            "0",
        ],
    );
    let lb = balancer(&config(&refs(&e), "idle_stream_timeout = \"100ms\"", ""));
    let reply = stream_chat(&lb, "quiet", 5).await;
    assert_eq!(reply.status, 200);
    let text = reply.text();
    assert_eq!(text.matches("\"content\":\" ").count(), 1, "{text}");
    assert!(
        text.trim_end().ends_with('}') && text.contains("no data for 100 ms"),
        "{text}"
    );
    assert!(
        eventually(Duration::from_secs(1), || async {
            in_flight(&lb).await[0].1 == 0
        })
        .await
    );
    let engine_metrics = e[0].url("/metrics");
    assert!(
        eventually(Duration::from_secs(1), || async {
            metric(&engine_metrics, "mock_engine_cancelled_total").await == 1.0
        })
        .await,
        "the engine's sequence was aborted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_the_probe_cancels_the_engine_and_blames_nobody() {
    let e = engines(1, FAST);
    let lb = balancer(&config(&refs(&e), "", ""));
    set_fault(&e[0], "stall", 0).await;
    let url = lb.url("/v1/chat/completions");
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        post_json(&url, &chat(&[("user", "hello")], true, 5), &[]),
    )
    .await;
    assert!(gave_up.is_err(), "the stalled stream was not committed");
    let engine_metrics = e[0].url("/metrics");
    assert!(
        eventually(Duration::from_secs(1), || async {
            metric(&engine_metrics, "mock_engine_cancelled_total").await == 1.0
        })
        .await,
        "the engine saw the cancel"
    );
    assert!(
        eventually(Duration::from_secs(1), || async {
            in_flight(&lb).await[0].1 == 0
        })
        .await
    );
    assert_eq!(
        node_info(&lb, "n0").await["state"],
        "closed",
        "the client's leaving is nobody's failure"
    );
}

/// The SSE comments and events of a stream's text, in order: `:` for a keep-alive,
/// `data` for an event.
fn sse_lines(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| match e {
            ": keep-alive" => ":",
            _ => e,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_for_its_first_token_gets_keep_alives_then_its_tokens() {
    let e = engines(1, FAST);
    let tenant =
        "tenant_header = \"x-tenant\"\n[[tenants]]\nname = \"t\"\nrequests_per_minute = 100";
    let lb = balancer(&config(&refs(&e), "sse_keepalive = \"200ms\"", tenant));
    set_fault(&e[0], "slow", 1200).await;
    let url = lb.url("/v1/chat/completions");
    let started = Instant::now();
    let body = serde_json::to_vec(&chat(&[("user", "hello")], true, 5)).unwrap();
    let headers = [("content-type", "application/json"), ("x-tenant", "t")];
    let mut resp = send("POST", &url, &headers, body).await;
    let head_after = started.elapsed();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    // Committed before the node answered: no node to name; its tenant's limits told.
    assert!(resp.headers().get("x-prefixlb-node").is_none());
    assert_eq!(resp.headers()["x-ratelimit-remaining-requests"], "99");
    let id = resp.headers()["x-request-id"].to_str().unwrap();
    assert!(id.starts_with("prefixlb-"), "its id: {id}");
    let first = next_chunk(resp.body_mut()).await.unwrap();
    assert_eq!(&first[..], b": keep-alive\n\n", "{head_after:?}");
    let rest = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&first),
        String::from_utf8_lossy(&rest.to_bytes())
    );
    let lines = sse_lines(&text);
    let comments = lines.iter().take_while(|l| **l == ":").count();
    assert!(comments >= 2, "a comment every 200 ms of the 1.2 s: {text}");
    assert!(
        !lines[comments..].contains(&":"),
        "the tokens came without pause: {text}"
    );
    let waiting = "prefixlb_sse_keepalives_total{when=\"waiting\"}";
    let counted = sum_metric(&lb.admin_url("/metrics"), waiting).await;
    assert_eq!(counted, comments as f64);
    assert_eq!(text.matches("\"content\":\" ").count(), 5, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    // A request that is not a stream waits as before, its head naming its node.
    let reply = post_json(&url, &chat(&[("user", "hello")], false, 5), &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-prefixlb-node"), "n0");
    assert!(reply.json()["choices"][0]["message"]["content"].is_string());
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_quiet_mid_way_gets_keep_alives_between_its_events() {
    let event = |json: &str| {
        let e = format!("data: {json}\n\n");
        (
            format!("{:x}\r\n{e}\r\n", e.len()).into_bytes(),
            Duration::ZERO,
        )
    };
    let mut script = vec![(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec(),
        Duration::ZERO,
    )];
    script.push(event(
        r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}"#,
    ));
    script.last_mut().unwrap().1 = Duration::from_millis(900);
    script.push(event(
        r#"{"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}"#,
    ));
    script.push(event("[DONE]"));
    script.push((b"0\r\n\r\n".to_vec(), Duration::from_secs(5)));
    let engine = scripted_engine(script).await;
    let lb = balancer(&config_at(&[engine], "sse_keepalive = \"200ms\""));
    let reply = stream_chat(&lb, "pause", 5).await;
    assert_eq!(reply.status, 200);
    // Committed by its first token, as without keep-alives.
    assert_eq!(reply.header("x-prefixlb-node"), "n0");
    let text = reply.text();
    let lines = sse_lines(&text);
    assert!(lines[0].contains("\"Hi\""), "{text}");
    let comments = lines.iter().filter(|l| **l == ":").count();
    assert!(comments >= 2, "a comment every 200 ms of the 900: {text}");
    assert!(lines[1..=comments].iter().all(|l| *l == ":"), "{text}");
    assert!(lines[comments + 1].contains("\" there\""), "{text}");
    let streaming = "prefixlb_sse_keepalives_total{when=\"streaming\"}";
    let counted = sum_metric(&lb.admin_url("/metrics"), streaming).await;
    assert_eq!(counted, comments as f64);
    assert_eq!(lines.last(), Some(&"data: [DONE]"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_begun_by_keep_alives_ends_in_an_error_event_when_it_cannot_be_served() {
    let e = engines(1, &["--decode-ms-per-token", "50"]);
    let lb = balancer(&config(
        &refs(&e),
        "sse_keepalive = \"200ms\"",
        "max_in_flight = 1\nwhen_saturated = \"queue\"\nqueue_timeout = \"1s\"",
    ));
    let mut held = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "long")], true, 200),
    )
    .await;
    assert!(next_chunk(held.body_mut()).await.is_some());
    // OpenAI's shape: the balancer's own 503 as a `data:` event.
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "queued")], true, 5),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200);
    let text = reply.text();
    let lines = sse_lines(&text);
    let comments = lines.iter().take_while(|l| **l == ":").count();
    assert!(comments >= 2, "{text}");
    assert_eq!(
        lines.len(),
        comments + 1,
        "one event after the comments: {text}"
    );
    let error: serde_json::Value =
        serde_json::from_str(lines[comments].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], "queue_timeout", "{text}");
    // Anthropic's: an `event: error` of its own shape.
    let messages = json!({"model": "mock", "max_tokens": 5, "stream": true,
        "messages": [{"role": "user", "content": "queued too"}]});
    let reply = post_json(&lb.url("/v1/messages"), &messages, &[]).await;
    assert_eq!(reply.status, 200);
    let text = reply.text();
    let last = sse_lines(&text).pop().unwrap();
    let data = last
        .strip_prefix("event: error\ndata: ")
        .unwrap_or_else(|| panic!("{text}"));
    let error: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "overloaded_error", "{text}");
    drop(held);
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
    let served = metric(&e[0].url("/metrics"), "mock_engine_requests_total").await;
    assert_eq!(served, 1.0, "the queued requests never reached the engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_error_after_keep_alives_is_the_streams_last_event() {
    let body = r#"{"object":"error","message":"This model's maximum context length is 2048 tokens.","type":"BadRequestError","param":null,"code":400}"#;
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let engine = scripted_engine(vec![
        (Vec::new(), Duration::from_millis(700)),
        (answer.into_bytes(), Duration::from_secs(5)),
    ])
    .await;
    let lb = balancer(&config_at(&[engine], "sse_keepalive = \"200ms\""));
    let reply = stream_chat(&lb, "too long", 5).await;
    assert_eq!(reply.status, 200);
    let text = reply.text();
    let lines = sse_lines(&text);
    assert_eq!(lines[0], ":", "{text}");
    let event = lines.last().unwrap().strip_prefix("data: ").unwrap();
    let error: serde_json::Value = serde_json::from_str(event).unwrap();
    assert_eq!(
        error["error"]["message"],
        "This model's maximum context length is 2048 tokens. (HTTP 400, after the stream began)"
    );
    assert_eq!(error["error"]["code"], 400);
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_after_keep_alives_cancels_the_engine() {
    let e = engines(1, FAST);
    let lb = balancer(&config(&refs(&e), "sse_keepalive = \"200ms\"", ""));
    set_fault(&e[0], "stall", 0).await;
    let mut resp = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hello")], true, 5),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        &next_chunk(resp.body_mut()).await.unwrap()[..],
        b": keep-alive\n\n"
    );
    assert_eq!(in_flight(&lb).await[0].1, 1, "the engine has it");
    drop(resp);
    let engine_metrics = e[0].url("/metrics");
    assert!(
        eventually(Duration::from_secs(2), || async {
            metric(&engine_metrics, "mock_engine_cancelled_total").await == 1.0
        })
        .await,
        "the engine saw the cancel"
    );
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
    let page = call("GET", &lb.admin_url("/metrics"), &[], bytes::Bytes::new())
        .await
        .text();
    let cancelled = page.lines().find(|l| {
        l.starts_with("prefixlb_requests_total{")
            && l.contains("node=\"n0\"")
            && l.contains("outcome=\"cancelled\"")
    });
    assert!(cancelled.is_some_and(|l| l.ends_with(" 1")), "{page}");
}
