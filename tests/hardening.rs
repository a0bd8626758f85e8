//! Correct on every path and safe on a public port (issue 9), end to end over real
//! sockets: body edits on the fallback path, the listener's limits, forwarded paths,
//! blame, API keys and admin auth, config bounds, and `explain` telling the truth.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FAST: [&str; 4] = ["--decode-ms-per-token", "0", "--prefill-us-per-token", "0"];

/// An address nothing listens on.
fn closed_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The data events of an SSE body, parsed (`[DONE]` as a string).
fn events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.to_string())))
        .collect()
}

async fn engine_requests(e: &Proc) -> f64 {
    metric(&e.url("/metrics"), "mock_engine_http_requests_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_request_falls_back_with_a_valid_body() {
    let mut flags = vec!["--model", "backup-model"];
    flags.extend_from_slice(&FAST);
    let backup = engine("backup", &flags);
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [[pools]]\nname = \"main\"\nmodels = [\"test-model\"]\nfallbacks = [\"backup\"]\n\
         nodes = [{{ id = \"down\", url = \"http://{}\" }}]\n\
         [[pools]]\nname = \"backup\"\nmodels = [\"backup-model\"]\n\
         nodes = [{{ id = \"b0\", url = \"http://{}\" }}]\n",
        closed_port(),
        backup.addr
    );
    let lb = balancer(&config);
    let url = lb.url("/v1/chat/completions");
    let messages = json!([{"role": "user", "content": "héllo \"quoted\" \\ tab\t 🎉"}]);
    // The issue's body (no stream_options), and the other shapes of stream_options.
    let variants = [
        (
            json!({"model": "test-model", "messages": messages, "stream": true, "max_tokens": 8}),
            false,
        ),
        (
            json!({"stream_options": {"include_usage": false}, "messages": messages, "model": "test-model", "stream": true, "max_tokens": 8}),
            false,
        ),
        (
            json!({"messages": messages, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 8, "model": "test-model"}),
            true,
        ),
    ];
    for (i, (body, asked_usage)) in variants.iter().enumerate() {
        let reply = post_json(&url, body, &[]).await;
        assert_eq!(reply.status, 200, "variant {i}: {}", reply.text());
        assert_eq!(reply.header("x-prefixlb-route"), "fallback:backup");
        let events = events(&reply.text());
        assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
        let chunks: Vec<&Value> = events.iter().filter(|e| e.is_object()).collect();
        // The engine parsed the body and echoes the model it read: the rewritten one.
        assert!(
            chunks.iter().all(|c| c["model"] == "backup-model"),
            "{events:?}"
        );
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text.split_whitespace().count(), 8, "{text:?}");
        let usage_chunks = chunks.iter().filter(|c| c["usage"].is_object()).count();
        assert_eq!(usage_chunks, usize::from(*asked_usage), "variant {i}");
    }
    assert_eq!(
        engine_requests(&backup).await,
        3.0,
        "each sent once, none retried"
    );
    // The balancer counted the engine's usage for all three.
    let prompt = metric(&lb.admin_url("/metrics"), "prefixlb_prompt_tokens_total").await;
    assert!(prompt > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_half_headers_neither_block_nor_linger() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "header_read_timeout = \"2s\"", ""));
    let mut stalled = Vec::new();
    for i in 0..1000 {
        let mut s = TcpStream::connect(lb.addr).await.unwrap();
        // Half an HTTP/1.1 head; half of an HTTP/2 preface (the protocol is still
        // unknown); or nothing at all.
        let half: &[u8] = match i % 3 {
            0 => b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\nContent-Ty",
            1 => b"PRI * HTTP/2.0\r\n",
            _ => b"",
        };
        s.write_all(half).await.unwrap();
        stalled.push(s);
    }
    // Still open before the timeout (the newest one: opening 1,000 can take a while
    // on a busy machine).
    let mut probe_buf = [0u8; 16];
    let newest = stalled.last_mut().unwrap();
    let early = tokio::time::timeout(Duration::from_millis(300), newest.read(&mut probe_buf)).await;
    assert!(early.is_err(), "closed before header_read_timeout");
    for i in 0..20 {
        let reply = post_json(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", &format!("question {i}"))], false, 2),
            &[],
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    // Each stalled connection is closed by the balancer after the header timeout.
    let mut reads = tokio::task::JoinSet::new();
    for mut s in stalled {
        reads.spawn(async move {
            let mut buf = [0u8; 512];
            // hyper may answer a half head with an error status before closing.
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return true,
                    Ok(_) => {}
                }
            }
        });
    }
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        let mut closed = 0;
        while let Some(Ok(true)) = reads.join_next().await {
            closed += 1;
        }
        closed
    })
    .await
    .unwrap_or(0);
    assert_eq!(closed, 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "header_read_timeout = \"1s\"", ""));
    let body = serde_json::to_vec(&chat(&[("user", "one")], false, 1)).unwrap();
    let mut s = raw_request(&lb, "", body.len()).await;
    s.write_all(&body).await.unwrap();
    assert_eq!(status_of(&mut s).await, Some(200));
    // The response was read; the connection stays open, idle, until the timeout.
    let idle = closed_after(&mut s).await;
    assert!(idle >= Duration::from_millis(500), "closed after {idle:?}");
}

