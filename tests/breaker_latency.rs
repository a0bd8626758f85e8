//! The breaker never turns load into an outage (issue 12): TTFT is judged against the
//! work (normalized by the prompt tokens each stream had to prefill) and against the
//! node's peers, and latency never ejects more than `max_ejected_share` of a pool.
//! Over loopback against `mock-engine` processes whose prefill is made slower.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// 50 µs of prefill per token: a cold 2,000-token prompt takes 100 ms.
const ENGINE: &[&str] = &["--prefill-us-per-token", "50", "--decode-ms-per-token", "5"];

/// Small windows and short timers; `slow_ttft` (the floor under which nothing is
/// slow) far below the TTFTs here, so what is tested is the normalization.
const BREAKER: &str = "[breaker]\nmin_samples = 4\nslow_ttft = \"50ms\"\ncanary_step = \"200ms\"\n";

/// `open_for` of the tests that watch a node recover.
const OPEN_1S: &str = "open_for = \"1s\"\n";

fn engines(n: usize) -> Vec<Proc> {
    (0..n).map(|i| engine(&format!("e{i}"), ENGINE)).collect()
}

fn lb_for(e: &[Proc], breaker_extra: &str) -> Proc {
    let refs: Vec<&Proc> = e.iter().collect();
    let sections = format!("{BREAKER}{breaker_extra}\n[health]\ninterval = \"60s\"\n");
    balancer(&config_ext(&refs, &sections, ""))
}

/// A prompt of about `tokens` tokens that no engine has seen (unique from its start).
fn cold_text(tag: &str, tokens: usize) -> String {
    let mut s = format!("{tag} {:?} ", Instant::now());
    while s.len() < tokens * 4 {
        s.push_str("lorem ipsum dolor sit amet ");
    }
    s
}

async fn cold(lb: &Proc, session: &str, tokens: usize) -> Reply {
    cold_at(lb.url("/v1/chat/completions"), session.to_string(), tokens).await
}

/// [`cold`], owning its arguments (for a spawned task).
async fn cold_at(url: String, session: String, tokens: usize) -> Reply {
    let text = cold_text(&session, tokens);
    post_json(
        &url,
        &chat(&[("user", &text)], true, 2),
        &[("x-session-id", &session)],
    )
    .await
}

/// `per_node` session keys whose first node is each of the pool's `nodes`.
async fn keys_by_node(lb: &Proc, nodes: usize, per_node: usize) -> Vec<Vec<String>> {
    let mut keys = vec![Vec::new(); nodes];
    for i in 0..2000 {
        let s = format!("conversation-{i}");
        let first: usize = walk_of(lb, &s).await[0][1..].parse().unwrap();
        if keys[first].len() < per_node {
            keys[first].push(s);
        }
        if keys.iter().all(|k| k.len() == per_node) {
            return keys;
        }
    }
    panic!("not enough keys per node: {keys:?}");
}

