//! A disaggregated pool (`disaggregation = "vllm"`): each chat or completions request
//! is prefilled on a prefill engine (one token, whole, `kv_transfer_params` asking it
//! to keep the KV cache), then decoded on a decode engine that pulls the cache with
//! the params the prefill engine answered. Against `mock-engine`s that speak vLLM's
//! KV-connector params and record every prefill kept and every pull made
//! (`GET /mock/kv_transfers`), so a pull of params the balancer lost or changed
//! shows.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const PREFILL: [&str; 2] = ["p0", "p1"];
const DECODE: [&str; 2] = ["d0", "d1"];

/// A config whose one pool `mock` is disaggregated over `prefill` and `decode`
/// engines.
fn disaggregated(prefill: &[String], decode: &[String], extra: &str) -> String {
    let mut nodes = String::new();
    for (role, urls, ids) in [("prefill", prefill, PREFILL), ("decode", decode, DECODE)] {
        for (url, id) in urls.iter().zip(ids) {
            nodes +=
                &format!("[[pools.nodes]]\nid = \"{id}\"\nurl = \"{url}\"\nrole = \"{role}\"\n");
        }
    }
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{extra}\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\ndisaggregation = \"vllm\"\n{nodes}"
    )
}

fn url(engine: &Proc) -> String {
    format!("http://{}", engine.addr)
}

