//! The data plane end to end: `prefixlb serve` in front of `mock-engine` processes,
//! driven over loopback by a real HTTP client.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn four_engines(flags: &[&str]) -> Vec<Proc> {
    (0..4).map(|i| engine(&format!("e{i}"), flags)).collect()
}

fn refs(engines: &[Proc]) -> Vec<&Proc> {
    engines.iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_turn_of_a_conversation_lands_on_one_node() {
    let engines = four_engines(&["--decode-ms-per-token", "0", "--prefill-us-per-token", "0"]);
    let lb = balancer(&config(&refs(&engines), "", ""));
    let system = "You are a careful assistant. ".repeat(20);
    let mut history: Vec<Vec<(String, String)>> = (0..20)
        .map(|c| {
            vec![
                ("system".into(), system.clone()),
                (
                    "user".into(),
                    format!("Conversation {c}: tell me about topic {c}."),
                ),
            ]
        })
        .collect();
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    for turn in 0..10 {
        for (c, messages) in history.iter_mut().enumerate() {
            let refs: Vec<(&str, &str)> = messages
                .iter()
                .map(|(r, t)| (r.as_str(), t.as_str()))
                .collect();
            let reply =
                post_json(&lb.url("/v1/chat/completions"), &chat(&refs, false, 4), &[]).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            homes
                .entry(c)
                .or_default()
                .insert(reply.header("x-prefixlb-node").to_string());
            let answer = reply.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            messages.push(("assistant".into(), answer));
            messages.push(("user".into(), format!("Follow-up {turn} on topic {c}")));
        }
    }
    for (c, nodes) in &homes {
        assert_eq!(nodes.len(), 1, "conversation {c} was served by {nodes:?}");
    }
    let used: HashSet<&String> = homes.values().flatten().collect();
    assert!(used.len() >= 3, "only {used:?} used");
    // Affinity is what makes the engines' caches hit: later turns reuse earlier blocks.
    let mut hits = 0.0;
    let mut queries = 0.0;
    for e in &engines {
        hits += metric(&e.url("/metrics"), "vllm:prefix_cache_hits_total").await;
        queries += metric(&e.url("/metrics"), "vllm:prefix_cache_queries_total").await;
    }
    assert!(hits / queries > 0.5, "fleet hit rate {}", hits / queries);
}

/// Starts 16 slow streams with one key, waits until all hold a slot, and returns them
/// with the key's successor order.
async fn saturate(lb: &Proc) -> (Vec<hyper::Response<hyper::body::Incoming>>, Vec<String>) {
    let body = serde_json::to_vec(&chat(&[("user", "same key")], true, 60)).unwrap();
    let explain = call(
        "POST",
        &lb.admin_url("/admin/explain"),
        &[("x-session-id", "hot-key")],
        body.clone(),
    )
    .await
    .json();
    let order: Vec<String> = explain["successors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["node"].as_str().unwrap().to_string())
        .collect();
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let url = lb.url("/v1/chat/completions");
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            send(
                "POST",
                &url,
                &[
                    ("content-type", "application/json"),
                    ("x-session-id", "hot-key"),
                ],
                body,
            )
            .await
        }));
    }
    let mut streams = Vec::new();
    for t in tasks {
        streams.push(t.await.unwrap());
    }
    (streams, order)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_turn_requests_sharing_a_system_prompt_gather_on_its_node() {
    // 16 few-shot prompts, each a sixteenth of the traffic: with the default hybrid
    // key a group narrows to one node, where its prefix is cached once.
    let engines = four_engines(&["--decode-ms-per-token", "0", "--prefill-us-per-token", "0"]);
    let lb = balancer(&config(&refs(&engines), "", ""));
    let prefix = |g: usize| format!("Few-shot prompt {g}. {}", "Example answer. ".repeat(80));
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    for round in 0..6 {
        for g in 0..16 {
            let body = chat(
                &[
                    ("system", &prefix(g)),
                    ("user", &format!("question {round}")),
                ],
                false,
                2,
            );
            let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            if round >= 3 {
                homes
                    .entry(g)
                    .or_default()
                    .insert(reply.header("x-prefixlb-node").to_string());
            }
        }
    }
    for (g, nodes) in &homes {
        assert_eq!(nodes.len(), 1, "group {g} was served by {nodes:?}");
    }
    let used: HashSet<&String> = homes.values().flatten().collect();
    assert!(used.len() >= 3, "groups spread over the pool: {used:?}");
    // The explanation shows the group and its width.
    let body =
        serde_json::to_vec(&chat(&[("system", &prefix(3)), ("user", "q")], false, 2)).unwrap();
    let x = call("POST", &lb.admin_url("/admin/explain"), &[], body)
        .await
        .json();
    assert_eq!(x["group"]["width"], 1, "{x}");
    assert_eq!(
        x["choice"].as_str(),
        homes[&3].iter().next().map(|s| s.as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_fills_successors_in_ring_order_and_rejects_beyond() {
    let engines = four_engines(&["--decode-ms-per-token", "50"]);
    let lb = balancer(&config(
        &refs(&engines),
        "",
        "max_in_flight = 4\nwhen_saturated = \"reject\"",
    ));
    let (streams, order) = saturate(&lb).await;

    let mut per_node: HashMap<String, usize> = HashMap::new();
    for s in &streams {
        assert_eq!(s.status(), 200);
        let node = s.headers()["x-prefixlb-node"].to_str().unwrap().to_string();
        let route = s.headers()["x-prefixlb-route"]
            .to_str()
            .unwrap()
            .to_string();
        let distance = order.iter().position(|n| *n == node).unwrap();
        let expected = if distance == 0 {
            "primary".to_string()
        } else {
            format!("spill:{distance}")
        };
        assert_eq!(
            route, expected,
            "route label matches the node's place in the walk"
        );
        *per_node.entry(node).or_default() += 1;
    }
    assert_eq!(per_node.len(), 4);
    assert!(per_node.values().all(|&n| n == 4), "{per_node:?}");
    for (node, n) in in_flight(&lb).await {
        assert_eq!(n, 4, "{node}");
    }

    let extra = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "same key")], true, 4),
        &[("x-session-id", "hot-key")],
    )
    .await;
    assert_eq!(extra.status, 503);
    assert_eq!(extra.header("retry-after"), "1");
    assert_eq!(extra.json()["error"]["code"], "saturated");

    // Finish every stream; no engine ever ran more than its cap; all slots come back.
    for s in streams {
        let body = http_body_util::BodyExt::collect(s.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
    }
    for e in &engines {
        assert!(metric(&e.url("/metrics"), "mock_engine_peak_running").await <= 4.0);
    }
    assert!(in_flight_settles(&lb, Duration::from_secs(2)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_requests_queue_until_a_slot_frees() {
    let engines = four_engines(&["--decode-ms-per-token", "20"]);
    let lb = balancer(&config(&refs(&engines), "", "max_in_flight = 4"));
    let (streams, order) = saturate(&lb).await;
    let started = Instant::now();
    let waiter = {
        let url = lb.url("/v1/chat/completions");
        tokio::spawn(async move {
            post_json(
                &url,
                &chat(&[("user", "same key")], true, 2),
                &[("x-session-id", "hot-key")],
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the 17th request must wait while all 16 slots are held"
    );
    drop(streams); // the clients leave: slots free, the waiter is admitted
    let reply = waiter.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-route"), "queued");
    assert!(order.contains(&reply.header("x-prefixlb-node").to_string()));
    assert!(reply.text().contains("data: [DONE]"));
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_relayed_chunk_by_chunk() {
    let engines = vec![engine("e0", &["--decode-ms-per-token", "100"])];
    let lb = balancer(&config(&refs(&engines), "", ""));
    let resp = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "stream please")], true, 10),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        let s = String::from_utf8_lossy(&chunk).into_owned();
        if s.contains("\"content\":\" ") {
            arrivals.push(Instant::now());
        }
        text.push_str(&s);
    }
    assert_eq!(arrivals.len(), 10, "{text}");
    // Tokens are produced 100 ms apart; buffering would deliver them together.
    let spread = arrivals[9] - arrivals[0];
    assert!(
        spread >= Duration::from_millis(600),
        "first and last token arrived {spread:?} apart"
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_upstream_and_frees_the_slot() {
    let engines = vec![engine("e0", &["--decode-ms-per-token", "100"])];
    let lb = balancer(&config(&refs(&engines), "", ""));
    let resp = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "a long answer")], true, 500),
    )
    .await;
    let mut body = resp.into_body();
    next_chunk(&mut body).await.expect("first chunk");
    next_chunk(&mut body).await.expect("second chunk");
    assert_eq!(in_flight(&lb).await[0].1, 1);
    let left = Instant::now();
    drop(body);
    let engine_url = engines[0].url("/metrics");
    assert!(
        eventually(Duration::from_secs(1), || async {
            metric(&engine_url, "mock_engine_cancelled_total").await == 1.0
        })
        .await,
        "the engine did not see the cancellation within 1 s"
    );
    assert!(left.elapsed() < Duration::from_secs(1));
    assert!(
        eventually(Duration::from_secs(1), || async {
            in_flight(&lb).await[0].1 == 0
        })
        .await
    );
    assert_eq!(metric(&engine_url, "vllm:num_requests_running").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_fail_over_to_the_next_node() {
    let live = four_engines(&["--decode-ms-per-token", "0"]);
    // A port that refuses connections: bound once, then closed.
    let dead_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut text = config(&refs(&live), "", "");
    text.push_str(&format!(
        "[[pools.nodes]]\nid = \"dead\"\nurl = \"http://{dead_addr}\"\n"
    ));
    let lb = balancer(&text);

    let mut failed_over = 0;
    for i in 0..40 {
        let body = chat(&[("user", &format!("question number {i}"))], false, 2);
        let explain = call(
            "POST",
            &lb.admin_url("/admin/explain"),
            &[],
            serde_json::to_vec(&body).unwrap(),
        )
        .await
        .json();
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_ne!(reply.header("x-prefixlb-node"), "dead");
        if explain["successors"][0]["node"] == "dead" {
            failed_over += 1;
            // The first two failures open the dead node's breaker (failure_threshold
            // 2); after that its keys go straight to their second node.
            let expected = if failed_over <= 2 { "2" } else { "1" };
            assert_eq!(reply.header("x-prefixlb-attempts"), expected, "request {i}");
            assert_eq!(
                reply.header("x-prefixlb-node"),
                explain["successors"][1]["node"].as_str().unwrap()
            );
        } else {
            assert_eq!(reply.header("x-prefixlb-attempts"), "1");
        }
    }
    assert!(failed_over > 2, "too few keys had the dead node as primary");
    assert!(in_flight(&lb).await.iter().all(|(_, n)| *n == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_clear_errors_and_the_balancer_keeps_serving() {
    let engines = vec![engine(
        "e0",
        &["--decode-ms-per-token", "0", "--prefill-us-per-token", "0"],
    )];
    let lb = balancer(&config(&refs(&engines), "", ""));
    let url = lb.url("/v1/chat/completions");
    let json_ct = [("content-type", "application/json")];

    let cases: Vec<(&str, Reply, u16, &str)> = vec![
        (
            "invalid JSON",
            call(
                "POST",
                &url,
                &json_ct,
                "{\"model\": \"mock\", \"messages\": [",
            )
            .await,
            400,
            "invalid_json",
        ),
        (
            "missing messages",
            call("POST", &url, &json_ct, "{\"model\": \"mock\"}").await,
            400,
            "missing_required_parameter",
        ),
        (
            "messages of the wrong type",
            post_json(&url, &json!({"model": "mock", "messages": "hi"}), &[]).await,
            400,
            "invalid_parameter",
        ),
        (
            "unknown model",
            post_json(
                &url,
                &json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
                &[],
            )
            .await,
            404,
            "model_not_found",
        ),
        (
            "over the limit",
            call("POST", &url, &json_ct, vec![b' '; 17 * 1024 * 1024]).await,
            413,
            "request_too_large",
        ),
        (
            "wrong content type",
            call(
                "POST",
                &url,
                &[("content-type", "text/plain")],
                "{\"model\": \"mock\"}",
            )
            .await,
            415,
            "unsupported_media_type",
        ),
        (
            "compressed body",
            call(
                "POST",
                &url,
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "gzip"),
                ],
                vec![0x1f, 0x8b, 0x08, 0x00, 0x00],
            )
            .await,
            415,
            "unsupported_content_encoding",
        ),
        (
            "empty body",
            call("POST", &url, &json_ct, "").await,
            400,
            "empty_body",
        ),
    ];
    for (name, reply, status, code) in cases {
        assert_eq!(reply.status.as_u16(), status, "{name}: {}", reply.text());
        let body = reply.json();
        assert_eq!(body["error"]["code"], code, "{name}");
        assert!(
            body["error"]["message"].as_str().unwrap().len() > 10,
            "{name}"
        );
        assert_eq!(reply.header("content-type"), "application/json", "{name}");
    }
    // Valid JSON of the wrong shape is not called invalid JSON.
    let wrong = post_json(&url, &json!({"model": "mock", "messages": "hi"}), &[]).await;
    let message = wrong.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with("invalid request body: 'messages' must be an array"),
        "{message}"
    );
    assert!(
        call("POST", &url, &json_ct, "{}").await.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages")
    );

    // A 10 MB single-line prompt is under the 16 MB limit: it is served.
    let big = "a".repeat(10 * 1024 * 1024);
    let reply = post_json(&url, &chat(&[("user", &big)], false, 2), &[]).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        &reply.text()[..reply.text().len().min(300)]
    );
    assert_eq!(
        reply.json()["usage"]["prompt_tokens"].as_u64().unwrap(),
        (big.len() as u64 + 6).div_ceil(4)
    );

    // Still serving, with nothing leaked.
    let ok = post_json(&url, &chat(&[("user", "still there?")], false, 2), &[]).await;
    assert_eq!(ok.status, 200);
    assert!(in_flight(&lb).await.iter().all(|(_, n)| *n == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_answered_from_config_and_h2c_works() {
    let engines = vec![engine("e0", &["--decode-ms-per-token", "0"])];
    let lb = balancer(&config(&refs(&engines), "", ""));
    let models = get_json(&lb.url("/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "mock");
    assert_eq!(models["object"], "list");

    // HTTP/2 with prior knowledge (h2c) on the same port.
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let req = http::Request::post(lb.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-test")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            serde_json::to_vec(&chat(&[("user", "h2")], false, 2)).unwrap(),
        )))
        .unwrap();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-prefixlb-node"], "n0");
}

/// Four fast mock engines behind a balancer whose pool `mock` has `pool_lines` too.
fn four_engines_with(pool_lines: &str) -> (Vec<Proc>, Proc) {
    let engines: Vec<Proc> = (0..4)
        .map(|i| engine(&format!("e{i}"), &["--decode-ms-per-token", "0"]))
        .collect();
    let addrs: Vec<_> = engines.iter().map(|e| e.addr).collect();
    let lb = balancer(&config_at(&addrs, "").replace(
        "models = [\"mock\"]\n",
        &format!("models = [\"mock\"]\n{pool_lines}\n"),
    ));
    (engines, lb)
}

/// `/v1/models` as (id, parent) pairs, in order.
async fn listed_models(lb: &Proc) -> Vec<(String, Option<String>)> {
    let models = get_json(&lb.url("/v1/models")).await;
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
            (text(&m["id"]).unwrap(), text(&m["parent"]))
        })
        .collect()
}

/// `aliases`: other names for a pool's model are listed by `/v1/models`, rewritten to
/// the model on the way to the engine (which answers with the model's own name), and
/// routed as that model: the same prompt under either name lands on one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_are_listed_rewritten_and_placed_as_their_model() {
    let (_engines, lb) = four_engines_with("aliases = { \"gpt-4o\" = \"mock\", fast = \"mock\" }");
    let ids: Vec<_> = listed_models(&lb)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, ["mock", "fast", "gpt-4o"]);
    let url = lb.url("/v1/chat/completions");
    let mut nodes = Vec::new();
    for (name, stream) in [("gpt-4o", false), ("fast", true), ("mock", false)] {
        let mut body = chat(&[("user", "one prompt under three names")], stream, 2);
        body["model"] = name.into();
        let r = post_json(&url, &body, &[]).await;
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        // The engine saw (and echoed) the model, not the alias.
        assert!(
            r.text().contains("\"model\":\"mock\""),
            "{name}: {}",
            r.text()
        );
        assert!(!r.text().contains(name) || name == "mock", "{}", r.text());
        nodes.push(r.header("x-prefixlb-node").to_string());
    }
    assert!(nodes.iter().all(|n| *n == nodes[0]), "{nodes:?}");
    let mut unknown = chat(&[("user", "x")], false, 2);
    unknown["model"] = "gpt-5".into();
    let r = post_json(&url, &unknown, &[]).await;
    assert_eq!(r.status, 404);
    assert!(r.text().contains("mock, fast, gpt-4o"), "{}", r.text());
}

/// LoRA `adapters`: an adapter's requests are keyed apart from its model's and from
/// the other adapters' (an engine caches prefixes per adapter), while an alias of an
/// adapter is keyed as the adapter; `/v1/models` lists adapters with their `parent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_keyed_apart_and_their_aliases_with_them() {
    let (_engines, lb) = four_engines_with(
        "adapters = [\"sql-lora\", \"chat-lora\"]\naliases = { sql = \"sql-lora\" }",
    );
    let listed = listed_models(&lb).await;
    assert_eq!(
        listed,
        [
            ("mock".to_string(), None),
            ("sql-lora".to_string(), Some("mock".to_string())),
            ("chat-lora".to_string(), Some("mock".to_string())),
            ("sql".to_string(), None)
        ]
    );
    let url = lb.url("/v1/chat/completions");
    let node_of = |model: &'static str, prompt: String| {
        let url = url.clone();
        async move {
            let mut body = chat(&[("user", &prompt)], false, 2);
            body["model"] = model.into();
            let r = post_json(&url, &body, &[]).await;
            assert_eq!(r.status, 200, "{model}: {}", r.text());
            // Adapters are forwarded by their own name; an alias as its adapter.
            let sent = if model == "sql" { "sql-lora" } else { model };
            assert!(
                r.text().contains(&format!("\"model\":\"{sent}\"")),
                "{}",
                r.text()
            );
            r.header("x-prefixlb-node").to_string()
        }
    };
    let (mut differ, mut prompts) = (0, 0);
    for k in 0..12 {
        let prompt = format!("the same question number {k} asked of every adapter");
        let sql = node_of("sql-lora", prompt.clone()).await;
        let chat_lora = node_of("chat-lora", prompt.clone()).await;
        let base = node_of("mock", prompt.clone()).await;
        // Each name's home holds: its next request, and the alias's, go there.
        assert_eq!(node_of("sql", prompt.clone()).await, sql, "alias {k}");
        assert_eq!(node_of("sql-lora", prompt.clone()).await, sql, "again {k}");
        assert_eq!(node_of("chat-lora", prompt.clone()).await, chat_lora);
        assert_eq!(node_of("mock", prompt).await, base);
        prompts += 1;
        differ += usize::from(sql != chat_lora || sql != base);
    }
    // Keyed as one, every prompt would find the first name's home under the others.
    assert!(
        differ * 2 >= prompts,
        "{differ} of {prompts} prompts placed apart"
    );
}