/// How long until the balancer closes `s` (reading and dropping anything it sends);
/// fails if it stays open for 10 s.
async fn closed_after(s: &mut TcpStream) -> Duration {
    let started = Instant::now();
    let mut rest = [0u8; 4096];
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match s.read(&mut rest).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "an idle keep-alive connection stayed open");
    started.elapsed()
}

/// Reads one chunked response whole (until its last chunk); the time it took.
async fn read_chunked_response(s: &mut TcpStream) -> (String, Duration) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.ends_with(b"0\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(15), s.read(&mut buf))
            .await
            .expect("the response went on")
            .expect("the connection stayed open");
        assert!(
            n > 0,
            "closed mid-response: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

/// `header_read_timeout` bounds the wait for a request head, not a request: a stream
/// that runs for longer is relayed whole, and on its kept-alive connection the idle
/// wait for the next head runs from the end of the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_outlasting_the_head_timeout_is_whole_and_the_idle_wait_follows_it() {
    let e = engine("e0", &["--decode-ms-per-token", "100"]);
    let lb = balancer(&config(&[&e], "header_read_timeout = \"1s\"", ""));
    let body = serde_json::to_vec(&chat(&[("user", "a long answer")], true, 25)).unwrap();
    let mut s = raw_request(&lb, "", body.len()).await;
    s.write_all(&body).await.unwrap();
    let (text, took) = read_chunked_response(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(
        took >= Duration::from_secs(2),
        "25 tokens at 100 ms took {took:?}"
    );
    // Half the limit after the stream ended, the connection still takes a request.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = serde_json::to_vec(&chat(&[("user", "again")], true, 1)).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        second.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&second).await.unwrap();
    let (text, _) = read_chunked_response(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // Then, idle, it is closed about a limit later.
    let idle = closed_after(&mut s).await;
    assert!(idle >= Duration::from_millis(700), "closed after {idle:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_apis_we_serve_reach_the_engines() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "", "extra_paths = [\"/v1/moderations\"]"));
    for (method, path) in [
        ("POST", "/flush_cache"),
        ("POST", "/update_weights_from_disk"),
        ("GET", "/metrics"),
        ("GET", "/v1/chat/completions/../../metrics"),
        ("GET", "/v1/responses/../metrics"),
        ("GET", "/v1/responses/resp_1/../../metrics"),
        ("POST", "/v1/responses/resp_1/flush"),
        ("GET", "/v1/anything"),
        ("POST", "/v1/moderations/x"),
        ("DELETE", "/v1/models"),
    ] {
        let reply = call(method, &lb.url(path), &[], "{}").await;
        assert!(
            matches!(reply.status.as_u16(), 404 | 405),
            "{method} {path}: {}",
            reply.status
        );
        assert!(
            reply.json()["error"]["message"].is_string(),
            "OpenAI error format"
        );
    }
    assert_eq!(engine_requests(&e).await, 0.0, "nothing was forwarded");
    // A path listed in routing.extra_paths is forwarded.
    let reply = post_json(&lb.url("/v1/moderations"), &json!({"input": "q"}), &[]).await;
    assert_eq!(reply.header("x-prefixlb-node"), "n0");
    assert_eq!(engine_requests(&e).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_finish_with_no_content_are_answers() {
    let engines: Vec<Proc> = (0..2).map(|i| engine(&format!("e{i}"), &FAST)).collect();
    let lb = balancer(&config(&[&engines[0], &engines[1]], "", ""));
    for i in 0..50 {
        let body = chat(&[("user", &format!("say nothing {i}"))], true, 0);
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-prefixlb-attempts"), "1");
        let events = events(&reply.text());
        assert!(events
            .iter()
            .any(|e| e["choices"][0]["finish_reason"] == "length"));
        assert_eq!(events.last(), Some(&Value::String("[DONE]".into())));
    }
    assert_eq!(breaker_states(&lb).await, vec!["closed", "closed"]);
    let page = call("GET", &lb.admin_url("/metrics"), &[], "").await.text();
    assert!(page.contains("prefixlb_failovers_total{pool=\"mock\",reason=\"no_content\"} 0"));
    // A stream that ends with neither content nor finish_reason is still a failure.
    set_fault(&engines[0], "empty", 0).await;
    set_fault(&engines[1], "empty", 0).await;
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "x")], true, 4),
        &[],
    )
    .await;
    assert_eq!(reply.status, 502, "{}", reply.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_own_errors_open_no_breaker_and_are_not_retried() {
    let mut flags = vec!["--max-model-len", "64"];
    flags.extend_from_slice(&FAST);
    let engines: Vec<Proc> = (0..3).map(|i| engine(&format!("e{i}"), &flags)).collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let lb = balancer(&config(&refs, "", ""));
    let long = "far too long for the context window ".repeat(40);
    for i in 0..50 {
        let body = chat(&[("user", &format!("{i} {long}"))], i % 2 == 0, 8);
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        assert_eq!(reply.status, 400, "{}", reply.text());
        assert!(reply.text().contains("maximum context length"));
    }
    // An SSE error event with a 4xx code, inside a 200 stream (as SGLang sends).
    for e in &engines {
        set_fault(e, "client_error", 0).await;
    }
    for i in 0..50 {
        let body = chat(&[("user", &format!("short {i}"))], true, 8);
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-prefixlb-attempts"), "1");
        let events = events(&reply.text());
        let error = events.iter().find(|e| e.get("error").is_some());
        assert_eq!(
            error.map(|e| &e["error"]["code"]),
            Some(&json!(400)),
            "{events:?}"
        );
    }
    let mut sent = 0.0;
    for e in &engines {
        sent += engine_requests(e).await;
    }
    assert_eq!(sent, 100.0, "no request was retried");
    assert_eq!(breaker_states(&lb).await, vec!["closed"; 3]);
    let page = call("GET", &lb.admin_url("/metrics"), &[], "").await.text();
    let client_errors: f64 = page
        .lines()
        .filter(|l| {
            l.starts_with("prefixlb_requests_total{") && l.contains("outcome=\"client_error\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(client_errors, 100.0, "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_the_listener_and_stay_out_of_the_logs() {
    let e = engine("e0", &FAST);
    let dir = write_config("").parent().unwrap().to_path_buf();
    let keys = dir.join(format!("keys-{}.txt", std::process::id()));
    std::fs::write(&keys, "# fleet keys\nsk-file-key-6b1f\n\n").unwrap();
    let config = config_ext(
        &[&e],
        &format!(
            "[auth]\napi_keys_file = \"{}\"\napi_keys_env = \"PREFIXLB_TEST_KEYS\"\n",
            keys.display()
        ),
        "",
    );
    let (lb, log) = balancer_logged(
        &config,
        "prefixlb=debug,info",
        &[("PREFIXLB_TEST_KEYS", "sk-env-key-93c2, sk-env-key-2")],
    );
    let marker = "PROMPT-MARKER-5d0c1e";
    let body = chat(
        &[("user", &format!("{marker}: what is in my prompt?"))],
        true,
        2,
    );
    let url = lb.url("/v1/chat/completions");
    let none = post_json(&url, &body, &[]).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.json()["error"]["code"], "invalid_api_key");
    let wrong = post_json(&url, &body, &[("authorization", "Bearer sk-file-key-6b1e")]).await;
    assert_eq!(wrong.status, 401);
    for key in ["sk-file-key-6b1f", "sk-env-key-93c2"] {
        let bearer = format!("Bearer {key}");
        let right = post_json(&url, &body, &[("authorization", &bearer)]).await;
        assert_eq!(right.status, 200, "{}", right.text());
    }
    let models = call("GET", &lb.url("/v1/models"), &[], "").await;
    assert_eq!(models.status, 401);
    assert_eq!(call("GET", &lb.url("/health"), &[], "").await.status, 200);
    // An unknown model is echoed clipped, never whole.
    let huge_model = format!("m{}", "x".repeat(5000));
    let mut unknown = chat(&[("user", "hi")], false, 1);
    unknown["model"] = json!(huge_model);
    let reply = post_json(&url, &unknown, &[("authorization", "Bearer sk-env-key-2")]).await;
    assert_eq!(reply.status, 404);
    assert!(reply.text().len() < 1200, "{}", reply.text().len());
    drop(lb);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("request"),
        "the log has request lines: {text}"
    );
    for secret in [
        "sk-file-key-6b1f",
        "sk-env-key-93c2",
        "sk-file-key-6b1e",
        marker,
    ] {
        assert!(!text.contains(secret), "{secret} reached the log");
    }
    assert!(
        !text.contains(&"x".repeat(300)),
        "a long model name reached the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_all_but_the_probes() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "admin_token = \"adm-7c1\"", ""));
    for path in ["/healthz", "/readyz"] {
        assert_eq!(call("GET", &lb.admin_url(path), &[], "").await.status, 200);
    }
    for path in ["/metrics", "/admin/nodes"] {
        let reply = call("GET", &lb.admin_url(path), &[], "").await;
        assert_eq!(reply.status, 401, "{path}");
        let wrong = call(
            "GET",
            &lb.admin_url(path),
            &[("authorization", "Bearer adm-7c2")],
            "",
        )
        .await;
        assert_eq!(wrong.status, 401, "{path}");
        let right = call(
            "GET",
            &lb.admin_url(path),
            &[("authorization", "Bearer adm-7c1")],
            "",
        )
        .await;
        assert_eq!(right.status, 200, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_duration_is_a_located_error_on_check_and_on_reload() {
    let good = "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nrequest_timeout = \"60s\"\n";
    let e = engine("e0", &FAST);
    let pool = format!(
        "[[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\nnodes = [{{ id = \"n0\", url = \"http://{}\" }}]\n",
        e.addr
    );
    let path = write_config(&format!("{good}{pool}"));
    let lb = balancer_from_file(&path);
    let bad = good.replace("\"60s\"", "\"99999999999999999999999999s\"");
    std::fs::write(&path, format!("{bad}{pool}")).unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!("{}:4:19: ", path.display())),
        "{err}"
    );
    assert!(err.contains("longer than the limit"), "{err}");
    for huge in [
        "max_attempts = 4000000000",
        "max_in_flight = 4294967295",
        "max_queue = 99999999999",
    ] {
        std::fs::write(&path, format!("{good}[routing]\n{huge}\n{pool}")).unwrap();
        let out = std::process::Command::new(BIN)
            .args(["check", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{huge}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(":6:"),
            "{huge}"
        );
    }
    // The running balancer rejects the same edit and keeps serving.
    std::fs::write(&path, format!("{bad}{pool}")).unwrap();
    let reload = call("POST", &lb.admin_url("/admin/reload"), &[], "").await;
    assert_eq!(reload.status, 400);
    assert!(reload.text().contains(":4:19"), "{}", reload.text());
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "still there?")], false, 2),
        &[],
    )
    .await;
    assert_eq!(reply.status, 200);
}

/// Writes a raw HTTP/1.1 request head.
async fn raw_request(lb: &Proc, extra_headers: &str, body_len: usize) -> TcpStream {
    let mut s = TcpStream::connect(lb.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\ncontent-length: {body_len}\r\n{extra_headers}\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s
}

/// Reads until the status line is in, or the connection ends.
async fn status_of(s: &mut TcpStream) -> Option<u16> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(15), s.read(&mut buf))
            .await
            .ok()?
            .ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
        if let Some(line) = String::from_utf8_lossy(&got).lines().next() {
            if line.len() >= 12 {
                return line.get(9..12)?.parse().ok();
            }
        }
    }
}

