//! The data plane: reads a request (bounded), places it on the current [`Table`]
//! snapshot ([`Table::place`]), and hands it to [`forward`] for admission, the upstream
//! exchange and failover. Requests the balancer answers itself (`GET /v1/models`,
//! `GET /health`) and every error end here as complete responses.

mod admission;
pub mod body;
mod disaggregated;
pub mod edit;
mod error;
mod forward;
pub(crate) mod h1;
pub mod headers;
pub mod ingress;
mod keepalive;
pub mod kv_transfer;
mod probe;
mod relay;
pub mod request_body;
mod request_id;
pub mod sse;
pub mod tenant;
mod unanswered;
mod upstream;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::uri::PathAndQuery;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use request_body::RequestBody;
use serde_json::json;
use tokio::time::Instant;

pub use error::{anthropic_kind as anthropic_error_kind, ProxyError};

use crate::clip::clip;
use crate::routing::facts::Api;
use crate::routing::table::Table;
use crate::routing::Mode;
use crate::telemetry::metrics::RequestMetrics;
use crate::telemetry::outcome::RequestOutcome;
use crate::telemetry::traces;
use body::{full, BoxBody};
use ingress::{BodyLimits, ByteBudget};
use unanswered::{Progress, Unanswered};

/// The data plane's shared state: the current routing snapshot (swapped whole by the
/// control plane), the engine connections, the metric families it updates, and the
/// request-byte budget.
pub struct Proxy {
    table: ArcSwap<Table>,
    /// Keep-alive connections to the engines, handed back by the relayed body: one
    /// pool per serving lane (see [`set_lane`]), so a lane's requests reuse the
    /// connections its own runtime drives.
    upstreams: Box<[Arc<upstream::Upstream>]>,
    /// The health checks' own connections: a check never leaves the requests a
    /// connection the engine is about to close.
    checks: Arc<upstream::Upstream>,
    metrics: Arc<RequestMetrics>,
    /// Request bytes held across all connections (`max_buffered_bytes`).
    budget: Arc<ByteBudget>,
    /// The tenants' rate-limit buckets (kept across reloads).
    limits: Arc<tenant::Limiter>,
    stopping: AtomicBool,
}

impl Proxy {
    /// A data plane serving `table`, its engine connections bounded by the table's
    /// `connect_timeout`.
    pub fn new(table: Table, metrics: Arc<RequestMetrics>) -> Arc<Proxy> {
        Proxy::with_lanes(table, metrics, 1)
    }

    /// A data plane whose requests are served by `lanes` runtimes, each with its own
    /// engine connections.
    pub fn with_lanes(table: Table, metrics: Arc<RequestMetrics>, lanes: usize) -> Arc<Proxy> {
        let timeout = table.config.server.connect_timeout;
        let upstreams = (0..lanes.max(1))
            .map(|_| upstream::Upstream::new(timeout, UPSTREAM_IDLE))
            .collect();
        let checks = upstream::Upstream::new(timeout, UPSTREAM_IDLE);
        Arc::new(Proxy {
            table: ArcSwap::from_pointee(table),
            upstreams,
            checks,
            metrics,
            budget: Arc::default(),
            limits: Arc::default(),
            stopping: AtomicBool::new(false),
        })
    }

    /// Request bytes buffered now, across all connections.
    pub fn buffered_bytes(&self) -> usize {
        self.budget.used()
    }

    /// The current routing snapshot.
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// Swaps in a new routing snapshot; requests in flight keep the one they started
    /// with.
    pub fn install(&self, table: Table) {
        self.table.store(Arc::new(table));
    }

    /// Drops idle engine connections that expired or closed (see [`upstream::Upstream::sweep`]).
    pub fn sweep_idle_connections(&self) {
        for u in self.upstreams.iter() {
            u.sweep();
        }
        self.checks.sweep();
    }

    /// One active health check of `node`: `GET path` (after the URL's base path) on
    /// the checks' own engine connections (over TLS for an `https://` engine),
    /// a 2xx within `timeout` with its body read to the end; else why not.
    pub async fn check_node(
        &self,
        node: &crate::routing::node::Node,
        path: &str,
        timeout: Duration,
    ) -> Result<(), String> {
        tokio::time::timeout(timeout, self.get(&self.checks, node, path))
            .await
            .map_err(|_| format!("no answer within {} ms", timeout.as_millis()))?
            .map(drop)
    }

