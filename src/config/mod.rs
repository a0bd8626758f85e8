//! Configuration in two layers: serde structs that mirror the TOML file
//! ([`file`]: every key optional except `[[pools]]`, unknown keys rejected), and the
//! validated runtime [`Config`] built from them ([`validate`]). Every error names
//! `file:line:col` and what is wrong.

mod duration;
pub mod file;
mod tenancy;
mod tls;
mod validate;

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

pub use duration::{parse_duration, Dur, MAX_DURATION};
pub use file::{FileConfig, KeyMode, PinThreads, WhenSaturated};
pub use tenancy::{ClassConfig, Tenancy, TenantConfig};
pub use tls::{unix_now, Expiry, ListenerTls, TlsConfig};
pub use validate::parse_node_url;

/// `[tracing]`, validated: where spans go, which share of new traces is kept, and
/// the service name they carry.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The OTLP/HTTP traces URL (with its path: `/v1/traces` when none was given).
    pub otlp_endpoint: String,
    pub sample_ratio: f64,
    pub service_name: String,
}

/// A secret (a token or an API key): compared in constant time, never printed.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The secret's bytes, for comparison.
    pub fn expose(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// Whether `candidate` equals this secret, in time that does not depend on where
    /// they differ (only on their lengths).
    pub fn matches(&self, candidate: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        self.expose().ct_eq(candidate).into()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub routing: RoutingConfig,
    pub breaker: BreakerSettings,
    pub health: HealthConfig,
    pub auth: AuthConfig,
    /// How engines behind `https://` URLs are reached (`[tls]`).
    pub tls: std::sync::Arc<TlsConfig>,
    /// OpenTelemetry traces (`[tracing]`); none: off.
    pub tracing: Option<TracingConfig>,
    /// Tenants and priority classes (`[[tenants]]`, `[[priorities]]`).
    pub tenancy: Tenancy,
    /// Membership from Redis heartbeats, if configured.
    pub redis: Option<RedisConfig>,
    /// How the names of `discover` nodes are looked up.
    pub discovery: DiscoveryConfig,
    pub pools: Vec<PoolConfig>,
}

/// `[redis]` (validated).
#[derive(Debug, Clone, PartialEq)]
pub struct RedisConfig {
    /// The URL as written (it may hold a password: never log it).
    pub url: Secret,
    pub password_env: Option<String>,
    pub key_prefix: String,
    pub poll_interval: Duration,
    pub heartbeat_ttl: Duration,
}

/// Accepted API keys of the client listener (none: no check), each with the tenant it
/// names, if any (`name:key` lines).
#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    pub keys: Vec<(Option<String>, Secret)>,
    pub strip: bool,
}

impl AuthConfig {
    /// Whether an `Authorization` header value carries an accepted key. Every key is
    /// compared (no early exit), each in constant time.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        self.admits_key(authorization.and_then(|v| v.strip_prefix(b"Bearer ")))
    }

    /// Whether a bare key (an `x-api-key` value, or a bearer token) is accepted.
    pub fn admits_key(&self, key: Option<&[u8]>) -> bool {
        self.admit(key).is_some()
    }

    /// Admits a bare key: `Some(tenant)` if accepted (the key's name, if it has one),
    /// `None` if refused. Every key is compared, each in constant time.
    pub fn admit(&self, key: Option<&[u8]>) -> Option<Option<&str>> {
        if self.keys.is_empty() {
            return Some(None);
        }
        let token = key?;
        let mut found = None;
        for (name, secret) in &self.keys {
            if secret.matches(token) {
                found = Some(name.as_deref());
            }
        }
        found
    }
}

/// `[discovery]`: how the names of `discover` nodes are looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    pub interval: Duration,
    /// DNS servers to ask; none: the system's resolver settings.
    pub nameservers: Vec<SocketAddr>,
}

#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
    /// Where a node of the config reports its load (none: not read).
    pub metrics_path: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub admin_token: Option<Secret>,
    pub max_body_bytes: usize,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub idle_stream_timeout: Duration,
    /// How long a stream may send the client nothing before an SSE comment (zero:
    /// never).
    pub sse_keepalive: Duration,
    /// Every request has an id in `x-request-id` (`proxy::request_id`).
    pub request_ids: bool,
    pub shutdown_grace: Duration,
    pub watch_config: bool,
    pub header_read_timeout: Duration,
    pub max_headers: usize,
    pub max_header_bytes: usize,
    pub http2_keep_alive_interval: Duration,
    pub max_connections: usize,
    /// Serving lanes (0: one shared runtime).
    pub lanes: usize,
    /// Whether each serving thread (lane, or shared runtime worker) is pinned to a CPU.
    pub pin_threads: PinThreads,
    /// How long a serving thread runs without a break before it offers its CPU (zero:
    /// never).
    pub yield_after: Duration,
    pub body_read_timeout: Duration,
    pub max_buffered_bytes: usize,
    /// The listener's certificate and key when `listen` serves HTTPS
    /// (`tls_cert_file`, `tls_key_file`), and its clients' CAs if it asks for client
    /// certificates (`tls_client_ca_file`), read when the config is.
    pub tls: Option<ListenerTls>,
    /// The admin listener serves HTTPS with `tls`'s certificate (`admin_tls`).
    pub admin_tls: bool,
}

