//! OpenAI's audio APIs (`/v1/audio/transcriptions`, `/v1/audio/translations`) over
//! real sockets: multipart uploads through a balancer to `mock-engine`s serving a
//! Whisper model beside a chat pool. An upload reaches its model's pool whole (the
//! engine reports the file's length and digest), an alias is rewritten in the form,
//! a stream is relayed, uploads spread over the pool by their file, an upload's size
//! is not taken for prompt tokens, and a body that is not a form is refused before
//! any engine sees it.

mod common;

use std::time::Duration;

use common::*;
use http_body_util::BodyExt;

const WHISPER: &str = "openai/whisper-large-v3";

/// A chat pool (the default) on one engine and a Whisper pool on `whisper` engines,
/// with `extra` top-level sections.
fn fleet(whisper: usize, extra: &str) -> (Proc, Vec<Proc>, Proc) {
    let chat = engine("chat", &["--decode-ms-per-token", "0"]);
    let engines: Vec<Proc> = (0..whisper)
        .map(|i| {
            engine(
                &format!("w{i}"),
                &["--model", WHISPER, "--decode-ms-per-token", "5"],
            )
        })
        .collect();
    let nodes: String = engines
        .iter()
        .enumerate()
        .map(|(i, e)| {
            format!(
                "[[pools.nodes]]\nid = \"w{i}\"\nurl = \"http://{}\"\n",
                e.addr
            )
        })
        .collect();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{extra}\n\
         [[pools]]\nname = \"chat\"\nmodels = [\"mock\"]\ndefault = true\n\
         [[pools.nodes]]\nid = \"c0\"\nurl = \"http://{}\"\n\
         [[pools]]\nname = \"whisper\"\nmodels = [\"{WHISPER}\"]\naliases = {{ \"whisper-1\" = \"{WHISPER}\" }}\n{nodes}",
        chat.addr
    );
    let lb = balancer(&config);
    (chat, engines, lb)
}