/// Text of its own for each conversation and turn (no block shared with another).
fn words(conversation: usize, turn: usize) -> String {
    (0..100)
        .map(|i| format!("c{conversation}t{turn}w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The prefill engines' caches served over 30 % of the prompt tokens they were asked
/// for, and the prefill pool counted those tokens from their answers' usage (a
/// stream's too), as it does any request's.
async fn prefill_caches_hit(lb: &Proc, prefill: &[Proc]) {
    let mut hits = 0.0;
    let mut queries = 0.0;
    for p in prefill {
        let url = format!("http://{}/metrics", p.addr);
        hits += metric(&url, "vllm:prefix_cache_hits_total").await;
        queries += metric(&url, "vllm:prefix_cache_queries_total").await;
    }
    assert!(
        hits / queries > 0.3,
        "prefill engines' hit rate {hits}/{queries}"
    );
    let counted = eventually(Duration::from_secs(2), || async {
        prefill_prompt_tokens(lb).await == queries
    })
    .await;
    let seen = prefill_prompt_tokens(lb).await;
    assert!(counted, "{seen} of {queries}");
}

/// The prompt tokens the balancer counted from its prefill nodes' (`p…`) answers
/// (each counted when its answer has been read to its end).
async fn prefill_prompt_tokens(lb: &Proc) -> f64 {
    let page = call("GET", &lb.admin_url("/metrics"), &[], Vec::new())
        .await
        .text();
    page.lines()
        .filter(|l| l.starts_with("prefixlb_prompt_tokens_total{node=\"p"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn transfers(engine: &Proc) -> Value {
    get_json(&format!("http://{}/mock/kv_transfers", engine.addr)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_prefills_on_its_prefix_s_engine_and_decodes_with_the_params_it_answered() {
    let prefill: Vec<Proc> = PREFILL.iter().map(|id| engine(id, &[])).collect();
    let decode: Vec<Proc> = DECODE.iter().map(|id| engine(id, &[])).collect();
    let lb = balancer(&disaggregated(
        &prefill.iter().map(url).collect::<Vec<_>>(),
        &decode.iter().map(url).collect::<Vec<_>>(),
        "",
    ));
    // 6 conversations of 3 turns: chat, streamed every other turn, and one as a
    // completions prompt; one conversation's requests name no model.
    let mut requests = 0usize;
    let mut prefilled_on: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for c in 0..6 {
        let mut text = String::new();
        let mut messages: Vec<(&str, String)> = Vec::new();
        for t in 0..3 {
            text += &words(c, t);
            messages.push(("user", words(c, t)));
            let stream = t % 2 == 1;
            let (path, mut body) = if c == 5 {
                let body =
                    json!({"model": "mock", "prompt": text, "max_tokens": 4, "stream": stream});
                ("/v1/completions", body)
            } else {
                let m: Vec<(&str, &str)> = messages.iter().map(|(r, x)| (*r, x.as_str())).collect();
                ("/v1/chat/completions", chat(&m, stream, 4))
            };
            messages.push(("assistant", format!("answer {t}")));
            if c == 4 {
                body.as_object_mut().unwrap().remove("model");
            }
            let id = format!("client-chosen-{c}{t}");
            let named: &[(&str, &str)] = match c {
                0 => &[("x-request-id", &id)],
                _ => &[],
            };
            let reply = post_json(&lb.url(path), &body, named).await;
            requests += 1;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let decoded_on = reply.header("x-prefixlb-node");
            assert!(DECODE.contains(&decoded_on), "{decoded_on}");
            assert_eq!(reply.header("x-engine-id"), decoded_on);
            let prefill_node = reply.header("x-prefixlb-prefill-node").to_string();
            assert!(PREFILL.contains(&prefill_node.as_str()), "{prefill_node}");
            prefilled_on.entry(c).or_default().insert(prefill_node);
            if stream {
                assert!(reply
                    .header("content-type")
                    .starts_with("text/event-stream"));
                let text = reply.text();
                assert!(text.contains("data: [DONE]"), "{text}");
            } else {
                assert_eq!(reply.json()["usage"]["completion_tokens"], 4);
            }
        }
    }
    // Every turn of a chat was prefilled where its prefix is cached (a completions
    // prompt under `prefix_chars` is keyed whole, so its second turn may move, in any
    // pool).
    for (c, nodes) in prefilled_on.iter().filter(|(c, _)| **c != 5) {
        assert_eq!(nodes.len(), 1, "conversation {c} prefilled on {nodes:?}");
    }
    // Each chat's later turns hit what its earlier turns left (about half the prompt
    // tokens of 3 turns: 3,344 of 7,225 here); the completions prompt moves once.
    prefill_caches_hit(&lb, &prefill).await;
    // Each prefill was asked for one token and kept for a decode engine, and each
    // decode engine pulled exactly the blocks a prefill engine answered, once, in a
    // request with the prefill's request id (the client's where it sent one).
    let mut produced: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for (p, id) in prefill.iter().zip(PREFILL) {
        let t = transfers(p).await;
        assert_eq!(t["produced"], t["produced_tokens"], "{id}: {t}");
        assert_eq!(t["consumed"], json!([]), "{id}: {t}");
        produced.insert(
            id.to_string(),
            t["produced_ids"].as_array().unwrap().clone(),
        );
    }
    assert_eq!(produced.values().map(Vec::len).sum::<usize>(), requests);
    let mut pulled = BTreeSet::new();
    let mut request_ids = BTreeSet::new();
    for (d, id) in decode.iter().zip(DECODE) {
        let t = transfers(d).await;
        assert_eq!(t["produced"], 0, "{id}: {t}");
        for pull in t["consumed"].as_array().unwrap() {
            let engine = pull[0].as_str().unwrap().to_string();
            let block = pull[1][0].as_u64().unwrap() as usize;
            let kept = produced[&engine].get(block);
            assert!(kept.is_some(), "{id} pulled {pull} never kept");
            assert_eq!(
                Some(&pull[2]),
                kept,
                "{id}: {pull} and its prefill's request id"
            );
            assert!(pull[2].is_string(), "{pull}");
            request_ids.insert(pull[2].as_str().unwrap().to_string());
            assert!(pulled.insert((engine, block)), "{id} pulled {pull} twice");
        }
    }
    assert_eq!(pulled.len(), requests);
    assert_eq!(request_ids.len(), requests, "{request_ids:?}");
    assert!(request_ids.contains("client-chosen-00"), "{request_ids:?}");
    // A prefill leg's time is its node's time to first token, in the prefill pool.
    let page = call("GET", &lb.admin_url("/metrics"), &[], Vec::new())
        .await
        .text();
    let prefill_ttfts: f64 = page
        .lines()
        .filter(|l| l.starts_with("prefixlb_ttft_seconds_count{") && l.contains("pool=\"mock\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(prefill_ttfts as usize, requests, "{page}");
    // Both legs' slots are free again.
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
    // `check` names the two pools; `route` explains both legs.
    let config = write_config(&disaggregated(
        &prefill.iter().map(url).collect::<Vec<_>>(),
        &decode.iter().map(url).collect::<Vec<_>>(),
        "",
    ));
    let said =
        String::from_utf8(run_cli(&["check", "--config", config.to_str().unwrap()])).unwrap();
    assert!(
        said.contains("pool mock/decode (models: mock) [decode engines of mock]: 2 nodes"),
        "{said}"
    );
    assert!(said.contains("each decode engine streams at most 4 answers at once"));
    // `decode_max_in_flight` caps the decode engines alone.
    let raised = write_config(&std::fs::read_to_string(&config).unwrap().replace(
        "disaggregation = ",
        "decode_max_in_flight = 64\ndisaggregation = ",
    ));
    let said =
        String::from_utf8(run_cli(&["check", "--config", raised.to_str().unwrap()])).unwrap();
    let caps: Vec<(&str, &str)> = said
        .lines()
        .filter_map(|l| {
            let l = l.trim_start().strip_prefix("node ")?;
            Some((
                l.split_whitespace().next()?,
                l.split("cap ").nth(1)?.split_whitespace().next()?,
            ))
        })
        .collect();
    assert_eq!(
        caps,
        [("p0", "4"), ("p1", "4"), ("d0", "64"), ("d1", "64")],
        "{said}"
    );
    assert!(
        !said.contains("each decode engine streams at most"),
        "{said}"
    );
    let body = config.with_extension("json");
    std::fs::write(&body, chat(&[("user", "hi")], true, 4).to_string()).unwrap();
    let args = [
        "route",
        "--config",
        config.to_str().unwrap(),
        body.to_str().unwrap(),
    ];
    let routed: Value = serde_json::from_slice(&run_cli(&args)).unwrap();
    assert_eq!(routed["pool"], "mock", "{routed}");
    assert_eq!(routed["decode"]["pool"], "mock/decode", "{routed}");
    assert!(DECODE.contains(&routed["decode"]["choice"].as_str().unwrap()));
    // Other APIs go whole to the prefill engines.
    let reply = post_json(
        &lb.url("/v1/embeddings"),
        &json!({"model": "mock", "input": "x"}),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(PREFILL.contains(&reply.header("x-prefixlb-node")));
    // The status page's summary names each pool's part.
    let summary = get_json(&lb.admin_url("/admin/summary")).await;
    let parts: Vec<(&str, &Value, &Value)> = summary["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                &p["decode_pool"],
                &p["decodes_for"],
            )
        })
        .collect();
    assert_eq!(
        parts,
        [
            ("mock", &json!("mock/decode"), &Value::Null),
            ("mock/decode", &Value::Null, &json!("mock"))
        ]
    );
    // `/v1/models` lists the model once.
    let models = get_json(&lb.url("/v1/models")).await;
    assert_eq!(models["data"].as_array().unwrap().len(), 1, "{models}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_without_a_kv_connector_gets_a_clear_502() {
    // An engine started without a KV connector answers whole, with no params.
    let body = json!({"id": "x", "object": "chat.completion", "model": "mock",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
    .to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let plain = scripted_engine(vec![((head + &body).into_bytes(), Duration::ZERO)]).await;
    let decode = engine("d0", &[]);
    let lb = balancer(&disaggregated(
        &[format!("http://{plain}")],
        &[url(&decode)],
        "[health]\nmetrics_path = \"\"\n",
    ));
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hello")], false, 4),
        &[],
    )
    .await;
    assert_eq!(reply.status, 502, "{}", reply.text());
    let error = &reply.json()["error"];
    assert_eq!(error["code"], "no_kv_transfer_params", "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("`p0`"),
        "{error}"
    );
    assert_eq!(transfers(&decode).await["consumed"], json!([]));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_engine_s_answer_to_a_bad_request_reaches_the_client() {
    let prefill = engine("p0", &["--max-model-len", "64"]);
    let decode = engine("d0", &[]);
    let config = disaggregated(&[url(&prefill)], &[url(&decode)], "");
    let (lb, log) = balancer_logged(&config, "prefixlb=warn", &[]);
    // The decode engines left at the default cap are named when it starts.
    let warned = eventually(Duration::from_secs(5), || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("set decode_max_in_flight") && text.contains("pool=mock/decode cap=4")
    })
    .await;
    assert!(warned, "{}", std::fs::read_to_string(&log).unwrap());
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", &words(0, 0))], true, 4),
        &[],
    )
    .await;
    assert_eq!(reply.status, 400, "{}", reply.text());
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("maximum context length is 64"),
        "{message}"
    );
    assert_eq!(reply.header("x-prefixlb-node"), "p0");
    assert_eq!(transfers(&decode).await["consumed"], json!([]));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_decode_engine_is_failed_over_with_the_same_params() {
    let prefill = engine("p0", &[]);
    let decode: Vec<Proc> = DECODE.iter().map(|id| engine(id, &[])).collect();
    let lb = balancer(&disaggregated(
        &[url(&prefill)],
        &decode.iter().map(url).collect::<Vec<_>>(),
        "[health]\ninterval = \"60s\"\n",
    ));
    set_fault(&decode[0], "error", 0).await;
    for c in 0..6 {
        let stream = c % 2 == 0;
        let reply = post_json(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", &words(c, 0))], stream, 4),
            &[],
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("x-prefixlb-node"), "d1");
    }
    // Each pull that reached d1 was a block p0 kept, once; d0 pulled nothing.
    let pulls = transfers(&decode[1]).await["consumed"].clone();
    let blocks: BTreeSet<u64> = pulls
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1][0].as_u64().unwrap())
        .collect();
    assert_eq!(blocks, (0..6).collect(), "{pulls}");
    assert_eq!(transfers(&decode[0]).await["consumed"], json!([]));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_prefill_engine_is_failed_over_at_the_first_token_timeout() {
    let prefill: Vec<Proc> = PREFILL.iter().map(|id| engine(id, &[])).collect();
    let decode = engine("d0", &[]);
    let config = disaggregated(
        &prefill.iter().map(url).collect::<Vec<_>>(),
        &[url(&decode)],
        "[health]\ninterval = \"60s\"\n",
    )
    .replace(
        "disaggregation = ",
        "first_token_timeout = \"1s\"\ndisaggregation = ",
    );
    let lb = balancer(&config);
    set_fault(&prefill[0], "stall", 0).await;
    // Not the 600 s of a whole answer: a prefill is a first token.
    let served = tokio::time::timeout(Duration::from_secs(30), async {
        for c in 0..4 {
            let reply = post_json(
                &lb.url("/v1/chat/completions"),
                &chat(&[("user", &words(c, 0))], c % 2 == 0, 4),
                &[],
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            assert_eq!(reply.header("x-prefixlb-prefill-node"), "p1");
        }
    })
    .await;
    assert!(served.is_ok(), "a stalled prefill engine held its requests");
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_several_answers_is_decoded_whole_without_a_prefill() {
    // Each of its answers would pull the one prefill's cache, freed by the first done.
    let prefill = engine("p0", &[]);
    let decode = engine("d0", &[]);
    let lb = balancer(&disaggregated(&[url(&prefill)], &[url(&decode)], ""));
    let mut several = chat(&[("user", &words(0, 0))], true, 4);
    several["n"] = json!(2);
    let batch = json!({"model": "mock", "prompt": [words(1, 0), words(2, 0)], "max_tokens": 4});
    for (path, body) in [
        ("/v1/chat/completions", several),
        ("/v1/completions", batch),
    ] {
        let reply = post_json(&lb.url(path), &body, &[]).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("x-prefixlb-node"), "d0");
        assert!(reply.headers.get("x-prefixlb-prefill-node").is_none());
    }
    assert_eq!(transfers(&prefill).await["produced"], 0);
    assert_eq!(transfers(&decode).await["consumed"], json!([]));
    // One answer asked for: prefilled and pulled as ever.
    let one = chat(&[("user", &words(3, 0))], false, 4);
    let reply = post_json(&lb.url("/v1/chat/completions"), &one, &[]).await;
    assert_eq!(reply.header("x-prefixlb-prefill-node"), "p0");
    assert_eq!(transfers(&prefill).await["produced"], 1);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

/// A config whose one pool `mock` is disaggregated as SGLang's: each prefill node
/// names its engine's port as its bootstrap port (a mock engine's bootstrap server is
/// its HTTP server).
fn sglang_disaggregated(prefill: &[&Proc], decode: &[&Proc], extra: &str) -> String {
    let mut nodes = String::new();
    for (p, id) in prefill.iter().zip(PREFILL) {
        let port = p.addr.port();
        nodes += &format!(
            "[[pools.nodes]]\nid = \"{id}\"\nurl = \"{}\"\nrole = \"prefill\"\nbootstrap_port = {port}\n",
            url(p)
        );
    }
    for (d, id) in decode.iter().zip(DECODE) {
        nodes += &format!(
            "[[pools.nodes]]\nid = \"{id}\"\nurl = \"{}\"\nrole = \"decode\"\n",
            url(d)
        );
    }
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{extra}\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\ndisaggregation = \"sglang\"\n{nodes}"
    )
}

fn sglang_engines(role: &str, ids: [&str; 2]) -> Vec<Proc> {
    let flags = ["--disaggregation-mode", role];
    ids.iter().map(|id| engine(id, &flags)).collect()
}

/// (prefill engine, room) of each room a prefill engine kept, and of each a decode
/// engine pulled.
async fn rooms(prefill: &[Proc], decode: &[Proc]) -> (Vec<(String, u64)>, Vec<(String, u64)>) {
    let mut kept = Vec::new();
    for (p, id) in prefill.iter().zip(PREFILL) {
        let t = transfers(p).await;
        assert_eq!(t["consumed"], json!([]), "{id}: {t}");
        for room in t["rooms"].as_array().unwrap() {
            kept.push((id.to_string(), room.as_u64().unwrap()));
        }
    }
    let mut pulled = Vec::new();
    for d in decode {
        let t = transfers(d).await;
        assert_eq!(t["rooms"], json!([]), "{t}");
        for pull in t["consumed"].as_array().unwrap() {
            pulled.push((
                pull[0].as_str().unwrap().to_string(),
                pull[1][0].as_u64().unwrap(),
            ));
        }
    }
    kept.sort();
    pulled.sort();
    (kept, pulled)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_each_request_goes_to_a_prefill_and_a_decode_engine_with_one_room() {
    let prefill = sglang_engines("prefill", PREFILL);
    let decode = sglang_engines("decode", DECODE);
    let lb = balancer(&sglang_disaggregated(
        &prefill.iter().collect::<Vec<_>>(),
        &decode.iter().collect::<Vec<_>>(),
        "",
    ));
    // 5 conversations of 3 turns, streamed every other turn; then SGLang's own
    // `/generate`, a completions prompt, and a request for two answers.
    let mut requests = 0usize;
    let mut prefilled_on: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for c in 0..5 {
        let mut messages: Vec<(&str, String)> = Vec::new();
        for t in 0..3 {
            messages.push(("user", words(c, t)));
            let stream = (c + t) % 2 == 1;
            let m: Vec<(&str, &str)> = messages.iter().map(|(r, x)| (*r, x.as_str())).collect();
            let reply = post_json(&lb.url("/v1/chat/completions"), &chat(&m, stream, 4), &[]).await;
            requests += 1;
            assert_eq!(reply.status, 200, "{}", reply.text());
            assert!(DECODE.contains(&reply.header("x-prefixlb-node")));
            assert_eq!(reply.header("x-engine-id"), reply.header("x-prefixlb-node"));
            let prefill_node = reply.header("x-prefixlb-prefill-node").to_string();
            prefilled_on.entry(c).or_default().insert(prefill_node);
            match stream {
                true => assert!(reply.text().contains("data: [DONE]"), "{}", reply.text()),
                false => assert_eq!(reply.json()["usage"]["completion_tokens"], 4),
            }
            messages.push(("assistant", format!("answer {t}")));
        }
    }
    for (c, nodes) in &prefilled_on {
        assert_eq!(nodes.len(), 1, "conversation {c} prefilled on {nodes:?}");
        assert!(PREFILL.contains(&nodes.first().unwrap().as_str()));
    }
    let mut two = chat(&[("user", &words(9, 0))], false, 4);
    two["n"] = json!(2);
    let others = [
        (
            "/generate",
            json!({"text": words(7, 0), "sampling_params": {"max_new_tokens": 4}}),
        ),
        (
            "/v1/completions",
            json!({"model": "mock", "prompt": words(8, 0), "max_tokens": 4}),
        ),
        ("/v1/chat/completions", two),
    ];
    for (path, body) in others {
        let reply = post_json(&lb.url(path), &body, &[]).await;
        requests += 1;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        assert!(DECODE.contains(&reply.header("x-prefixlb-node")), "{path}");
        assert!(
            PREFILL.contains(&reply.header("x-prefixlb-prefill-node")),
            "{path}"
        );
    }
    // Each request's room was kept by the prefill engine its legs named, and pulled
    // from there by one decode engine, once; every room is new.
    let (kept, pulled) = rooms(&prefill, &decode).await;
    assert_eq!(kept.len(), requests, "{kept:?}");
    assert_eq!(kept, pulled);
    let distinct: BTreeSet<u64> = kept.iter().map(|(_, room)| *room).collect();
    assert_eq!(distinct.len(), requests);
    // The prefill engines hold the conversations' prefixes: later turns hit.
    prefill_caches_hit(&lb, &prefill).await;
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
    // `check` names each prefill engine's bootstrap port.
    let config = write_config(&sglang_disaggregated(
        &prefill.iter().collect::<Vec<_>>(),
        &decode.iter().collect::<Vec<_>>(),
        "",
    ));
    let said =
        String::from_utf8(run_cli(&["check", "--config", config.to_str().unwrap()])).unwrap();
    for p in &prefill {
        let port = format!("bootstrap port {}", p.addr.port());
        assert!(said.contains(&port), "{said}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_prefill_engine_that_fails_ends_its_decode_leg_and_the_pair_goes_again() {
    // p0 goes away between health checks (each pair sent to it fails to connect), or
    // answers every request with a 500.
    for gone in [true, false] {
        let mut prefill = sglang_engines("prefill", PREFILL);
        let decode = sglang_engines("decode", DECODE);
        let lb = balancer(&sglang_disaggregated(
            &prefill.iter().collect::<Vec<_>>(),
            &decode.iter().collect::<Vec<_>>(),
            "[health]\ninterval = \"60s\"\n",
        ));
        let p0 = prefill.remove(0);
        let _failing = match gone {
            true => {
                drop(p0);
                None
            }
            false => {
                set_fault(&p0, "error", 0).await;
                Some(p0)
            }
        };
        let started = std::time::Instant::now();
        for c in 0..6 {
            let reply = post_json(
                &lb.url("/v1/chat/completions"),
                &chat(&[("user", &words(c, 0))], c % 2 == 0, 4),
                &[],
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let prefilled_on = reply.header("x-prefixlb-prefill-node");
            assert_eq!(
                prefilled_on, "p1",
                "gone {gone}, request {c}: {:?}",
                reply.headers
            );
        }
        // No decode leg was left waiting on a room never kept (a decode engine gives
        // up on one after 5 s).
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let p1 = transfers(&prefill[0]).await;
        let mut pulled = 0;
        for d in &decode {
            for pull in transfers(d).await["consumed"].as_array().unwrap() {
                assert_eq!(pull[0], "p1", "{pull}");
                pulled += 1;
            }
        }
        assert_eq!(pulled, 6);
        assert_eq!(p1["rooms"].as_array().unwrap().len(), 6, "{p1}");
        if gone {
            // With every prefill engine gone, the client reads why each try failed.
            drop(prefill.remove(0));
            let body = chat(&[("user", &words(9, 0))], true, 4);
            let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
            assert_eq!(reply.status, 502, "{}", reply.text());
            let message = reply.json()["error"]["message"].to_string();
            assert!(message.contains("p1: "), "{message}");
        }
        assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_data_parallel_prefill_server_s_rank_is_named_to_the_decode_engine() {
    // One prefill server of two ranks, each keeping the rooms it prefilled: a decode
    // engine pulls from the rank its request names.
    let prefill = engine(
        "p0",
        &[
            "--disaggregation-mode",
            "prefill",
            "--data-parallel-size",
            "2",
        ],
    );
    let decode = sglang_engines("decode", DECODE);
    let config = sglang_disaggregated(&[&prefill], &decode.iter().collect::<Vec<_>>(), "").replace(
        "role = \"prefill\"\n",
        "role = \"prefill\"\ndata_parallel_size = 2\n",
    );
    let lb = balancer(&config);
    let mut ranks = BTreeSet::new();
    for c in 0..8 {
        let (path, body) = match c % 2 {
            0 => (
                "/v1/chat/completions",
                chat(&[("user", &words(c, 0))], c % 4 == 0, 4),
            ),
            _ => (
                "/generate",
                json!({"text": words(c, 0), "sampling_params": {"max_new_tokens": 4}}),
            ),
        };
        let reply = post_json(&lb.url(path), &body, &[]).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text());
        ranks.insert(reply.header("x-prefixlb-prefill-node").to_string());
    }
    assert_eq!(
        ranks,
        BTreeSet::from(["p0@0".to_string(), "p0@1".to_string()])
    );
    let (kept, pulled) = rooms(&[prefill], &decode).await;
    assert_eq!((kept.len(), kept), (8, pulled));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_a_client_who_leaves_frees_both_legs_slots() {
    // Leaving while the decode engine has no first token (its leg pending), then
    // while the prefill engine has not answered (its leg pending, the decode leg's
    // answer held for it).
    for (stalled, mode, ms) in [("d0", "stall", 0), ("p0", "slow", 3000)] {
        let prefill = sglang_engines("prefill", PREFILL);
        let decode = sglang_engines("decode", DECODE);
        let config = sglang_disaggregated(&[&prefill[0]], &[&decode[0]], "");
        let lb = balancer(&config);
        let engine = if stalled == "d0" {
            &decode[0]
        } else {
            &prefill[0]
        };
        set_fault(engine, mode, ms).await;
        let url = lb.url("/v1/chat/completions");
        let asking = tokio::spawn(async move {
            let body = chat(&[("user", &words(0, 0))], true, 4);
            tokio::time::timeout(Duration::from_millis(800), post_json(&url, &body, &[])).await
        });
        let held = eventually(Duration::from_millis(700), || async {
            in_flight(&lb)
                .await
                .iter()
                .any(|(node, n)| node == stalled && *n == 1)
        })
        .await;
        assert!(
            held,
            "{stalled}'s leg holds its slot: {:?}",
            in_flight(&lb).await
        );
        assert!(asking.await.unwrap().is_err(), "answered despite {stalled}");
        assert!(
            in_flight_settles(&lb, Duration::from_secs(5)).await,
            "{stalled}: {:?}",
            in_flight(&lb).await
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_prefill_or_decode_engine_free_the_fallback_pool_takes_the_request_whole() {
    for how in ["vllm", "sglang"] {
        let role = |r: &'static str| match how {
            "sglang" => vec!["--disaggregation-mode", r],
            _ => vec![],
        };
        let prefill = engine("p0", &role("prefill"));
        let decode = engine("d0", &role("decode"));
        let plain = engine("whole", &[]);
        let pd = match how {
            "sglang" => sglang_disaggregated(&[&prefill], &[&decode], ""),
            _ => disaggregated(&[url(&prefill)], &[url(&decode)], ""),
        };
        let config = pd.replace("models = [\"mock\"]\n", "models = [\"mock\"]\nfallbacks = [\"plain\"]\n")
            + &format!(
                "[[pools]]\nname = \"plain\"\nmodels = [\"other\"]\n[[pools.nodes]]\nid = \"n0\"\nurl = \"{}\"\n",
                url(&plain)
            );
        let lb = balancer(&config);
        let ask = |stream: bool| {
            let url = lb.url("/v1/chat/completions");
            async move { post_json(&url, &chat(&[("user", &words(0, 0))], stream, 4), &[]).await }
        };
        let drain = |node: &'static str, verb: &'static str| {
            let url = lb.admin_url(&format!("/admin/nodes/{node}/{verb}"));
            async move { call("POST", &url, &[], "").await }
        };
        let reply = ask(false).await;
        assert_eq!(reply.header("x-prefixlb-prefill-node"), "p0", "{how}");
        for (node, stream) in [("p0", true), ("d0", false)] {
            drain(node, "drain").await;
            let reply = ask(stream).await;
            assert_eq!(reply.status, 200, "{how}, {node} drained: {}", reply.text());
            assert_eq!(
                reply.header("x-prefixlb-node"),
                "n0",
                "{how}, {node} drained"
            );
            assert_eq!(reply.header("x-prefixlb-route"), "fallback:plain");
            assert!(reply.headers.get("x-prefixlb-prefill-node").is_none());
            drain(node, "undrain").await;
        }
        assert_eq!(ask(true).await.header("x-prefixlb-node"), "d0", "{how}");
        assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
    }
}

#[test]
fn check_refuses_a_disaggregated_pool_it_cannot_serve() {
    let pool = |lines: &str| {
        format!("[server]\nlisten = \"127.0.0.1:0\"\n[[pools]]\nname = \"m\"\n{lines}")
    };
    let node = |id: &str, role: &str| {
        let role = match role {
            "" => String::new(),
            r => format!("role = \"{r}\"\n"),
        };
        format!("[[pools.nodes]]\nid = \"{id}\"\nurl = \"http://127.0.0.1:1\"\n{role}")
    };
    let both = node("p", "prefill") + &node("d", "decode");
    for (lines, says) in [
        (
            node("a", "decode"),
            "has a role, and pool \"m\" has no disaggregation",
        ),
        (
            "disaggregation = \"vllm\"\n".to_string() + &node("p", "prefill"),
            "no node with role = \"decode\"",
        ),
        (
            "disaggregation = \"vllm\"\n".to_string() + &node("d", "decode"),
            "no node with role = \"prefill\"",
        ),
        (
            "disaggregation = \"vllm\"\n".to_string() + &node("p", "") + &node("d", "decode"),
            "needs role = \"prefill\" or \"decode\"",
        ),
        (
            "disaggregation = \"vllm\"\n".to_string() + &node("p", "prefil") + &node("d", "decode"),
            "role = \"prefil\"",
        ),
        (
            "disaggregation = \"mooncake\"\n".to_string() + &both,
            "\"vllm\" (prefill, then decode",
        ),
        (
            "disaggregation = \"vllm\"\n".to_string()
                + &node("p", "prefill")
                + "bootstrap_port = 8998\n"
                + &node("d", "decode"),
            "only a prefill engine of a pool with disaggregation = \"sglang\" has one",
        ),
        (
            "disaggregation = \"sglang\"\n".to_string() + &both + "bootstrap_port = 8998\n",
            "node \"d\" has a bootstrap_port",
        ),
        (
            "decode_max_in_flight = 8\n".to_string() + &node("a", ""),
            "has decode_max_in_flight and no disaggregation",
        ),
    ] {
        let said = check_refuses(&pool(&lines));
        assert!(said.contains(says), "{lines}\n{said}");
    }
    let fallback =
        "[server]\nlisten = \"127.0.0.1:0\"\n[[pools]]\nname = \"other\"\nfallbacks = [\"m\"]\n"
            .to_string()
            + &node("o", "")
            + "[[pools]]\nname = \"m\"\ndisaggregation = \"vllm\"\n"
            + &both;
    assert!(check_refuses(&fallback).contains("falls back to \"m\", which is disaggregated"));
    let taken =
        "[server]\nlisten = \"127.0.0.1:0\"\n[[pools]]\nname = \"m/decode\"\nmodels = [\"x\"]\n"
            .to_string()
            + &node("o", "")
            + "[[pools]]\nname = \"m\"\ndisaggregation = \"vllm\"\n"
            + &both;
    assert!(check_refuses(&taken).contains("another pool has that name"));
}

/// With `server.request_ids` off, both legs of a request still share one id (vLLM
/// asks it): the client's, else one made for the pair; the answer tells none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_share_an_id_with_request_ids_off() {
    let prefill: Vec<Proc> = PREFILL.iter().map(|id| engine(id, &[])).collect();
    let decode: Vec<Proc> = DECODE.iter().map(|id| engine(id, &[])).collect();
    let lb = balancer(&disaggregated(
        &prefill.iter().map(url).collect::<Vec<_>>(),
        &decode.iter().map(url).collect::<Vec<_>>(),
        "request_ids = false",
    ));
    for k in 0..4 {
        let id = format!("client-{k}");
        let named: &[(&str, &str)] = if k < 2 { &[("x-request-id", &id)] } else { &[] };
        let body = chat(&[("user", &words(k, 0))], false, 4);
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, named).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(reply.headers.get("x-request-id").is_none());
    }
    let mut kept = BTreeSet::new();
    for p in &prefill {
        for id in transfers(p).await["produced_ids"].as_array().unwrap() {
            kept.insert(id.as_str().expect("a prefill with an id").to_string());
        }
    }
    let mut pulled = BTreeSet::new();
    for d in &decode {
        for pull in transfers(d).await["consumed"].as_array().unwrap() {
            pulled.insert(pull[2].as_str().expect("a pull with an id").to_string());
        }
    }
    assert_eq!(kept.len(), 4, "{kept:?}");
    assert_eq!(kept, pulled);
    assert!(
        kept.contains("client-0") && kept.contains("client-1"),
        "{kept:?}"
    );
}

/// A request whose prefill leg is answered with an error (the prompt over the prefill
/// engine's context) gives its tokens back, as any request answered with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_refused_gives_the_tokens_back() {
    let prefill: Vec<Proc> = PREFILL
        .iter()
        .map(|id| engine(id, &["--max-model-len", "1000"]))
        .collect();
    let decode: Vec<Proc> = DECODE.iter().map(|id| engine(id, &[])).collect();
    let lb = balancer(&disaggregated(
        &prefill.iter().map(url).collect::<Vec<_>>(),
        &decode.iter().map(url).collect::<Vec<_>>(),
        "[routing]\ntenant_header = \"x-tenant\"\n\
         [[tenants]]\nname = \"small\"\ntokens_per_minute = 3000\n",
    ));
    // About 1,100 prompt tokens each: charged and kept, the fourth would be refused.
    let mut statuses = Vec::new();
    for k in 0..4 {
        let long = format!("{k} {}", "word ".repeat(880));
        let body = chat(&[("user", &long)], false, 4);
        let reply = post_json(
            &lb.url("/v1/chat/completions"),
            &body,
            &[("x-tenant", "small")],
        )
        .await;
        statuses.push(reply.status.as_u16());
    }
    assert_eq!(statuses, [400, 400, 400, 400]);
}