    /// Reads what `node`'s engine serves from its `/v1/models` (on the checks'
    /// connections, bounded by `timeout`), for the nodes behind its URL to keep: LoRA
    /// adapters its engine lists are learned, and an engine that does not list an
    /// adapter is not chosen for it. None: the engine cannot say (its nodes' lists stay
    /// unknown).
    pub async fn read_models(
        &self,
        node: &crate::routing::node::Node,
        timeout: Duration,
    ) -> Option<crate::routing::node::Served> {
        tokio::time::timeout(timeout, self.get(&self.checks, node, "/v1/models"))
            .await
            .ok()
            .and_then(Result::ok)
            .and_then(|body| crate::routing::node::Served::from_json(&body))
    }

    /// Reads the Prometheus text of `node`'s engine at `path` (on the checks'
    /// connections, bounded by `timeout`). None: no 2xx answer in time.
    pub async fn read_metrics(
        &self,
        node: &crate::routing::node::Node,
        path: &str,
        timeout: Duration,
    ) -> Option<bytes::Bytes> {
        tokio::time::timeout(timeout, self.get(&self.checks, node, path))
            .await
            .ok()
            .and_then(Result::ok)
    }

    /// `GET path` on `node`'s engine over `via`: the body of a 2xx, else why not.
    async fn get(
        &self,
        via: &Arc<upstream::Upstream>,
        node: &crate::routing::node::Node,
        path: &str,
    ) -> Result<bytes::Bytes, String> {
        let target = PathAndQuery::try_from(path)
            .ok()
            .and_then(|p| node.origin_form(&p).ok())
            .ok_or_else(|| format!("{path:?} is no path for this node"))?;
        let (authority, host) = node.authority().ok_or("the node's URL has no host")?;
        let tls = match node.is_tls() {
            false => None,
            true => Some(self.table().config.tls.client()?),
        };
        let empty = (headers::UpstreamHeaders::default(), bytes::Bytes::new());
        let req = upstream::Outgoing {
            method: &Method::GET,
            target: target.path_and_query().map_or("/", |p| p.as_str()),
            host,
            headers: &empty.0,
            rank: node.rank_header(),
            body: &empty.1,
            tls: tls.as_ref(),
            tls_name: node.tls_name(),
        };
        // Bounded by the caller's timeout.
        let resp = via
            .send(authority, req, Instant::now(), None)
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let mut body = resp.into_body();
        let mut bytes = bytes::BytesMut::new();
        while let Some(frame) = http_body_util::BodyExt::frame(&mut body).await {
            if let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() {
                if bytes.len() + data.len() > MAX_READ_BYTES {
                    return Err("the answer is too long".into());
                }
                bytes.extend_from_slice(&data);
            }
        }
        body.release(Instant::now());
        match status.is_success() {
            true => Ok(bytes.freeze()),
            false => Err(format!("HTTP {}", status.as_u16())),
        }
    }

    /// Marks the balancer as shutting down (`/readyz` answers 503).
    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// Handles one client request; always returns a complete response.
    pub async fn handle(
        &'static self,
        req: Request<RequestBody>,
        peer: SocketAddr,
    ) -> Response<BoxBody> {
        let table = self.table();
        let every = table.config.server.sse_keepalive;
        if !every.is_zero() {
            // Boxed: a request's future holds this path's only when keep-alives are on.
            return Box::pin(self.kept_alive(table, req, peer, every)).await;
        }
        // Here, not in a function awaited here: one more level of futures moved each
        // request's whole future once more (1,000 instructions a request, measured).
        let api = Api::from_path(req.uri().path());
        let mut req = req;
        let mut request = self.begin(&table, &mut req);
        let started = request.started();
        let routed = self
            .route(&table, req, peer, started, &mut request.at, &request.span)
            .await;
        request.answered();
        self.answer(routed, &request, api, started)
    }

