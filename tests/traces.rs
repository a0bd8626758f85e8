//! OpenTelemetry traces end to end (issue 27): a balancer with `[tracing]` exports its
//! spans over OTLP/HTTP to a small receiver here (decoding them with the
//! `opentelemetry-proto` messages); requests with and without a `traceparent`, a
//! failover and a queued request are checked span by span: names, kinds, parent ids,
//! attributes, and the `traceparent` each engine received (mock-engine echoes it as
//! `x-mock-traceparent`).

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use parking_lot::Mutex;
use prost::Message;

/// One exported span, flattened.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    kind: i32,
    trace: String,
    id: String,
    parent: String,
    attrs: HashMap<String, String>,
    service: String,
    error: bool,
}

impl Span {
    fn attr(&self, key: &str) -> &str {
        self.attrs.get(key).map_or("", String::as_str)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An OTLP/HTTP receiver on loopback keeping every span it is sent.
async fn receiver() -> (SocketAddr, Arc<Mutex<Vec<Span>>>) {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = spans.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let kept = kept.clone();
                        async move {
                            assert_eq!(req.uri().path(), "/v1/traces");
                            assert_eq!(req.headers()["content-type"], "application/x-protobuf");
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let export = ExportTraceServiceRequest::decode(body).unwrap();
                            let mut out = kept.lock();
                            for rs in export.resource_spans {
                                let service = rs
                                    .resource
                                    .iter()
                                    .flat_map(|r| &r.attributes)
                                    .find(|kv| kv.key == "service.name")
                                    .map(|kv| value(kv.value.as_ref()))
                                    .unwrap_or_default();
                                for ss in rs.scope_spans {
                                    for s in ss.spans {
                                        out.push(Span {
                                            name: s.name,
                                            kind: s.kind,
                                            trace: hex(&s.trace_id),
                                            id: hex(&s.span_id),
                                            parent: hex(&s.parent_span_id),
                                            attrs: s
                                                .attributes
                                                .iter()
                                                .map(|kv| {
                                                    (kv.key.clone(), value(kv.value.as_ref()))
                                                })
                                                .collect(),
                                            service: service.clone(),
                                            error: s.status.is_some_and(|st| st.code == 2),
                                        });
                                    }
                                }
                            }
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                                Bytes::new(),
                            )))
                        }
                    },
                );
                let io = hyper_util::rt::TokioIo::new(sock);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    (addr, spans)
}