#[derive(Debug, Clone)]
pub struct RoutingConfig {
    pub key: KeyMode,
    pub prefix_chars: usize,
    /// Lower-cased header name.
    pub key_header: http::HeaderName,
    pub hash_seed: u64,
    pub vnodes: u32,
    pub max_in_flight: u32,
    pub load_factor: Option<f64>,
    pub when_saturated: WhenSaturated,
    pub max_queue: usize,
    pub queue_timeout: Duration,
    pub max_attempts: u32,
    pub track_usage: bool,
    pub max_scan_bytes: usize,
    pub extra_paths: Vec<String>,
    pub split_cap_across_replicas: bool,
}

#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub name: String,
    pub models: Vec<String>,
    /// Other names for `models` or `adapters`: (alias, the name it stands for), in name
    /// order.
    pub aliases: Vec<(String, String)>,
    /// LoRA adapters served by the pool's engines, keyed apart (see [`PoolConfig::adapter`]).
    pub adapters: Vec<String>,
    pub first_token_timeout: Duration,
    pub fallbacks: Vec<String>,
    pub supports_thinking: bool,
    pub default: bool,
    pub nodes: Vec<NodeConfig>,
    /// Entries whose URL's host is a DNS name standing for several engines
    /// (`discover`): their nodes are made from the addresses it resolves to.
    pub named: Vec<NamedNodes>,
    /// How its requests are split between prefill and decode engines, if they are.
    pub disaggregation: Option<Disaggregation>,
    /// A disaggregated pool's decode engines: the name of the pool made of them
    /// ([`PoolConfig::decode_pool_name`]), which follows this one in the config.
    pub decode_pool: Option<String>,
    /// For the pool of a disaggregated pool's decode engines: that pool's name. Such a
    /// pool serves no model of its own: requests reach it only from its prefill pool.
    pub decodes_for: Option<String>,
    /// Its nodes' in-flight cap per unit of weight, where it is not
    /// `routing.max_in_flight` (a decode engines' pool's `decode_max_in_flight`).
    pub max_in_flight: Option<u32>,
}

/// How a disaggregated pool's requests go to its prefill and decode engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disaggregation {
    /// vLLM's KV connectors (`NixlConnector`, ...): the request goes to a prefill
    /// engine with `max_tokens` 1 and `kv_transfer_params.do_remote_decode`, then to a
    /// decode engine with the `kv_transfer_params` the prefill engine answered.
    Vllm,
    /// SGLang's (`--disaggregation-mode prefill|decode`): the request goes to a
    /// prefill and a decode engine at once, both told the prefill engine's
    /// `bootstrap_host` and `bootstrap_port` and one new `bootstrap_room`, where the
    /// decode engine pulls the KV cache from; the decode engine's answer is the
    /// client's.
    Sglang,
}

impl Disaggregation {
    pub fn as_str(self) -> &'static str {
        match self {
            Disaggregation::Vllm => "vllm",
            Disaggregation::Sglang => "sglang",
        }
    }
}

/// How a named entry's engines are found in DNS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Discover {
    /// `"dns"`: every address of the URL's host (its IPv4 ones; IPv6 if it has none), on
    /// the URL's port.
    Dns,
    /// `"srv"`: every target of the URL's host's SRV records, on its own port (Consul,
    /// a Kubernetes Service's named port).
    Srv,
}

impl Discover {
    /// As written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Discover::Dns => "dns",
            Discover::Srv => "srv",
        }
    }
}

/// An engine server a DNS name gave: its address, and its own port when the records
/// give one (SRV).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    pub ip: std::net::IpAddr,
    pub port: Option<u16>,
}