    /// [`handle`](Self::handle) with `server.sse_keepalive` (`every`): the request's
    /// answer raced against its keep-alives.
    async fn kept_alive(
        &'static self,
        table: Arc<Table>,
        req: Request<RequestBody>,
        peer: SocketAddr,
        every: Duration,
    ) -> Response<BoxBody> {
        let api = Api::from_path(req.uri().path());
        let seen = Arc::new(keepalive::StreamSeen::default());
        let told = seen.clone();
        let answer = async move {
            let mut req = req;
            let mut request = self.begin(&table, &mut req);
            let started = request.started();
            request.at.stream_seen = Some(told);
            let routed = self
                .route(&table, req, peer, started, &mut request.at, &request.span)
                .await;
            request.answered();
            self.answer(routed, &request, api, started)
        };
        keepalive::answer(every, api.is_anthropic(), seen, &self.metrics, answer).await
    }

    /// A request begun: its clock read, its trace span and its id
    /// (`server.request_ids`); counted as cancelled if it is dropped before its answer.
    fn begin(&self, table: &Table, req: &mut Request<RequestBody>) -> Unanswered<'_> {
        let started = Instant::now();
        let span = traces::request_span(req.method(), req.uri().path(), req.headers());
        let server = &table.config.server;
        let id = server
            .request_ids
            .then(|| request_id::settle(req.headers_mut()));
        Unanswered::new(&self.metrics, started, span, id)
    }

    /// The client's answer: the routed one or the refusal, with the request's id.
    fn answer(
        &self,
        routed: Result<Response<BoxBody>, ProxyError>,
        request: &Unanswered<'_>,
        api: Api,
        started: Instant,
    ) -> Response<BoxBody> {
        let mut answer = routed.unwrap_or_else(|e| self.refused(request, e, api, started));
        if let Some(id) = &request.at.id {
            request_id::tell(answer.headers_mut(), &id.value, api);
        }
        answer
    }

    /// A request refused with `e`: counted, logged, answered in its API's shape.
    fn refused(
        &self,
        request: &Unanswered<'_>,
        e: ProxyError,
        api: Api,
        started: Instant,
    ) -> Response<BoxBody> {
        let pool = request.at.pool.unwrap_or("none");
        let outcome = RequestOutcome::of_status(e.status().as_u16());
        let span = &request.span;
        traces::record_refusal(span, e.status().as_u16(), outcome.as_str(), e.code());
        self.metrics.count_unanswered(pool, outcome);
        tracing::info!(
            pool,
            request_id = request.at.id.as_ref().map(|id| request_id::text(&id.value)),
            status = e.status().as_u16(),
            code = e.code(),
            error = %e,
            duration_ms = started.elapsed().as_millis() as u64,
            "request refused"
        );
        e.into_response(api)
    }

    async fn route<'t>(
        &self,
        table: &'t Arc<Table>,
        req: Request<RequestBody>,
        peer: SocketAddr,
        started: Instant,
        at: &mut Progress<'t>,
        span: &tracing::Span,
    ) -> Result<Response<BoxBody>, ProxyError> {
        let path = req.uri().path();
        let method = req.method();
        if method == Method::GET && path == "/health" {
            return Ok(Response::new(full("ok")));
        }
        // Before anything is read or revealed.
        let auth = &table.config.auth;
        let api = Api::from_path(path);
        let Some(key_name) = auth.admit(credential(req.headers(), api)) else {
            return Err(ProxyError::Unauthorized);
        };
        if path == "/v1/models" {
            return match *method {
                Method::GET => Ok(models(table)),
                _ => Err(method_not_allowed(method, path)),
            };
        }
        if api == Api::Other && !table.config.routing.extra_paths.iter().any(|p| p == path) {
            return Err(ProxyError::UnknownPath {
                method: clip(method.as_str()),
                path: clip(path),
            });
        }
        if api.requires_json() || api.takes_form() {
            if method != Method::POST {
                return Err(method_not_allowed(method, path));
            }
            match api.takes_form() {
                true => ingress::check_form_content_type(req.headers())?,
                false => ingress::check_json_content_type(req.headers())?,
            }
            ingress::check_identity_encoding(req.headers())?;
        }
        let server = &table.config.server;
        let limits = BodyLimits {
            max_bytes: server.max_body_bytes,
            timeout: server.body_read_timeout,
            budget: server.max_buffered_bytes,
        };
        let (parts, body) = req.into_parts();
        // Held until this function returns: through the queue and every attempt.
        let mut claim = self.budget.claim();
        let body = ingress::read_body(body, &parts.headers, limits, started, &mut claim).await?;
        if api.takes_form() {
            ingress::check_form_boundary(&parts.headers, &body)?;
        }
        // Built in a block whose locals end before any `.await`: the request's future
        // (copied whole as it is made) then holds the exchange, not also the placement,
        // asker and header key it was built from.
        let mut exchange = {
            let header_key = parts
                .headers
                .get(&table.config.routing.key_header)
                .map(HeaderValue::as_bytes);
            let placement = table.place(parts.uri.path(), header_key, &body, Mode::Route)?;
            at.pool = Some(&table.pools[placement.own_pool()].config.name);
            traces::record_placement(span, &placement);
            let caller = tenant::Caller {
                key_name,
                certified: parts.extensions.get::<tenant::CertifiedName>(),
            };
            let asker = self.ask(table, caller, &parts.headers, &placement, started)?;
            if let Some(seen) = &at.stream_seen {
                if placement.facts.stream && api.streams() {
                    // A head sent early carries what its tenant has left.
                    let limits = asker.standing.as_ref().map(|s| s.headers_for(api));
                    let mut early = limits.unwrap_or_default();
                    if let Some(id) = &at.id {
                        early.extend(request_id::headers(&id.value, api));
                    }
                    seen.set(early);
                }
            }
            traces::record_asker(span, asker.tenant_label(), asker.class_name);
            let lane = LANE.with(std::cell::Cell::get) % self.upstreams.len();
            forward::Exchange {
                upstream: &self.upstreams[lane],
                metrics: &self.metrics,
                table,
                placement,
                method: parts.method,
                path: parts
                    .uri
                    .path_and_query()
                    .cloned()
                    .unwrap_or_else(|| PathAndQuery::from_static("/")),
                headers: headers::UpstreamHeaders::new(parts.headers, peer, auth.strip)
                    .with_id(at.id.clone()),
                body,
                started,
                asker,
                span: span.clone(),
                queue_wait: Duration::ZERO,
                leg: forward::Leg::Whole,
            }
        };
        // Its tokens are given back unless it is answered with a success (whose body
        // settles them from the engine's usage): refused after admission (the queue, no
        // node, every attempt failed), answered with an error status (an engine's, or
        // either leg's of a disaggregated request), or its client left while it
        // waited. It still counts as a request.
        let mut refund = tenant::Refund(exchange.asker.charge.clone());
        let answer = match exchange.placement.splits() {
            // Boxed: its future holds two legs' at once, and every request's future
            // would be as large (and copied as often) if it were held in place.
            true => Box::pin(disaggregated::run(&mut exchange, &mut at.asking)).await,
            false => exchange.run(&mut at.asking).await,
        };
        if answer.as_ref().is_ok_and(|a| a.status().is_success()) {
            refund.0 = None;
        }
        answer
    }
}

