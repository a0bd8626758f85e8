//! The client-side HTTP/1.1 server under attack, over real sockets: raw request bytes
//! to a real balancer in front of a `mock-engine`. Hostile heads (a body framed two
//! ways, lengths that disagree, codings that hide the body's end, folded lines, an
//! overflowing chunk size) each carry a second, smuggled request after the first's
//! body as a front proxy would have read it; the case asserts the one answer the
//! client got, that it said `connection: close` and the connection closed after it,
//! and that the engine saw no request at all. Valid framings (chunked bodies, pipelining, `Expect:
//! 100-continue`, HTTP/1.0, bodies that trickle in, bodies nobody reads) are served
//! whole and keep the connection. The heads alone are in `src/server/h1/tests.rs`.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FAST: [&str; 2] = ["--decode-ms-per-token", "0"];

async fn engine_requests(e: &Proc) -> f64 {
    metric(&e.url("/metrics"), "mock_engine_http_requests_total").await
}

fn chat_body(text: &str) -> String {
    chat(&[("user", text)], false, 2).to_string()
}

/// A complete request for `path` with this body.
fn request(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Everything the balancer sends until it closes the connection (or 5 s pass).
async fn read_to_close(s: &mut TcpStream) -> (String, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    (String::from_utf8_lossy(&got).into_owned(), closed)
}

/// Reads `n` whole responses (each framed by its content-length or chunked end).
async fn read_responses(s: &mut TcpStream, n: usize) -> Vec<(u16, String)> {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let parsed = split_responses(&got);
        if parsed.len() >= n {
            return parsed;
        }
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("responses within 5 s")
            .unwrap();
        assert!(read > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..read]);
    }
}

