//! Finding the cache in real traffic (issue 10), end to end over real sockets: a shared
//! preamble inside the first user message is learned from the traffic, conversations
//! behind it spread while every turn stays at home, explanations show what was learned,
//! and a later turn waits for its full home when that saves more than it costs (but
//! not for a home that only `load_factor`'s relative bound holds back; a wait that runs
//! out on a full pool queues as configured, and one whose home is drained ends at once).

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const FAST: [&str; 4] = ["--decode-ms-per-token", "0", "--prefill-us-per-token", "0"];

/// A chat whose first user message starts with `preamble`, with `turns` user turns.
fn chat_with_preamble(preamble: &str, conv: usize, answers: &[String]) -> Value {
    let mut messages = vec![
        json!({"role": "user", "content": format!("{preamble}\n\nConversation {conv}: {}", "tell me more. ".repeat(20))}),
    ];
    for (t, a) in answers.iter().enumerate() {
        messages.push(json!({"role": "assistant", "content": a}));
        messages.push(json!({"role": "user", "content": format!("follow-up {t} of {conv}")}));
    }
    json!({"model": "mock", "messages": messages, "max_tokens": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preamble_inside_the_first_user_message_is_learned() {
    let engines: Vec<Proc> = (0..4).map(|i| engine(&format!("e{i}"), &FAST)).collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let lb = balancer(&config(&refs, "", ""));
    let preamble = format!(
        "Operating instructions. {}",
        "Follow the runbook exactly. ".repeat(200)
    );
    let url = lb.url("/v1/chat/completions");
    let mut answers: Vec<Vec<String>> = vec![Vec::new(); 16];
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    for turn in 0..4 {
        for (c, history) in answers.iter_mut().enumerate() {
            let reply = post_json(&url, &chat_with_preamble(&preamble, c, history), &[]).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            // The first turns of the first conversations teach the balancer the
            // preamble; from the second round on every turn must stay at home.
            if turn > 0 {
                homes
                    .entry(c)
                    .or_default()
                    .insert(reply.header("x-prefixlb-node").to_string());
            }
            let answer = reply.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string();
            history.push(answer);
        }
    }
    for (c, nodes) in &homes {
        assert_eq!(nodes.len(), 1, "conversation {c} moved: {nodes:?}");
    }
    let used: HashSet<&String> = homes.values().flatten().collect();
    assert!(
        used.len() >= 3,
        "conversations behind one preamble spread: {used:?}"
    );
    // What was learned, as explained for one more conversation's later turn.
    let body = serde_json::to_vec(&chat_with_preamble(&preamble, 3, &answers[3])).unwrap();
    let x = call("POST", &lb.admin_url("/admin/explain"), &[], body)
        .await
        .json();
    assert_eq!(x["prefix"]["found_by"], "learned", "{x}");
    assert!(
        x["prefix"]["bytes"].as_u64().unwrap() + 512 > preamble.len() as u64,
        "{x}"
    );
    assert_eq!(x["turn"], "later");
    let home = x["home"].as_str().unwrap();
    assert!(homes[&3].contains(home), "{x}");
    assert_eq!(x["choice"], home, "the next turn goes home: {x}");
    // The engines' caches agree: later turns reuse the preamble and the history.
    let (mut hits, mut queries) = (0.0, 0.0);
    for e in &engines {
        hits += metric(&e.url("/metrics"), "vllm:prefix_cache_hits_total").await;
        queries += metric(&e.url("/metrics"), "vllm:prefix_cache_queries_total").await;
    }
    assert!(hits / queries > 0.8, "fleet hit rate {}", hits / queries);
}

/// A session key whose first node is `node`.
async fn session_on(lb: &Proc, node: &str) -> String {
    for i in 0..200 {
        let s = format!("hold-{i}");
        if walk_of(lb, &s).await[0] == node {
            return s;
        }
    }
    panic!("no session key starts at {node}");
}

/// Two engines decoding at `decode_ms` per token (no prefill time), behind a balancer
/// with these `[routing]` lines.
fn two_engines_behind(decode_ms: &str, routing: &str) -> (Vec<Proc>, Proc) {
    let flags = [
        "--decode-ms-per-token",
        decode_ms,
        "--prefill-us-per-token",
        "0",
    ];
    let engines: Vec<Proc> = (0..2).map(|i| engine(&format!("e{i}"), &flags)).collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let lb = balancer(&config(&refs, "", routing));
    (engines, lb)
}

/// A turn of the conversation that opens with `text`: its first, or a later one (the
/// history plus a short exchange).
fn turn(text: &str, max_tokens: u32, later: bool) -> Value {
    let mut messages = vec![json!({"role": "user", "content": text})];
    if later {
        messages.push(json!({"role": "assistant", "content": "noted"}));
        messages.push(json!({"role": "user", "content": "and now?"}));
    }
    json!({"model": "mock", "max_tokens": max_tokens, "messages": messages})
}

/// Holds `node`'s slot with another key's stream of `tokens`, its first chunk read.
async fn hold(lb: &Proc, node: &str, tokens: u32) -> hyper::Response<hyper::body::Incoming> {
    let session = session_on(lb, node).await;
    let body = serde_json::to_vec(&json!({"model": "mock", "stream": true, "max_tokens": tokens, "messages": [{"role": "user", "content": "hold"}]})).unwrap();
    let mut held = send(
        "POST",
        &lb.url("/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("x-session-id", &session),
        ],
        body,
    )
    .await;
    assert_eq!(held.headers()["x-prefixlb-node"], node);
    let _ = next_chunk(held.body_mut()).await;
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_turn_waits_for_its_full_home_when_that_pays() {
    let (_engines, lb) = two_engines_behind("20", "max_in_flight = 1");
    let url = lb.url("/v1/chat/completions");
    // Two conversations: one with a long history (≈ 10,000 tokens), one with a short.
    let big = format!("big: {}", "a long shared document. ".repeat(1700));
    let conversations = [big.as_str(), "small: hi"];
    let mut homes = Vec::new();
    for text in conversations {
        let reply = post_json(&url, &turn(text, 10, false), &[]).await;
        assert_eq!(reply.status, 200);
        homes.push(reply.header("x-prefixlb-node").to_string());
    }
    for (i, text) in conversations.into_iter().enumerate() {
        let home = &homes[i];
        // Hold the home's one slot for ~0.6 s with another key's stream.
        let held = hold(&lb, home, 30).await;
        let reply = post_json(&url, &turn(text, 2, true), &[]).await;
        assert_eq!(reply.status, 200);
        if i == 0 {
            // ≈ 10,000 cached tokens: 2 s of prefill saved vs ~0.2 s for a slot.
            assert_eq!(reply.header("x-prefixlb-node"), home, "waited for home");
            assert_eq!(reply.header("x-prefixlb-route"), "queued");
        } else {
            assert_ne!(reply.header("x-prefixlb-node"), home, "spilled at once");
            assert_eq!(reply.header("x-prefixlb-route"), "spill:1");
        }
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_held_back_by_load_factor_alone_is_not_waited_for() {
    // With `load_factor`, a busy home is over its share long before it is full. A
    // request that waited for it there would shrink the pool's in-flight total, and
    // with it the bound, while the other engine idled (measured: half the throughput).
    let (_engines, lb) = two_engines_behind("1", "max_in_flight = 1000\nload_factor = 1.25");
    let url = lb.url("/v1/chat/completions");
    // One conversation asked again and again (a known home, ~250 tokens at stake).
    let body = json!({"model": "mock", "max_tokens": 4, "messages": [
        {"role": "user", "content": "the same question, asked by every client. ".repeat(24)}]});
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(async move {
                let mut nodes = Vec::new();
                for _ in 0..25 {
                    let reply = post_json(&url, &body, &[]).await;
                    assert_eq!(reply.status, 200, "{}", reply.text());
                    nodes.push(reply.header("x-prefixlb-node").to_string());
                }
                nodes
            })
        })
        .collect();
    let mut served: HashMap<String, usize> = HashMap::new();
    for c in clients {
        for node in c.await.unwrap() {
            *served.entry(node).or_default() += 1;
        }
    }
    let metrics = lb.admin_url("/metrics");
    let decision = |route: &str| {
        format!("prefixlb_routing_decisions_total{{pool=\"mock\",route=\"{route}\"}}")
    };
    assert_eq!(
        metric(&metrics, &decision("queued")).await,
        0.0,
        "{served:?}"
    );
    assert!(metric(&metrics, &decision("spill")).await > 0.0);
    assert_eq!(served.len(), 2, "both engines served: {served:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_wait_that_runs_out_on_a_full_pool_queues_as_configured() {
    // A later turn waits for its full home (≈ 2 s of prefill at stake); meanwhile the
    // node it would have spilled to fills. When its budget runs out the pool is
    // saturated, and `when_saturated = "queue"` applies: it waits for a slot (no 503).
    let (_engines, lb) = two_engines_behind("20", "max_in_flight = 1\nwhen_saturated = \"queue\"");
    let url = lb.url("/v1/chat/completions");
    let big = format!("big: {}", "a long shared document. ".repeat(1700));
    let first = post_json(&url, &turn(&big, 10, false), &[]).await;
    assert_eq!(first.status, 200);
    let home = first.header("x-prefixlb-node").to_string();
    let other = if home == "n0" { "n1" } else { "n0" };
    // The home is busy for ≈ 3 s.
    let held_home = hold(&lb, &home, 150).await;
    let later = {
        let (url, body) = (url.clone(), turn(&big, 2, true));
        tokio::spawn(async move { post_json(&url, &body, &[]).await })
    };
    // Once the later turn waits for home, the other node fills for ≈ 3 s too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held_other = hold(&lb, other, 150).await;
    let reply = later.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-route"), "queued");
    drop((held_home, held_other));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_its_home_leaves_when_the_home_is_drained() {
    let (_engines, lb) = two_engines_behind("20", "max_in_flight = 1");
    let url = lb.url("/v1/chat/completions");
    // ≈ 20,000 tokens at stake: a wait budget of ≈ 4 s.
    let big = format!("big: {}", "a long shared document. ".repeat(3400));
    let first = post_json(&url, &turn(&big, 2, false), &[]).await;
    assert_eq!(first.status, 200);
    let home = first.header("x-prefixlb-node").to_string();
    // The home's one slot held for ≈ 5 s.
    let held = hold(&lb, &home, 250).await;
    let started = std::time::Instant::now();
    let later = {
        let (url, body) = (url.clone(), turn(&big, 2, true));
        tokio::spawn(async move { post_json(&url, &body, &[]).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let drained = call(
        "POST",
        &lb.admin_url(&format!("/admin/nodes/{home}/drain")),
        &[],
        "",
    )
    .await;
    assert_eq!(drained.status, 200);
    let reply = later.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_ne!(reply.header("x-prefixlb-node"), home, "went elsewhere");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "left the drained home at once, not after its ≈ 4 s budget: {:?}",
        started.elapsed()
    );
    drop(held);
}