/// Every node serves a few cold prompts one at a time: the pool learns its prefill
/// rate (nothing is judged before 8 streams), then each node has a window of streams
/// as expected.
async fn warm_up(lb: &Proc, keys: &[Vec<String>]) {
    for round in 0..7 {
        for node_keys in keys {
            let r = cold(lb, &node_keys[round % node_keys.len()], 2000).await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
    }
}

async fn slow_prefill(engine: &Proc, factor: u32) {
    let mode = if factor > 1 { "slow_prefill" } else { "ok" };
    let reply = post_json(
        &engine.url("/mock/fault"),
        &serde_json::json!({"mode": mode, "factor": factor}),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

async fn nodes(lb: &Proc) -> Vec<Value> {
    get_json(&lb.admin_url("/admin/nodes")).await["nodes"]
        .as_array()
        .unwrap()
        .clone()
}

/// Breaker transitions to `to`, summed over nodes, from the metrics.
async fn transitions_to(lb: &Proc, to: &str) -> f64 {
    let text = call("GET", &lb.admin_url("/metrics"), &[], Vec::new())
        .await
        .text();
    let needle = format!("to=\"{to}\"");
    text.lines()
        .filter(|l| l.starts_with("prefixlb_breaker_transitions_total") && l.contains(&needle))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_node_of_four_is_shunted_then_opened_then_recovered() {
    let e = engines(4);
    let lb = lb_for(&e, OPEN_1S);
    let keys = keys_by_node(&lb, 4, 6).await;
    warm_up(&lb, &keys).await;
    let n0 = &keys[0];
    // Stage 1: three times slower: shunted, not opened.
    slow_prefill(&e[0], 3).await;
    let mut shunt = 0.0;
    for i in 0..40 {
        let r = cold(&lb, &n0[i % n0.len()], 2000).await;
        assert_eq!(r.status, 200);
        let info = node_info(&lb, "n0").await;
        assert_eq!(info["state"], "closed", "3× slower is not opened: {info}");
        shunt = info["shunt_ratio"].as_f64().unwrap();
        if shunt > 0.0 {
            break;
        }
    }
    assert!(shunt > 0.0, "a node 3× slower than its peers is shunted");
    // Stage 2: five times slower: opened.
    slow_prefill(&e[0], 5).await;
    let mut state = String::new();
    for i in 0..80 {
        let r = cold(&lb, &n0[i % n0.len()], 2000).await;
        assert_eq!(r.status, 200);
        state = node_info(&lb, "n0").await["state"]
            .as_str()
            .unwrap()
            .to_string();
        if state == "open" {
            break;
        }
    }
    assert_eq!(state, "open", "a node 5× slower than its peers is opened");
    let r = cold(&lb, &n0[0], 100).await;
    assert_ne!(r.header("x-prefixlb-node"), "n0");
    for other in ["n1", "n2", "n3"] {
        let info = node_info(&lb, other).await;
        assert_eq!(info["state"], "closed", "{info}");
        assert_eq!(info["shunt_ratio"], 0.0, "{info}");
    }
    // Stage 3: fast again; after open_for the probe and the canary bring it back.
    slow_prefill(&e[0], 1).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while node_info(&lb, "n0").await["state"] != "closed" && Instant::now() < deadline {
        for k in n0 {
            cold(&lb, k, 200).await;
        }
    }
    assert_eq!(node_info(&lb, "n0").await["state"], "closed");
    let r = cold(&lb, &n0[0], 200).await;
    assert_eq!(r.header("x-prefixlb-node"), "n0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_nodes_slower_at_once_is_overload_not_an_outage() {
    let e = engines(4);
    let lb = lb_for(&e, OPEN_1S);
    let keys = keys_by_node(&lb, 4, 5).await;
    warm_up(&lb, &keys).await;
    for engine in &e {
        slow_prefill(engine, 5).await;
    }
    let (mut ok, mut waited) = (0, 0);
    for wave in 0..3 {
        // 24 at once on 4 nodes × 4 slots: some wait in the queue.
        let sends: Vec<_> = (0..24)
            .map(|i| {
                let url = lb.url("/v1/chat/completions");
                tokio::spawn(cold_at(url, format!("wave-{wave}-{i}"), 2000))
            })
            .collect();
        for s in sends {
            let r = s.await.unwrap();
            match r.status.as_u16() {
                200 => {
                    ok += 1;
                    if r.header("x-prefixlb-route") == "queued" {
                        waited += 1;
                    }
                }
                503 => waited += 1,
                other => panic!("unexpected {other}: {}", r.text()),
            }
        }
        for n in nodes(&lb).await {
            assert_eq!(n["state"], "closed", "wave {wave}: {n}");
            assert_eq!(n["shunt_ratio"], 0.0, "wave {wave}: {n}");
            assert_eq!(n["degraded"], false, "wave {wave}: {n}");
        }
    }
    assert!(ok >= 48, "most requests served: {ok} of 72");
    assert!(waited > 0, "overload shows as waiting or 503s");
    assert_eq!(transitions_to(&lb, "open").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_cold_prompts_on_healthy_engines_are_not_slow() {
    let e = engines(4);
    let lb = lb_for(&e, OPEN_1S);
    let keys = keys_by_node(&lb, 4, 5).await;
    warm_up(&lb, &keys).await;
    for wave in 0..4 {
        // On every node at once: one 20,000-token cold prompt (a second of prefill
        // here, 200× a short turn's TTFT) with short turns queued behind it.
        let mut sends = Vec::new();
        for (n, node_keys) in keys.iter().enumerate() {
            for (j, k) in node_keys.iter().take(3).enumerate() {
                let url = lb.url("/v1/chat/completions");
                let session = k.clone();
                let tokens = if j == 0 { 20_000 } else { 10 };
                let tag = format!("{wave}-{n}-{j}");
                sends.push(tokio::spawn(async move {
                    let text = cold_text(&tag, tokens);
                    post_json(
                        &url,
                        &chat(&[("user", &text)], true, 2),
                        &[("x-session-id", &session)],
                    )
                    .await
                }));
            }
        }
        for s in sends {
            let r = s.await.unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
        for n in nodes(&lb).await {
            assert_eq!(n["state"], "closed", "wave {wave}: {n}");
            assert_eq!(n["shunt_ratio"], 0.0, "wave {wave}: {n}");
        }
    }
    assert_eq!(transitions_to(&lb, "open").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_never_ejects_more_than_the_cap() {
    let e = engines(4);
    // A cap of one node in four; the opened one stays open for the whole test.
    let lb = lb_for(&e, "max_ejected_share = 0.25\nopen_for = \"60s\"\n");
    let keys = keys_by_node(&lb, 4, 6).await;
    warm_up(&lb, &keys).await;
    slow_prefill(&e[0], 5).await;
    slow_prefill(&e[1], 5).await;
    let mut degraded = None;
    for i in 0..120 {
        let node_keys = &keys[i % 2];
        let r = cold(&lb, &node_keys[(i / 2) % node_keys.len()], 2000).await;
        assert_eq!(r.status, 200);
        let all = nodes(&lb).await;
        let open: Vec<&Value> = all.iter().filter(|n| n["state"] != "closed").collect();
        assert!(
            open.len() <= 1,
            "latency ejected more than the cap: {all:?}"
        );
        if open.len() == 1 {
            let other = if open[0]["id"] == "n0" { "n1" } else { "n0" };
            let info = all.iter().find(|n| n["id"] == other).unwrap();
            if info["degraded"] == true {
                degraded = Some(other.to_string());
                break;
            }
        }
    }
    let degraded = degraded.expect("the second slow node is kept in, marked degraded");
    let metrics = call("GET", &lb.admin_url("/metrics"), &[], Vec::new())
        .await
        .text();
    assert!(
        metrics.contains(&format!("prefixlb_node_degraded{{node=\"{degraded}\"}} 1")),
        "{metrics}"
    );
    assert_eq!(transitions_to(&lb, "open").await, 1.0);
}

/// The breaker judges what a node does now, not what its window remembers: after the
/// whole fleet was slow together (nothing ejected: that is overload) and recovered, a
/// node 20× slower than its peers again is opened within 10 of its streams, though its
/// window and its peers' still hold the slow minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_slow_after_a_fleet_wide_slowdown_is_opened_within_ten_streams() {
    let e = engines(4);
    let lb = lb_for(&e, "");
    let keys = keys_by_node(&lb, 4, 6).await;
    warm_up(&lb, &keys).await;
    // Every node 20× slower at once, each serving slow streams side by side.
    for engine in &e {
        slow_prefill(engine, 20).await;
    }
    let round = |tokens: usize| {
        let keys = keys.clone();
        let url = lb.url("/v1/chat/completions");
        async move {
            let sends: Vec<_> = keys
                .iter()
                .map(|node_keys| tokio::spawn(cold_at(url.clone(), node_keys[0].clone(), tokens)))
                .collect();
            for s in sends {
                assert_eq!(s.await.unwrap().status, 200);
            }
        }
    };
    for _ in 0..5 {
        round(500).await;
    }
    for n in nodes(&lb).await {
        assert_eq!(
            n["state"], "closed",
            "a fleet-wide slowdown ejects nothing: {n}"
        );
    }
    // All fast again; then one node alone 20× slower.
    for engine in &e {
        slow_prefill(engine, 1).await;
    }
    for _ in 0..3 {
        round(500).await;
    }
    slow_prefill(&e[0], 20).await;
    let mut opened_after = None;
    for i in 0..10 {
        // The other nodes keep serving as before.
        let r = cold(&lb, &keys[1 + i % 3][0], 500).await;
        assert_eq!(r.status, 200);
        let r = cold(&lb, &keys[0][i % keys[0].len()], 500).await;
        assert_eq!(r.status, 200);
        if node_info(&lb, "n0").await["state"] == "open" {
            opened_after = Some(i + 1);
            break;
        }
    }
    let after = opened_after.expect("a node 20x slower than its peers is opened within 10 streams");
    eprintln!("opened after {after} of its slow streams");
    for other in ["n1", "n2", "n3"] {
        assert_eq!(node_info(&lb, other).await["state"], "closed");
    }
}
