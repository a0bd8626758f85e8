//! Prometheus metrics: one registry, and the families each component updates, handed
//! to it when it is made: what requests did ([`RequestMetrics`], the data plane's), what
//! the membership watcher sees ([`FleetMetrics`]) and config reloads (the control
//! plane's). Label sets are bounded: node ids, pool names and fixed enums, never a model
//! string from a client or a path. Node ids are unique across pools, so the per-node
//! families carry `node` alone (the card's names); the per-request families carry
//! `pool` too. Per-node state (in-flight, caps, breaker, health, shunting, queues, ring
//! sizes) is read from the current routing snapshot at scrape time, so it is always
//! exact and a node removed by a reload disappears from the page.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use super::outcome::{FailoverReason, RequestOutcome, StoredLookup};
pub use super::series::NodeSeries;
use super::series::{Families, HistogramSpecs, SeriesCache};
use crate::routing::breaker::BreakerState;
use crate::routing::route::RouteKind;
use crate::routing::table::Table;

/// TTFT buckets: a prefix-cache hit answers in tens of milliseconds, a cold prefill of
/// a long prompt in seconds, a queued or swapping engine in tens of seconds, and a
/// stall ends at `first_token_timeout` (60 s by default; deep pools allow more).
const TTFT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];
/// Whole-request buckets: from a cached short answer to a long generation, up to the
/// 600 s `request_timeout`.
const DURATION_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Queue waits: a slot usually frees within one generation; `queue_timeout` is 30 s.
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Every metric of the balancer: the registry and its families, by who updates them.
pub struct Metrics {
    registry: Registry,
    /// The data plane's.
    pub requests: Arc<RequestMetrics>,
    /// The membership watcher's.
    pub fleet: Arc<FleetMetrics>,
    /// The control plane's: config reloads, by result.
    pub config_reloads: IntCounterVec,
    /// The client port's: open client connections, by serving lane.
    pub client_connections: IntGaugeVec,
    /// Serving threads' CPU yields (`server.yield_after`), by lane.
    pub lane_yields: IntCounterVec,
    /// Read from the routing snapshot at each scrape.
    snapshot: SnapshotGauges,
}

/// What requests did: the families the data plane updates.
pub struct RequestMetrics {
    failovers: IntCounterVec,
    stored_responses: IntCounterVec,
    queue_wait: HistogramVec,
    queue_wait_by_tenant: HistogramVec,
    queue_sheds: IntCounterVec,
    rate_limited: IntCounterVec,
    tenant_tokens: IntCounterVec,
    tls_refusals: IntCounterVec,
    sse_keepalives: IntCounterVec,
    /// The per-node series the data plane updates (see [`NodeSeries`]), and their
    /// families (`requests_total`, `ttft_seconds`, …).
    series: SeriesCache,
}

/// One tenant's token counters, looked up once for a request and added to when it
/// ends.
pub struct TenantTokens {
    prompt: IntCounter,
    cached: IntCounter,
    completion: IntCounter,
}

impl TenantTokens {
    /// Adds a request's prompt tokens (and those served from cache) and its output.
    pub fn count(&self, prompt: u64, cached: u64, completion: u64) {
        self.prompt.inc_by(prompt);
        self.cached.inc_by(cached);
        self.completion.inc_by(completion);
    }
}

/// What the membership watcher sees of Redis.
pub struct FleetMetrics {
    /// With `[redis]`: 1 while the Redis watcher reads membership, 0 while Redis is
    /// unreachable. Without: no series (a family with no labels whose one series is
    /// removed), so it cannot read as Redis down.
    pub redis_up: IntGaugeVec,
    /// `serve` replicas heartbeating in Redis, this one included.
    pub balancer_replicas: IntGauge,
    /// Per `discover` name: 1 while its last lookup answered, 0 while it
    /// fails (its nodes frozen as last known).
    pub dns_up: IntGaugeVec,
}

