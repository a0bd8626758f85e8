//! The data plane: reads a request (bounded), plans its route from the current
//! [`Table`] snapshot, and hands it to [`forward`] for admission, the upstream exchange
//! and failover. Requests the balancer answers itself (`GET /v1/models`, `GET /health`)
//! and every error end here as complete responses.

mod error;
mod forward;
pub mod headers;
mod probe;
mod relay;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::json;
use tokio::time::Instant;

pub use error::ProxyError;

use crate::body::{full, BoxBody};
use crate::config::{Config, ConfigError};
use crate::key::Api;
use crate::metrics::Metrics;
use crate::table::{Registry, Table};

/// The upstream HTTP client: pooled keep-alive connections to the engines.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// The balancer's shared state: the current routing snapshot, the runtime state
/// registry, and the pooled client.
pub struct Proxy {
    table: ArcSwap<Table>,
    registry: Registry,
    client: UpstreamClient,
    metrics: Arc<Metrics>,
    /// The config file, for reloads (none for in-process configs).
    source: Option<PathBuf>,
    stopping: AtomicBool,
}

impl Proxy {
    pub fn new(config: Config, source: Option<PathBuf>) -> Arc<Proxy> {
        let registry = Registry::default();
        let client = upstream_client(config.server.connect_timeout);
        let table = Table::build(config, &registry);
        Arc::new(Proxy {
            table: ArcSwap::from_pointee(table),
            registry,
            client,
            metrics: Arc::new(Metrics::new()),
            source,
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

    /// Re-reads the config file: parse, validate, build a new snapshot (node state
    /// carried over by id), swap it in. An invalid file keeps the running config.
    pub fn reload(&self) -> Result<(), ConfigError> {
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
        if was.listen != now.listen || was.admin_listen != now.admin_listen {
            tracing::warn!("server.listen / server.admin_listen changed: that needs a restart; the rest is applied");
        }
        self.install(config);
        Ok(())
    }

    /// The current routing snapshot.
    pub fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// Builds a snapshot from `config` (carrying node state over by id) and swaps it in.
    pub fn install(&self, config: Config) {
        self.table
            .store(Arc::new(Table::build(config, &self.registry)));
    }

    /// The pooled client to the engines (shared with the health checker).
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
                let outcome = match e.status().as_u16() {
                    503 => "rejected",
                    400..=499 => "client_error",
                    _ => "error",
                };
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
        if req.method() == Method::GET {
            match path {
                "/v1/models" => return Ok(models(table)),
                "/health" => return Ok(Response::new(full("ok"))),
                _ => {}
            }
        }
        let api = Api::from_path(path);
        if api.requires_json() {
            if req.method() != Method::POST {
                return Err(ProxyError::MethodNotAllowed {
                    method: req.method().to_string(),
                    path: path.to_string(),
                });
            }
            check_json_content_type(req.headers())?;
        }
        let limit = table.config.server.max_body_bytes;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            discard_body(req.into_body(), limit).await;
            return Err(ProxyError::BodyTooLarge { limit });
        }
        let (parts, body) = req.into_parts();
        let body = read_body(body, limit, declared.unwrap_or(0) as usize).await?;
        let header_key = parts
            .headers
            .get(&table.config.routing.key_header)
            .map(HeaderValue::as_bytes);
        let plan = table.plan(parts.uri.path(), header_key, &body)?;
        *pool = Some(&table.pools[plan.pool].config.name);
        forward::forward(
            &self.client,
            &self.metrics,
            table,
            plan,
            parts,
            body,
            peer,
            started,
        )
        .await
    }
}

fn upstream_client(connect_timeout: Duration) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}

/// JSON APIs take `application/json` (or a `+json` type); a missing content-type is
/// accepted, as engines do.
fn check_json_content_type(headers: &http::HeaderMap) -> Result<(), ProxyError> {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let ct = ct.to_str().unwrap_or("").to_ascii_lowercase();
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence == "application/json" || essence.ends_with("+json") {
        Ok(())
    } else {
        Err(ProxyError::UnsupportedMediaType(essence.to_string()))
    }
}

/// Reads a body of at most `limit` bytes into one buffer (sized by `content-length`).
async fn read_body(mut body: Incoming, limit: usize, declared: usize) -> Result<Bytes, ProxyError> {
    let mut buf = bytes::BytesMut::with_capacity(declared.min(limit));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ProxyError::BodyRead(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                discard_body(body, limit).await;
                return Err(ProxyError::BodyTooLarge { limit });
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.freeze())
}

/// Reads and drops the rest of an oversized body (up to 4 × the limit, for at most
/// 10 s) so that the client, still sending, can read our 413 instead of a broken pipe.
async fn discard_body(mut body: Incoming, limit: usize) {
    let cap = limit.saturating_mul(4);
    let drain = async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > cap {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
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
