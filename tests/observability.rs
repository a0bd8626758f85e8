//! Seeing and tuning the fleet: `/metrics` after a scripted run, the Grafana
//! dashboard against what a running balancer exports, hot reload under load, and
//! `/admin/explain` against `prefixlb route`.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use prometheus_parse::{Scrape, Value as Sample};
use serde_json::{json, Value};

fn engines(n: usize, flags: &[&str]) -> Vec<Proc> {
    (0..n).map(|i| engine(&format!("e{i}"), flags)).collect()
}

fn refs(e: &[Proc]) -> Vec<&Proc> {
    e.iter().collect()
}

async fn scrape(lb: &Proc) -> (String, Scrape) {
    let page = call("GET", &lb.admin_url("/metrics"), &[], "").await.text();
    let parsed = Scrape::parse(page.lines().map(|l| Ok(l.to_string())))
        .expect("the page parses as Prometheus text");
    (page, parsed)
}

/// Sum of a counter or gauge's samples whose labels include `labels`.
fn total(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match &x.value {
            Sample::Counter(v) | Sample::Gauge(v) | Sample::Untyped(v) => *v,
            Sample::Histogram(h) => h.last().map(|b| b.count).unwrap_or(0.0),
            Sample::Summary(_) => 0.0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_run_shows_in_the_metrics_and_the_dashboard_queries_exist() {
    let e = engines(
        4,
        &["--decode-ms-per-token", "5", "--prefill-us-per-token", "10"],
    );
    // Tenants told apart by a header: their tokens are counted (tenant_tokens_total).
    let routing = "max_in_flight = 4\ntenant_header = \"x-tenant\"";
    let lb = balancer(&config(&refs(&e), "", routing));
    set_fault(&e[0], "error", 0).await;

    // A hot key: six streams at once over a cap of four spill two.
    let hot: Vec<_> = (0..6)
        .map(|_| {
            let url = lb.url("/v1/chat/completions");
            tokio::spawn(async move {
                post_json(
                    &url,
                    &chat(&[("user", "hot")], true, 20),
                    &[("x-session-id", "hot")],
                )
                .await
            })
        })
        .collect();
    for h in hot {
        assert_eq!(h.await.unwrap().status, 200);
    }
    // 20 conversations × 10 turns, alternating streaming and not.
    let system = "You are a terse assistant for GPU operators. ".repeat(30);
    let mut conversations: Vec<Vec<(String, String)>> = (0..20)
        .map(|c| {
            vec![
                ("system".into(), system.clone()),
                ("user".into(), format!("conversation {c} starts")),
            ]
        })
        .collect();
    for turn in 0..10 {
        for (c, m) in conversations.iter_mut().enumerate() {
            let msgs: Vec<(&str, &str)> = m.iter().map(|(r, t)| (r.as_str(), t.as_str())).collect();
            let stream = (turn + c) % 2 == 0;
            let reply = post_json(
                &lb.url("/v1/chat/completions"),
                &chat(&msgs, stream, 3),
                &[],
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            let text = reply.text();
            if stream {
                assert!(
                    !text.contains("\"usage\""),
                    "a client that did not ask for usage does not get it"
                );
            }
            m.push(("assistant".into(), "ok".into()));
            m.push(("user".into(), format!("turn {turn}")));
        }
    }
    // A client that asks for usage still gets it.
    let mut asks = chat(&[("user", "with usage")], true, 2);
    asks["stream_options"] = json!({"include_usage": true});
    assert!(post_json(&lb.url("/v1/chat/completions"), &asks, &[])
        .await
        .text()
        .contains("\"usage\""));

    let (page, s) = scrape(&lb).await;
    assert!(
        total(&s, "prefixlb_requests_total", &[("outcome", "success")]) >= 200.0,
        "{page}"
    );
    assert!(total(&s, "prefixlb_ttft_seconds", &[]) >= 100.0);
    assert!(total(&s, "prefixlb_request_duration_seconds", &[]) >= 200.0);
    assert!(
        total(
            &s,
            "prefixlb_routing_decisions_total",
            &[("route", "spill")]
        ) >= 2.0
    );
    assert!(
        total(
            &s,
            "prefixlb_routing_decisions_total",
            &[("route", "primary")]
        ) >= 100.0
    );
    assert!(total(&s, "prefixlb_failovers_total", &[("reason", "http_5xx")]) >= 1.0);
    assert!(
        total(
            &s,
            "prefixlb_breaker_transitions_total",
            &[("node", "n0"), ("to", "open")]
        ) >= 1.0
    );
    assert_eq!(total(&s, "prefixlb_breaker_state", &[("node", "n0")]), 1.0);
    assert_eq!(total(&s, "prefixlb_in_flight", &[]), 0.0);
    assert_eq!(total(&s, "prefixlb_node_cap", &[("node", "n1")]), 4.0);
    assert_eq!(total(&s, "prefixlb_ring_nodes", &[("pool", "mock")]), 4.0);

    // The realized hit rate is the engines' own: compare with their vLLM counters.
    let prompt = total(&s, "prefixlb_prompt_tokens_total", &[]);
    let cached = total(&s, "prefixlb_cached_prompt_tokens_total", &[]);
    let (mut queries, mut hits) = (0.0, 0.0);
    for engine in &e {
        queries += metric(&engine.url("/metrics"), "vllm:prefix_cache_queries_total").await;
        hits += metric(&engine.url("/metrics"), "vllm:prefix_cache_hits_total").await;
    }
    assert_eq!(
        prompt, queries,
        "every prompt token the engines saw was counted"
    );
    assert_eq!(cached, hits);
    assert!(
        cached / prompt > 0.5,
        "affinity makes later turns hit: {}",
        cached / prompt
    );

    // Every metric the dashboard queries is exported.
    let dashboard: Value = serde_json::from_str(include_str!("../grafana/prefixlb.json")).unwrap();
    let mut queried = HashSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            queried.extend(metrics_read_by(target["expr"].as_str().unwrap()));
        }
    }
    assert!(queried.len() >= 15, "{queried:?}");
    // The certificates' expiry comes only with a certificate (tests/client_tls.rs).
    let with_tls = "prefixlb_tls_certificate_expiry_timestamp_seconds";
    assert!(queried.contains(with_tls));
    assert!(!page.contains(with_tls), "no certificate, no series");
    for name in queried.iter().filter(|n| *n != with_tls) {
        assert!(
            page.contains(&format!("# TYPE {name} ")),
            "the dashboard queries {name}, which is not exported"
        );
    }

    // And every metric the alerting rules read (`prefixlb_dns_up` only comes with a
    // DNS name, `prefixlb_redis_up` with a `[redis]` section, the certificates' expiry
    // with a certificate: tests/discovery.rs, tests/fleet.rs and tests/client_tls.rs
    // read them).
    let rules =
        yaml_rust2::YamlLoader::load_from_str(include_str!("../deploy/prometheus/alerts.yaml"))
            .unwrap();
    let mut read = HashSet::new();
    for group in rules[0]["groups"].as_vec().unwrap() {
        for rule in group["rules"].as_vec().unwrap() {
            read.extend(metrics_read_by(rule["expr"].as_str().unwrap()));
        }
    }
    assert!(read.len() >= 10, "{read:?}");
    for name in read.iter().filter(|n| {
        ![
            "prefixlb_dns_up",
            "prefixlb_redis_up",
            "prefixlb_tls_certificate_expiry_timestamp_seconds",
        ]
        .contains(&n.as_str())
    }) {
        assert!(
            page.contains(&format!("# TYPE {name} ")),
            "an alerting rule reads {name}, which is not exported"
        );
    }
    // No `[redis]`: no `prefixlb_redis_up`, which would read as Redis down.
    assert!(!page.contains("prefixlb_redis_up"), "{page}");
}

/// The metric families a PromQL expression reads (a histogram's by its base name).
fn metrics_read_by(expr: &str) -> Vec<String> {
    expr.match_indices("prefixlb_")
        .map(|(i, _)| {
            let name: String = expr[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            ["_bucket", "_sum", "_count"].iter().fold(name, |n, sfx| {
                n.strip_suffix(sfx).map(str::to_string).unwrap_or(n)
            })
        })
        .collect()
}

/// A client who leaves before the answer's head (waiting in the queue, waiting on an
/// engine, or halfway through sending the body) is counted and logged as cancelled,
/// with the pool and node it had reached, and its slot comes back.
/// Every request has one id (`x-request-id`), which the engine, the client's answer
/// and the log line share: the client's, else one the balancer makes (one the client
/// sent that is not an id is replaced); refusals and cancelled requests have theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_has_one_id_the_engine_the_answer_and_the_log_share() {
    let e = engines(1, &["--decode-ms-per-token", "1"]);
    let (lb, log) = balancer_logged(&config(&refs(&e), "", ""), "info", &[]);
    let url = lb.url("/v1/chat/completions");
    let body = chat(&[("user", "hello")], false, 3);
    fn ids(r: &Reply) -> (&str, &str) {
        (r.header("x-request-id"), r.header("x-mock-request-id"))
    }
    // The client's.
    let r = post_json(&url, &body, &[("x-request-id", "req_client-7")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(ids(&r), ("req_client-7", "req_client-7"));
    // None sent, or not an id: a new one, the same at the engine.
    let mut made = Vec::new();
    for sent in [None, Some("has a space")] {
        let headers: Vec<(&str, &str)> = sent.iter().map(|v| ("x-request-id", *v)).collect();
        let stream = chat(&[("user", "hello")], true, 3);
        let r = post_json(&url, &stream, &headers).await;
        assert_eq!(r.status, 200);
        let (answered, engine) = ids(&r);
        assert!(
            answered.starts_with("prefixlb-") && answered.len() == 41,
            "{answered}"
        );
        assert_eq!(answered, engine);
        made.push(answered.to_string());
    }
    assert_ne!(made[0], made[1]);
    // On Anthropic's API in its own header too, which its SDK reads.
    let m =
        json!({"model": "mock", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]});
    let r = post_json(&lb.url("/v1/messages"), &m, &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("request-id"), r.header("x-request-id"));
    assert!(r.header("request-id").starts_with("prefixlb-"));
    // A refusal has one too.
    let unknown = json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]});
    let r = post_json(&url, &unknown, &[("x-request-id", "req_refused")]).await;
    assert_eq!(
        (r.status.as_u16(), r.header("x-request-id")),
        (404, "req_refused")
    );
    let line_of = |id: String| {
        let log = log.clone();
        move || {
            let text = std::fs::read_to_string(&log).unwrap();
            let id = format!("request_id=\"{id}\"");
            text.lines().find(|l| l.contains(&id)).map(str::to_string)
        }
    };
    for (id, kind) in [
        ("req_client-7".to_string(), " request"),
        (made[0].clone(), " request"),
        ("req_refused".to_string(), "request refused"),
    ] {
        let line = line_of(id.clone());
        assert!(
            eventually(Duration::from_secs(5), || async { line().is_some() }).await,
            "no log line names {id}"
        );
        let line = line().unwrap();
        assert!(line.contains(kind), "{line}");
    }
    // Off: none made or told; a client's passes through as any other header.
    let off = balancer(&config(&refs(&e), "request_ids = false", ""));
    let url = off.url("/v1/chat/completions");
    let r = post_json(&url, &body, &[]).await;
    assert_eq!(r.status, 200);
    assert!(r.headers.get("x-request-id").is_none(), "{:?}", r.headers);
    assert!(r.headers.get("x-mock-request-id").is_none());
    let r = post_json(&url, &body, &[("x-request-id", "has a space")]).await;
    assert_eq!(r.header("x-mock-request-id"), "has a space");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_who_leaves_before_the_answer_is_counted_and_logged_as_cancelled() {
    use tokio::io::AsyncWriteExt;
    let e = engines(
        1,
        &["--decode-ms-per-token", "5", "--prefill-us-per-token", "0"],
    );
    let (lb, log) = balancer_logged(&config(&refs(&e), "", "max_in_flight = 1"), "info", &[]);
    // The engine takes requests and never answers them.
    set_fault(&e[0], "stall", 0).await;
    let url = lb.url("/v1/chat/completions");
    // The first holds n0's one slot, waiting on the engine; the second waits in the
    // queue for that slot. Both clients give up, the second first (the first's
    // patience leaves room for a slow machine).
    let asking = {
        let url = url.clone();
        tokio::spawn(async move {
            let body = chat(&[("user", "the first")], false, 5);
            tokio::time::timeout(Duration::from_secs(3), post_json(&url, &body, &[])).await
        })
    };
    assert!(
        eventually(Duration::from_secs(1), || async {
            in_flight(&lb).await[0].1 == 1
        })
        .await,
        "the first request holds n0's slot"
    );
    let body = chat(&[("user", "the second")], true, 5);
    let queued =
        tokio::time::timeout(Duration::from_millis(300), post_json(&url, &body, &[])).await;
    assert!(queued.is_err(), "the second waited in the queue");
    assert!(asking.await.unwrap().is_err(), "the first was not answered");
    // The third sends half its body and hangs up.
    let mut half = tokio::net::TcpStream::connect(lb.addr).await.unwrap();
    half.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"model\"",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(half);

    let cancelled = |pool: &'static str, node: &'static str| {
        let lb = &lb;
        async move {
            let (_, s) = scrape(lb).await;
            let labels = [("pool", pool), ("node", node), ("outcome", "cancelled")];
            total(&s, "prefixlb_requests_total", &labels)
        }
    };
    let counted = eventually(Duration::from_secs(2), || async {
        cancelled("mock", "n0").await == 1.0
            && cancelled("mock", "none").await == 1.0
            && cancelled("none", "none").await == 1.0
    })
    .await;
    assert!(
        counted,
        "cancelled: n0 {}, queued {}, mid-body {}",
        cancelled("mock", "n0").await,
        cancelled("mock", "none").await,
        cancelled("none", "none").await
    );
    assert_eq!(in_flight(&lb).await[0].1, 0, "the slot came back");
    let lines = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("request cancelled") && l.contains("outcome=\"cancelled\""))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert!(
        eventually(Duration::from_secs(5), || async { lines().len() == 3 }).await,
        "three cancelled lines: {:?}",
        lines()
    );
    let lines = lines();
    assert!(
        lines.iter().all(|l| l.contains("request_id=\"prefixlb-")),
        "each names its request: {lines:?}"
    );
    for (pool, node) in [("mock", "n0"), ("mock", "none"), ("none", "none")] {
        let named = format!("pool=\"{pool}\" node=\"{node}\"");
        assert!(
            lines.iter().any(|l| l.contains(&named)),
            "no line with {named}: {lines:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_under_load_loses_nothing_and_rejects_bad_files() {
    let e = engines(2, &["--decode-ms-per-token", "10"]);
    let good = config(&refs(&e), "", "");
    let path = write_config(&good);
    let lb = balancer_from_file(&path);
    let load: Vec<_> = (0..6)
        .map(|w| {
            let url = lb.url("/v1/chat/completions");
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for i in 0..15 {
                    let session = format!("w{w}-{i}");
                    let r = post_json(
                        &url,
                        &chat(&[("user", "load")], true, 8),
                        &[("x-session-id", &session)],
                    )
                    .await;
                    statuses.push((r.status.as_u16(), r.text().ends_with("data: [DONE]\n\n")));
                }
                statuses
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(150)).await;
    std::fs::write(
        &path,
        good.replace("[routing]\n", "[routing]\nmax_in_flight = 2\nvnodes = 40\n"),
    )
    .unwrap();
    let r = call("POST", &lb.admin_url("/admin/reload"), &[], "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        eventually(Duration::from_secs(1), || async {
            node_info(&lb, "n0").await["cap"] == 2
        })
        .await
    );

    tokio::time::sleep(Duration::from_millis(150)).await;
    std::fs::write(
        &path,
        good.replace("[routing]\n", "[routing]\nmax_inflight = 9\n"),
    )
    .unwrap();
    let r = call("POST", &lb.admin_url("/admin/reload"), &[], "").await;
    assert_eq!(r.status, 400);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains(":6:1: unknown field `max_inflight`"), "{msg}");
    assert_eq!(
        node_info(&lb, "n0").await["cap"],
        2,
        "the running config stays"
    );

    for w in load {
        for (status, complete) in w.await.unwrap() {
            assert_eq!(status, 200);
            assert!(complete, "a stream was cut by a reload");
        }
    }
    assert!(in_flight_settles(&lb, Duration::from_secs(1)).await);
    let (_, s) = scrape(&lb).await;
    assert_eq!(
        total(&s, "prefixlb_config_reloads_total", &[("result", "ok")]),
        1.0
    );
    assert_eq!(
        total(&s, "prefixlb_config_reloads_total", &[("result", "error")]),
        1.0
    );

    // SIGHUP reloads too.
    std::fs::write(
        &path,
        good.replace("[routing]\n", "[routing]\nmax_in_flight = 3\n"),
    )
    .unwrap();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &lb.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    assert!(
        eventually(Duration::from_secs(2), || async {
            node_info(&lb, "n0").await["cap"] == 3
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_config_applies_edits_by_itself() {
    let e = engines(1, &[]);
    let text = config(&refs(&e), "watch_config = true", "");
    let path = write_config(&text);
    let lb = balancer_from_file(&path);
    assert_eq!(node_info(&lb, "n0").await["cap"], 4, "the default");
    // mtime granularity: make sure the edit gets a new timestamp.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    std::fs::write(
        &path,
        text.replace("[routing]\n", "[routing]\nmax_in_flight = 7\n"),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(4), || async {
            node_info(&lb, "n0").await["cap"] == 7
        })
        .await
    );
}

/// The nodes of the config show the load their engines report (read from the
/// engine's `/metrics` after each passed health check): a server's own, or each
/// rank's its rank's; with `health.metrics_path = ""` none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_of_the_config_show_the_load_their_engines_report() {
    let slow = ["--decode-ms-per-token", "50"];
    let plain = engine("plain", &slow);
    let split = engine(
        "split",
        &[&slow[..], &["--data-parallel-size", "2"]].concat(),
    );
    let text = |metrics_path: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [health]\ninterval = \"100ms\"\n{metrics_path}\n\
             [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n\
             [[pools.nodes]]\nid = \"plain\"\nurl = \"http://{}\"\n\
             [[pools.nodes]]\nid = \"split\"\nurl = \"http://{}\"\ndata_parallel_size = 2\n",
            plain.addr, split.addr
        )
    };
    let lb = balancer(&text(""));
    let quiet = balancer(&text("metrics_path = \"\""));
    // Sequences sent straight to the engines (not through a balancer, so only the
    // engines' metrics can tell of them): one on `plain`, two on rank 1 of `split`.
    let held: Vec<_> = [(&plain, None), (&split, Some("1")), (&split, Some("1"))]
        .into_iter()
        .enumerate()
        .map(|(i, (e, rank))| {
            let url = e.url("/v1/chat/completions");
            let body = chat(&[("user", &format!("question {i}"))], false, 120);
            tokio::spawn(async move {
                let rank: Vec<_> = rank
                    .map(|r| ("x-data-parallel-rank", r))
                    .into_iter()
                    .collect();
                post_json(&url, &body, &rank).await
            })
        })
        .collect();
    let want = [("plain", 1.0), ("split@0", 0.0), ("split@1", 2.0)]
        .map(|(id, n)| (id.to_string(), Some(n)));
    until_engine_running(&lb, &want, Duration::from_secs(4)).await;
    let (_, page) = scrape(&lb).await;
    let series = |name: &str, node: &str| total(&page, name, &[("node", node)]);
    assert_eq!(series("prefixlb_engine_requests_running", "split@1"), 2.0);
    let waiting = |n: &str| {
        page.samples.iter().any(|x| {
            x.metric == "prefixlb_engine_requests_waiting" && x.labels.get("node") == Some(n)
        })
    };
    assert!(waiting("plain") && waiting("split@0"), "{:?}", page.samples);
    // The KV cache its sequences hold (mock-engine: prompt and answer tokens over its
    // cache's), on their rank only.
    let kv = |n: &str| total(&page, "prefixlb_engine_kv_cache_usage", &[("node", n)]);
    assert!(
        kv("split@1") > 0.0 && kv("split@1") < 1.0,
        "{}",
        kv("split@1")
    );
    assert_eq!(kv("split@0"), 0.0);
    assert!(engine_running(&quiet)
        .await
        .iter()
        .all(|(_, n)| n.is_none()));
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
}