/// Bytes that look like a recording (a header, then half a second of 16 kHz
/// silence, as most begin) and like the form's own syntax (line ends, dashes).
fn audio(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut bytes = b"RIFF\0\0\0\0WAVEfmt \r\n--\r\n".to_vec();
    bytes.resize(16_000, 0);
    while bytes.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

const BOUNDARY: &str = "----prefixlb7d1f0c9e";

/// A form as the `openai` SDK (httpx) writes it: the text fields, then the file.
fn form(fields: &[(&str, &str)], file: Option<&[u8]>) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, value) in fields {
        b.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes(),
        );
    }
    if let Some(file) = file {
        b.extend_from_slice(format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"speech.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
        b.extend_from_slice(file);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    b
}

fn form_type() -> String {
    format!("multipart/form-data; boundary={BOUNDARY}")
}

async fn upload(lb: &Proc, path: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> Reply {
    let ct = form_type();
    let mut all = vec![("content-type", ct.as_str())];
    all.extend_from_slice(headers);
    call("POST", &lb.url(path), &all, body).await
}

/// What the engine says it received for `file` under `model`.
fn received(model: &str, file: &[u8]) -> String {
    let digest = xxhash_rust::xxh3::xxh3_64(file);
    format!("model={model} bytes={} xxh3={digest:016x}", file.len())
}

async fn uploads_served(e: &Proc) -> f64 {
    metric(&e.url("/metrics"), "mock_engine_audio_requests_total").await
}

#[tokio::test]
async fn an_upload_reaches_its_model_s_pool_whole_with_its_alias_rewritten() {
    let (chat, whisper, lb) = fleet(2, "");
    let file = audio(1, 300_000);
    for (path, model) in [
        ("/v1/audio/transcriptions", WHISPER),
        ("/v1/audio/translations", "whisper-1"),
    ] {
        let body = form(&[("model", model), ("language", "en")], Some(&file));
        let r = upload(&lb, path, body, &[]).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        // The engine serves only its own name: an alias reaches it rewritten.
        assert_eq!(r.json()["text"], received(WHISPER, &file), "{path}");
        assert!(r.header("x-prefixlb-node").starts_with('w'));
    }

    // A stream, relayed as it comes.
    let body = form(&[("model", "whisper-1"), ("stream", "true")], Some(&file));
    let ct = form_type();
    let resp = send(
        "POST",
        &lb.url("/v1/audio/transcriptions"),
        &[("content-type", &ct)],
        body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let sse = resp.into_body().collect().await.unwrap().to_bytes();
    let sse = String::from_utf8_lossy(&sse);
    let text: String = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, received(WHISPER, &file));
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");

    let mut served = 0.0;
    for e in &whisper {
        served += uploads_served(e).await;
    }
    assert_eq!(served, 3.0);
    assert_eq!(uploads_served(&chat).await, 0.0);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn uploads_spread_over_the_pool_and_their_size_is_not_taken_for_tokens() {
    // A tenant allowed 2,000 tokens a minute: a 200 KB upload read as text would be
    // 50,000 tokens, and the upload after it refused.
    let tenants = "[routing]\ntenant_header = \"x-tenant\"\n\
                   [[tenants]]\nname = \"metered\"\ntokens_per_minute = 2000\n";
    let (_chat, whisper, lb) = fleet(3, tenants);
    let big = audio(99, 200_000);
    for _ in 0..3 {
        let body = form(&[("model", WHISPER)], Some(&big));
        let r = upload(
            &lb,
            "/v1/audio/transcriptions",
            body,
            &[("x-tenant", "metered")],
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }

    // Keyed by the whole file: the same file goes to the same engine, and different
    // files spread though they begin alike (a key read from the body's start would
    // see the form's fields and the same silence in each, and send all to one).
    let mut nodes = Vec::new();
    for seed in 0..24 {
        let file = audio(seed, 20_000);
        let body = form(&[("model", WHISPER)], Some(&file));
        let r = upload(&lb, "/v1/audio/transcriptions", body, &[]).await;
        assert_eq!(r.status, 200, "{}", r.text());
        nodes.push(r.header("x-prefixlb-node").to_string());
    }
    for id in ["w0", "w1", "w2"] {
        assert!(nodes.iter().any(|n| n == id), "{id} got none: {nodes:?}");
    }
    let again = form(&[("model", WHISPER)], Some(&audio(5, 20_000)));
    let ct = form_type();
    let explained = call(
        "POST",
        &lb.admin_url("/admin/explain?path=/v1/audio/transcriptions"),
        &[("content-type", &ct)],
        again.clone(),
    )
    .await
    .json();
    let digest = xxhash_rust::xxh3::xxh3_128(&audio(5, 20_000)).to_le_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        (
            &explained["api"],
            &explained["key_source"],
            &explained["key"]
        ),
        (&"audio".into(), &"file".into(), &hex.into()),
        "{explained}"
    );
    assert_eq!(explained["choice"], nodes[5].as_str());
    let r = upload(&lb, "/v1/audio/transcriptions", again, &[]).await;
    assert_eq!(r.header("x-prefixlb-node"), nodes[5]);
    let mut served = 0.0;
    for e in &whisper {
        served += uploads_served(e).await;
    }
    assert_eq!(served, 28.0);
    assert!(in_flight_settles(&lb, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn a_body_that_is_not_a_whole_form_is_refused_before_any_engine_sees_it() {
    let (chat, whisper, lb) = fleet(1, "");
    let path = "/v1/audio/transcriptions";
    let json = r#"{"model": "whisper-1", "file": "speech.wav"}"#;
    let r = call(
        "POST",
        &lb.url(path),
        &[("content-type", "application/json")],
        json,
    )
    .await;
    assert_eq!(r.status, 415, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "unsupported_media_type");
    assert!(r.text().contains("multipart/form-data"), "{}", r.text());

    let no_file = form(&[("model", WHISPER)], None);
    let r = upload(&lb, path, no_file, &[]).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("'file' is a required property"),
        "{}",
        r.text()
    );

    // A body whose boundary is not its content type's, and one that never closes.
    let mut other = form(&[("model", WHISPER)], Some(b"x"));
    other[2] = b'=';
    let mut unclosed = form(&[("model", WHISPER)], Some(b"x"));
    unclosed.truncate(unclosed.len() - BOUNDARY.len() - 6);
    for body in [other, unclosed] {
        let r = upload(&lb, path, body, &[]).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "invalid_form", "{}", r.text());
    }
    let r = call("GET", &lb.url(path), &[], "").await;
    assert_eq!(r.status, 405);

    for e in [&chat, &whisper[0]] {
        assert_eq!(engine_http_requests(e).await, 0.0);
    }
}

async fn engine_http_requests(e: &Proc) -> f64 {
    metric(&e.url("/metrics"), "mock_engine_http_requests_total").await
}
