//! An engine server that runs several data-parallel ranks behind one URL (vLLM
//! `--data-parallel-size`): each rank has its own KV cache, so the balancer makes each
//! rank a node (`data_parallel_size` on the node) and names the rank of every request
//! in `x-data-parallel-rank`. Against a `mock-engine --data-parallel-size 4`, whose
//! ranks take the requests that name none in turn, as a server's own balancer would
//! (blind to the cache).

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const RANKS: usize = 4;

/// A config with one engine server; `data_parallel_size` on its node if `ranks` > 1.
fn one_server(engine: &Proc, ranks: usize) -> String {
    let split = if ranks > 1 {
        format!("data_parallel_size = {ranks}\n")
    } else {
        String::new()
    };
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n\
         [[pools.nodes]]\nid = \"gpu\"\nurl = \"http://{}\"\n{split}",
        engine.addr
    )
}

/// Text of its own for each conversation and turn (no block shared with another).
fn words(conversation: usize, turn: usize) -> String {
    (0..120)
        .map(|i| format!("c{conversation}t{turn}w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Plays `conversations` conversations of 4 turns one request at a time; returns, per
/// conversation, each turn's node and cached prompt tokens.
async fn converse(lb: &Proc, conversations: usize) -> Vec<Vec<(String, u64)>> {
    let mut all = Vec::new();
    for c in 0..conversations {
        let mut messages: Vec<(String, String)> = Vec::new();
        let mut turns = Vec::new();
        for t in 0..4 {
            messages.push(("user".into(), words(c, t)));
            let m: Vec<(&str, &str)> = messages
                .iter()
                .map(|(r, x)| (r.as_str(), x.as_str()))
                .collect();
            let reply = post_json(&lb.url("/v1/chat/completions"), &chat(&m, false, 4), &[]).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let v: Value = reply.json();
            turns.push((
                reply.header("x-prefixlb-node").to_string(),
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap(),
            ));
            let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
            messages.push(("assistant".into(), answer.to_string()));
        }
        all.push(turns);
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_of_a_data_parallel_server_is_a_node_that_keeps_its_conversations() {
    let ranks = RANKS.to_string();
    let engine = engine("dp", &["--data-parallel-size", &ranks]);
    let lb = balancer(&one_server(&engine, RANKS));
    let ids: Vec<String> = in_flight(&lb).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), RANKS, "{ids:?}");
    for r in 0..RANKS {
        assert!(ids.contains(&format!("gpu@{r}")), "{ids:?}");
    }
    let conversations = converse(&lb, 8).await;
    let mut used = std::collections::BTreeSet::new();
    for turns in &conversations {
        let node = &turns[0].0;
        used.insert(node.clone());
        for (t, (n, cached)) in turns.iter().enumerate().skip(1) {
            assert_eq!(n, node, "every turn on its conversation's rank: {turns:?}");
            assert!(*cached > 0, "turn {t} found its history cached: {turns:?}");
        }
    }
    assert!(
        used.len() > 1,
        "conversations spread over the ranks: {used:?}"
    );
    assert!(in_flight_settles(&lb, std::time::Duration::from_secs(5)).await);
}

/// SGLang's native `/generate` reads the rank from the body (`routed_dp_rank`), not from
/// the header: the balancer writes it there, so a conversation's turns stay on its
/// rank, and a rank the client wrote (one the server does not have) is overridden.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_generate_requests_carry_their_rank_in_the_body() {
    let ranks = RANKS.to_string();
    let engine = engine("dp", &["--data-parallel-size", &ranks]);
    let lb = balancer(&one_server(&engine, RANKS));
    let mut used = std::collections::BTreeSet::new();
    for c in 0..6 {
        // An opening longer than the routing key reads, as an agent's or a document's.
        let mut text = format!("{} {} ", words(c, 100), words(c, 101));
        let mut node = String::new();
        for t in 0..4 {
            text.push_str(&words(c, t));
            let body = json!({
                "text": text, "sampling_params": {"max_new_tokens": 4}, "stream": t % 2 == 1,
            });
            let reply = post_json(&lb.url("/generate"), &body, &[]).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let served = reply.header("x-prefixlb-node").to_string();
            // The last event of a stream, or the whole answer.
            let answer = reply
                .text()
                .split("data: ")
                .filter_map(|e| serde_json::from_str::<Value>(e.trim()).ok())
                .last()
                .unwrap_or_else(|| reply.json());
            let cached = answer["meta_info"]["cached_tokens"].as_u64().unwrap();
            if t == 0 {
                node = served;
                used.insert(node.clone());
            } else {
                assert_eq!(served, node, "conversation {c} turn {t} left its rank");
                assert!(cached > 0, "conversation {c} turn {t}: nothing cached");
            }
            text.push_str(answer["text"].as_str().unwrap());
        }
    }
    assert!(
        used.len() > 1,
        "conversations spread over the ranks: {used:?}"
    );
    let asks_for_9 = json!({"text": "hi", "routed_dp_rank": 9});
    let direct = post_json(&engine.url("/generate"), &asks_for_9, &[]).await;
    assert_eq!(direct.status, 400, "{}", direct.text());
    let reply = post_json(&lb.url("/generate"), &asks_for_9, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(in_flight_settles(&lb, std::time::Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_s_ranks_not_named_scatter_a_conversation_and_a_client_cannot_name_one() {
    // The same server as one node: its own turn-taking puts each turn on another rank,
    // whose cache has never seen the conversation.
    let ranks = RANKS.to_string();
    let engine = engine("dp", &["--data-parallel-size", &ranks]);
    let lb = balancer(&one_server(&engine, 1));
    for turns in converse(&lb, 2).await {
        assert!(
            turns.iter().all(|(n, cached)| n == "gpu" && *cached == 0),
            "{turns:?}"
        );
    }
    // A client's own rank, in vLLM's header or in SGLang's override, never reaches the
    // engine (which refuses a rank it does not have with a 400).
    for header in ["x-data-parallel-rank", "x-override-routed-dp-rank"] {
        let hi = chat(&[("user", "hi")], false, 2);
        let direct = post_json(&engine.url("/v1/chat/completions"), &hi, &[(header, "9")]).await;
        assert_eq!(direct.status, 400, "{header}: {}", direct.text());
        let reply = post_json(&lb.url("/v1/chat/completions"), &hi, &[(header, "9")]).await;
        assert_eq!(reply.status, 200, "{header}: {}", reply.text());
    }
}

/// Two servers of [`RANKS`] ranks, `a` then `b`, behind a balancer with
/// `max_attempts = 2` and health checks too slow to notice anything; `a` is stopped.
/// Returns the balancer and `b`.
fn two_servers_one_stopped() -> (Proc, Proc) {
    let ranks = RANKS.to_string();
    let flags = ["--data-parallel-size", ranks.as_str()];
    let (a, b) = (engine("a", &flags), engine("b", &flags));
    let lb = balancer(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [routing]\nmax_attempts = 2\n[health]\ninterval = \"60s\"\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n\
         [[pools.nodes]]\nid = \"a\"\nurl = \"http://{}\"\ndata_parallel_size = {RANKS}\n\
         [[pools.nodes]]\nid = \"b\"\nurl = \"http://{}\"\ndata_parallel_size = {RANKS}\n",
        a.addr, b.addr
    ));
    drop(a);
    (lb, b)
}

/// Sends request `i` (a prompt of its own); it must be served by `b`. Returns how many
/// attempts it took (`x-prefixlb-attempts`).
async fn served_by_b(lb: &Proc, i: usize) -> String {
    let text = format!("request {i} with a prompt of its own");
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", &text)], false, 2),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200, "request {i}: {}", reply.text());
    assert!(reply.header("x-prefixlb-node").starts_with("b@"));
    reply.header("x-prefixlb-attempts").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_refuses_connections_takes_all_its_ranks_out_of_a_request_s_failover() {
    // A request first sent to one of the stopped server's ranks has one attempt left:
    // it must go to the other server, not to another rank of the stopped one.
    let (lb, _b) = two_servers_one_stopped();
    let mut failed_over = 0;
    for i in 0..24 {
        if served_by_b(&lb, i).await == "2" {
            failed_over += 1;
        }
    }
    assert!(
        failed_over > 0,
        "some requests were first sent to the stopped server"
    );
    assert!(in_flight_settles(&lb, std::time::Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_refuses_connections_opens_every_rank_s_breaker_at_once() {
    // `failure_threshold` (2) failed connections to the stopped server, on whichever
    // ranks, open all of its ranks' breakers: no later request pays for trying it.
    // Were each rank's breaker to learn alone, up to 2 × 4 requests would.
    let (lb, _b) = two_servers_one_stopped();
    let mut i = 0;
    let mut failed_over = 0;
    while failed_over < 2 {
        assert!(i < 64, "no request was first sent to the stopped server");
        if served_by_b(&lb, i).await == "2" {
            failed_over += 1;
        }
        i += 1;
    }
    let states = breaker_states(&lb).await;
    assert_eq!(states[..RANKS], ["open"; RANKS], "{states:?}");
    assert!(states[RANKS..].iter().all(|s| s == "closed"), "{states:?}");
    for j in i..i + 24 {
        assert_eq!(served_by_b(&lb, j).await, "1", "request {j}");
    }
    assert!(in_flight_settles(&lb, std::time::Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_health_check_answers_for_every_rank_of_a_server() {
    // A server of 4 ranks and a plain one, checked in the same rounds: the first gets
    // as many `GET /health` as the second, not 4 times as many, and when its health
    // fails every rank goes down with it.
    let ranks = RANKS.to_string();
    let split = engine("split", &["--data-parallel-size", &ranks]);
    let plain = engine("plain", &[]);
    let lb = balancer(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [health]\ninterval = \"100ms\"\nunhealthy_after = 1\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n\
         [[pools.nodes]]\nid = \"split\"\nurl = \"http://{}\"\ndata_parallel_size = {RANKS}\n\
         [[pools.nodes]]\nid = \"plain\"\nurl = \"http://{}\"\n",
        split.addr, plain.addr
    ));
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let (to_split, to_plain) = (health_checks(&split).await, health_checks(&plain).await);
    assert!(to_plain >= 3.0, "{to_plain} checks in 1.5 s");
    assert!(
        to_split <= to_plain + 1.0,
        "the 4-rank server was checked {to_split} times, the plain one {to_plain}"
    );
    let fault = json!({"mode": "error", "ttft_ms": 0});
    assert_eq!(
        post_json(&split.url("/mock/fault"), &fault, &[])
            .await
            .status,
        200
    );
    let healthy = || async {
        let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
        nodes["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["healthy"].as_bool().unwrap())
            .collect::<Vec<_>>()
    };
    let down = eventually(std::time::Duration::from_secs(5), || async {
        healthy().await[..RANKS].iter().all(|h| !h)
    })
    .await;
    assert!(down, "{:?}", healthy().await);
    assert!(healthy().await[RANKS], "the plain server stays up");
}

/// How many `GET /health` an engine has answered.
async fn health_checks(engine: &Proc) -> f64 {
    metric(&engine.url("/metrics"), "mock_engine_health_checks_total").await
}

/// A server of four ranks given as one node (or as two) is named in a warning that
/// says how to give it its ranks, once; given its four, nothing is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_given_the_wrong_number_of_ranks_is_named_in_a_warning() {
    let ranks = RANKS.to_string();
    let engine = engine("dp", &["--data-parallel-size", &ranks]);
    let fast = "[health]\ninterval = \"100ms\"\n";
    for (given, advice) in [
        (1, Some("given 1: set data_parallel_size = 4")),
        (2, Some("given 2: set data_parallel_size = 4")),
        (RANKS, None),
    ] {
        let (lb, log) = balancer_logged(
            &format!("{fast}{}", one_server(&engine, given)),
            "warn",
            &[],
        );
        tokio::time::sleep(Duration::from_millis(800)).await;
        let text = std::fs::read_to_string(&log).unwrap();
        let warnings: Vec<_> = text
            .lines()
            .filter(|l| l.contains("data-parallel rank"))
            .collect();
        // `/admin/nodes` shows it on every node of the server.
        let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
        let shown: Vec<Option<&str>> = nodes["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["engine_advice"].as_str())
            .collect();
        assert_eq!(shown.len(), given);
        match advice {
            Some(advice) => {
                assert_eq!(warnings.len(), 1, "logged once: {text}");
                assert!(
                    warnings[0].contains(advice) && warnings[0].contains("gpu"),
                    "{text}"
                );
                assert!(
                    shown.iter().all(|a| a.is_some_and(|a| a.contains(advice))),
                    "{shown:?}"
                );
            }
            None => {
                assert!(warnings.is_empty(), "{text}");
                assert!(shown.iter().all(Option::is_none), "{shown:?}");
            }
        }
        drop(lb);
    }
}