/// The default `max_headers` (100, which the listener leaves to hyper's own default
/// rather than setting) still holds: 99 fields are served, 100 get a 431 (as with
/// any limit hyper is given: the parser needs one slot to spare).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_header_limit_is_one_hundred_fields() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "", ""));
    let body = chat(&[("user", "hello")], false, 1).to_string();
    // raw_request writes three fields of its own.
    let fields = |n: usize| -> String { (0..n).map(|i| format!("x-h{i}: v\r\n")).collect() };
    let mut s = raw_request(&lb, &fields(96), body.len()).await;
    s.write_all(body.as_bytes()).await.unwrap();
    assert_eq!(status_of(&mut s).await, Some(200));
    let mut s = raw_request(&lb, &fields(97), body.len()).await;
    s.write_all(body.as_bytes()).await.unwrap();
    assert_eq!(status_of(&mut s).await, Some(431));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_and_bodies_are_bounded() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(
        &[&e],
        "body_read_timeout = \"1s\"\nmax_headers = 20\nmax_header_bytes = 16384\nmax_body_bytes = 65536\nmax_buffered_bytes = 100000",
        "",
    ));
    // Too many header fields, or too many header bytes: 431.
    let many: String = (0..50).map(|i| format!("x-h{i}: v\r\n")).collect();
    let mut s = raw_request(&lb, &many, 0).await;
    assert_eq!(status_of(&mut s).await, Some(431));
    let big = format!("x-big: {}\r\n", "v".repeat(40_000));
    let mut s = raw_request(&lb, &big, 0).await;
    assert!(matches!(status_of(&mut s).await, Some(431) | None));
    // A body that stops arriving: 408 after body_read_timeout.
    let mut slow = raw_request(&lb, "", 1000).await;
    slow.write_all(b"{\"messages\": [").await.unwrap();
    let started = Instant::now();
    assert_eq!(status_of(&mut slow).await, Some(408));
    assert!(started.elapsed() >= Duration::from_millis(900));
    // Buffered bytes across connections: a held 60 KB upload leaves no room for 50 KB.
    let mut held = raw_request(&lb, "", 60_000).await;
    held.write_all(&[b' '; 1000]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pad = "p".repeat(50_000);
    let body = chat(&[("user", &pad)], false, 1);
    let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert_eq!(reply.header("retry-after"), "1");
    assert_eq!(reply.json()["error"]["code"], "buffer_full");
    drop(held);
    let served = eventually(Duration::from_secs(5), || async {
        post_json(&lb.url("/v1/chat/completions"), &body, &[])
            .await
            .status
            == 200
    })
    .await;
    assert!(
        served,
        "the budget came back when the held upload went away"
    );
}

