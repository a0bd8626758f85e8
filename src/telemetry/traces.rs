//! OpenTelemetry traces (`[tracing]`): one `request` span per client request (server
//! kind), an `attempt` span per engine it tries (client kind) and a `probe` span for
//! a stream's wait for its first token. The spans are `tracing` spans of the target
//! [`TARGET`]; the `tracing-opentelemetry` layer made by [`layer`] turns them into
//! OpenTelemetry spans, batched on the tokio runtime and exported as OTLP/HTTP
//! protobuf. An incoming W3C `traceparent`/`tracestate` is continued, and each attempt
//! sends the engine a `traceparent` naming the attempt's span, so vLLM's or SGLang's
//! own spans join the trace.
//!
//! Attributes carry what explains a request's time (its pool, model, API, key hash,
//! group, route, node, attempts, queue wait, TTFT, tokens, outcome) and never prompt
//! text, a routing key's text or an API key.
//!
//! Without `[tracing]` no layer listens to [`TARGET`]: every span is disabled at its
//! callsite (one cached check) and nothing here allocates; the client's own
//! `traceparent` then goes to the engine untouched.

use std::time::Duration;

use http::{HeaderMap, Method};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing::field::Empty;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::config::TracingConfig;
use crate::routing::decision::Placement;
use crate::routing::group::Grouping;

/// The `tracing` target of every span made here (and of nothing else).
pub const TARGET: &str = "prefixlb::trace";

/// How long one export to the collector may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The running exporter: flushed and stopped by [`Exporter::shutdown`].
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// Sends the spans still batched and stops the exporter.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("tracing: the last spans were not exported: {e}");
        }
    }
}

/// The layer that exports spans of [`TARGET`] as `config` says, and its exporter.
/// Must be called inside the tokio runtime (the batch processor runs on it).
pub fn layer<S>(config: &TracingConfig) -> anyhow::Result<(impl Layer<S>, Exporter)>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use opentelemetry_sdk::runtime::Tokio;
    use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;

    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(config.otlp_endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(BatchSpanProcessor::builder(exporter, Tokio).build())
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.sample_ratio,
        ))))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(config.service_name.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer("prefixlb");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_target(false)
        .with_level(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE));
    Ok((layer, Exporter { provider }))
}

/// The span of one client request, continuing the caller's trace when its headers
/// carry one. Disabled (and free) when traces are off, and for the balancer's own
/// `GET /health` (a load balancer's probe every few seconds is no trace).
pub fn request_span(method: &Method, path: &str, headers: &HeaderMap) -> Span {
    if method == Method::GET && path == "/health" {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "request",
        otel.name = %format_args!("{method} {}", crate::clip::clip(path)),
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = %method,
        url.path = %crate::clip::clip(path),
        http.response.status_code = Empty,
        gen_ai.request.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        prefixlb.pool = Empty,
        prefixlb.api = Empty,
        prefixlb.stream = Empty,
        prefixlb.key_source = Empty,
        prefixlb.key_hash = Empty,
        prefixlb.group_hash = Empty,
        prefixlb.group_width = Empty,
        prefixlb.home = Empty,
        prefixlb.tenant = Empty,
        prefixlb.priority = Empty,
        prefixlb.route = Empty,
        prefixlb.node = Empty,
        prefixlb.attempts = Empty,
        prefixlb.queue_wait_ms = Empty,
        prefixlb.ttft_ms = Empty,
        prefixlb.cached_tokens = Empty,
        prefixlb.outcome = Empty,
        error.type = Empty,
    );
    if !span.is_disabled() {
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let _ = span.set_parent(parent);
    }
    span
}