impl Proxy {
    /// Who the request is (its tenant and class), charged to its tenant's rate
    /// limits (429 when over) as of `started`, and how it waits if it must.
    fn ask<'t>(
        &self,
        table: &'t Table,
        caller: tenant::Caller<'_>,
        headers: &http::HeaderMap,
        placement: &crate::routing::decision::Placement,
        started: Instant,
    ) -> Result<admission::Asker<'t>, ProxyError> {
        let tenancy = &table.config.tenancy;
        let who = tenant::identify(tenancy, caller, headers);
        let facts = &placement.facts;
        let tokens =
            u64::from(facts.tokens.prompt) + u64::from(facts.max_tokens.unwrap_or(DEFAULT_OUTPUT));
        let mut charge = None;
        let mut standing = None;
        if placement.api.is_load() {
            if who.config.tokens_per_minute.is_some() {
                charge = Some(tenant::Charge {
                    limiter: self.limits.clone(),
                    tenant: who.tenant.clone(),
                    estimate: tokens,
                });
            }
            match self.limits.charge(&who, tokens, started.into_std()) {
                Ok(left) => standing = left.map(Box::new),
                Err(refusal) => {
                    let limit = refusal.limit.as_str();
                    self.metrics.count_rate_limited(who.label(), limit);
                    return Err(ProxyError::RateLimited {
                        tenant: clip(&who.tenant),
                        limit,
                        retry_after_secs: refusal.wait.as_secs_f64().ceil().max(1.0) as u32,
                        retry_after_ms: (refusal.wait.as_secs_f64() * 1e3).ceil().max(1.0) as u32,
                        standing: Box::new(refusal.standing),
                    });
                }
            }
        }
        let routing = &table.config.routing;
        Ok(admission::Asker {
            queue_timeout: tenant::queue_deadline(headers, routing.queue_timeout),
            class_max: tenancy.classes[who.class].max_queue,
            class_name: &tenancy.classes[who.class].name,
            charge,
            standing,
            known_tenant: who.known,
            who: crate::routing::fair::Waiting {
                weight: who.config.weight,
                class: who.class,
                cost: tokens as f64,
                tenant: who.tenant,
            },
        })
    }
}

