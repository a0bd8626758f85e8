//! The data plane: reads a request (bounded), plans its route from the current
//! [`Table`] snapshot, and hands it to [`forward`] for admission, the upstream exchange
//! and failover. Requests the balancer answers itself (`GET /v1/models`, `GET /health`)
//! and every error end here as complete responses.

mod admission;
pub mod body;
pub mod edit;
mod error;
mod forward;
mod h1;
pub mod headers;
pub mod ingress;
pub mod outcome;
mod probe;
mod relay;
pub mod sse;
mod upstream;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use parking_lot::Mutex;
use serde_json::json;
use tokio::time::Instant;

pub use error::ProxyError;

use crate::clip::clip;
use crate::config::{Config, ConfigError};
use crate::fleet::record::{self, Membership, NodeRecord};
use crate::routing::key::Api;
use crate::routing::table::{Registry, Table};
use crate::server::metrics::Metrics;
use body::{full, BoxBody};
use ingress::{BodyLimits, ByteBudget};
use outcome::RequestOutcome;

/// What a table is built from.
struct Sources {
    config: Config,
    /// Heartbeating engines (their identity: load figures and start times zeroed).
    members: Vec<NodeRecord>,
}

/// The upstream HTTP client: pooled keep-alive connections to the engines.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// The balancer's shared state: the current routing snapshot, the runtime state
/// registry, and the pooled client.
pub struct Proxy {
    table: ArcSwap<Table>,
    registry: Registry,
    /// For health checks.
    client: UpstreamClient,
    /// For requests: keep-alive connections handed back by the relayed body.
    upstream: Arc<upstream::Upstream>,
    metrics: Arc<Metrics>,
    /// Request bytes held across all connections (`max_buffered_bytes`).
    budget: Arc<ByteBudget>,
    /// The config file, for reloads (none for in-process configs).
    source: Option<PathBuf>,
    /// Reloads run one at a time, whatever triggered them.
    reloading: Mutex<()>,
    /// The config as loaded and the engines heartbeating in Redis: the table is built
    /// from both, whichever changed (one rebuild at a time).
    sources: Mutex<Sources>,
    stopping: AtomicBool,
}

impl Proxy {
    pub fn new(config: Config, source: Option<PathBuf>) -> Arc<Proxy> {
        let registry = Registry::default();
        let client = upstream_client(config.server.connect_timeout);
        let upstream = upstream::Upstream::new(config.server.connect_timeout, UPSTREAM_IDLE);
        let table = Table::build(config.clone(), &registry);
        Arc::new(Proxy {
            sources: Mutex::new(Sources {
                config,
                members: Vec::new(),
            }),
            table: ArcSwap::from_pointee(table),
            registry,
            client,
            upstream,
            metrics: Arc::new(Metrics::new()),
            budget: Arc::default(),
            source,
            reloading: Mutex::new(()),
            stopping: AtomicBool::new(false),
        })
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The config file this balancer reloads from, if any.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// Request bytes buffered now, across all connections.
    pub fn buffered_bytes(&self) -> usize {
        self.budget.used()
    }

    /// Re-reads the config file: parse, validate, build a new snapshot (node state
    /// carried over by id), swap it in. An invalid file keeps the running config.
    /// Concurrent reloads (SIGHUP, the file watch, `/admin/reload`) run one at a time.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let _one_at_a_time = self.reloading.lock();
        let result = self.try_reload();
        let label = if result.is_ok() { "ok" } else { "error" };
        self.metrics
            .config_reloads
            .with_label_values(&[label])
            .inc();
        match &result {
            Ok(()) => tracing::info!("config reloaded"),
            Err(e) => tracing::error!(error = %e, "config reload failed; the running config stays"),
        }
        result
    }

    fn try_reload(&self) -> Result<(), ConfigError> {
        let Some(path) = &self.source else {
            return Err(ConfigError {
                file: "(none)".into(),
                line: 1,
                col: 1,
                message: "this balancer was not started from a config file".into(),
            });
        };
        let config = Config::load(path)?;
        let old = self.table();
        let (was, now) = (&old.config.server, &config.server);
        let restart_only = [
            ("listen", was.listen != now.listen),
            ("admin_listen", was.admin_listen != now.admin_listen),
            (
                "header_read_timeout",
                was.header_read_timeout != now.header_read_timeout,
            ),
            ("max_headers", was.max_headers != now.max_headers),
            (
                "max_header_bytes",
                was.max_header_bytes != now.max_header_bytes,
            ),
            (
                "http2_keep_alive_interval",
                was.http2_keep_alive_interval != now.http2_keep_alive_interval,
            ),
            (
                "max_connections",
                was.max_connections != now.max_connections,
            ),
        ];
        for (key, changed) in restart_only {
            if changed {
                tracing::warn!("server.{key} changed: that takes a restart; the rest is applied");
            }
        }
        self.install(config);
        Ok(())
    }

    /// The current routing snapshot.
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// Builds a snapshot from `config` and the heartbeating engines (carrying node
    /// state over by id) and swaps it in.
    pub fn install(&self, config: Config) {
        let mut sources = self.sources.lock();
        sources.config = config;
        self.rebuild(&sources);
    }