/// Adapters learned from the engines' `/v1/models` (vLLM lists them with a `parent`):
/// a request for one goes to the pool of its parent, keyed as an adapter, and never to
/// an engine that does not list it; a declared adapter's requests skip such engines
/// too. `/v1/models` lists the learned adapter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_goes_only_to_engines_that_serve_it_and_is_learned_from_them() {
    let fast = ["--decode-ms-per-token", "0"];
    let with = |id: &str, adapters: &str| {
        let mut flags = fast.to_vec();
        flags.extend(["--adapters", adapters]);
        engine(id, &flags)
    };
    let engines = [
        with("e0", "sql-lora,chat-lora"),
        with("e1", "sql-lora"),
        with("e2", "chat-lora"),
        engine("e3", &fast),
    ];
    let addrs: Vec<_> = engines.iter().map(|e| e.addr).collect();
    let text = config_at(&addrs, "[health]\ninterval = \"200ms\"").replace(
        "models = [\"mock\"]\n",
        "models = [\"mock\"]\nadapters = [\"chat-lora\"]\n",
    );
    let lb = balancer(&text);
    // The engines' lists are read with the first health checks: every one of them
    // (an engine whose list is not read yet is not known to lack an adapter).
    let read = |nodes: &serde_json::Value| {
        let listed = |n: &serde_json::Value| n["models"].as_array().map(Vec::len);
        nodes["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(listed)
            .collect::<Vec<_>>()
    };
    let all_read = eventually(Duration::from_secs(10), || async {
        read(&get_json(&lb.admin_url("/admin/nodes")).await)
            .iter()
            .all(Option::is_some)
    })
    .await;
    let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
    assert!(all_read, "{nodes}");
    // e0 lists the model and two adapters, e1 and e2 one each, e3 only the model.
    assert_eq!(
        read(&nodes),
        [Some(3), Some(2), Some(2), Some(1)],
        "{nodes}"
    );
    assert!(
        listed_models(&lb)
            .await
            .contains(&("sql-lora".to_string(), Some("mock".to_string()))),
        "{:?}",
        listed_models(&lb).await
    );
    let send = |model: &'static str, k: usize| {
        let url = lb.url("/v1/chat/completions");
        async move {
            let mut body = chat(&[("user", &format!("question {k} for {model}"))], false, 2);
            body["model"] = model.into();
            let r = post_json(&url, &body, &[]).await;
            assert_eq!(r.status, 200, "{model} {k}: {}", r.text());
            r.header("x-prefixlb-node").to_string()
        }
    };
    let mut sql_nodes = std::collections::BTreeSet::new();
    let mut chat_nodes = std::collections::BTreeSet::new();
    for k in 0..24 {
        sql_nodes.insert(send("sql-lora", k).await);
        chat_nodes.insert(send("chat-lora", k).await);
    }
    // Learned `sql-lora` is served by e0 and e1 only; declared `chat-lora` by e0 and e2
    // (e3 lists only the model, so it is known not to serve either).
    assert!(
        sql_nodes.iter().all(|n| n == "n0" || n == "n1"),
        "{sql_nodes:?}"
    );
    assert!(
        chat_nodes.iter().all(|n| n == "n0" || n == "n2"),
        "{chat_nodes:?}"
    );
    assert_eq!(sql_nodes.len(), 2, "spread over both: {sql_nodes:?}");
    // A model nobody serves is still unknown.
    let mut body = chat(&[("user", "x")], false, 2);
    body["model"] = "nope-lora".into();
    assert_eq!(
        post_json(&lb.url("/v1/chat/completions"), &body, &[])
            .await
            .status,
        404
    );
}