/// The whole responses at the front of `bytes`: status and body.
fn split_responses(mut bytes: &[u8]) -> Vec<(u16, String)> {
    let mut out = Vec::new();
    loop {
        let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
            return out;
        };
        let head = String::from_utf8_lossy(&bytes[..end]).to_ascii_lowercase();
        let status: u16 = head[9..12].parse().unwrap();
        let rest = &bytes[end + 4..];
        if status == 100 {
            bytes = rest;
            continue;
        }
        let len: Option<usize> = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap());
        let (body, used) = match len {
            Some(len) if rest.len() >= len => (rest[..len].to_vec(), len),
            Some(_) => return out,
            None => match rest.windows(5).position(|w| w == b"0\r\n\r\n") {
                Some(at) => (rest[..at].to_vec(), at + 5),
                None => return out,
            },
        };
        out.push((status, String::from_utf8_lossy(&body).into_owned()));
        bytes = &rest[used..];
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_shaped_heads_get_one_refusal_and_nothing_reaches_the_engine() {
    let e = engine("e0", &FAST);
    let (lb, log) = balancer_logged(&config(&[&e], "", ""), "info", &[]);
    let smuggled = request("/v1/chat/completions", &chat_body("smuggled"));
    let post =
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\n";
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "CL.TE",
            format!("{post}content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"),
            400,
        ),
        (
            "TE.CL",
            format!("{post}transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n"),
            400,
        ),
        (
            "two lengths",
            format!("{post}content-length: 0\r\ncontent-length: 5\r\n\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a list of lengths",
            format!("{post}content-length: 0, 5\r\n\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a signed length",
            format!("{post}content-length: +0\r\n\r\n"),
            400,
        ),
        (
            "chunked hidden behind a coding",
            format!("{post}transfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n"),
            400,
        ),
        (
            "a coding before chunked",
            format!("{post}transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
            501,
        ),
        (
            "chunked twice",
            format!(
                "{post}transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
            ),
            400,
        ),
        (
            "obs-fold",
            format!("{post}x-a: b\r\n transfer-encoding: chunked\r\ncontent-length: 0\r\n\r\n"),
            400,
        ),
        (
            "a space before the colon",
            format!("{post}transfer-encoding : chunked\r\ncontent-length: 0\r\n\r\n"),
            400,
        ),
        (
            "chunked in HTTP/1.0",
            "POST /v1/chat/completions HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                .to_string(),
            400,
        ),
        (
            "a chunk size past u64",
            format!("{post}transfer-encoding: chunked\r\n\r\n10000000000000000\r\n"),
            400,
        ),
        (
            "a chunk size that is not hex",
            format!("{post}transfer-encoding: chunked\r\n\r\nzz\r\n"),
            400,
        ),
    ];
    let mut wrong = Vec::new();
    for (name, head, status) in &cases {
        let mut s = TcpStream::connect(lb.addr).await.unwrap();
        s.write_all(format!("{head}{smuggled}").as_bytes())
            .await
            .unwrap();
        let (text, closed) = read_to_close(&mut s).await;
        let statuses: Vec<&str> = text
            .match_indices("HTTP/1.1 ")
            .map(|(at, _)| &text[at + 9..at + 12])
            .collect();
        let said_close = text.contains("\r\nconnection: close\r\n");
        if statuses != [status.to_string().as_str()] || !closed || !said_close {
            wrong.push(format!(
                "{name}: statuses {statuses:?}, closed {closed}: {text:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Bytes that are not HTTP (a TLS ClientHello on the plain port), with no line end:
    // refused at once, not at the 10 s head timeout.
    let mut s = TcpStream::connect(lb.addr).await.unwrap();
    s.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        .await
        .unwrap();
    let (text, closed) = read_to_close(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 400 ") && closed, "{text:?}");
    assert_eq!(
        engine_requests(&e).await,
        0.0,
        "a request reached the engine"
    );
    assert_eq!(in_flight(&lb).await[0].1, 0);
    // Each refusal is in the log with its status: a head's by the connection, a
    // chunked body's by the proxy.
    let refused = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("request head refused") || l.contains("request refused"))
            .filter(|l| l.contains(" status="))
            .count()
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            refused() == cases.len() + 1
        })
        .await,
        "{} refusal lines for {} refusals",
        refused(),
        cases.len() + 1
    );
    // And each is counted, with pool and node `none`: the 501 as an error, the rest
    // (400s) as the client's.
    let metrics = lb.admin_url("/metrics");
    let counted = |outcome: &str| {
        let name =
            format!("prefixlb_requests_total{{node=\"none\",outcome=\"{outcome}\",pool=\"none\"}}");
        let metrics = metrics.clone();
        async move { metric(&metrics, &name).await }
    };
    let fives = cases.iter().filter(|c| c.2 == 501).count() as f64;
    assert_eq!(counted("error").await, fives);
    assert_eq!(
        counted("client_error").await,
        (cases.len() + 1) as f64 - fives
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_trickled_pipelined_and_unread_bodies_are_served_and_keep_the_connection() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "", ""));
    let mut s = TcpStream::connect(lb.addr).await.unwrap();

    // A chunked body, with an extension and a trailer, in uneven chunks.
    let body = chat_body("chunked");
    let (a, b) = body.split_at(7);
    let chunked = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x};ext=1\r\n{a}\r\n{:X}\r\n{b}\r\n0\r\nx-trailer: t\r\n\r\n",
        a.len(),
        b.len()
    );
    s.write_all(chunked.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].0, 200, "{}", got[0].1);
    assert!(got[0].1.contains("chat.completion"), "{}", got[0].1);

    // A body that arrives in pieces, a while apart.
    let body = chat_body("trickled");
    let whole = request("/v1/chat/completions", &body);
    let (head, rest) = whole.split_at(whole.len() - body.len() + 5);
    s.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    s.write_all(rest.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].0, 200, "{}", got[0].1);

    // A head sent three bytes at a time.
    let whole = request("/v1/chat/completions", &chat_body("in pieces"));
    for piece in whole.as_bytes().chunks(3) {
        s.write_all(piece).await.unwrap();
        s.flush().await.unwrap();
    }
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].0, 200, "{}", got[0].1);

    // A body nobody reads (an unknown path), then a request on the same connection.
    let pad = "x".repeat(20_000);
    let two = format!(
        "{}{}",
        request("/v1/unknown", &pad),
        request("/v1/chat/completions", &chat_body("after"))
    );
    s.write_all(two.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 2).await;
    assert_eq!(got[0].0, 404, "{}", got[0].1);
    assert_eq!(got[1].0, 200, "{}", got[1].1);

    // Three pipelined in one write, answered in order.
    let three: String = (0..3)
        .map(|i| {
            request(
                "/v1/chat/completions",
                &chat_body(&format!("pipelined {i}")),
            )
        })
        .collect();
    s.write_all(three.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 3).await;
    assert!(got.iter().all(|(status, _)| *status == 200), "{got:?}");
    assert_eq!(engine_requests(&e).await, 7.0);
    assert_eq!(in_flight(&lb).await[0].1, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_continue_waits_for_the_go_ahead_and_http_1_0_closes_unless_kept() {
    let e = engine("e0", &FAST);
    let lb = balancer(&config(&[&e], "", ""));

    let body = chat_body("expecting");
    let mut s = TcpStream::connect(lb.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut interim = [0u8; 25];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut interim))
        .await
        .expect("a 100 Continue before the body")
        .unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(body.as_bytes()).await.unwrap();
    let got = read_responses(&mut s, 1).await;
    assert_eq!(got[0].0, 200, "{}", got[0].1);

    // HTTP/1.0: answered, then closed.
    let mut s = TcpStream::connect(lb.addr).await.unwrap();
    let old =
        request("/v1/chat/completions", &chat_body("old")).replacen("HTTP/1.1", "HTTP/1.0", 1);
    s.write_all(old.as_bytes()).await.unwrap();
    let (text, closed) = read_to_close(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("connection: close\r\n"), "{text}");
    assert!(closed);

    // HTTP/1.0 with keep-alive: the connection carries a second request.
    let kept = old.replacen("host: lb\r\n", "host: lb\r\nconnection: keep-alive\r\n", 1);
    let mut s = TcpStream::connect(lb.addr).await.unwrap();
    s.write_all(format!("{kept}{kept}").as_bytes())
        .await
        .unwrap();
    let got = read_responses(&mut s, 2).await;
    assert_eq!((got[0].0, got[1].0), (200, 200));
}
