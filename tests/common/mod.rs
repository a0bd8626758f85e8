//! Test harness: real `prefixlb` processes (`mock-engine`s and `serve`) on loopback
//! ports chosen by the OS, and a small real HTTP client.

#![allow(dead_code)]

pub mod load;
pub mod tls;
pub mod toxic;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_prefixlb");

/// A child process killed on drop.
pub struct Proc {
    child: Child,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin.expect("not a balancer"))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit by itself; returns its exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        exit_within(&mut self.child, limit).and_then(|status| status.code())
    }
}

/// Waits up to `limit` for `child` to exit by itself; its status, or `None` if it
/// still runs.
pub fn exit_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Starts a process and reads its "listening on http[s]://ADDR [(admin http://ADDR)]"
/// line.
fn spawn(args: &[&str]) -> Proc {
    spawn_with(args, "warn", Stdio::inherit(), &[])
}

fn spawn_with(args: &[&str], log: &str, stderr: Stdio, env: &[(&str, &str)]) -> Proc {
    // `PREFIXLB_BIN` runs a suite against another build (an older one, to see what a
    // fix fixed); the one just built by default.
    let bin = std::env::var("PREFIXLB_BIN").unwrap_or_else(|_| BIN.to_string());
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_LOG", log)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("spawning prefixlb");
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("reading the listening line");
    let urls: Vec<SocketAddr> = line
        .split("://")
        .skip(1)
        .map(|s| {
            s.trim_end_matches(|c: char| !c.is_ascii_digit())
                .parse()
                .unwrap()
        })
        .collect();
    assert!(!urls.is_empty(), "no address in {line:?}");
    Proc {
        child,
        addr: urls[0],
        admin: urls.get(1).copied(),
    }
}

/// Starts a `mock-engine` with extra flags.
pub fn engine(id: &str, flags: &[&str]) -> Proc {
    let mut args = vec!["mock-engine", "--listen", "127.0.0.1:0", "--id", id];
    args.extend_from_slice(flags);
    spawn(&args)
}

/// Starts a `mock-engine` on a given address (to restart one where it was).
pub fn engine_at(id: &str, addr: SocketAddr, flags: &[&str]) -> Proc {
    let listen = addr.to_string();
    let mut args = vec!["mock-engine", "--listen", &listen, "--id", id];
    args.extend_from_slice(flags);
    spawn(&args)
}

static CONFIGS: AtomicUsize = AtomicUsize::new(0);