#[test]
fn check_reports_unknown_keys_with_their_position() {
    let path = write_config("[routing]\nvnodes = 160\nmax_inflight = 4\n\n[[pools]]\nname = \"p\"\nnodes = [{ id = \"a\", url = \"http://127.0.0.1:1\" }]\n");
    let out = std::process::Command::new(BIN)
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!(
            "{}:3:1: unknown field `max_inflight`",
            path.display()
        )),
        "{err}"
    );

    let good = write_config("[[pools]]\nname = \"p\"\nnodes = [{ id = \"a\", url = \"http://127.0.0.1:1\" }, { id = \"b\", url = \"http://127.0.0.1:2\", weight = 3 }]\n");
    let out = std::process::Command::new(BIN)
        .args(["check", "--config", good.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("pool p (models: p): 2 nodes, 640 ring points"),
        "{report}"
    );
}

#[test]
fn route_explains_offline_like_admin_explain() {
    let path = write_config("[[pools]]\nname = \"p\"\nnodes = [{ id = \"a\", url = \"http://127.0.0.1:1\" }, { id = \"b\", url = \"http://127.0.0.1:2\" }]\n");
    let body = write_config(
        r#"{"model": "p", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]}"#,
    );
    let route = |extra: &[&str], body: &std::path::Path| -> Value {
        let mut args = vec!["route", "--config", path.to_str().unwrap()];
        args.extend_from_slice(extra);
        args.push(body.to_str().unwrap());
        serde_json::from_slice(&run_cli(&args)).unwrap()
    };
    let x = route(&[], &body);
    assert_eq!(x["pool"], "p");
    // A hybrid key is the conversation part after the shared prefix (here, before
    // anything is learned, the system part), as raw JSON text.
    assert_eq!(x["key"], "user\n\"hello\"\n");
    assert_eq!(x["prefix"]["found_by"], "system part");
    assert_eq!(x["hash"].as_str().unwrap().len(), 16);
    assert_eq!(x["successors"].as_array().unwrap().len(), 2);
    assert_eq!(x["choice"], x["successors"][0]["node"]);
    // A new conversation with a short opening goes where fewer conversations live;
    // one that opens with a long text (a pasted document) by load alone.
    assert_eq!(x["placement"]["by"], "recent homes, then load", "{x}");
    let document = "word ".repeat(400);
    let long = write_config(&format!(
        r#"{{"model": "p", "messages": [{{"role": "system", "content": "sys"}}, {{"role": "user", "content": "{document}"}}]}}"#
    ));
    let z = route(&[], &long);
    assert_eq!(z["placement"]["by"], "load", "{z}");
    assert!(z["placement"]["own_tokens"].as_u64().unwrap() > 256, "{z}");

    let y = route(&["--header", "X-Session-Id: s1"], &body);
    assert_eq!(y["key_source"], "header");
    assert_eq!(y["key"], "s1");
}