thread_local! {
    /// The serving lane of this thread (0 on the shared runtime).
    static LANE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Marks this thread as serving lane `lane`: its requests use that lane's engine
/// connections. Called once by each lane's thread.
pub fn set_lane(lane: usize) {
    LANE.with(|l| l.set(lane));
}

/// Output tokens assumed of a request that does not say (`max_tokens`), for its cost
/// in the queue and against its tenant's token rate.
const DEFAULT_OUTPUT: u32 = 256;

fn method_not_allowed(method: &Method, path: &str) -> ProxyError {
    ProxyError::MethodNotAllowed {
        method: clip(method.as_str()),
        path: clip(path),
    }
}

/// The client's API key: the token of `Authorization: Bearer …`, or on Anthropic's
/// paths, when there is no `Authorization`, the `x-api-key` header its SDKs send.
fn credential(headers: &http::HeaderMap, api: Api) -> Option<&[u8]> {
    match headers.get(header::AUTHORIZATION) {
        Some(v) => v.as_bytes().strip_prefix(b"Bearer "),
        None if api.is_anthropic() => headers.get(&headers::X_API_KEY).map(HeaderValue::as_bytes),
        None => None,
    }
}

/// Most bytes of an engine's health, `/v1/models` or metrics answer read.
const MAX_READ_BYTES: usize = 1 << 20;

/// How long an idle upstream connection is kept for reuse: engines close idle
/// keep-alive connections early (uvicorn under vLLM and SGLang after 5 s, llama.cpp's
/// server after 5 s), and one reused past that fails mid-request, which would count
/// against a healthy node.
const UPSTREAM_IDLE: Duration = Duration::from_secs(4);

/// The data plane's clock for the routing core: tokio's (so a paused test clock holds
/// for both), as a std `Instant`.
fn now() -> std::time::Instant {
    Instant::now().into_std()
}

/// `GET /v1/models`, answered from the pools.
fn models(table: &Table) -> Response<BoxBody> {
    let mut data: Vec<_> = table
        .models()
        .map(|(m, pool)| {
            let c = &pool.config;
            let mut model = json!({"id": m, "object": "model", "created": 0, "owned_by": format!("prefixlb/{}", c.name)});
            // An adapter names its base model, as vLLM lists LoRA adapters.
            if c.adapters.iter().any(|a| a == m) {
                model["parent"] = c.models.first().map_or(json!(null), |base| json!(base));
            }
            model
        })
        .collect();
    // Adapters learned from the engines' own lists.
    for pool in &table.pools {
        for (adapter, parent) in pool.learned_adapters() {
            data.push(json!({"id": adapter, "object": "model", "created": 0, "owned_by": format!("prefixlb/{}", pool.config.name), "parent": parent}));
        }
    }
    let mut resp = Response::new(full(json!({"object": "list", "data": data}).to_string()));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
