//! Engines behind TLS (issue 25), over real sockets: a rustls front with test
//! certificates made at test time relays to a mock engine. Requests and streams pass
//! with the right CA; a wrong CA fails the node with the reason in `/admin/nodes`;
//! mTLS works with a client certificate and fails without one; `check` names a CA file
//! it cannot read at file:line:col.

mod common;

use std::time::Duration;

use common::tls::{make_pki, tls_front, Pki};
use common::*;
use serde_json::json;

const FAST: [&str; 4] = ["--decode-ms-per-token", "1", "--prefill-us-per-token", "0"];

/// A config with one https node at `front` (named `localhost`, as its certificate
/// says) and the given `[tls]` lines.
fn https_config(front: std::net::SocketAddr, tls: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [health]\ninterval = \"200ms\"\nunhealthy_after = 1\n{tls}\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n\
         [[pools.nodes]]\nid = \"tls0\"\nurl = \"https://localhost:{}\"\n",
        front.port()
    )
}

fn tls_lines(pki: &Pki, ca: &str, client: bool) -> String {
    let mut s = format!("[tls]\nca_file = {:?}\n", pki.path(ca));
    if client {
        s += &format!(
            "client_cert_file = {:?}\nclient_key_file = {:?}\n",
            pki.path("client.pem"),
            pki.path("client-key.pem")
        );
    }
    s
}

async fn node(lb: &Proc) -> serde_json::Value {
    node_info(lb, "tls0").await
}

/// A mock engine behind a TLS front (requiring a client certificate with
/// `client_ca`), and a balancer trusting `ca` (and showing a client certificate with
/// `client`): the certificates, the engine, the front's address and the balancer.
async fn behind_tls(
    tag: &str,
    client_ca: bool,
    ca: &str,
    client: bool,
) -> (Pki, Proc, std::net::SocketAddr, Proc) {
    let pki = make_pki(tag);
    let e = engine("e0", &FAST);
    let front = tls_front(&pki, e.addr, client_ca).await;
    let lb = balancer(&https_config(front, &tls_lines(&pki, ca, client)));
    (pki, e, front, lb)
}

/// A chat request through `lb`.
async fn ask(lb: &Proc, stream: bool) -> Reply {
    let body = chat(&[("user", "hi")], stream, 3);
    post_json(&lb.url("/v1/chat/completions"), &body, &[]).await
}

#[tokio::test]
async fn requests_and_streams_pass_to_an_engine_behind_tls() {
    let (_pki, _e, _front, lb) = behind_tls("ok", false, "ca.pem", false).await;
    let r = ask(&lb, false).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-prefixlb-node"), "tls0");
    let s = ask(&lb, true).await;
    assert_eq!(s.status, 200);
    assert_eq!(
        s.text().matches("\"content\"").count(),
        4,
        "role chunk and three tokens: {}",
        s.text()
    );
    assert!(s.text().ends_with("data: [DONE]\n\n"));
    // Many requests reuse the TLS connections; the health checks pass over TLS too.
    for _ in 0..20 {
        let r = post_json(
            &lb.url("/v1/completions"),
            &json!({"model": "mock", "prompt": "x", "max_tokens": 2}),
            &[],
        )
        .await;
        assert_eq!(r.status, 200);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let n = node(&lb).await;
    assert_eq!(
        (n["healthy"].clone(), n["check_error"].clone()),
        (json!(true), json!(null)),
        "{n}"
    );
}

#[tokio::test]
async fn a_wrong_ca_fails_the_node_with_its_reason_in_admin_nodes() {
    let (_pki, _e, _front, lb) = behind_tls("wrong", false, "other-ca.pem", false).await;
    let r = ask(&lb, false).await;
    // The first health check may have taken the node out already (503); else the
    // attempt itself failed on the handshake (502), and says so.
    match r.status.as_u16() {
        502 => assert!(r.text().contains("tls handshake failed"), "{}", r.text()),
        503 => assert!(r.text().contains("no node"), "{}", r.text()),
        s => panic!("{s}: {}", r.text()),
    }
    let failed = eventually(Duration::from_secs(5), || async {
        let n = node(&lb).await;
        n["healthy"] == json!(false)
            && n["check_error"]
                .as_str()
                .is_some_and(|e| e.contains("tls handshake failed") && e.contains("UnknownIssuer"))
    })
    .await;
    assert!(failed, "{}", node(&lb).await);
}

#[tokio::test]
async fn mtls_works_with_a_client_certificate_and_fails_without_one() {
    let (pki, _e, front, lb) = behind_tls("mtls", true, "ca.pem", true).await;
    let r = ask(&lb, true).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.text().ends_with("data: [DONE]\n\n"));
    // Its expiry is exported (rcgen's default: 4096-01-01).
    let expiry = "prefixlb_tls_certificate_expiry_timestamp_seconds{certificate=\"engine_client\"}";
    let shown = sum_metric(&lb.admin_url("/metrics"), expiry).await as i64;
    assert_eq!(shown, rcgen::date_time_ymd(4096, 1, 1).unix_timestamp());
    // Without the certificate the engine refuses us: the node fails, and says why.
    let lb = balancer(&https_config(front, &tls_lines(&pki, "ca.pem", false)));
    assert_eq!(sum_metric(&lb.admin_url("/metrics"), expiry).await, 0.0);
    let r = ask(&lb, false).await;
    assert!(r.status.is_server_error(), "{} {}", r.status, r.text());
    let failed = eventually(Duration::from_secs(5), || async {
        let n = node(&lb).await;
        n["healthy"] == json!(false) && n["check_error"].as_str().is_some_and(|e| !e.is_empty())
    })
    .await;
    assert!(failed, "{}", node(&lb).await);
}

#[test]
fn check_names_a_tls_file_it_cannot_read_and_a_lone_client_key() {
    let pki = make_pki("check");
    let with = |tls: &str| https_config("127.0.0.1:1".parse().unwrap(), tls);
    let text = with("[tls]\nca_file = \"/nonexistent/ca.pem\"\n");
    let err = check_refuses(&text);
    let line = text.lines().position(|l| l.starts_with("ca_file")).unwrap() + 1;
    let want = format!(":{line}:11: [tls] ca_file: cannot read /nonexistent/ca.pem");
    assert!(err.contains(&want), "{err}");
    // A certificate with no key; a key that is not a key.
    let cert = pki.path("client.pem");
    let err = check_refuses(&with(&format!("[tls]\nclient_cert_file = {cert:?}\n")));
    assert!(err.contains("go together"), "{err}");
    let key = pki.path("ca.pem");
    let err = check_refuses(&with(&format!(
        "[tls]\nclient_cert_file = {cert:?}\nclient_key_file = {key:?}\n"
    )));
    assert!(err.contains("client_key_file"), "{err}");
    // A good one: check reports the https node and what it trusts.
    let text = with(&tls_lines(&pki, "ca.pem", true));
    let out = run_cli(&["check", "--config", write_config(&text).to_str().unwrap()]);
    let out = String::from_utf8_lossy(&out);
    let want = "tls: 1 https nodes; trusting ca_file (1 certificates); client certificate (mTLS)";
    assert!(out.contains(want), "{out}");
}