/// `max_connections` caps the port's open connections, with four lanes (more lanes than
/// slots: a lane must not hold a slot while the kernel queues a client on another
/// lane's listener) and with the shared runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_for_a_free_slot() {
    let e = engine("e0", &FAST);
    for lanes in ["lanes = 4", "lanes = 0"] {
        let lb = balancer(&config(
            &[&e],
            &format!("max_connections = 2\nheader_read_timeout = \"30s\"\n{lanes}"),
            "",
        ));
        let idle: Vec<TcpStream> = vec![
            TcpStream::connect(lb.addr).await.unwrap(),
            TcpStream::connect(lb.addr).await.unwrap(),
        ];
        // The two are counted as open (on whichever lanes); the waiting third is not.
        let open = || open_client_connections(&lb);
        let counted = eventually(Duration::from_secs(5), || async { open().await == 2.0 }).await;
        assert!(
            counted,
            "{lanes}: {} open connections counted",
            open().await
        );
        let url = lb.url("/v1/chat/completions");
        let waiting = tokio::spawn(async move {
            post_json(&url, &chat(&[("user", "let me in")], false, 1), &[]).await
        });
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            !waiting.is_finished(),
            "{lanes}: a third connection was served at the cap"
        );
        assert_eq!(
            open().await,
            2.0,
            "{lanes}: the waiting third is not counted"
        );
        drop(idle);
        let reply = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("served once a slot freed")
            .unwrap();
        assert_eq!(reply.status, 200);
        let closed = eventually(Duration::from_secs(5), || async { open().await == 0.0 }).await;
        assert!(closed, "{lanes}: {} open connections counted", open().await);
    }
}

