//! Dynamic fleets (issue 11) against a real `redis-server`, real `prefixlb agent`
//! processes beside `mock-engine`s, and real `serve` replicas. Without `redis-server`
//! on the PATH each test prints a skip line, except under `CI=true`, where that fails.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Heartbeats and polls fast, so tests take seconds.
const POLL_MS: u64 = 200;
const TTL_MS: u64 = 1000;

/// A child process (not an HTTP server) killed on drop.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Daemon {
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.0.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig}");
    }

    fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        exit_within(&mut self.0, limit).and_then(|status| status.code())
    }

    /// Stops it and returns what it wrote to its standard error.
    fn stop_and_read_stderr(mut self) -> String {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let mut text = String::new();
        if let Some(mut err) = self.0.stderr.take() {
            std::io::Read::read_to_string(&mut err, &mut text).unwrap();
        }
        text
    }
}

/// A `redis-server` on a free loopback port, no persistence.
struct Redis {
    port: u16,
    extra: Vec<String>,
    daemon: Option<Daemon>,
}

impl Redis {
    /// `None` (after a skip line) when `redis-server` is not installed, outside CI.
    fn start(extra: &[&str]) -> Option<Redis> {
        if !installed("redis-server", "redis-server", "the fleet tests") {
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut r = Redis {
            port,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            daemon: None,
        };
        r.up();
        Some(r)
    }

    fn up(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        self.daemon = Some(Daemon(child));
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn down(&mut self) {
        self.daemon = None;
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

fn agent(redis: &str, engine: &Proc, id: &str, extra: &[&str]) -> Daemon {
    agent_in(redis, "mock", engine, id, extra)
}

/// An agent heartbeating `engine` into pool `pool`.
fn agent_in(redis: &str, pool: &str, engine: &Proc, id: &str, extra: &[&str]) -> Daemon {
    let child = Command::new(BIN)
        .args(["agent", "--redis", redis, "--pool", pool, "--id", id])
        .args(["--backend", &engine.url("")])
        .args([
            "--interval",
            &format!("{POLL_MS}ms"),
            "--ttl",
            &format!("{TTL_MS}ms"),
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Daemon(child)
}

/// An agent beside each engine, ids `{prefix}0`, `{prefix}1`, ….
fn agents(redis: &str, engines: &[Proc], prefix: &str) -> Vec<Daemon> {
    engines
        .iter()
        .enumerate()
        .map(|(i, engine)| agent(redis, engine, &format!("{prefix}{i}"), &[]))
        .collect()
}

fn fleet_config(redis: &str, routing: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[routing]\n{routing}\n\
         [redis]\nurl = \"{redis}\"\npoll_interval = \"{POLL_MS}ms\"\nheartbeat_ttl = \"{TTL_MS}ms\"\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n"
    )
}

/// A gauge of `lb`'s `/metrics` (common's [`metric`], by balancer).
async fn gauge(lb: &Proc, name: &str) -> f64 {
    metric(&lb.admin_url("/metrics"), name).await
}

async fn ring_nodes(lb: &Proc) -> usize {
    gauge(lb, "prefixlb_ring_nodes").await as usize
}

/// Waits until `lb` has `n` nodes on its ring; returns how long it took.
async fn until_nodes(lb: &Proc, n: usize, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if ring_nodes(lb).await == n {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{} nodes after {limit:?}, wanted {n}",
            ring_nodes(lb).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn engines(n: usize) -> Vec<Proc> {
    (0..n)
        .map(|i| engine(&format!("e{i}"), &["--decode-ms-per-token", "2"]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_agents_make_a_pool_routed_like_the_same_static_nodes() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engines(3);
    let lb = balancer(&fleet_config(&redis.url(), ""));
    assert_eq!(ring_nodes(&lb).await, 0);
    let _agents = agents(&redis.url(), &e, "gpu-");
    until_nodes(&lb, 3, Duration::from_secs(3)).await;
    let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
    for n in nodes["nodes"].as_array().unwrap() {
        assert_eq!(n["source"], "redis", "{n}");
        assert!(
            n["engine_load"]["running"].is_number(),
            "engine load relayed: {n}"
        );
    }
    // The same ids as static nodes route every key to the same node.
    let static_nodes: String = e
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "[[pools.nodes]]\nid = \"gpu-{i}\"\nurl = \"http://{}\"\n",
                p.addr
            )
        })
        .collect();
    let static_config = write_config(&format!(
        "[[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n{static_nodes}"
    ));
    let body = write_config(&serde_json::to_string(&chat(&[("user", "x")], true, 1)).unwrap());
    for k in 0..40 {
        let session = format!("conversation-{k}");
        let live = walk_of(&lb, &session).await;
        let offline: Value = serde_json::from_slice(&run_cli(&[
            "route",
            "--config",
            static_config.to_str().unwrap(),
            "--header",
            &format!("x-session-id:{session}"),
            body.to_str().unwrap(),
        ]))
        .unwrap();
        let offline: Vec<String> = offline["successors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["node"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(live, offline, "{session}");
    }
    let r = stream_chat(&lb, "conversation-1", 3).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_leaves_within_ttl_and_its_streams_finish_a_stopped_one_at_once() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engines(3);
    let lb = balancer(&fleet_config(&redis.url(), ""));
    let mut agents = agents(&redis.url(), &e, "n");
    until_nodes(&lb, 3, Duration::from_secs(3)).await;
    // A long stream on n0 (400 tokens × 2 ms), then its agent is killed.
    let mut session = String::new();
    for k in 0..200 {
        session = format!("s{k}");
        if walk_of(&lb, &session).await[0] == "n0" {
            break;
        }
    }
    let url = lb.url("/v1/chat/completions");
    let s = session.clone();
    let stream = tokio::spawn(async move {
        post_json(
            &url,
            &chat(&[("user", "hello")], true, 400),
            &[("x-session-id", &s)],
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    agents[0].signal("KILL");
    let left = until_nodes(&lb, 2, Duration::from_millis(TTL_MS + 3 * POLL_MS + 500)).await;
    assert!(
        left <= Duration::from_millis(TTL_MS + 2 * POLL_MS + 300),
        "left after {left:?}"
    );
    let reply = stream.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-prefixlb-node"), "n0");
    assert!(
        reply.text().ends_with("data: [DONE]\n\n"),
        "the stream finished"
    );
    assert_eq!(reply.text().matches("\"content\":").count(), 401);
    // SIGTERM: it deregisters, and leaves at the next poll.
    agents[1].signal("TERM");
    assert_eq!(agents[1].wait_exit(Duration::from_secs(3)), Some(0));
    let left = until_nodes(&lb, 1, Duration::from_secs(2)).await;
    assert!(
        left < Duration::from_millis(TTL_MS),
        "left after {left:?}: not by expiry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_freezes_membership_and_costs_clients_nothing() {
    let Some(mut redis) = Redis::start(&[]) else {
        return;
    };
    let e = engines(3);
    let lb = balancer(&fleet_config(&redis.url(), ""));
    let _agents = agents(&redis.url(), &e, "n");
    until_nodes(&lb, 3, Duration::from_secs(3)).await;
    assert_eq!(gauge(&lb, "prefixlb_redis_up").await, 1.0);
    let latencies = |n: usize| {
        let lb_url = lb.url("/v1/chat/completions");
        async move {
            let mut took = Vec::new();
            for i in 0..n {
                let start = Instant::now();
                let r = post_json(
                    &lb_url,
                    &chat(&[("user", "hi")], false, 1),
                    &[("x-session-id", &format!("k{}", i % 7))],
                )
                .await;
                assert_eq!(r.status, 200, "{}", r.text());
                took.push(start.elapsed());
            }
            took.sort();
            took[n / 2]
        }
    };
    let before = latencies(60).await;
    redis.down();
    let during = latencies(60).await;
    assert_eq!(gauge(&lb, "prefixlb_redis_up").await, 0.0);
    assert_eq!(ring_nodes(&lb).await, 3, "membership frozen");
    let during_late = latencies(60).await;
    assert!(
        during <= before * 2 + Duration::from_millis(5)
            && during_late <= before * 2 + Duration::from_millis(5),
        "p50 before {before:?}, during {during:?} / {during_late:?}"
    );
    // Back (empty: no persistence): resync, and no engine dropped meanwhile.
    redis.up();
    let start = Instant::now();
    while gauge(&lb, "prefixlb_redis_up").await != 1.0 {
        assert!(start.elapsed() < Duration::from_secs(15), "no resync");
        assert_eq!(ring_nodes(&lb).await, 3);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..20 {
        assert_eq!(ring_nodes(&lb).await, 3);
        tokio::time::sleep(Duration::from_millis(POLL_MS / 2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_engine_stops_heartbeating_and_leaves() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engines(2);
    let lb = balancer(&fleet_config(&redis.url(), ""));
    let _agents = agents(&redis.url(), &e, "n");
    until_nodes(&lb, 2, Duration::from_secs(3)).await;
    set_fault(&e[1], "error", 0).await;
    until_nodes(&lb, 1, Duration::from_millis(TTL_MS + 3 * POLL_MS)).await;
    set_fault(&e[1], "ok", 0).await;
    until_nodes(&lb, 2, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_s_data_parallel_server_joins_as_a_node_per_rank() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engine("dp", &["--data-parallel-size", "3"]);
    let lb = balancer(&fleet_config(&redis.url(), ""));
    let _agent = agent(&redis.url(), &e, "d", &["--data-parallel-size", "3"]);
    until_nodes(&lb, 3, Duration::from_secs(3)).await;
    let mut ids: Vec<String> = in_flight(&lb).await.into_iter().map(|(id, _)| id).collect();
    ids.sort();
    assert_eq!(ids, ["d@0", "d@1", "d@2"]);
    // A conversation's second turn is sent to the rank that holds its first.
    let first = [(
        "user",
        "a question of its own, long enough to fill a block or two of the cache model's blocks",
    )];
    let url = lb.url("/v1/chat/completions");
    let one = post_json(&url, &chat(&first, false, 4), &[]).await;
    assert_eq!(one.status, 200, "{}", one.text());
    let answer = one.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turns = [
        first[0],
        ("assistant", &answer),
        ("user", "and a follow-up"),
    ];
    let two = post_json(&url, &chat(&turns, false, 4), &[]).await;
    assert_eq!(two.header("x-prefixlb-node"), one.header("x-prefixlb-node"));
    let cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    assert!(cached.as_u64().unwrap() > 0, "{cached}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_server_s_ranks_each_show_their_own_engine_load() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engine(
        "dp",
        &["--data-parallel-size", "2", "--decode-ms-per-token", "50"],
    );
    let lb = balancer(&fleet_config(&redis.url(), ""));
    let _agent = agent(&redis.url(), &e, "d", &["--data-parallel-size", "2"]);
    until_nodes(&lb, 2, Duration::from_secs(3)).await;
    // Two sequences on rank 1 of the server, sent straight to it (not through the
    // balancer, so only the engine's metrics can tell the balancer of them).
    let held: Vec<_> = (0..2)
        .map(|i| {
            let url = e.url("/v1/chat/completions");
            let body = chat(&[("user", &format!("question {i}"))], false, 120);
            tokio::spawn(
                async move { post_json(&url, &body, &[("x-data-parallel-rank", "1")]).await },
            )
        })
        .collect();
    let want = [
        ("d@0".to_string(), Some(0.0)),
        ("d@1".to_string(), Some(2.0)),
    ];
    until_engine_running(&lb, &want, Duration::from_secs(4)).await;
    let series = "prefixlb_engine_requests_running{node=\"d@1\",pool=\"mock\"}";
    assert_eq!(gauge(&lb, series).await, 2.0);
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
    let idle = [
        ("d@0".to_string(), Some(0.0)),
        ("d@1".to_string(), Some(0.0)),
    ];
    let start = Instant::now();
    while engine_running(&lb).await != idle {
        assert!(start.elapsed() < Duration::from_secs(3), "never idle again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An agent that announces a server of three ranks as one says, once, how to announce
/// its ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_announcing_the_wrong_number_of_ranks_says_so_once() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engine("dp", &["--data-parallel-size", "3"]);
    let wrong = agent(&redis.url(), &e, "d", &[]);
    let right = agent(&redis.url(), &e, "r", &["--data-parallel-size", "3"]);
    // Several heartbeats.
    tokio::time::sleep(Duration::from_millis(5 * POLL_MS)).await;
    let said = wrong.stop_and_read_stderr();
    let advice: Vec<_> = said
        .lines()
        .filter(|l| l.contains("data-parallel rank"))
        .collect();
    assert_eq!(advice.len(), 1, "{said}");
    assert!(advice[0].contains("--data-parallel-size 3"), "{said}");
    let said = right.stop_and_read_stderr();
    assert!(!said.contains("data-parallel rank"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_heartbeat_prefill_and_decode_engines_into_a_disaggregated_pool() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let (prefill, decode) = (engine("p", &[]), engine("d", &[]));
    // No node in the file: the prefill engine heartbeats into the pool, the decode
    // engine into the pool of its decode engines.
    let config = fleet_config(&redis.url(), "").replace(
        "models = [\"mock\"]\n",
        "models = [\"mock\"]\ndisaggregation = \"vllm\"\n",
    );
    let lb = balancer(&config);
    let _agents = [
        agent_in(&redis.url(), "mock", &prefill, "p0", &[]),
        agent_in(&redis.url(), "mock/decode", &decode, "d0", &[]),
    ];
    let joined = eventually(Duration::from_secs(10), || async {
        let nodes = admin_nodes(&lb).await;
        let pools: Vec<(&str, &str)> = nodes
            .iter()
            .map(|n| (n["id"].as_str().unwrap(), n["pool"].as_str().unwrap()))
            .collect();
        pools == [("d0", "mock/decode"), ("p0", "mock")]
    })
    .await;
    assert!(joined, "{:?}", admin_nodes(&lb).await);
    for c in 0..4 {
        let body = chat(&[("user", &format!("conversation {c}"))], c % 2 == 0, 4);
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(reply.header("x-prefixlb-node"), "d0");
        assert_eq!(reply.header("x-prefixlb-prefill-node"), "p0");
    }
    let pulls = get_json(&decode.url("/mock/kv_transfers")).await;
    assert_eq!(pulls["consumed"].as_array().unwrap().len(), 4, "{pulls}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_know_each_other_agree_and_split_the_cap() {
    let Some(redis) = Redis::start(&[]) else {
        return;
    };
    let e = engines(3);
    let config = fleet_config(
        &redis.url(),
        "max_in_flight = 4\nsplit_cap_across_replicas = true",
    );
    let a = balancer(&config);
    let b = balancer(&config);
    let _agents = agents(&redis.url(), &e, "n");
    until_nodes(&a, 3, Duration::from_secs(3)).await;
    until_nodes(&b, 3, Duration::from_secs(3)).await;
    let start = Instant::now();
    while gauge(&a, "prefixlb_balancer_replicas").await != 2.0
        || gauge(&b, "prefixlb_balancer_replicas").await != 2.0
    {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "replicas never counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for k in 0..40 {
        let session = format!("conversation-{k}");
        assert_eq!(
            walk_of(&a, &session).await,
            walk_of(&b, &session).await,
            "{session}"
        );
    }
    for lb in [&a, &b] {
        for n in get_json(&lb.admin_url("/admin/nodes")).await["nodes"]
            .as_array()
            .unwrap()
        {
            assert_eq!(n["cap"], 2, "half of 4 per replica: {n}");
        }
    }
    // One replica gone: the other takes the whole cap again after the TTL.
    drop(b);
    let start = Instant::now();
    while gauge(&a, "prefixlb_balancer_replicas").await != 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "the dead replica is still counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(node_info(&a, "n0").await["cap"], 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_password_redis_rejects_exits_non_zero_and_says_why() {
    let Some(redis) = Redis::start(&["--requirepass", "s3cret"]) else {
        return;
    };
    let e = engines(1);
    let url = format!("redis://:wrong@127.0.0.1:{}", redis.port);
    let mut a = agent(&url, &e[0], "n0", &[]);
    let code = a.wait_exit(Duration::from_secs(5));
    assert_eq!(code, Some(2), "exits non-zero");
    let mut stderr = String::new();
    use std::io::Read;
    a.0.stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("rejected the credentials"), "{stderr}");
    assert!(
        !stderr.contains("wrong"),
        "the password is not echoed: {stderr}"
    );
    // The right one, from the environment.
    let child = Command::new(BIN)
        .args([
            "agent",
            "--redis",
            &redis.url(),
            "--password-env",
            "FLEET_PW",
            "--pool",
            "mock",
        ])
        .args([
            "--backend",
            &e[0].url(""),
            "--interval",
            "200ms",
            "--ttl",
            "1s",
        ])
        .env("FLEET_PW", "s3cret")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut ok = Daemon(child);
    assert_eq!(
        ok.wait_exit(Duration::from_millis(800)),
        None,
        "keeps running"
    );
}
