//! HTTPS on the client port (`server.tls_cert_file`, `server.tls_key_file`,
//! `server.tls_client_ca_file`), over real sockets: a rustls client against a balancer
//! serving a certificate made at test time, in front of a mock engine. HTTP/1.1 and
//! HTTP/2 are chosen by ALPN; a body sent in pieces after its head arrives whole; plain
//! HTTP on the port is told to use HTTPS; a renewed certificate is served from the next
//! handshake while open connections go on; a client that never says hello is closed;
//! with a clients' CA only clients showing a certificate it signed are served; `check`
//! reports HTTPS and refuses a certificate without its key, or with another's.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::tls::{make_pki, make_pki_until, Pki};
use common::*;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

const FAST: [&str; 4] = ["--decode-ms-per-token", "1", "--prefill-us-per-token", "0"];

/// A balancer serving HTTPS with `pki`'s `localhost` certificate in front of `e`.
fn https_balancer(pki: &Pki, e: &Proc, server: &str) -> Proc {
    let lines = format!(
        "{server}\ntls_cert_file = {:?}\ntls_key_file = {:?}",
        pki.path("engine.pem"),
        pki.path("engine-key.pem")
    );
    balancer(&config(&[e], &lines, ""))
}

fn pem_certs(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A TLS connection to `addr` as `localhost`, trusting the CAs in `cas`, offering
/// `alpn`.
async fn connect(addr: SocketAddr, cas: &[PathBuf], alpn: &[&[u8]]) -> TlsStream<TcpStream> {
    handshake(addr, cas, alpn).await.unwrap()
}

/// [`connect`], whose handshake may fail.
async fn try_connect(addr: SocketAddr, cas: &[PathBuf]) -> std::io::Result<TlsStream<TcpStream>> {
    handshake(addr, cas, &[]).await
}

async fn handshake(
    addr: SocketAddr,
    cas: &[PathBuf],
    alpn: &[&[u8]],
) -> std::io::Result<TlsStream<TcpStream>> {
    handshake_as(addr, cas, alpn, None).await
}

/// A handshake showing the client certificate and key of `identity`, if any.
async fn handshake_as(
    addr: SocketAddr,
    cas: &[PathBuf],
    alpn: &[&[u8]],
    identity: Option<(&Path, &Path)>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        for c in pem_certs(ca) {
            roots.add(c).unwrap();
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => {
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key).unwrap();
            config.with_client_auth_cert(pem_certs(cert), key).unwrap()
        }
        None => config.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
}

/// The certificate the server showed on `tls`.
fn shown(tls: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    tls.get_ref().1.peer_certificates().unwrap()[0]
        .clone()
        .into_owned()
}

fn post(path: &str, body: &Value) -> hyper::Request<Full<Bytes>> {
    hyper::Request::post(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// Sends `req` on an HTTP/1.1 connection; the status, the version and the body.
async fn over_http1(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    req: hyper::Request<Full<Bytes>>,
) -> (u16, hyper::Version, String) {
    let res = sender.send_request(req).await.unwrap();
    let (status, version) = (res.status().as_u16(), res.version());
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, version, String::from_utf8_lossy(&body).into_owned())
}

async fn http1(tls: TlsStream<TcpStream>) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

#[tokio::test]
async fn https_serves_http1_and_http2_as_the_client_chooses_by_alpn() {
    let pki = make_pki("alpn");
    let e = engine("e0", &FAST);
    let lb = https_balancer(&pki, &e, "");
    let ca = [pki.path("ca.pem")];
    let chat_body = chat(&[("user", "hello over tls")], false, 3);
    let stream_body = chat(&[("user", "hello over tls")], true, 3);

    // HTTP/1.1 (ALPN http/1.1), one connection for both requests.
    let tls = connect(lb.addr, &ca, &[b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let mut h1 = http1(tls).await;
    let (status, version, text) =
        over_http1(&mut h1, post("/v1/chat/completions", &chat_body)).await;
    assert_eq!((status, version), (200, hyper::Version::HTTP_11), "{text}");
    assert!(text.contains("chat.completion"), "{text}");
    let (status, _, text) = over_http1(&mut h1, post("/v1/chat/completions", &stream_body)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text.matches("\"content\"").count(), 4, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    // HTTP/2 (ALPN h2, as curl and browsers offer it first): no preface sniffing needed.
    let tls = connect(lb.addr, &ca, &[b"h2", b"http/1.1"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut streams = Vec::new();
    for _ in 0..3 {
        let req = post("https://localhost/v1/chat/completions", &stream_body);
        streams.push(h2.send_request(req));
    }
    for res in futures_join(streams).await {
        let res = res.unwrap();
        assert_eq!(
            (res.status().as_u16(), res.version()),
            (200, hyper::Version::HTTP_2)
        );
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert!(body.ends_with(b"data: [DONE]\n\n"));
    }
    assert!(
        in_flight_settles(&lb, Duration::from_secs(3)).await,
        "{:?}",
        in_flight(&lb).await
    );
    // The status page's summary says when the certificate expires (rcgen's: 4096).
    let tls = &get_json(&lb.admin_url("/admin/summary")).await["tls"];
    assert_eq!(
        tls["listener"]["expires"], "Jan  1 00:00:00 4096 +00:00",
        "{tls}"
    );
    assert!(
        tls["listener"]["days_left"].as_i64().unwrap() > 700_000,
        "{tls}"
    );
    assert!(tls["engine_client"].is_null(), "{tls}");
}

/// Awaits every future, in order.
async fn futures_join<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    for f in fs {
        out.push(f.await);
    }
    out
}

/// Writes a request head and its body on a new HTTPS connection that the request
/// closes: with no `pieces`, in one write (TLS records of 16 KB, the head in the
/// first); else the head, then the body in `pieces`, each after a pause. The answer's
/// status and body.
async fn in_pieces(
    lb: &Proc,
    ca: &[PathBuf],
    path: &str,
    body: &[u8],
    pieces: usize,
    pause: Duration,
) -> (u16, Value) {
    let mut tls = connect(lb.addr, ca, &[b"http/1.1"]).await;
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    if pieces == 0 {
        tls.write_all(&[head.as_bytes(), body].concat())
            .await
            .unwrap();
    } else {
        tls.write_all(head.as_bytes()).await.unwrap();
        tls.flush().await.unwrap();
        for piece in body.chunks(body.len().div_ceil(pieces)) {
            tokio::time::sleep(pause).await;
            tls.write_all(piece).await.unwrap();
            tls.flush().await.unwrap();
        }
    }
    tls.flush().await.unwrap();
    let mut answer = Vec::new();
    tls.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let (_, json) = answer.split_once("\r\n\r\n").unwrap();
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_body_sent_after_its_head_in_other_tls_records_arrives_whole() {
    let pki = make_pki("pieces");
    let e = engine("e0", &FAST);
    let lb = https_balancer(&pki, &e, "");
    let ca = [pki.path("ca.pem")];
    // 200 KB sent with its head: the records the socket holds are read on before the
    // handler is called (bodies up to 256 KB); 200 and 430 KB in pieces after pauses:
    // handed to the handler as they come.
    let pause = Duration::from_millis(100);
    let cases = [
        (25_000, 0, Duration::ZERO),
        (25_000, 2, pause),
        (60_000, 3, pause),
    ];
    for (words, pieces, pause) in cases {
        let words: String = (0..words).map(|i| format!("w{i} ")).collect();
        let body = json!({"model": "mock", "prompt": words, "max_tokens": 2}).to_string();
        // What the engine counts for the body when it gets it straight.
        let direct = post_json(
            &e.url("/v1/completions"),
            &serde_json::from_str(&body).unwrap(),
            &[],
        )
        .await;
        let want = direct.json()["usage"]["prompt_tokens"].clone();
        let (status, answer) =
            in_pieces(&lb, &ca, "/v1/completions", body.as_bytes(), pieces, pause).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer["usage"]["prompt_tokens"],
            want,
            "{} bytes: {answer}",
            body.len()
        );
    }
    // A small chat body in its own record right after the head.
    let small = chat(&[("user", "a small body")], false, 2).to_string();
    let (status, answer) = in_pieces(
        &lb,
        &ca,
        "/v1/chat/completions",
        small.as_bytes(),
        0,
        Duration::ZERO,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert!(in_flight_settles(&lb, Duration::from_secs(3)).await);
}

#[tokio::test]
async fn plain_http_on_the_https_port_is_told_to_use_https() {
    let pki = make_pki("plain");
    let e = engine("e0", &FAST);
    let lb = https_balancer(&pki, &e, "");
    let body = chat(&[("user", "hi")], false, 2);
    let r = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "https_required", "{}", r.text());
    assert!(r.text().contains("https://"), "{}", r.text());
    // Nothing reached the engine; the same request over HTTPS does.
    let engine_requests =
        || async { sum_metric(&e.url("/metrics"), "mock_engine_requests_total").await };
    assert_eq!(engine_requests().await, 0.0);
    let mut h1 = http1(connect(lb.addr, &[pki.path("ca.pem")], &[]).await).await;
    let (status, _, text) = over_http1(&mut h1, post("/v1/chat/completions", &body)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(engine_requests().await, 1.0);
    // A client that does not trust the certificate ends its handshake: counted apart.
    assert!(try_connect(lb.addr, &[pki.path("other-ca.pem")])
        .await
        .is_err());
    let failures = |reason: &'static str| {
        let page = lb.admin_url("/metrics");
        async move {
            let name = format!("prefixlb_tls_handshake_failures_total{{reason=\"{reason}\"}}");
            sum_metric(&page, &name).await
        }
    };
    let counted = eventually(Duration::from_secs(2), || async {
        failures("failed").await == 1.0
    })
    .await;
    assert!(counted, "{}", failures("failed").await);
    assert_eq!(failures("plain_http").await, 1.0);
}

#[tokio::test]
async fn a_renewed_certificate_is_shown_from_the_next_handshake_and_open_connections_go_on() {
    let names = ["localhost", "127.0.0.1"];
    let pki = make_pki_until("renew-a", &names, Some((2031, 5, 17)));
    let next = make_pki_until("renew-b", &names, Some((2032, 6, 1)));
    // The balancer's own copies of the files, which the renewal overwrites.
    let dir = pki.path("served");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::copy(pki.path("engine.pem"), &cert).unwrap();
    std::fs::copy(pki.path("engine-key.pem"), &key).unwrap();
    let e = engine("e0", &FAST);
    let lines = format!(
        "watch_config = true\nadmin_tls = true\ntls_cert_file = {cert:?}\ntls_key_file = {key:?}"
    );
    let lb = balancer(&config(&[&e], &lines, ""));
    let cas = [pki.path("ca.pem"), next.path("ca.pem")];
    let first = pem_certs(&pki.path("engine.pem"))[0].clone();
    let renewed = pem_certs(&next.path("engine.pem"))[0].clone();

    let tls = connect(lb.addr, &cas, &[b"http/1.1"]).await;
    assert_eq!(shown(&tls), first);
    // The admin port serves HTTPS too (`admin_tls`): the gauge is read over it.
    let read = |name: &'static str| {
        let cas = cas.clone();
        let admin = lb.admin.unwrap();
        async move {
            let tls = connect(admin, &cas, &[b"http/1.1"]).await;
            let req = hyper::Request::get("/metrics")
                .header("host", "localhost")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let (_, _, page) = over_http1(&mut http1(tls).await, req).await;
            let line = page
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '));
            line.unwrap_or_else(|| panic!("{name}: {page}"))
                .parse::<i64>()
                .unwrap()
        }
    };
    let expiry =
        || read("prefixlb_tls_certificate_expiry_timestamp_seconds{certificate=\"listener\"}");
    let day = |y, m, d| rcgen::date_time_ymd(y, m, d).unix_timestamp();
    assert_eq!(expiry().await, day(2031, 5, 17));
    let mut open = http1(tls).await;
    let body = chat(&[("user", "before")], false, 2);
    assert_eq!(
        over_http1(&mut open, post("/v1/chat/completions", &body))
            .await
            .0,
        200
    );

    // As cert-manager renews a Secret: both files replaced, nothing else touched.
    std::fs::copy(next.path("engine.pem"), &cert).unwrap();
    std::fs::copy(next.path("engine-key.pem"), &key).unwrap();
    let renewed_shown = eventually(Duration::from_secs(8), || async {
        shown(&connect(lb.addr, &cas, &[]).await) == renewed
    })
    .await;
    assert!(renewed_shown, "the renewed certificate was not served");
    let admin = lb.admin.unwrap();
    assert_eq!(
        shown(&connect(admin, &cas, &[]).await),
        renewed,
        "the admin port's too"
    );
    assert_eq!(
        expiry().await,
        day(2032, 6, 1),
        "the gauge follows the renewal"
    );
    // The connection opened before goes on with its own session.
    let body = chat(&[("user", "after")], false, 2);
    assert_eq!(
        over_http1(&mut open, post("/v1/chat/completions", &body))
            .await
            .0,
        200
    );
    let reloads = read("prefixlb_config_reloads_total{result=\"ok\"}").await;
    assert!(reloads >= 1, "{reloads}");
}

#[tokio::test]
async fn a_client_that_never_says_hello_is_closed_at_header_read_timeout() {
    let pki = make_pki("silent");
    let e = engine("e0", &FAST);
    let lb = https_balancer(&pki, &e, "header_read_timeout = \"300ms\"");
    let mut silent = TcpStream::connect(lb.addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the connection was not closed: {read:?}"
    );
    let closed = eventually(Duration::from_secs(2), || async {
        open_client_connections(&lb).await == 0.0
    })
    .await;
    assert!(closed, "{}", open_client_connections(&lb).await);
    let timeouts = metric(
        &lb.admin_url("/metrics"),
        "prefixlb_tls_handshake_failures_total{reason=\"timeout\"}",
    )
    .await;
    assert_eq!(timeouts, 1.0);
}

#[tokio::test]
async fn with_tls_client_ca_file_only_clients_with_a_certificate_it_signed_are_served() {
    let pki = make_pki("mtls");
    let other = make_pki("mtls-other");
    let e = engine("e0", &FAST);
    let ca = format!("tls_client_ca_file = {:?}", pki.path("ca.pem"));
    let lb = https_balancer(&pki, &e, &ca);
    let trust = [pki.path("ca.pem")];
    let body = chat(&[("user", "who are you")], false, 2);
    // A request over a connection; an error if the handshake or the exchange failed.
    let ask = |identity: Option<(PathBuf, PathBuf)>| {
        let (addr, trust, body) = (lb.addr, trust.clone(), body.clone());
        async move {
            let who = identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
            let tls = handshake_as(addr, &trust, &[b"http/1.1"], who).await?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(conn);
            let res = sender
                .send_request(post("/v1/chat/completions", &body))
                .await
                .map_err(std::io::Error::other)?;
            Ok::<u16, std::io::Error>(res.status().as_u16())
        }
    };
    let signed = (pki.path("client.pem"), pki.path("client-key.pem"));
    assert_eq!(ask(Some(signed)).await.unwrap(), 200);
    // No certificate, or one another CA signed: the handshake fails (in TLS 1.3 the
    // client hears of it at its first read), and no engine sees the request.
    assert!(ask(None).await.is_err());
    let stranger = (other.path("client.pem"), other.path("client-key.pem"));
    assert!(ask(Some(stranger)).await.is_err());
    let served = sum_metric(&e.url("/metrics"), "mock_engine_requests_total").await;
    assert_eq!(served, 1.0);
    let failed = eventually(Duration::from_secs(2), || async {
        let name = "prefixlb_tls_handshake_failures_total{reason=\"failed\"}";
        sum_metric(&lb.admin_url("/metrics"), name).await == 2.0
    })
    .await;
    assert!(failed);
}

#[test]
fn check_reports_https_and_refuses_a_certificate_without_its_key_or_with_another_s() {
    let pki = make_pki("check");
    let other = make_pki("check-other");
    let pool = "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[[pools.nodes]]\nid = \"a\"\nurl = \"http://127.0.0.1:9\"\n";
    // A good pair (and the clients' CA): `check` says the port serves HTTPS.
    let good = format!(
        "[server]\nlisten = \"127.0.0.1:8443\"\ntls_cert_file = {:?}\ntls_key_file = {:?}\ntls_client_ca_file = {:?}\n{pool}",
        pki.path("engine.pem"),
        pki.path("engine-key.pem"),
        pki.path("ca.pem")
    );
    let path = write_config(&good);
    let said = String::from_utf8(run_cli(&["check", "--config", path.to_str().unwrap()])).unwrap();
    assert!(
        said.contains("listen: https://127.0.0.1:8443 (1 certificates in the chain; expires Jan  1 00:00:00 4096 +00:00 (in "),
        "{said}"
    );
    assert!(
        said.contains(" days)); client certificates required"),
        "{said}"
    );
    // An expired certificate is served (its renewal may be on the way), and said so.
    let old = make_pki_until("check-expired", &["localhost"], Some((2020, 1, 1)));
    let expired = format!(
        "[server]\nlisten = \"127.0.0.1:8443\"\ntls_cert_file = {:?}\ntls_key_file = {:?}\n{pool}",
        old.path("engine.pem"),
        old.path("engine-key.pem"),
    );
    let path = write_config(&expired);
    let said = String::from_utf8(run_cli(&["check", "--config", path.to_str().unwrap()])).unwrap();
    assert!(
        said.contains("(1 certificates in the chain; EXPIRED Jan  1 00:00:00 2020 +00:00 ("),
        "{said}"
    );
    // `[server]` lines (certificate, key, clients' CA; "" leaves one out), and what
    // `check` says of them.
    let (cert, key, ca) = (
        pki.path("engine.pem"),
        pki.path("engine-key.pem"),
        pki.path("ca.pem"),
    );
    let other_key = other.path("engine-key.pem");
    let no_such = PathBuf::from("no-such.pem");
    let cases: [([Option<&PathBuf>; 3], &str); 5] = [
        (
            [Some(&cert), None, None],
            ":2:17: server.tls_cert_file and server.tls_key_file go together",
        ),
        (
            [Some(&cert), Some(&other_key), None],
            ":3:16: server.tls_key_file: the key does not go with the certificate",
        ),
        (
            [Some(&no_such), Some(&key), None],
            ":2:17: server.tls_cert_file: cannot read",
        ),
        (
            [None, None, Some(&ca)],
            ":2:22: server.tls_client_ca_file needs server.tls_cert_file",
        ),
        (
            [Some(&cert), Some(&key), Some(&key)],
            ":4:22: server.tls_client_ca_file: ",
        ),
    ];
    for (files, want) in cases {
        let names = ["tls_cert_file", "tls_key_file", "tls_client_ca_file"];
        let lines: String = names
            .iter()
            .zip(files)
            .filter_map(|(name, file)| Some(format!("{name} = {:?}\n", file?)))
            .collect();
        let said = check_refuses(&format!("[server]\n{lines}{pool}"));
        assert!(said.contains(want), "{lines}: {said}");
    }
}

#[tokio::test]
async fn a_client_certificate_names_its_tenant_over_http1_and_http2() {
    let pki = make_pki("tenant");
    let e = engine("e0", &FAST);
    let server = format!(
        "tls_cert_file = {:?}\ntls_key_file = {:?}\ntls_client_ca_file = {:?}",
        pki.path("engine.pem"),
        pki.path("engine-key.pem"),
        pki.path("ca.pem")
    );
    // The client certificate's common name is `prefixlb`: a tenant with a limit.
    let routing = "tenant_from_client_certificate = true\ntenant_header = \"x-tenant\"\n\
                   [[tenants]]\nname = \"prefixlb\"\nrequests_per_minute = 3\n";
    let lb = balancer(&config(&[&e], &server, routing));
    let trust = [pki.path("ca.pem")];
    let me = Some((pki.path("client.pem"), pki.path("client-key.pem")));
    let me = me.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let body = chat(&[("user", "who am i")], false, 2);
    // The certificate wins over the header; its tenant's limit is told in the answer.
    let remaining = |res: &hyper::Response<hyper::body::Incoming>| {
        let h = res.headers();
        assert_eq!(h["x-ratelimit-limit-requests"], "3", "{h:?}");
        h["x-ratelimit-remaining-requests"]
            .to_str()
            .unwrap()
            .to_string()
    };
    let tls = handshake_as(lb.addr, &trust, &[b"http/1.1"], me)
        .await
        .unwrap();
    let mut h1 = http1(tls).await;
    let mut req = post("/v1/chat/completions", &body);
    req.headers_mut()
        .insert("x-tenant", "someone-else".parse().unwrap());
    let res = h1.send_request(req).await.unwrap();
    assert_eq!((res.status().as_u16(), remaining(&res)), (200, "2".into()));
    let tls = handshake_as(lb.addr, &trust, &[b"h2"], me).await.unwrap();
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let res = h2
        .send_request(post("https://localhost/v1/chat/completions", &body))
        .await
        .unwrap();
    assert_eq!(res.version(), hyper::Version::HTTP_2);
    assert_eq!((res.status().as_u16(), remaining(&res)), (200, "1".into()));
    res.into_body().collect().await.unwrap();
    let tokens = "prefixlb_tenant_tokens_total{kind=\"prompt\",tenant=\"prefixlb\"}";
    let counted = eventually(Duration::from_secs(2), || async {
        sum_metric(&lb.admin_url("/metrics"), tokens).await > 0.0
    })
    .await;
    assert!(counted, "its tokens are counted under its name");
    // Without client certificates there is no name to take.
    let refused = check_refuses(&format!(
        "[server]\ntls_cert_file = {:?}\ntls_key_file = {:?}\n[routing]\ntenant_from_client_certificate = true\n[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[[pools.nodes]]\nid = \"a\"\nurl = \"http://127.0.0.1:9\"\n",
        pki.path("engine.pem"),
        pki.path("engine-key.pem"),
    ));
    assert!(
        refused.contains(
            ":5:34: routing.tenant_from_client_certificate needs server.tls_client_ca_file"
        ),
        "{refused}"
    );
}

#[tokio::test]
async fn with_admin_tls_the_admin_port_serves_https_and_asks_no_client_certificate() {
    let pki = make_pki("admin");
    let e = engine("e0", &FAST);
    // Clients of the client port must show a certificate; the admin port's need not.
    let lines = format!(
        "admin_tls = true\nadmin_token = \"secret\"\ntls_client_ca_file = {:?}",
        pki.path("ca.pem")
    );
    let lb = https_balancer(&pki, &e, &lines);
    let admin = lb.admin.unwrap();
    let trust = [pki.path("ca.pem")];
    let tls = connect(admin, &trust, &[b"http/1.1"]).await;
    assert_eq!(shown(&tls), pem_certs(&pki.path("engine.pem"))[0]);
    let mut h1 = http1(tls).await;
    let get = |path: &str, token: Option<&str>| {
        let mut req = hyper::Request::get(path).header("host", "localhost");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        req.body(Full::new(Bytes::new())).unwrap()
    };
    let (status, _, _) = over_http1(&mut h1, get("/healthz", None)).await;
    assert_eq!(status, 200);
    let (status, _, _) = over_http1(&mut h1, get("/metrics", None)).await;
    assert_eq!(status, 401, "the token still guards it");
    let (status, _, page) = over_http1(&mut h1, get("/metrics", Some("secret"))).await;
    assert_eq!(status, 200);
    assert!(
        page.contains(
            "prefixlb_tls_certificate_expiry_timestamp_seconds{certificate=\"listener\"}"
        ),
        "{page}"
    );
    // Plain HTTP on the admin port is told to use HTTPS.
    let mut plain = TcpStream::connect(admin).await.unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("https_required"),
        "{answer}"
    );
    // `check` says so, and refuses it without a certificate.
    let pool = "[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[[pools.nodes]]\nid = \"a\"\nurl = \"http://127.0.0.1:9\"\n";
    let text = format!(
        "[server]\nadmin_listen = \"127.0.0.1:9443\"\nadmin_tls = true\ntls_cert_file = {:?}\ntls_key_file = {:?}\n{pool}",
        pki.path("engine.pem"),
        pki.path("engine-key.pem")
    );
    let path = write_config(&text);
    let said = String::from_utf8(run_cli(&["check", "--config", path.to_str().unwrap()])).unwrap();
    assert!(said.contains("admin: https://127.0.0.1:9443 (the same certificate; no client certificates asked for)"), "{said}");
    let refused = check_refuses(&format!("[server]\nadmin_tls = true\n{pool}"));
    assert!(
        refused.contains(":2:13: server.admin_tls needs server.tls_cert_file"),
        "{refused}"
    );
}