/// An engine that streams fast: 32 KB events, far more than socket buffers or an
/// HTTP/2 window hold, then stays open a minute; it counts the connections dropped.
async fn flooding_engine() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let event = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
        "x".repeat(32 * 1024)
    );
    let mut script = vec![(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec(),
        Duration::ZERO,
    )];
    for _ in 0..2000 {
        script.push((
            format!("{:x}\r\n{event}\r\n", event.len()).into_bytes(),
            Duration::ZERO,
        ));
    }
    script.push((Vec::new(), Duration::from_secs(60)));
    scripted_engine_counting(script).await
}

/// Asserts that `lb`'s slots all come free and the flooding engine's connection is
/// dropped, after `who` stopped taking the answer.
async fn freed_and_dropped(lb: &Proc, dropped: &std::sync::atomic::AtomicUsize, who: &str) {
    let freed = eventually(Duration::from_secs(15), || async {
        in_flight(lb).await.iter().all(|(_, n)| *n == 0)
    })
    .await;
    assert!(freed, "the slot stayed held by {who}");
    let aborted = eventually(Duration::from_secs(5), || async {
        dropped.load(std::sync::atomic::Ordering::Relaxed) >= 1
    })
    .await;
    assert!(aborted, "the engine's connection was not dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_releases_the_slot() {
    let (engine, dropped) = flooding_engine().await;
    let lb = balancer(&config_at(&[engine], "idle_stream_timeout = \"1s\""));
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut s = socket.connect(lb.addr).await.unwrap();
    let body = serde_json::to_vec(&chat(
        &[("user", "a very long answer please")],
        true,
        100_000,
    ))
    .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body).await.unwrap();
    let mut first = [0u8; 64];
    s.read_exact(&mut first).await.unwrap();
    assert!(first.starts_with(b"HTTP/1.1 200"));
    // Stop reading, keep the socket open.
    freed_and_dropped(&lb, &dropped, "a client that stopped reading").await;
    drop(s);
}