/// A `[[pools.nodes]]` entry with `discover`: one engine server per endpoint its URL's
/// host name gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedNodes {
    /// The entry's id; each endpoint's node is `{id}-{address}` (with SRV,
    /// `{id}-{address}:{port}`).
    pub id: String,
    /// The URL as written, its host the name looked up.
    pub url: http::Uri,
    pub discover: Discover,
    pub weight: u32,
    pub data_parallel_size: u32,
    /// Each of its engines' SGLang bootstrap port ([`NodeConfig::bootstrap_port`]).
    pub bootstrap_port: Option<u16>,
}

impl NamedNodes {
    /// The DNS name looked up.
    pub fn name(&self) -> &str {
        self.url.host().unwrap_or_default()
    }

    /// The nodes of the engine server at `endpoint`: its id is `{id}-{address}` (and
    /// `:{port}` for a port of its own) and its URL this entry's with the address for
    /// the name (and its own port).
    pub fn at(&self, endpoint: Endpoint) -> Vec<NodeConfig> {
        let address = match endpoint.ip {
            std::net::IpAddr::V4(a) => a.to_string(),
            std::net::IpAddr::V6(a) => format!("[{a}]"),
        };
        let (id, authority) = match (endpoint.port, self.url.port_u16()) {
            (Some(port), _) => (
                format!("{}-{address}:{port}", self.id),
                format!("{address}:{port}"),
            ),
            (None, Some(port)) => (
                format!("{}-{}", self.id, endpoint.ip),
                format!("{address}:{port}"),
            ),
            (None, None) => (format!("{}-{}", self.id, endpoint.ip), address),
        };
        let mut parts = self.url.clone().into_parts();
        // An address and a port always make an authority.
        parts.authority = authority.parse().ok();
        let url = http::Uri::from_parts(parts).unwrap_or_else(|_| self.url.clone());
        let mut nodes = NodeConfig::ranks(id, url, self.weight, self.data_parallel_size);
        for node in &mut nodes {
            node.bootstrap_port = self.bootstrap_port;
            if self.url.scheme_str() == Some("https") {
                // Reached at its address, its certificate names the entry's host.
                node.tls_name = Some(self.name().to_string());
            }
        }
        nodes
    }
}

impl PoolConfig {
    /// Whether requests may name this pool's models: not a decode engines' pool, which
    /// its prefill pool alone sends requests to.
    pub fn addressable(&self) -> bool {
        self.decodes_for.is_none()
    }

    /// The name of the pool made of a disaggregated pool's decode engines.
    pub fn decode_pool_name(pool: &str) -> String {
        format!("{pool}/decode")
    }

    /// The model (or adapter) an alias stands for; `None` for a name that is no alias
    /// here.
    pub fn aliased(&self, name: &str) -> Option<&str> {
        self.aliases
            .iter()
            .find(|(alias, _)| alias == name)
            .map(|(_, model)| model.as_str())
    }

    /// The adapter a requested `model` names (directly or by an alias), if it names one
    /// of the pool's adapters: its requests are keyed apart from the model's.
    pub fn adapter<'a>(&'a self, requested: &'a str) -> Option<&'a str> {
        let name = self.aliased(requested).unwrap_or(requested);
        self.adapters.iter().any(|a| a == name).then_some(name)
    }
}

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub id: String,
    /// Base URL with no trailing slash, e.g. `http://10.0.0.5:8000` or
    /// `http://host:8000/prefix`.
    pub url: http::Uri,
    pub weight: u32,
    /// The data-parallel rank this node is, of an engine server that runs several
    /// behind one URL (vLLM's `--data-parallel-size`, SGLang's `--dp-size`): each
    /// request to it names the rank in `x-data-parallel-rank`. None: the server's own.
    pub data_parallel_rank: Option<u32>,
    /// The name its engine's TLS certificate is checked against (and sent as SNI),
    /// where it is not the URL's host: a node found in DNS is reached at its address
    /// and named by the entry's host.
    pub tls_name: Option<String>,
    /// A prefill engine's port for SGLang's KV-transfer bootstrap
    /// (`--disaggregation-bootstrap-port`), sent to both legs of a request
    /// (`disaggregation = "sglang"`). None: `null`, the engines' own default (8998).
    pub bootstrap_port: Option<u16>,
}

/// Most data-parallel ranks one engine server may be split into.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 256;

impl NodeConfig {
    /// The nodes one engine server becomes: itself, or, with a `data_parallel_size` of
    /// N > 1, one node per rank, `{id}@0` … `{id}@{N-1}`, each with its own KV cache,
    /// ring points, cap and breaker, as the server's ranks have.
    pub fn ranks(id: String, url: http::Uri, weight: u32, data_parallel_size: u32) -> Vec<Self> {
        if data_parallel_size <= 1 {
            return vec![NodeConfig {
                id,
                url,
                weight,
                data_parallel_rank: None,
                tls_name: None,
                bootstrap_port: None,
            }];
        }
        (0..data_parallel_size)
            .map(|rank| NodeConfig {
                id: Self::rank_id(&id, rank),
                url: url.clone(),
                weight,
                data_parallel_rank: Some(rank),
                tls_name: None,
                bootstrap_port: None,
            })
            .collect()
    }