/// Local ports of the open TCP connections on this machine to `port`, from
/// `/proc/net/tcp`.
fn connections_to(port: u16) -> HashSet<u16> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let port_of = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (local, remote) = (port_of(f.get(1)?)?, port_of(f.get(2)?)?);
            // Open ones only (`01`): sockets left closing by earlier tests whose
            // engine had this port are not this engine's connections.
            (remote == port && *f.get(3)? == "01").then_some(local)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_connections_are_reused_and_one_left_mid_stream_is_not() {
    let e = engine("e0", &["--decode-ms-per-token", "5"]);
    // One lane: each lane keeps its own engine connections, and which lane the kernel
    // hands the client's connections to is not this test's business.
    let lb = balancer(&config_ext(
        &[&e],
        "lanes = 1\n[health]\ninterval = \"60s\"\n",
        "",
    ));
    let engine_port = e.addr.port();
    // The health checker's first round has connected (it makes no other for 60 s).
    assert!(
        eventually(Duration::from_secs(5), || async {
            !connections_to(engine_port).is_empty()
        })
        .await
    );
    for i in 0..10 {
        let r = post_json(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", "hi")], i % 2 == 1, 3),
            &[],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The health checker's one connection and one for requests, however many requests.
    let used = connections_to(engine_port);
    assert!(
        !used.is_empty() && used.len() <= 2,
        "connections to the engine: {used:?}"
    );

    // A client leaves mid-stream: that connection still carries the rest of its
    // response, so it must be closed, and the next request goes on a fresh one.
    let mut resp = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "long")], true, 200),
    )
    .await;
    assert!(next_chunk(resp.body_mut()).await.is_some());
    drop(resp);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
    let r = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "after")], false, 3),
        &[],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json()["choices"][0]["finish_reason"],
        "length",
        "{}",
        r.text()
    );
    // Exactly one new connection: the abandoned one was not handed to the next request
    // (which would have gone on a connection open before).
    let now = connections_to(engine_port);
    let fresh: Vec<_> = now.difference(&used).collect();
    assert_eq!(fresh.len(), 1, "{used:?} then {now:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_takes_a_node_that_comes_back_without_a_slot_freeing() {
    // No slot frees on the busy node, but another node comes back (undrained; the same
    // holds for a recovered health check or a closing breaker): the queue sees it.
    let engines: Vec<Proc> = (0..2)
        .map(|i| engine(&format!("e{i}"), &["--decode-ms-per-token", "20"]))
        .collect();
    let lb = balancer(&config(&refs(&engines), "", "max_in_flight = 1"));
    let drain = |node: &str, action: &str| {
        let url = lb.admin_url(&format!("/admin/nodes/{node}/{action}"));
        async move { assert_eq!(call("POST", &url, &[], "").await.status, 200) }
    };
    drain("n1", "drain").await;
    // n0's one slot held for ≈ 6 s.
    let body = serde_json::to_vec(&chat(&[("user", "hold")], true, 300)).unwrap();
    let mut held = send(
        "POST",
        &lb.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        body,
    )
    .await;
    assert_eq!(held.headers()["x-prefixlb-node"], "n0");
    let _ = next_chunk(held.body_mut()).await;
    let started = Instant::now();
    let waiter = {
        let url = lb.url("/v1/chat/completions");
        tokio::spawn(
            async move { post_json(&url, &chat(&[("user", "next")], false, 2), &[]).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "queued while n0 is full and n1 drained"
    );
    drain("n1", "undrain").await;
    let reply = waiter.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-node"), "n1");
    assert_eq!(reply.header("x-prefixlb-route"), "queued");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "admitted once n1 came back, not when n0's stream ended: {:?}",
        started.elapsed()
    );
    drop(held);
}

/// `server.lanes`: the client port served by that many single-threaded runtimes, each
/// its own thread with its own listener. The lanes' threads exist, each counts its
/// open connections, many streams at once all complete whole, every slot comes back,
/// and SIGTERM lets an open stream finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_serve_the_client_port_from_their_own_threads() {
    let engines = four_engines(&["--decode-ms-per-token", "5"]);
    let mut lb = balancer(&config(&refs(&engines), "lanes = 2", "max_in_flight = 64"));
    // Both lanes' connection counts are on the first page the admin port serves.
    let first = call("GET", &lb.admin_url("/metrics"), &[], bytes::Bytes::new())
        .await
        .text();
    for lane in ["0", "1"] {
        let series = format!("prefixlb_client_connections{{lane=\"{lane}\"}} 0");
        assert!(first.contains(&series), "no {series} in the first scrape");
    }
    let pid = lb.pid();
    let threads = move || -> Vec<String> {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    };
    let started = eventually(Duration::from_secs(5), || async {
        let names = threads();
        ["prefixlb-lane-0", "prefixlb-lane-1"]
            .iter()
            .all(|lane| names.iter().any(|t| t == lane))
    })
    .await;
    assert!(started, "{:?}", threads());
    // Each lane counts its open connections: ten opened at once are all counted, on
    // both lanes together, and the counts return to zero when they close.
    let lane_open = |lane| client_connections(&lb, lane);
    let open: Vec<_> = (0..10)
        .map(|_| std::net::TcpStream::connect(lb.addr).unwrap())
        .collect();
    let counted = eventually(Duration::from_secs(5), || async {
        lane_open(0).await + lane_open(1).await == 10.0
    })
    .await;
    assert!(
        counted,
        "lanes hold {} and {}",
        lane_open(0).await,
        lane_open(1).await
    );
    drop(open);
    let closed = eventually(Duration::from_secs(5), || async {
        lane_open(0).await == 0.0 && lane_open(1).await == 0.0
    })
    .await;
    assert!(
        closed,
        "lanes hold {} and {}",
        lane_open(0).await,
        lane_open(1).await
    );
    let sends = (0..64).map(|i| {
        let url = lb.url("/v1/chat/completions");
        tokio::spawn(async move {
            let body = chat(&[("user", &format!("conversation {i}"))], true, 8);
            post_json(&url, &body, &[]).await
        })
    });
    for send in sends {
        let reply = send.await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(
            reply.text().ends_with("data: [DONE]\n\n"),
            "{}",
            reply.text()
        );
    }
    let idle = eventually(Duration::from_secs(5), || async {
        in_flight(&lb).await.iter().all(|(_, n)| *n == 0)
    })
    .await;
    assert!(idle, "{:?}", in_flight(&lb).await);
    // A stream open at SIGTERM finishes; the process then exits cleanly.
    let resp = post_stream(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "the last one")], true, 100),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let pid = lb.pid().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let mut body = resp.into_body();
    let mut text = String::new();
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(lb.wait_exit(Duration::from_secs(10)), Some(0));
}