/// HTTP/2's flow control: a client that keeps its connection alive (it answers pings)
/// but never opens its stream's window takes no more of the answer, and hyper stops
/// asking the balancer for it. After `idle_stream_timeout` the engine's stream is
/// dropped and the slot freed; the client's stream is reset when it reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_never_opens_its_window_releases_the_slot() {
    use http_body_util::BodyExt;
    let (engine, dropped) = flooding_engine().await;
    let lb = balancer(&config_at(&[engine], "idle_stream_timeout = \"1s\""));
    let io = hyper_util::rt::TokioIo::new(TcpStream::connect(lb.addr).await.unwrap());
    let (mut sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(1024)
            .handshake(io)
            .await
            .unwrap();
    // The connection keeps running (and answering the balancer's pings) throughout.
    let conn = tokio::spawn(conn);
    let body = serde_json::to_vec(&chat(
        &[("user", "a very long answer please")],
        true,
        100_000,
    ))
    .unwrap();
    let req = http::Request::post(lb.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    // Read nothing: the stream's window stays at 1 KB.
    freed_and_dropped(&lb, &dropped, "a stream whose window never opened").await;
    assert!(!conn.is_finished(), "the connection itself stays open");
    // Reading again, the client finds its stream ended in an error, not cut silently.
    let read = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await
        .expect("the stream ends once read");
    assert!(read.is_err(), "a stalled stream ended as if complete");
}

/// The HTTP/2 limit is on a shut window, not on a slow answer: a stream whose engine
/// takes longer than `idle_stream_timeout` in all, but never that long between two
/// tokens, reaches its end over HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_longer_than_the_limit_is_not_cut() {
    use http_body_util::BodyExt;
    let e = engine("slow", &["--decode-ms-per-token", "300"]);
    let lb = balancer(&config_at(&[e.addr], "idle_stream_timeout = \"1s\""));
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let body = serde_json::to_vec(&chat(&[("user", "slowly")], true, 8)).unwrap();
    let req = http::Request::post(lb.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let started = Instant::now();
    let resp = h2.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let text = resp
        .into_body()
        .collect()
        .await
        .expect("the stream ends whole");
    let text = String::from_utf8(text.to_bytes().to_vec()).unwrap();
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "the engine was not slow"
    );
    assert_eq!(events(&text).last(), Some(&Value::String("[DONE]".into())));
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

/// A plain answer is held before it commits, up to its first MiB: one that stalls there
/// for `idle_stream_timeout` is a failure (a 504 here, with no other node), not a cut
/// answer; one that stalls past its first MiB, committed already, is cut. Both blame
/// the node and free its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_body_that_stalls_fails_before_commit_and_is_cut_after() {
    let head = |len: usize| {
        format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n{{\"id\":")
            .into_bytes()
    };
    let early = scripted_engine(vec![(head(100), Duration::from_secs(60))]).await;
    let mut late = head(3 << 20);
    late.extend(std::iter::repeat_n(b' ', 3 << 19));
    let late = scripted_engine(vec![(late, Duration::from_secs(60))]).await;
    for (engine, committed) in [(early, false), (late, true)] {
        let lb = balancer(&config_at(
            &[engine],
            "idle_stream_timeout = \"1s\"\n[breaker]\nfailure_threshold = 1",
        ));
        let started = Instant::now();
        let resp = post_stream(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", "x")], false, 2),
        )
        .await;
        let status = resp.status();
        let body = http_body_util::BodyExt::collect(resp.into_body()).await;
        if committed {
            assert_eq!(status, 200);
            assert!(
                body.is_err(),
                "the cut body must fail, not end short and clean"
            );
        } else {
            // The last (only) attempt timed out.
            assert_eq!(status, 504);
            let text = String::from_utf8_lossy(&body.unwrap().to_bytes()).into_owned();
            assert!(text.contains("stalled"), "{text}");
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(in_flight(&lb).await.iter().all(|(_, n)| *n == 0));
        assert_eq!(breaker_states(&lb).await, vec!["open"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_of_nothing_before_the_first_token_is_a_failure() {
    let mut script = vec![(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec(),
        Duration::ZERO,
    )];
    let comments = ": padding padding padding padding padding padding\n\n".repeat(1000);
    for _ in 0..30 {
        let chunk = format!("{:x}\r\n{comments}\r\n", comments.len());
        script.push((chunk.into_bytes(), Duration::ZERO));
    }
    script.push((Vec::new(), Duration::from_secs(60)));
    let chatty = scripted_engine(script).await;
    let good = engine("good", &FAST);
    let lb = balancer(&config_at(&[chatty, good.addr], ""));
    // Route to the chatty node first: find a session key whose primary is n0.
    let mut session = String::new();
    for i in 0..100 {
        session = format!("s{i}");
        if walk_of(&lb, &session).await[0] == "n0" {
            break;
        }
    }
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hello")], true, 3),
        &[("x-session-id", &session)],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-node"), "n1");
    assert_eq!(reply.header("x-prefixlb-attempts"), "2");
    assert!(
        !reply.text().contains("padding"),
        "nothing of n0 reached the client"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_the_node_the_next_request_gets() {
    let engines: Vec<Proc> = (0..3)
        .map(|i| engine(&format!("e{i}"), &["--decode-ms-per-token", "50"]))
        .collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let lb = balancer(&config(
        &refs,
        "",
        "max_in_flight = 1\nwhen_saturated = \"reject\"",
    ));
    let order = walk_of(&lb, "k").await;
    let explain = || async {
        let body = serde_json::to_vec(&chat(&[("user", "x")], false, 1)).unwrap();
        call(
            "POST",
            &lb.admin_url("/admin/explain"),
            &[("x-session-id", "k")],
            body,
        )
        .await
        .json()
    };
    let next = || async {
        post_json(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", "x")], false, 1),
            &[("x-session-id", "k")],
        )
        .await
    };
    let x = explain().await;
    assert_eq!(
        (x["choice"].as_str(), x["route"].as_str()),
        (Some(order[0].as_str()), Some("primary"))
    );
    assert_eq!(next().await.header("x-prefixlb-node"), order[0]);
    // Draining the primary: the second node.
    call(
        "POST",
        &lb.admin_url(&format!("/admin/nodes/{}/drain", order[0])),
        &[],
        "",
    )
    .await;
    let x = explain().await;
    assert_eq!(
        (x["choice"].as_str(), x["route"].as_str()),
        (Some(order[1].as_str()), Some("spill:1"))
    );
    assert_eq!(next().await.header("x-prefixlb-node"), order[1]);
    // The second at its cap (a long stream of the key holds its one slot): the third.
    let mut held = send(
        "POST",
        &lb.url("/v1/chat/completions"),
        &[("content-type", "application/json"), ("x-session-id", "k")],
        serde_json::to_vec(&chat(&[("user", "x")], true, 200)).unwrap(),
    )
    .await;
    assert_eq!(held.headers()["x-prefixlb-node"], order[1].as_str());
    let _ = next_chunk(held.body_mut()).await;
    let x = explain().await;
    assert_eq!(
        (x["choice"].as_str(), x["route"].as_str()),
        (Some(order[2].as_str()), Some("spill:2"))
    );
    assert_eq!(next().await.header("x-prefixlb-node"), order[2]);
    // An open breaker on the third: nothing left, and explain says so. (Two requests
    // that differ: the same one retried would be blamed once.) With no other engine
    // to ask, the client reads the engine's own 500.
    set_fault(&engines[node_index(&order[2])], "error", 0).await;
    for question in ["x", "y"] {
        let r = post_json(
            &lb.url("/v1/chat/completions"),
            &chat(&[("user", question)], false, 1),
            &[("x-session-id", "k")],
        )
        .await;
        assert_eq!(r.status, 500, "{}", r.text());
        assert!(r.text().contains("injected fault"), "{}", r.text());
    }
    let x = explain().await;
    assert_eq!(x["choice"], Value::Null, "{x}");
    assert_eq!(x["route"], "saturated", "{x}");
    assert_eq!(next().await.status, 503);
    drop(held);
}

fn node_index(id: &str) -> usize {
    id.trim_start_matches('n').parse().unwrap()
}

/// The engine-side HTTP/1.1 path reads every framing a server may use (RFC 9112 §6.3),
/// not only the two `mock-engine` sends: each answer reaches the client whole, and a
/// head that is not HTTP is a clear 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_framing_an_engine_may_use_is_relayed_whole() {
    let json = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"whole"}}]}"#;
    let plain = |head: &str| format!("{head}\r\n\r\n{json}").into_bytes();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "interim 103 then content-length",
            format!(
                "HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n\
                 HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{json}",
                json.len()
            )
            .into_bytes(),
        ),
        (
            "HTTP/1.0, read until close",
            plain("HTTP/1.0 200 OK\r\ncontent-type: application/json"),
        ),
        (
            "connection: close, read until close",
            plain("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close"),
        ),
        (
            "chunked with extensions and trailers",
            {
                let (a, b) = json.split_at(20);
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
                     {:x};name=value\r\n{a}\r\n{:X}\r\n{b}\r\n0\r\nx-checksum: 1\r\n\r\n",
                    a.len(),
                    b.len()
                )
                .into_bytes()
            },
        ),
    ];
    for (case, answer) in cases {
        let (lb, reply) = through_engine_answering(answer).await;
        assert_eq!(reply.status, 200, "{case}: {}", reply.text());
        assert_eq!(reply.text(), json, "{case}");
        assert!(in_flight(&lb).await.iter().all(|(_, n)| *n == 0), "{case}");
    }
    let (_lb, reply) = through_engine_answering(b"SSH-2.0-OpenSSH_9.6\r\n".to_vec()).await;
    assert_eq!(reply.status, 502, "{}", reply.text());
    assert!(
        reply.text().contains("malformed response head"),
        "{}",
        reply.text()
    );
}

/// A balancer in front of one engine that answers `answer`, and its reply to a chat.
async fn through_engine_answering(answer: Vec<u8>) -> (Proc, Reply) {
    let engine = scripted_engine(vec![(answer, Duration::ZERO)]).await;
    let lb = balancer(&config_at(&[engine], ""));
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "x")], false, 2),
        &[],
    )
    .await;
    (lb, reply)
}