/// Writes a config file for this test run and returns its path.
/// Runs `prefixlb ARGS` to completion, asserts it succeeded (showing its stderr if
/// not), and returns its stdout.
pub fn run_cli(args: &[&str]) -> Vec<u8> {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "prefixlb {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs `prefixlb check` on a config text, asserts that it refuses it (exit 2), and
/// returns what it said.
pub fn check_refuses(text: &str) -> String {
    let path = write_config(text);
    let out = Command::new(BIN)
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{text}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn write_config(text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prefixlb-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("c{}.toml", CONFIGS.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&path, text).unwrap();
    path
}

/// A config with one pool `mock` over the given engines (node ids n0, n1, …), plus
/// extra `[server]` and `[routing]` lines.
pub fn config(engines: &[&Proc], server: &str, routing: &str) -> String {
    config_ext(engines, &format!("{server}\n[routing]\n{routing}"), "")
}

/// Starts `prefixlb serve` on a config text.
pub fn balancer(config_text: &str) -> Proc {
    balancer_from_file(&write_config(config_text))
}

/// Starts `prefixlb serve` on a config file (which a test may edit and reload).
pub fn balancer_from_file(path: &std::path::Path) -> Proc {
    spawn(&["serve", "--config", path.to_str().unwrap()])
}

/// Starts `prefixlb serve` with its log (`RUST_LOG` = `log`) written to a file, and
/// extra environment variables; returns the process and the log's path.
pub fn balancer_logged(config_text: &str, log: &str, env: &[(&str, &str)]) -> (Proc, PathBuf) {
    balancer_logged_as(config_text, log, env, "text")
}

/// As [`balancer_logged`], with `--log-format` `format`.
pub fn balancer_logged_as(
    config_text: &str,
    log: &str,
    env: &[(&str, &str)],
    format: &str,
) -> (Proc, PathBuf) {
    let config = write_config(config_text);
    let log_path = config.with_extension("log");
    let file = std::fs::File::create(&log_path).unwrap();
    let lb = spawn_with(
        &[
            "serve",
            "--config",
            config.to_str().unwrap(),
            "--log-format",
            format,
        ],
        log,
        Stdio::from(file),
        env,
    );
    (lb, log_path)
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A complete response.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or_else(|| panic!("no header {name} in {:?}", self.headers))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends a request and returns the response head with its streaming body.
pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> hyper::Response<Incoming> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    client()
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .expect("request failed")
}

/// Sends a request and reads the whole response.
pub async fn call(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let resp = send(method, url, headers, body).await;
    let (parts, body) = resp.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("reading body").to_bytes(),
    }
}

/// POSTs a JSON body and returns the response head with its streaming body.
pub async fn post_stream(url: &str, body: &Value) -> hyper::Response<Incoming> {
    send(
        "POST",
        url,
        &[("content-type", "application/json")],
        serde_json::to_vec(body).unwrap(),
    )
    .await
}

/// POSTs a JSON body.
pub async fn post_json(url: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    call("POST", url, &h, serde_json::to_vec(body).unwrap()).await
}

pub async fn get_json(url: &str) -> Value {
    call("GET", url, &[], Bytes::new()).await.json()
}

/// `lb`'s nodes as `/admin/nodes` shows them, sorted by id.
pub async fn admin_nodes(lb: &Proc) -> Vec<Value> {
    let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
    let mut list = nodes["nodes"].as_array().unwrap().clone();
    list.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    list
}

/// Each node's `running` engine load (the load its engine reports), as `lb`'s
/// `/admin/nodes` shows it: (id, running), sorted by id.
pub async fn engine_running(lb: &Proc) -> Vec<(String, Option<f64>)> {
    admin_nodes(lb)
        .await
        .iter()
        .map(|n| {
            let id = n["id"].as_str().unwrap().to_string();
            (id, n["engine_load"]["running"].as_f64())
        })
        .collect()
}

/// Waits up to `limit` for [`engine_running`] to read `want`; fails with what it read.
pub async fn until_engine_running(lb: &Proc, want: &[(String, Option<f64>)], limit: Duration) {
    let start = Instant::now();
    while engine_running(lb).await != want {
        assert!(
            start.elapsed() < limit,
            "{:?}, wanted {want:?}",
            engine_running(lb).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `program` (a server a suite starts, from Debian's `package`) is installed.
/// Outside CI a missing one prints a skip line for `suite`; under `CI=true` it fails.
pub fn installed(program: &str, package: &str, suite: &str) -> bool {
    if Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok()
    {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{program} is not installed (CI installs it: apt-get install -y {package})"
    );
    eprintln!(
        "SKIP: {program} not found on PATH; install it (apt-get install {package}) to run {suite}"
    );
    false
}

/// The value of a metric in a Prometheus text page (first series with that name).
pub async fn metric(url: &str, name: &str) -> f64 {
    let page = call("GET", url, &[], Bytes::new()).await.text();
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in {page}"))
}

/// The sum of a metric's series in a Prometheus text page (0 when it has none).
pub async fn sum_metric(url: &str, name: &str) -> f64 {
    let page = call("GET", url, &[], Bytes::new()).await.text();
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `prefixlb_client_connections` of one serving lane (lane 0: the shared runtime).
pub async fn client_connections(lb: &Proc, lane: usize) -> f64 {
    let name = format!("prefixlb_client_connections{{lane=\"{lane}\"}}");
    metric(&lb.admin_url("/metrics"), &name).await
}

/// `prefixlb_client_connections` summed over the serving lanes: the port's open
/// connections, whichever lane the kernel gave each.
pub async fn open_client_connections(lb: &Proc) -> f64 {
    let page = call("GET", &lb.admin_url("/metrics"), &[], Bytes::new())
        .await
        .text();
    page.lines()
        .filter(|l| l.starts_with("prefixlb_client_connections{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// In-flight count per node id from `/admin/nodes`.
pub async fn in_flight(lb: &Proc) -> Vec<(String, u64)> {
    let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
    nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["id"].as_str().unwrap().to_string(),
                n["in_flight"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Sends `n` short chats to `url` at once (`tag` and a number as their text) and
/// asserts that every one got a 200.
pub async fn chats_at_once(url: &str, n: usize, tag: &str) {
    let sends: Vec<_> = (0..n)
        .map(|i| {
            let (url, text) = (url.to_string(), format!("{tag} {i}"));
            tokio::spawn(async move {
                let body = chat(&[("user", &text)], false, 4);
                post_json(&url, &body, &[]).await.status
            })
        })
        .collect();
    for send in sends {
        assert_eq!(send.await.unwrap(), 200);
    }
}

/// Whether every node's in-flight count is back to 0 within `limit`.
pub async fn in_flight_settles(lb: &Proc, limit: Duration) -> bool {
    eventually(limit, || async {
        in_flight(lb).await.iter().all(|(_, n)| *n == 0)
    })
    .await
}

/// Polls `cond` until it holds or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// One engine behind a balancer whose only slot (`max_in_flight = 1`, requests
/// queue) is held by a long stream to `path` with `body`, its first chunk read: the
/// engine, the balancer and the stream.
pub async fn only_slot_held(path: &str, body: &Value) -> (Proc, Proc, hyper::Response<Incoming>) {
    let e = engine("e0", &["--decode-ms-per-token", "50"]);
    let lb = balancer(&config(
        &[&e],
        "",
        "max_in_flight = 1\nwhen_saturated = \"queue\"\nqueue_timeout = \"20s\"",
    ));
    let mut held = post_stream(&lb.url(path), body).await;
    assert_eq!(held.status(), 200);
    assert!(next_chunk(held.body_mut()).await.is_some());
    (e, lb, held)
}

/// A chat body.
pub fn chat(messages: &[(&str, &str)], stream: bool, max_tokens: u32) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    serde_json::json!({"model": "mock", "messages": messages, "stream": stream, "max_tokens": max_tokens})
}

/// Reads the next data frame of a streaming body.
pub async fn next_chunk(body: &mut Incoming) -> Option<Bytes> {
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("stream error").into_data() {
            return Some(data);
        }
    }
    None
}

/// A config over the engines (node ids n0, n1, …) with extra top-level sections
/// (e.g. `[breaker]`) and extra lines for the pool.
pub fn config_ext(engines: &[&Proc], sections: &str, pool_lines: &str) -> String {
    let nodes: Vec<String> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| {
            format!(
                "[[pools.nodes]]\nid = \"n{i}\"\nurl = \"http://{}\"\n",
                e.addr
            )
        })
        .collect();
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{sections}\n[[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n{pool_lines}\n{}",
        nodes.join("")
    )
}

/// Puts an engine into a fault mode.
pub async fn set_fault(engine: &Proc, mode: &str, ttft_ms: u64) {
    let reply = post_json(
        &engine.url("/mock/fault"),
        &serde_json::json!({"mode": mode, "ttft_ms": ttft_ms}),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

/// The successor order of a session key, from `/admin/explain`.
pub async fn walk_of(lb: &Proc, session: &str) -> Vec<String> {
    let body = serde_json::to_vec(&chat(&[("user", "x")], true, 1)).unwrap();
    let x = call(
        "POST",
        &lb.admin_url("/admin/explain"),
        &[("x-session-id", session)],
        body,
    )
    .await
    .json();
    x["successors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["node"].as_str().unwrap().to_string())
        .collect()
}

/// One node's entry of `/admin/nodes`.
pub async fn node_info(lb: &Proc, id: &str) -> Value {
    let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
    nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .cloned()
        .unwrap()
}

/// A streaming chat request with a session key; returns the reply (body read fully).
pub async fn stream_chat(lb: &Proc, session: &str, max_tokens: u32) -> Reply {
    post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hello")], true, max_tokens),
        &[("x-session-id", session)],
    )
    .await
}

/// A fake engine on a real socket that answers every connection with `script`: it
/// reads the request head (and a body of its content-length), then writes each
/// `(bytes, pause_after)` step. For engine misbehaviour `mock-engine` does not do.
pub async fn scripted_engine(script: Vec<(Vec<u8>, Duration)>) -> SocketAddr {
    scripted_engine_counting(script).await.0
}

/// [`scripted_engine`], also counting the answers cut short because the peer (the
/// balancer) closed the connection.
pub async fn scripted_engine_counting(
    script: Vec<(Vec<u8>, Duration)>,
) -> (SocketAddr, std::sync::Arc<AtomicUsize>) {
    let dropped = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = dropped.clone();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let script = std::sync::Arc::new(script);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let script = script.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                // The head, then the body it announces.
                let body_len = loop {
                    let Ok(n) = sock.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        break end + 4 + len;
                    }
                };
                while seen.len() < body_len {
                    let Ok(n) = sock.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                }
                for (bytes, pause) in script.iter() {
                    if sock.write_all(bytes).await.is_err() {
                        counter.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    tokio::time::sleep(*pause).await;
                }
            });
        }
    });
    (addr, dropped)
}

/// A config whose one pool `mock` has nodes at these addresses (ids n0, n1, …).
pub fn config_at(addrs: &[SocketAddr], sections: &str) -> String {
    let nodes: Vec<String> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("[[pools.nodes]]\nid = \"n{i}\"\nurl = \"http://{a}\"\n"))
        .collect();
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{sections}\n[[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n{}",
        nodes.join("")
    )
}

/// The breaker state of every node, from `/admin/nodes`.
pub async fn breaker_states(lb: &Proc) -> Vec<String> {
    let nodes = get_json(&lb.admin_url("/admin/nodes")).await;
    nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["state"].as_str().unwrap().to_string())
        .collect()
}