    /// Applies what the Redis watcher read: each engine's load figures, the number of
    /// balancer replicas, and, when the set of engines changed, a new snapshot.
    pub fn apply_membership(&self, m: &Membership) {
        for r in &m.nodes {
            self.registry.node(&r.id).set_engine_load(r.load);
        }
        let mut sources = self.sources.lock();
        for p in &sources.config.pools {
            self.registry.pool(&p.name).set_replicas(m.replicas.max(1));
        }
        let members: Vec<NodeRecord> = m
            .nodes
            .iter()
            .map(|r| NodeRecord {
                load: None,
                started_at: 0,
                ..r.clone()
            })
            .collect();
        if members != sources.members {
            let (was, now) = (sources.members.len(), members.len());
            sources.members = members;
            tracing::info!(nodes_before = was, nodes_now = now, "membership changed");
            self.rebuild(&sources);
        }
    }

    fn rebuild(&self, sources: &Sources) {
        let (config, from_redis, skipped) = record::merge(&sources.config, &sources.members);
        for s in skipped {
            tracing::warn!("{s}");
        }
        self.table.store(Arc::new(Table::build_with(
            config,
            &self.registry,
            &from_redis,
        )));
    }

    /// Drops idle engine connections that expired or closed (see [`upstream::Upstream::sweep`]).
    pub fn sweep_idle_connections(&self) {
        self.upstream.sweep();
    }

    /// The pooled client the health checker uses.
    pub fn client(&self) -> &UpstreamClient {
        &self.client
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
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<BoxBody> {
        let table = self.table();
        let started = Instant::now();
        let mut pool = None;
        match self.route(&table, req, peer, started, &mut pool).await {
            Ok(resp) => resp,
            Err(e) => {
                let pool = pool.unwrap_or("none");
                let outcome = RequestOutcome::of_status(e.status().as_u16());
                self.metrics
                    .observe_request(pool, "none", outcome, started.elapsed());
                tracing::info!(
                    pool,
                    status = e.status().as_u16(),
                    code = e.code(),
                    error = %e,
                    duration_ms = started.elapsed().as_millis() as u64,
                    "request refused"
                );
                e.into()
            }
        }
    }

    async fn route<'t>(
        &self,
        table: &'t Arc<Table>,
        req: Request<Incoming>,
        peer: SocketAddr,
        started: Instant,
        pool: &mut Option<&'t str>,
    ) -> Result<Response<BoxBody>, ProxyError> {
        let path = req.uri().path();
        let method = req.method();
        if method == Method::GET && path == "/health" {
            return Ok(Response::new(full("ok")));
        }
        // Before anything is read or revealed.
        let auth = &table.config.auth;
        if !auth.admits(
            req.headers()
                .get(header::AUTHORIZATION)
                .map(HeaderValue::as_bytes),
        ) {
            return Err(ProxyError::Unauthorized);
        }
        if path == "/v1/models" {
            return match *method {
                Method::GET => Ok(models(table)),
                _ => Err(method_not_allowed(method, path)),
            };
        }
        let api = Api::from_path(path);
        if api == Api::Other && !table.config.routing.extra_paths.iter().any(|p| p == path) {
            return Err(ProxyError::UnknownPath {
                method: clip(method.as_str()),
                path: clip(path),
            });
        }
        if api.requires_json() {
            if method != Method::POST {
                return Err(method_not_allowed(method, path));
            }
            ingress::check_json_content_type(req.headers())?;
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
        let body = ingress::read_body(body, &parts.headers, limits, &mut claim).await?;
        let header_key = parts
            .headers
            .get(&table.config.routing.key_header)
            .map(HeaderValue::as_bytes);
        let plan = table.plan(parts.uri.path(), header_key, &body)?;
        *pool = Some(&table.pools[plan.pool].config.name);
        let exchange = forward::Exchange {
            upstream: &self.upstream,
            metrics: &self.metrics,
            table,
            plan,
            method: parts.method,
            path: parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
            headers: headers::upstream_headers(parts.headers, peer, auth.strip),
            body,
            started,
        };
        exchange.run().await
    }
}

fn method_not_allowed(method: &Method, path: &str) -> ProxyError {
    ProxyError::MethodNotAllowed {
        method: clip(method.as_str()),
        path: clip(path),
    }
}

/// How long an idle upstream connection is kept for reuse.
const UPSTREAM_IDLE: Duration = Duration::from_secs(4);

fn upstream_client(connect_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        // Engines close idle keep-alive connections early (uvicorn under vLLM and
        // SGLang after 5 s, llama.cpp's server after 5 s): a connection reused past
        // that fails mid-request (`IncompleteMessage`), which would count against a
        // healthy node. Drop idle ones before.
        .pool_idle_timeout(UPSTREAM_IDLE)
        .build(connector)
}

/// `GET /v1/models`, answered from the pools.
fn models(table: &Table) -> Response<BoxBody> {
    let data: Vec<_> = table
        .models()
        .map(|(m, pool)| json!({"id": m, "object": "model", "created": 0, "owned_by": format!("prefixlb/{}", pool.config.name)}))
        .collect();
    let mut resp = Response::new(full(json!({"object": "list", "data": data}).to_string()));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