/// Gauges set from the routing snapshot when the page is rendered.
struct SnapshotGauges {
    in_flight: IntGaugeVec,
    node_cap: IntGaugeVec,
    breaker_state: IntGaugeVec,
    breaker_transitions: IntCounterVec,
    shunt_ratio: GaugeVec,
    node_degraded: IntGaugeVec,
    normalized_ttft_p90: GaugeVec,
    node_healthy: IntGaugeVec,
    queue_depth: IntGaugeVec,
    queue_depth_by_priority: IntGaugeVec,
    ring_nodes: IntGaugeVec,
    engine_running: GaugeVec,
    engine_waiting: GaugeVec,
    engine_kv_cache_usage: GaugeVec,
    tls_certificate_expiry: IntGaugeVec,
    /// Breaker transitions already exported, per (node, state).
    transitions_seen: Mutex<HashMap<(String, BreakerState), u64>>,
}

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help).namespace("prefixlb")
}

fn hist(name: &str, help: &str, buckets: &[f64]) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .namespace("prefixlb")
        .buckets(buckets.to_vec())
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("metric definitions are valid");
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric names are unique");
                m
            }};
        }
        let families = Families {
            requests: reg!(IntCounterVec::new(
                opts("requests_total", "Requests finished, by pool, final node and outcome."),
                &["pool", "node", "outcome"]
            )),
            routing_decisions: reg!(IntCounterVec::new(
                opts("routing_decisions_total", "Where requests were sent: primary, spill, shunt, queued or fallback."),
                &["pool", "route"]
            )),
            prompt_tokens: reg!(IntCounterVec::new(
                opts("prompt_tokens_total", "Prompt tokens, from the engines' usage reports."),
                &["node"]
            )),
            cached_prompt_tokens: reg!(IntCounterVec::new(
                opts("cached_prompt_tokens_total", "Prompt tokens served from the engines' prefix caches (usage.prompt_tokens_details.cached_tokens, or Anthropic's usage.cache_read_input_tokens)."),
                &["node"]
            )),
        };
        let (series, histograms) = SeriesCache::new(
            families,
            HistogramSpecs {
                request_duration: hist(
                    "request_duration_seconds",
                    "Request duration to the end of the response body.",
                    DURATION_BUCKETS,
                )
                .variable_labels(vec!["pool".into(), "node".into()]),
                ttft: hist(
                    "ttft_seconds",
                    "Time to first token of committed streams (upstream send to first output).",
                    TTFT_BUCKETS,
                )
                .variable_labels(vec!["pool".into(), "node".into()]),
                spill_distance: hist(
                    "spill_distance",
                    "Position of the serving node in the key's walk (0 = primary).",
                    &[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
                ),
            },
        );
        registry
            .register(Box::new(histograms))
            .expect("metric names are unique");
        let requests = RequestMetrics {
            failovers: reg!(IntCounterVec::new(
                opts("failovers_total", "Attempts abandoned before commit, by reason."),
                &["pool", "reason"]
            )),
            stored_responses: reg!(IntCounterVec::new(
                opts("stored_response_requests_total", "Requests naming a stored response (previous_response_id, /v1/responses/{id}), by how its engine was found: known, found (asked engine by engine), missing (no engine held it), unavailable (its engine takes no requests)."),
                &["pool", "holder"]
            )),
            queue_wait: reg!(HistogramVec::new(
                hist("queue_wait_seconds", "Time queued requests waited for a slot.", QUEUE_BUCKETS),
                &["pool"]
            )),
            queue_wait_by_tenant: reg!(HistogramVec::new(
                hist("queue_wait_by_tenant_seconds", "Time queued requests waited for a slot, by priority class and tenant (configured tenants and key names; any other is `other`).", QUEUE_BUCKETS),
                &["priority", "tenant"]
            )),
            queue_sheds: reg!(IntCounterVec::new(
                opts("queue_shed_total", "Queued requests refused before they took a slot: their deadline passed (`deadline`) or the queue was full (`queue_full`)."),
                &["pool", "priority", "reason"]
            )),
            rate_limited: reg!(IntCounterVec::new(
                opts("rate_limited_total", "Requests refused with 429 for their tenant's rate limit, by limit."),
                &["tenant", "limit"]
            )),
            tenant_tokens: reg!(IntCounterVec::new(
                opts("tenant_tokens_total", "Tokens by tenant, from the engines' usage reports: `prompt`, `cached` (of the prompt, served from a prefix cache) and `completion` (output). Counted when the config tells tenants apart ([[tenants]], tenant_header, client certificates or named API keys)."),
                &["tenant", "kind"]
            )),
            tls_refusals: reg!(IntCounterVec::new(
                opts("tls_handshake_failures_total", "Client connections to the HTTPS port that ended before a TLS session: `plain_http` (answered 400 https_required), `timeout` (no handshake within header_read_timeout), `failed` (no version or cipher in common, the client refused our certificate, not TLS, or it left)."),
                &["reason"]
            )),
            sse_keepalives: reg!(IntCounterVec::new(
                opts("sse_keepalives_total", "SSE keep-alive comments sent to clients (server.sse_keepalive): `waiting` before the stream's answer (queued, a cold prefill; the first commits the stream), `streaming` in a pause of a committed stream."),
                &["when"]
            )),
            series,
        };
        let snapshot = SnapshotGauges {
            in_flight: reg!(IntGaugeVec::new(opts("in_flight", "Requests reserved on a node."), &["node"])),
            node_cap: reg!(IntGaugeVec::new(opts("node_cap", "A node's in-flight cap now."), &["node"])),
            breaker_state: reg!(IntGaugeVec::new(
                opts("breaker_state", "Breaker state: 0 closed, 1 open, 2 half_open, 3 recovering."),
                &["node"]
            )),
            breaker_transitions: reg!(IntCounterVec::new(
                opts("breaker_transitions_total", "Breaker transitions, by the state entered."),
                &["node", "to"]
            )),
            shunt_ratio: reg!(GaugeVec::new(opts("shunt_ratio", "Share of a node's keys shunted to their next node."), &["node"])),
            node_degraded: reg!(IntGaugeVec::new(opts("node_degraded", "1 if latency would open the node's breaker but the pool's ejection cap keeps it in rotation."), &["node"])),
            normalized_ttft_p90: reg!(GaugeVec::new(opts("normalized_ttft_p90", "P90 over the breaker window of TTFT divided by the TTFT the work should take (1 = as expected)."), &["node"])),
            node_healthy: reg!(IntGaugeVec::new(opts("node_healthy", "1 if the node passes its health checks."), &["node"])),
            queue_depth: reg!(IntGaugeVec::new(opts("queue_depth", "Requests waiting for a slot."), &["pool"])),
            queue_depth_by_priority: reg!(IntGaugeVec::new(opts("queue_depth_by_priority", "Requests waiting for a slot, by priority class."), &["pool", "priority"])),
            ring_nodes: reg!(IntGaugeVec::new(opts("ring_nodes", "Nodes on a pool's ring."), &["pool"])),
            engine_running: reg!(GaugeVec::new(opts("engine_requests_running", "Sequences the engine reports running (vLLM/SGLang/llama.cpp metrics, read by the health checks or relayed by its agent; a rank of a data-parallel server: its rank's)."), &["pool", "node"])),
            engine_waiting: reg!(GaugeVec::new(opts("engine_requests_waiting", "Requests waiting in the engine's own queue, as it reports."), &["pool", "node"])),
            engine_kv_cache_usage: reg!(GaugeVec::new(opts("engine_kv_cache_usage", "Share of the engine's KV cache in use, 0-1, as it reports."), &["pool", "node"])),
            tls_certificate_expiry: reg!(IntGaugeVec::new(opts("tls_certificate_expiry_timestamp_seconds", "When a certificate of the config expires (unix seconds, the earliest notAfter of its chain): `listener` (server.tls_cert_file, shown to clients), `engine_client` ([tls] client_cert_file, shown to engines)."), &["certificate"])),
            transitions_seen: Mutex::new(HashMap::new()),
        };
        let fleet = FleetMetrics {
            redis_up: reg!(IntGaugeVec::new(opts("redis_up", "1 while membership is read from Redis; 0 while Redis is unreachable (membership frozen as last known). Not exported without a [redis] section."), &[])),
            balancer_replicas: reg!(IntGauge::with_opts(opts("balancer_replicas", "prefixlb serve replicas heartbeating in Redis, this one included (1 without Redis)."))),
            dns_up: reg!(IntGaugeVec::new(opts("dns_up", "1 while the last lookup of a discover = \"dns\" or \"srv\" name found addresses; 0 while it fails or finds none (its nodes frozen as last known)."), &["name"])),
        };
        fleet.balancer_replicas.set(1);
        let config_reloads = reg!(IntCounterVec::new(
            opts("config_reloads_total", "Config reloads, by result."),
            &["result"]
        ));
        let client_connections = reg!(IntGaugeVec::new(
            opts("client_connections", "Open client connections, by serving lane (`server.lanes`; lane 0 when the port is served by the shared runtime)."),
            &["lane"]
        ));
        let lane_yields = reg!(IntCounterVec::new(
            opts("lane_yields_total", "Times a serving thread, busy for `server.yield_after` without a break, offered its CPU to other waiting threads (sched_yield) before a request, by lane (lane 0 when the shared runtime serves the port)."),
            &["lane"]
        ));
        Metrics {
            registry,
            requests: Arc::new(requests),
            fleet: Arc::new(fleet),
            config_reloads,
            client_connections,
            lane_yields,
            snapshot,
        }
    }

    /// The Prometheus text page, with snapshot-derived series refreshed first.
    pub fn render(&self, table: &Table) -> String {
        self.refresh(table);
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
    fn refresh(&self, table: &Table) {
        let (g, r) = (&self.snapshot, &self.requests);
        r.series.drain();
        let f = r.series.families();
        for g in [
            &g.in_flight,
            &g.node_cap,
            &g.breaker_state,
            &g.node_degraded,
            &g.node_healthy,
            &g.queue_depth,
            &g.queue_depth_by_priority,
            &g.ring_nodes,
        ] {
            g.reset();
        }
        g.shunt_ratio.reset();
        g.normalized_ttft_p90.reset();
        for g in [
            &g.engine_running,
            &g.engine_waiting,
            &g.engine_kv_cache_usage,
        ] {
            g.reset();
        }
        g.tls_certificate_expiry.reset();
        let certificates = [
            (
                "listener",
                table.config.server.tls.as_ref().map(|t| t.expires),
            ),
            (
                "engine_client",
                table.config.tls.client_certificate_expires(),
            ),
        ];
        for (certificate, expires) in certificates {
            if let Some(e) = expires {
                g.tls_certificate_expiry
                    .with_label_values(&[certificate])
                    .set(e.not_after);
            }
        }
        for result in ["ok", "error"] {
            self.config_reloads.with_label_values(&[result]);
        }
        // At zero while keep-alives are off (a panel reads 0, not "no data").
        for when in ["waiting", "streaming"] {
            r.sse_keepalives.with_label_values(&[when]);
        }
        // Rate limits: the default tenant and every configured one, at zero until hit.
        let tenants = table.config.tenancy.tenants.keys().map(String::as_str);
        for tenant in std::iter::once("default").chain(tenants) {
            for limit in ["requests_per_minute", "tokens_per_minute"] {
                r.rate_limited.with_label_values(&[tenant, limit]);
            }
        }
        let mut seen = g.transitions_seen.lock();
        for pool in &table.pools {
            let p = pool.config.name.as_str();
            let b = &pool.balancer;
            g.ring_nodes
                .with_label_values(&[p])
                .set(b.ring().len() as i64);
            g.queue_depth
                .with_label_values(&[p])
                .set(b.load().queued() as i64);
            for (i, class) in table.config.tenancy.classes.iter().enumerate() {
                g.queue_depth_by_priority
                    .with_label_values(&[p, &class.name])
                    .set(b.load().queued_in(i) as i64);
                r.queue_wait_by_tenant
                    .with_label_values(&[&class.name, "default"]);
                for reason in ["deadline", "queue_full"] {
                    r.queue_sheds.with_label_values(&[p, &class.name, reason]);
                }
            }
            r.queue_wait.with_label_values(&[p]);
            for route in RouteKind::ALL {
                f.routing_decisions.with_label_values(&[p, route.as_str()]);
            }
            for reason in FailoverReason::ALL {
                r.failovers.with_label_values(&[p, reason.as_str()]);
            }
            for holder in StoredLookup::ALL {
                r.stored_responses.with_label_values(&[p, holder.as_str()]);
            }
            for node in b.nodes() {
                let n = node.id();
                let state = node.state();
                g.in_flight
                    .with_label_values(&[n])
                    .set(state.in_flight() as i64);
                g.node_cap
                    .with_label_values(&[n])
                    .set(b.cap_of(node) as i64);
                g.breaker_state
                    .with_label_values(&[n])
                    .set(state.breaker.state() as i64);
                g.shunt_ratio
                    .with_label_values(&[n])
                    .set(state.breaker.shunt_ratio());
                g.node_degraded
                    .with_label_values(&[n])
                    .set(state.breaker.is_degraded() as i64);
                if let Some(load) = state.engine_load() {
                    for (g, v) in [
                        (&g.engine_running, load.running),
                        (&g.engine_waiting, load.waiting),
                        (&g.engine_kv_cache_usage, load.kv_cache_usage),
                    ] {
                        if let Some(v) = v {
                            g.with_label_values(&[p, n]).set(v);
                        }
                    }
                }
                if let Some((_, p90)) = state.breaker.summary(1) {
                    g.normalized_ttft_p90
                        .with_label_values(&[n])
                        .set(p90.as_f64());
                }
                g.node_healthy
                    .with_label_values(&[n])
                    .set(state.is_healthy() as i64);
                f.prompt_tokens.with_label_values(&[n]);
                f.cached_prompt_tokens.with_label_values(&[n]);
                r.series.get(p, n).show_ttft();
                for to in [
                    BreakerState::Closed,
                    BreakerState::Open,
                    BreakerState::HalfOpen,
                    BreakerState::Recovering,
                ] {
                    let now = state.transitions(to);
                    let last = seen.entry((n.to_string(), to)).or_insert(0);
                    let counter = g.breaker_transitions.with_label_values(&[n, to.as_str()]);
                    counter.inc_by(now.saturating_sub(*last));
                    *last = now;
                }
            }
        }
    }
}