fn value(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        Some(Any::DoubleValue(d)) => d.to_string(),
        Some(Any::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// Waits until the receiver holds a `request` span of trace `trace` whose own spans
/// (the request's and its children) number at least `want`; returns them.
async fn trace_of(spans: &Mutex<Vec<Span>>, trace: &str, want: usize) -> Vec<Span> {
    let found = eventually(Duration::from_secs(15), || async {
        let all = spans.lock();
        all.iter().filter(|s| s.trace == trace).count() >= want
    })
    .await;
    let all: Vec<Span> = spans
        .lock()
        .iter()
        .filter(|s| s.trace == trace)
        .cloned()
        .collect();
    assert!(found, "trace {trace}: wanted {want} spans, got {all:#?}");
    all
}

fn one<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    let found: Vec<&Span> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
    found[0]
}

/// `traceparent`'s trace id and parent span id.
fn parse_traceparent(v: &str) -> (String, String) {
    let parts: Vec<&str> = v.split('-').collect();
    assert_eq!(parts.len(), 4, "{v}");
    assert_eq!(parts[0], "00", "{v}");
    (parts[1].to_string(), parts[2].to_string())
}

const FAST: [&str; 4] = ["--decode-ms-per-token", "1", "--prefill-us-per-token", "0"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_follow_a_request_through_placement_attempts_and_the_engine() {
    let (otlp, spans) = receiver().await;
    let e0 = engine("e0", &FAST);
    let e1 = engine("e1", &FAST);
    let text = config_ext(
        &[&e0, &e1],
        &format!(
            "[routing]\nmax_in_flight = 1\nwhen_saturated = \"queue\"\nmax_attempts = 3\n\
             [health]\ninterval = \"60s\"\n\
             [tracing]\notlp_endpoint = \"http://{otlp}\"\nservice_name = \"lb-under-test\"\n"
        ),
        "",
    );
    let (lb, log) = balancer_logged(&text, "warn", &[("OTEL_BSP_SCHEDULE_DELAY", "100")]);

    // 1. No traceparent: a new trace, rooted at the request span.
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(
            &[("system", "You are terse."), ("user", "hello there")],
            false,
            4,
        ),
        &[("x-session-id", "plain")],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let (trace, engine_parent) = parse_traceparent(reply.header("x-mock-traceparent"));
    let got = trace_of(&spans, &trace, 2).await;
    let request = one(&got, "POST /v1/chat/completions");
    let attempt = one(&got, "attempt");
    assert_eq!(request.parent, "", "a root span: {request:#?}");
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(request.service, "lb-under-test");
    assert_eq!(attempt.kind, SpanKind::Client as i32);
    assert_eq!(
        attempt.parent, request.id,
        "the attempt is the request's child"
    );
    assert_eq!(
        engine_parent, attempt.id,
        "the engine's parent is the attempt"
    );
    assert_eq!(request.attr("prefixlb.pool"), "mock");
    assert_eq!(request.attr("gen_ai.request.model"), "mock");
    assert_eq!(request.attr("prefixlb.api"), "chat");
    assert_eq!(request.attr("prefixlb.key_source"), "header");
    assert_eq!(request.attr("prefixlb.key_hash").len(), 16, "{request:#?}");
    assert_eq!(
        request.attr("prefixlb.node"),
        reply.header("x-prefixlb-node")
    );
    assert_eq!(request.attr("prefixlb.attempts"), "1");
    assert_eq!(request.attr("prefixlb.outcome"), "success");
    assert_eq!(request.attr("http.response.status_code"), "200");
    assert!(
        request
            .attr("gen_ai.usage.input_tokens")
            .parse::<u64>()
            .unwrap()
            > 0
    );
    assert_eq!(request.attr("gen_ai.usage.output_tokens"), "4");
    assert_eq!(attempt.attr("prefixlb.node"), request.attr("prefixlb.node"));
    assert!(!request.error && !attempt.error);
    // No prompt text, no key text in any attribute.
    for s in &got {
        for v in s.attrs.values() {
            assert!(
                !v.contains("hello there") && !v.contains("terse") && !v.contains("plain"),
                "{s:#?}"
            );
        }
    }

    // 2. A caller's traceparent: continued; a stream's probe span under its attempt.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "stream this")], true, 3),
        &[
            ("x-session-id", "streamed"),
            (
                "traceparent",
                &format!("00-{caller_trace}-{caller_span}-01"),
            ),
        ],
    )
    .await;
    assert_eq!(reply.status, 200);
    let (trace, engine_parent) = parse_traceparent(reply.header("x-mock-traceparent"));
    assert_eq!(trace, caller_trace, "the engine joins the caller's trace");
    let got = trace_of(&spans, caller_trace, 3).await;
    let request = one(&got, "POST /v1/chat/completions");
    let attempt = one(&got, "attempt");
    let probe = one(&got, "probe");
    assert_eq!(
        request.parent, caller_span,
        "the caller's span is the parent"
    );
    assert_eq!(attempt.parent, request.id);
    assert_eq!(probe.parent, attempt.id);
    assert_eq!(engine_parent, attempt.id);
    assert_eq!(probe.attr("prefixlb.committed_by"), "output");
    assert!(probe.attr("prefixlb.ttft_ms").parse::<f64>().unwrap() >= 0.0);
    assert!(request.attr("prefixlb.ttft_ms").parse::<f64>().unwrap() >= 0.0);
    assert_eq!(request.attr("prefixlb.stream"), "true");

    // 3. A failover: the key's first node fails with 500s; the second answers.
    let walk = walk_of(&lb, "failing").await;
    let first = if walk[0] == "n0" { &e0 } else { &e1 };
    set_fault(first, "error", 0).await;
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "fail me over")], false, 2),
        &[("x-session-id", "failing")],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-attempts"), "2");
    let (trace, engine_parent) = parse_traceparent(reply.header("x-mock-traceparent"));
    let got = trace_of(&spans, &trace, 3).await;
    let request = one(&got, "POST /v1/chat/completions");
    let mut attempts: Vec<&Span> = got.iter().filter(|s| s.name == "attempt").collect();
    attempts.sort_by_key(|s| s.attr("prefixlb.attempt").to_string());
    assert_eq!(attempts.len(), 2, "{got:#?}");
    assert!(attempts.iter().all(|a| a.parent == request.id));
    assert_eq!(attempts[0].attr("prefixlb.node"), walk[0]);
    assert_eq!(attempts[0].attr("prefixlb.failover_reason"), "http_5xx");
    assert_eq!(attempts[0].attr("http.response.status_code"), "500");
    assert!(attempts[0].error, "a failed attempt has an error status");
    assert_eq!(attempts[1].attr("prefixlb.node"), walk[1]);
    assert!(!attempts[1].error);
    assert_eq!(
        engine_parent, attempts[1].id,
        "the answering engine saw its own attempt"
    );
    assert_eq!(request.attr("prefixlb.attempts"), "2");
    assert_eq!(request.attr("prefixlb.outcome"), "success");
    set_fault(first, "ok", 0).await;

    // 4. A queued request: both slots held by long streams, a third waits.
    let hold = |session: &'static str| {
        let url = lb.url("/v1/chat/completions");
        tokio::spawn(async move {
            let mut resp =
                post_stream_with(&url, &chat(&[("user", session)], true, 400), session).await;
            while next_chunk(resp.body_mut()).await.is_some() {}
        })
    };
    let holds = [hold("hold-a"), hold("hold-b")];
    let full = eventually(Duration::from_secs(5), || async {
        in_flight(&lb).await.iter().all(|(_, n)| *n == 1)
    })
    .await;
    assert!(full, "both slots held: {:?}", in_flight(&lb).await);
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "wait your turn")], false, 2),
        &[("x-session-id", "queued")],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-route"), "queued");
    let (trace, _) = parse_traceparent(reply.header("x-mock-traceparent"));
    let got = trace_of(&spans, &trace, 2).await;
    let request = one(&got, "POST /v1/chat/completions");
    assert_eq!(request.attr("prefixlb.route"), "queued");
    let waited: f64 = request.attr("prefixlb.queue_wait_ms").parse().unwrap();
    assert!(waited > 50.0, "queue wait {waited} ms");
    assert_eq!(one(&got, "attempt").attr("prefixlb.route"), "queued");
    for h in holds {
        h.await.unwrap();
    }

    // The balancer's own health answer makes no trace (checked once later spans came).
    let health_trace = "11111111111111111111111111111111";
    let health = call(
        "GET",
        &lb.url("/health"),
        &[(
            "traceparent",
            &format!("00-{health_trace}-2222222222222222-01"),
        )],
        "",
    )
    .await;
    assert_eq!(health.status, 200);

    // 5. A refusal of the balancer's own: a span with the error, no attempt.
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &serde_json::json!({"model": "nope", "messages": []}),
        &[(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )],
    )
    .await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    let got = trace_of(&spans, "0af7651916cd43dd8448eb211c80319c", 1).await;
    let request = one(&got, "POST /v1/chat/completions");
    assert_eq!(request.attr("http.response.status_code"), "404");
    assert_eq!(request.attr("prefixlb.outcome"), "client_error");
    assert_eq!(request.attr("error.type"), "model_not_found");
    assert!(got.iter().all(|s| s.name != "attempt"));
    assert!(
        spans.lock().iter().all(|s| s.trace != health_trace),
        "GET /health is traced"
    );
    drop(lb);
    let _ = std::fs::remove_file(log);
}