/// Lanes (the default, `lanes = "auto"`) bind the port with `SO_REUSEPORT`, which the
/// kernel lets any process of the same user share. A second balancer started on a port
/// the first serves must fail with "address in use", as it does with `lanes = 0`, not
/// start and take part of the first one's connections; the first keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_balancer_on_a_served_port_fails_to_start() {
    let engine = engine("e0", &[]);
    let first = balancer(&config(&[&engine], "", ""));
    for lanes in ["lanes = 2", "lanes = 0"] {
        let second = config(&[&engine], lanes, "").replacen(
            "listen = \"127.0.0.1:0\"",
            &format!("listen = \"{}\"", first.addr),
            1,
        );
        let mut child = std::process::Command::new(BIN)
            .args(["serve", "--config", write_config(&second).to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let Some(status) = exit_within(&mut child, Duration::from_secs(10)) else {
            let _ = child.kill();
            panic!("{lanes}: a second balancer started on {}", first.addr);
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(!status.success(), "{lanes}: {stderr}");
        assert!(
            stderr.contains(&format!("cannot bind server.listen {}", first.addr))
                && stderr.contains("in use"),
            "{lanes}: {stderr}"
        );
    }
    let reply = post_json(
        &first.url("/v1/chat/completions"),
        &chat(&[("user", "still here")], false, 4),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// `server.pin_threads`: each serving thread runs on one CPU of its own, the n-th of
/// those the process may use, round again past the last: each lane, or with no lanes
/// each worker of the shared runtime. `"auto"` (the default) pins only threads that
/// cover the process's CPUs; `"always"` pins whatever the count; `"never"` leaves them
/// to the scheduler. Read from the kernel (`Cpus_allowed_list` of each thread).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_threads_are_pinned_one_cpu_each() {
    let engine = engine("e0", &[]);
    let workers = std::thread::available_parallelism().unwrap().get();
    let cpus = cpu_list(&std::fs::read_to_string("/proc/self/status").unwrap()).len();
    for (server, threads, pinned) in [
        ("lanes = 3", 3, 3 >= cpus),
        ("lanes = 1", 1, 1 >= cpus),
        ("lanes = 1\npin_threads = \"always\"", 1, true),
        ("lanes = 2\npin_threads = \"never\"", 2, false),
        ("lanes = 0", workers, workers >= cpus),
        ("lanes = 0\npin_threads = \"never\"", workers, false),
    ] {
        let lb = balancer(&config(&[&engine], server, ""));
        let pid = lb.pid();
        let process = cpu_list(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap());
        assert!(!process.is_empty());
        // A shared runtime's worker is pinned at its first park: wait for all of them.
        let mut seen = Vec::new();
        let started = eventually(Duration::from_secs(5), || {
            seen = serving_cpus(pid, server.starts_with("lanes = 0"));
            let pinned_now = seen.iter().filter(|cpus| cpus.len() == 1).count();
            let done = seen.len() >= threads && (!pinned || pinned_now >= threads);
            async move { done }
        })
        .await;
        assert!(started, "{server}: serving threads {seen:?}");
        if pinned {
            // Lanes by number; the workers in the order they first parked.
            let mut got: Vec<_> = seen.iter().filter(|c| c.len() == 1).map(|c| c[0]).collect();
            let mut expected: Vec<_> = (0..threads).map(|n| process[n % process.len()]).collect();
            if server.starts_with("lanes = 0") {
                got.sort();
                expected.sort();
            }
            assert_eq!(got, expected, "{server}: {seen:?} (process: {process:?})");
        } else {
            assert!(
                seen.iter().all(|cpus| cpus == &process),
                "{server}: {seen:?} (process: {process:?})"
            );
        }
        // Pinned or not, they serve.
        answers_a_chat(&lb).await;
    }
}

/// The serving threads are set at start: a reload that changes `lanes` or
/// `pin_threads` says that takes a restart, applies the rest, and the lanes stay.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_says_lanes_and_pinning_take_a_restart() {
    let engine = engine("e0", &[]);
    let (lb, log) = balancer_logged(&config(&[&engine], "lanes = 2", ""), "warn", &[]);
    let two_lanes = || serving_cpus(lb.pid(), false).len() == 2;
    assert!(eventually(Duration::from_secs(5), || async { two_lanes() }).await);
    let edited = config(
        &[&engine],
        "lanes = 3\npin_threads = \"never\"\nyield_after = \"1ms\"",
        "",
    );
    std::fs::write(log.with_extension("toml"), edited).unwrap();
    let reload = call("POST", &lb.admin_url("/admin/reload"), &[], "").await;
    assert_eq!(reload.status, 200, "{}", reload.text());
    let warned = eventually(Duration::from_secs(5), || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        [
            "server.lanes changed",
            "server.pin_threads changed",
            "server.yield_after changed",
        ]
        .iter()
        .all(|w| text.contains(w))
    })
    .await;
    assert!(
        warned,
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    answers_a_chat(&lb).await;
    assert!(two_lanes(), "{:?}", serving_cpus(lb.pid(), false));
}

/// `server.yield_after`: a serving thread kept busy by a burst of requests offers its
/// CPU between them once it has run that long without a break (counted in
/// `prefixlb_lane_yields_total{lane}`, lane 0 for the shared runtime's workers); at
/// `"0s"` it never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_serving_thread_offers_its_cpu_after_yield_after() {
    let engine = engine("e0", &[]);
    for (lanes, yield_after, yields) in [
        (1, "1us", true),
        (1, "0s", false),
        (0, "1us", true),
        (0, "0s", false),
    ] {
        let server = format!("lanes = {lanes}\nyield_after = \"{yield_after}\"");
        let lb = balancer(&config(&[&engine], &server, "max_in_flight = 64"));
        // Three bursts of 48 at once: the lane takes many requests per wake.
        for _ in 0..3 {
            chats_at_once(&lb.url("/v1/chat/completions"), 48, "burst").await;
        }
        let counted = metric(
            &lb.admin_url("/metrics"),
            "prefixlb_lane_yields_total{lane=\"0\"}",
        )
        .await;
        assert_eq!(
            counted > 0.0,
            yields,
            "lanes = {lanes}, yield_after = {yield_after}: {counted} yields"
        );
    }
}

/// One short chat through the balancer gets a 200.
async fn answers_a_chat(lb: &Proc) {
    let body = chat(&[("user", "hi")], false, 4);
    let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// The CPUs each serving thread may run on: the lanes' by lane number, or the shared
/// runtime's workers (and any blocking threads, which share their name).
#[cfg(target_os = "linux")]
fn serving_cpus(pid: u32, shared: bool) -> Vec<Vec<usize>> {
    let mut threads: Vec<(usize, Vec<usize>)> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            let order = match comm.trim() {
                "tokio-rt-worker" if shared => 0,
                name => name
                    .strip_prefix("prefixlb-lane-")?
                    .parse()
                    .ok()
                    .filter(|_| !shared)?,
            };
            Some((
                order,
                cpu_list(&std::fs::read_to_string(dir.join("status")).ok()?),
            ))
        })
        .collect();
    threads.sort();
    threads.into_iter().map(|(_, cpus)| cpus).collect()
}