/// An engine whose metrics page is slow does not slow the health checks of the others:
/// its reads are not waited for by the rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_metrics_page_does_not_slow_the_health_checks() {
    let e = engines(2, &[]);
    set_fault(&e[0], "slow_metrics", 60_000).await;
    let lb = balancer(&config(
        &refs(&e),
        "[health]\ninterval = \"100ms\"\ntimeout = \"5s\"",
        "",
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let checks = || metric_of(&e[1], "mock_engine_health_checks_total");
    let before = checks().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let during = checks().await - before;
    // About 20 at one every 100 ms; were the rounds held by the 5 s read, at most 1.
    assert!(during >= 8.0, "{during} health checks in 2 s");
    drop(lb);
}

/// A metric of an engine's own `/metrics`.
async fn metric_of(engine: &Proc, name: &str) -> f64 {
    metric(&engine.url("/metrics"), name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_explain_answers_like_prefixlb_route() {
    let e = engines(3, &[]);
    let text = config(&refs(&e), "", "");
    let path = write_config(&text);
    let lb = balancer_from_file(&path);
    let body = serde_json::to_vec(&json!({"model": "mock", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld"}]}))
    .unwrap();
    let body_path = write_config(std::str::from_utf8(&body).unwrap());
    let out = std::process::Command::new(BIN)
        .args([
            "route",
            "--config",
            path.to_str().unwrap(),
            body_path.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let offline: Value = serde_json::from_slice(&out.stdout).unwrap();
    let online = call("POST", &lb.admin_url("/admin/explain"), &[], body)
        .await
        .json();
    assert_eq!(offline, online);
    // The hybrid key: the first user message behind the (short) system part.
    assert_eq!(online["key"], "user\n\"héllo wörld\"\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_the_admin_listener() {
    let e = engines(1, &[]);
    let lb = balancer(&config(&refs(&e), "admin_token = \"s3cret\"", ""));
    assert_eq!(
        call("GET", &lb.admin_url("/metrics"), &[], "").await.status,
        401
    );
    assert_eq!(
        call(
            "GET",
            &lb.admin_url("/admin/nodes"),
            &[("authorization", "Bearer nope")],
            ""
        )
        .await
        .status,
        401
    );
    let ok = call(
        "GET",
        &lb.admin_url("/admin/nodes"),
        &[("authorization", "Bearer s3cret")],
        "",
    )
    .await;
    assert_eq!(ok.status, 200);
    // The status page holds no data and is open; the summary it polls is not.
    let page = call("GET", &lb.admin_url("/"), &[], "").await;
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").starts_with("text/html"));
    let html = page.text();
    assert!(html.contains("/admin/summary") && html.contains("/admin/nodes"));
    assert!(
        !html.contains("src=\"http") && !html.contains("href=\"http"),
        "the page loads nothing from elsewhere"
    );
    assert_eq!(
        call("GET", &lb.admin_url("/admin/summary"), &[], "")
            .await
            .status,
        401
    );
    let summary = call(
        "GET",
        &lb.admin_url("/admin/summary"),
        &[("authorization", "Bearer s3cret")],
        "",
    )
    .await
    .json();
    assert_eq!(summary["pools"][0]["name"], "mock");
    assert_eq!(summary["pools"][0]["nodes"][0]["id"], "n0");
    assert_eq!(summary["redis"]["configured"], false);
}

/// The dashboard is one Grafana accepts (issue 27, in part): the fields its dashboard
/// model requires, a datasource variable every target uses, unique panel ids and
/// per-panel refIds, and panels that fit the 24-column grid without overlapping.
#[test]
fn the_dashboard_is_a_valid_grafana_dashboard() {
    let d: Value = serde_json::from_str(include_str!("../grafana/prefixlb.json")).unwrap();
    for field in [
        "title",
        "uid",
        "schemaVersion",
        "panels",
        "time",
        "templating",
    ] {
        assert!(!d[field].is_null(), "missing {field}");
    }
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let vars = d["templating"]["list"].as_array().unwrap();
    let ds = vars
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(ds["query"], "prometheus");
    let uid = format!("${{{}}}", ds["name"].as_str().unwrap());
    let panels = d["panels"].as_array().unwrap();
    let mut ids = HashSet::new();
    let mut cells = HashSet::new();
    for p in panels {
        let id = p["id"].as_u64().unwrap();
        assert!(ids.insert(id), "panel id {id} twice");
        assert!(p["type"].is_string() && p["title"].is_string(), "{p}");
        let g = &p["gridPos"];
        let (x, y, w, h) = ["x", "y", "w", "h"].map(|k| g[k].as_u64().unwrap()).into();
        assert!(
            w > 0 && h > 0 && x + w <= 24,
            "panel {id} does not fit: {g}"
        );
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "panel {id} overlaps another at {cx},{cy}"
                );
            }
        }
        let mut refs = HashSet::new();
        for t in p["targets"].as_array().unwrap() {
            assert!(
                refs.insert(t["refId"].as_str().unwrap().to_string()),
                "panel {id}: refId twice"
            );
            assert_eq!(t["datasource"]["uid"], uid.as_str(), "panel {id}");
            assert!(!t["expr"].as_str().unwrap().is_empty());
        }
        assert_eq!(p["datasource"]["uid"], uid.as_str(), "panel {id}");
    }
}
