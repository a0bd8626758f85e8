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