/// A streaming chat request with a session key, its body left to the caller.
async fn post_stream_with(
    url: &str,
    body: &serde_json::Value,
    session: &str,
) -> hyper::Response<hyper::body::Incoming> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("x-session-id", session)
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    client().request(req).await.unwrap()
}

#[tokio::test]
async fn without_tracing_the_callers_traceparent_reaches_the_engine_untouched() {
    let e0 = engine("e0", &FAST);
    let lb = balancer(&config(&[&e0], "", ""));
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hi")], false, 2),
        &[("traceparent", tp)],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-mock-traceparent"), tp);
    let reply = post_json(
        &lb.url("/v1/chat/completions"),
        &chat(&[("user", "hi")], false, 2),
        &[],
    )
    .await;
    assert!(
        reply.headers.get("x-mock-traceparent").is_none(),
        "no trace is made up"
    );
}

#[test]
fn check_refuses_a_bad_tracing_section() {
    let base = "[server]\nlisten = \"127.0.0.1:0\"\n[[pools]]\nname = \"p\"\nmodels = [\"m\"]\n[[pools.nodes]]\nid = \"a\"\nurl = \"http://127.0.0.1:1\"\n";
    let said = check_refuses(&format!(
        "{base}[tracing]\notlp_endpoint = \"https://collector:4318\"\n"
    ));
    assert!(said.contains("must be http://"), "{said}");
    let said = check_refuses(&format!(
        "{base}[tracing]\notlp_endpoint = \"http://c:4318\"\nsample_ratio = 1.5\n"
    ));
    assert!(
        said.contains("sample_ratio must be between 0.0 and 1.0"),
        "{said}"
    );
    let said = check_refuses(&format!("{base}[tracing]\nsample_ratio = 0.5\n"));
    assert!(said.contains("otlp_endpoint"), "{said}");
}