    /// The id of rank `rank`'s node of the server `id`.
    pub fn rank_id(id: &str, rank: u32) -> String {
        format!("{id}@{rank}")
    }

    /// The engine URL's path without its trailing `/` (empty for `http://h:8000/`).
    pub fn base_path(&self) -> &str {
        self.url.path().trim_end_matches('/')
    }

    /// The engine URL for a request path (and query) on the balancer.
    pub fn upstream_uri(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        let base = self.base_path();
        let mut parts = http::uri::Builder::new()
            .scheme(self.url.scheme_str().unwrap_or("http"))
            .authority(self.url.authority().map(|a| a.as_str()).unwrap_or(""));
        parts = parts.path_and_query(format!("{base}{path_and_query}"));
        parts.build()
    }
}

/// One shunting stage: at P90 TTFT ≥ `p90`, divert `divert` of the node's keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShuntStep {
    /// The node's median normalized TTFT is at least this multiple of its peers'
    /// reference (the median of their P90s).
    pub over_pool: f64,
    /// Share of the node's keys sent on.
    pub divert: f64,
}

/// `[breaker]` settings (validated): the TTFT-measuring circuit breaker of every node.
#[derive(Debug, Clone, PartialEq)]
pub struct BreakerSettings {
    /// Consecutive failures that open the breaker. Default 2.
    pub failure_threshold: u32,
    /// How long an open breaker refuses traffic. Default 30 s.
    pub open_for: Duration,
    /// A stream that reached its first token within this is never slow. Default 1 s.
    pub slow_ttft: Duration,
    /// A stream is slow when its normalized TTFT is over this multiple of its peers'
    /// reference (the median of their P90s). Default 3.
    pub slow_factor: f64,
    /// Share of slow streams in the window that opens the breaker. Default 0.5.
    pub slow_ratio: f64,
    /// Streams in a row, each over `slow_factor` times the peers' latest normalized
    /// TTFT, that open the breaker whatever the window holds. Default 5.
    pub slow_streams: u32,
    /// Streams the window must hold before it may open the breaker or shunt. Default 10.
    pub min_samples: usize,
    /// How far back TTFT samples count. Default 60 s.
    pub window: Duration,
    /// Shares of keys admitted while recovering, one per `canary_step`. Default
    /// `[0.1, 0.3, 0.7, 1.0]`.
    pub canary_steps: Vec<f64>,
    /// Duration of each canary step. Default 10 s.
    pub canary_step: Duration,
    /// Shunting stages, ascending. Default a median 1.5× the peers' reference → 20 %, 2× → 50 %.
    pub shunt_steps: Vec<ShuntStep>,
    /// Latency never takes more than this share of a pool's nodes out of rotation.
    /// Default 0.5.
    pub max_ejected_share: f64,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        BreakerSettings {
            failure_threshold: 2,
            open_for: Duration::from_secs(30),
            slow_ttft: Duration::from_secs(1),
            slow_factor: 3.0,
            slow_ratio: 0.5,
            slow_streams: 5,
            min_samples: 10,
            window: Duration::from_secs(60),
            canary_steps: vec![0.1, 0.3, 0.7, 1.0],
            canary_step: Duration::from_secs(10),
            shunt_steps: vec![
                ShuntStep {
                    over_pool: 1.5,
                    divert: 0.2,
                },
                ShuntStep {
                    over_pool: 2.0,
                    divert: 0.5,
                },
            ],
            max_ejected_share: 0.5,
        }
    }
}

/// A configuration error, located in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            line: 1,
            col: 1,
            message: format!("cannot read config: {e}"),
        })?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parses and validates config text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        let at = |span: Option<Range<usize>>, message: String| {
            let (line, col) = line_col(text, span.map(|s| s.start).unwrap_or(0));
            ConfigError {
                file: file.to_string(),
                line,
                col,
                message,
            }
        };
        let raw: FileConfig =
            toml::from_str(text).map_err(|e| at(e.span(), e.message().trim().to_string()))?;
        let dir = Path::new(file).parent().unwrap_or(Path::new(""));
        validate::config(raw, dir).map_err(|(span, msg)| at(span, msg))
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    (line, before[line_start..].chars().count() + 1)
}

#[cfg(test)]
mod tests;