/// The CPUs of a `/proc` status file's `Cpus_allowed_list` ("0-3,6").
#[cfg(target_os = "linux")]
fn cpu_list(status: &str) -> Vec<usize> {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap_or("")
        .trim();
    list.split(',')
        .filter(|r| !r.is_empty())
        .flat_map(|range| {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            lo.parse::<usize>().unwrap()..=hi.parse::<usize>().unwrap()
        })
        .collect()
}

/// The request log (one line per request at `info`): each serving thread gathers its
/// lines and writes them when it runs out of work, so a balancer between requests has
/// written every line so far; after a burst and SIGTERM the file holds every line; a
/// log that is not a terminal holds no colour codes; and JSON lines parse. Both ways
/// of serving (the shared runtime, the default, and two lanes), and both formats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_lines_are_written_when_the_balancer_idles_and_at_exit() {
    let engines = four_engines(&[]);
    for (lanes, format) in [(0, "text"), (2, "text"), (0, "json")] {
        let (mut lb, log) = balancer_logged_as(
            &config(
                &refs(&engines),
                &format!("lanes = {lanes}"),
                "max_in_flight = 64",
            ),
            "info",
            &[],
            format,
        );
        let is_request_line = |line: &str| match format {
            "json" => {
                let v: Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
                v["fields"]["message"] == "request" && v["fields"]["outcome"] == "success"
            }
            _ => line.contains(" request ") && line.contains("outcome="),
        };
        let lines = || {
            std::fs::read_to_string(&log)
                .unwrap()
                .lines()
                .filter(|l| is_request_line(l))
                .count()
        };
        let url = lb.url("/v1/chat/completions");
        for i in 0..40 {
            let body = chat(&[("user", &format!("one at a time {i}"))], i % 2 == 0, 4);
            let reply = post_json(&url, &body, &[]).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
        }
        // Forty lines are far less than a batch: only going idle writes them.
        let written = eventually(Duration::from_secs(5), || async { lines() == 40 }).await;
        assert!(
            written,
            "lanes = {lanes}, {format}: {} of 40 request lines",
            lines()
        );
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            !text.contains('\u{1b}'),
            "lanes = {lanes}, {format}: colour codes in a log file: {text:?}"
        );
        // Many at once, then SIGTERM: every line is in the file after the exit.
        chats_at_once(&url, 60, "all at once").await;
        let pid = lb.pid().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert_eq!(lb.wait_exit(Duration::from_secs(10)), Some(0));
        assert_eq!(
            lines(),
            100,
            "lanes = {lanes}, {format}: lines lost at exit"
        );
    }
}