/// Where a request was placed: its pool, model, API, key hash and group.
pub fn record_placement(span: &Span, p: &Placement) {
    if span.is_disabled() {
        return;
    }
    span.record("prefixlb.pool", p.pool().config.name.as_str());
    if let Some(model) = &p.facts.model {
        span.record("gen_ai.request.model", crate::clip::clip(model).as_str());
    }
    span.record("prefixlb.api", p.api.as_str());
    span.record("prefixlb.stream", p.facts.stream);
    span.record("prefixlb.key_source", p.facts.source.as_str());
    span.record("prefixlb.key_hash", format!("{:016x}", p.hash).as_str());
    if let Some((group, width)) = p.target.group {
        if matches!(p.grouping, Grouping::Group(_)) {
            span.record("prefixlb.group_hash", format!("{group:016x}").as_str());
        }
        span.record("prefixlb.group_width", width as u64);
    }
    if let Some(home) = p.home {
        span.record("prefixlb.home", p.pool().balancer.node(home.index).id());
    }
}

/// Who asked: the tenant (as metrics label it) and the priority class.
pub fn record_asker(span: &Span, tenant: &str, priority: &str) {
    span.record("prefixlb.tenant", tenant);
    span.record("prefixlb.priority", priority);
}

/// How a request ended when it was answered with an error of the balancer's own: its
/// outcome as metrics label it, and the error's code as `error.type`.
pub fn record_refusal(span: &Span, status: u16, outcome: &str, code: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("http.response.status_code", u64::from(status));
    span.record("prefixlb.outcome", outcome);
    span.record("error.type", code);
    if status >= 500 {
        span.record("otel.status_code", "ERROR");
    }
}

/// How a request ended when its client left before its answer: no status was sent.
/// Marked as an error, as a stream the client leaves is ([`record_end`]).
pub fn record_cancelled(span: &Span) {
    if span.is_disabled() {
        return;
    }
    span.record("prefixlb.outcome", "cancelled");
    span.record("error.type", "cancelled");
    span.record("otel.status_code", "ERROR");
}

/// The span of one attempt on `node` (the `attempt`-th), a child of the request's.
pub fn attempt_span(request: &Span, node: &str, attempt: u32) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: request,
        "attempt",
        otel.kind = "client",
        otel.status_code = Empty,
        prefixlb.node = node,
        prefixlb.attempt = attempt,
        prefixlb.route = Empty,
        http.response.status_code = Empty,
        prefixlb.failover_reason = Empty,
        error.type = Empty,
    )
}

/// An attempt that did not give the client an answer, and why.
pub fn record_failed_attempt(span: &Span, reason: &str, text: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("prefixlb.failover_reason", reason);
    span.record("error.type", crate::clip::clip(text).as_str());
    span.record("otel.status_code", "ERROR");
}

/// The span of a stream's wait for its first token, a child of its attempt's.
pub fn probe_span(attempt: &Span) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: attempt,
        "probe",
        prefixlb.ttft_ms = Empty,
        prefixlb.committed_by = Empty,
    )
}

/// What is known of a request when its answer ends.
pub struct Ending<'a> {
    pub status: u16,
    /// Its outcome label (as in metrics).
    pub outcome: &'a str,
    pub ttft: Option<Duration>,
    pub input_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
}

/// Records how an answered request ended on its spans (the request's and the
/// answering attempt's), which close when their last handle drops.
pub fn record_end(spans: &[Span; 2], end: Ending<'_>) {
    let [request, attempt] = spans;
    if request.is_disabled() {
        return;
    }
    request.record("http.response.status_code", u64::from(end.status));
    request.record("prefixlb.outcome", end.outcome);
    if let Some(t) = end.ttft {
        request.record("prefixlb.ttft_ms", ms(t));
    }
    if let Some(n) = end.input_tokens {
        request.record("gen_ai.usage.input_tokens", n);
    }
    if let Some(n) = end.cached_tokens {
        request.record("prefixlb.cached_tokens", n);
    }
    if let Some(n) = end.output_tokens {
        request.record("gen_ai.usage.output_tokens", n);
    }
    if end.outcome != "success" {
        request.record("error.type", end.outcome);
        attempt.record("error.type", end.outcome);
        if end.status >= 500 || end.outcome != "client_error" {
            request.record("otel.status_code", "ERROR");
            attempt.record("otel.status_code", "ERROR");
        }
    }
}

/// Sets `traceparent` (and `tracestate`) in `headers` to name `span`, replacing what
/// the client sent. Does nothing when traces are off.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
}

/// Milliseconds, as span attributes carry them.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