impl RequestMetrics {
    /// A node's series in its pool, for the updates of one request.
    pub fn series(&self, pool: &str, node: &str) -> &'static NodeSeries {
        self.series.get(pool, node)
    }

    /// Counts a request that ended before any node answered it (node `none`); the
    /// answered ones are counted through their node's [`NodeSeries`].
    pub fn count_unanswered(&self, pool: &str, outcome: RequestOutcome) {
        (self.series.families().requests)
            .with_label_values(&[pool, "none", outcome.as_str()])
            .inc();
    }

    /// A request naming a stored response, by how its engine was found.
    pub fn count_stored_lookup(&self, pool: &str, lookup: StoredLookup) {
        self.stored_responses
            .with_label_values(&[pool, lookup.as_str()])
            .inc();
    }

    /// Counts an attempt abandoned before commit.
    pub fn count_failover(&self, pool: &str, reason: FailoverReason) {
        self.failovers
            .with_label_values(&[pool, reason.as_str()])
            .inc();
    }

    /// A queued request's wait, by its class and tenant label.
    pub fn observe_tenant_wait(&self, priority: &str, tenant: &str, waited: Duration) {
        self.queue_wait_by_tenant
            .with_label_values(&[priority, tenant])
            .observe(waited.as_secs_f64());
    }

    /// A queued request refused before it took a slot.
    pub fn count_shed(&self, pool: &str, priority: &str, reason: &str) {
        self.queue_sheds
            .with_label_values(&[pool, priority, reason])
            .inc();
    }

    /// A request refused for its tenant's rate limit.
    pub fn count_rate_limited(&self, tenant: &str, limit: &str) {
        self.rate_limited.with_label_values(&[tenant, limit]).inc();
    }

    /// A client connection to the HTTPS port that ended before a TLS session.
    pub fn count_tls_refusal(&self, reason: &str) {
        self.tls_refusals.with_label_values(&[reason]).inc();
    }

    /// The counter of keep-alives sent `when` (`waiting`, `streaming`).
    pub fn sse_keepalives(&self, when: &str) -> IntCounter {
        self.sse_keepalives.with_label_values(&[when])
    }

    /// A tenant's token counters (its metric label: a configured name, or `other`).
    pub fn tenant_tokens(&self, tenant: &str) -> TenantTokens {
        let kind = |k: &str| self.tenant_tokens.with_label_values(&[tenant, k]);
        TenantTokens {
            prompt: kind("prompt"),
            cached: kind("cached"),
            completion: kind("completion"),
        }
    }

    pub fn observe_queue_wait(&self, pool: &str, waited: Duration) {
        self.queue_wait
            .with_label_values(&[pool])
            .observe(waited.as_secs_f64());
    }

    /// A node's prompt tokens and cached prompt tokens counted so far.
    pub fn tokens_of(&self, node: &str) -> (u64, u64) {
        self.series.tokens_of(node)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
