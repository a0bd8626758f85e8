//! Configuration in two layers: serde structs that mirror the TOML file (every key
//! optional except `[[pools]]`, unknown keys rejected), and the validated runtime
//! [`Config`] built from them. Every error names `file:line:col` and what is wrong.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use toml::Spanned;

use crate::breaker::{BreakerSettings, ShuntStep};

// ---------------------------------------------------------------------------------
// File layer: mirrors the TOML.
// ---------------------------------------------------------------------------------

/// The TOML file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerSection,
    #[serde(default)]
    pub routing: RoutingSection,
    #[serde(default)]
    pub breaker: BreakerSection,
    #[serde(default)]
    pub health: HealthSection,
    #[serde(default)]
    pub auth: AuthSection,
    /// Required: at least one pool.
    #[serde(default)]
    pub pools: Vec<PoolSection>,
}

/// `[server]`
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// Client listener. Default `"0.0.0.0:8080"`.
    pub listen: Spanned<String>,
    /// Admin listener (metrics, node state, drain). Default `"127.0.0.1:9091"`.
    pub admin_listen: Spanned<String>,
    /// Bearer token required on the admin listener (not for `/healthz`, `/readyz`).
    /// Default: none.
    pub admin_token: Option<Secret>,
    /// Largest request body accepted; beyond it, 413. Default 16 MiB.
    pub max_body_bytes: Spanned<u64>,
    /// Longest wait for an engine's response head. Default `"600s"`.
    pub request_timeout: Dur,
    /// TCP connect timeout to an engine. Default `"2s"`.
    pub connect_timeout: Dur,
    /// Longest silence inside a committed stream. Default `"120s"`.
    pub idle_stream_timeout: Dur,
    /// How long in-flight requests may run after SIGTERM. Default `"30s"`.
    pub shutdown_grace: Dur,
    /// Reload when the file's mtime changes (and then stays for a second). Default false.
    pub watch_config: bool,
    /// Time a client has to send a request head; on a kept-alive HTTP/1.1 connection
    /// also the longest idle wait for the next request. Default `"10s"`.
    pub header_read_timeout: Dur,
    /// Most request header fields (HTTP/1.1; beyond: 431). Default 100.
    pub max_headers: Spanned<usize>,
    /// Largest request head in bytes (HTTP/1.1 buffer, HTTP/2 header list). Default 64 KiB.
    pub max_header_bytes: Spanned<usize>,
    /// HTTP/2 keep-alive PING interval; a PING unanswered for as long closes the
    /// connection. Default `"20s"`.
    pub http2_keep_alive_interval: Dur,
    /// Open client connections at most; past it, new ones wait in the kernel's backlog.
    /// Default 10000.
    pub max_connections: Spanned<usize>,
    /// Time a client has to send its whole request body (408 after). Default `"30s"`.
    pub body_read_timeout: Dur,
    /// Request bytes buffered at once across all connections (queued requests
    /// included); over it, 503 with `Retry-After`. Default 1 GiB.
    pub max_buffered_bytes: Spanned<u64>,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            listen: unspanned("0.0.0.0:8080".to_string()),
            admin_listen: unspanned("127.0.0.1:9091".to_string()),
            admin_token: None,
            max_body_bytes: unspanned(16 * 1024 * 1024),
            request_timeout: Dur::secs(600),
            connect_timeout: Dur::secs(2),
            idle_stream_timeout: Dur::secs(120),
            shutdown_grace: Dur::secs(30),
            watch_config: false,
            header_read_timeout: Dur::secs(10),
            max_headers: unspanned(100),
            max_header_bytes: unspanned(64 * 1024),
            http2_keep_alive_interval: Dur::secs(20),
            max_connections: unspanned(10_000),
            body_read_timeout: Dur::secs(30),
            max_buffered_bytes: unspanned(1 << 30),
        }
    }
}

/// `[routing]`
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingSection {
    /// What part of the prompt is hashed: `"hybrid"`, `"conversation"` or
    /// `"prefix"`. Default `"hybrid"` (chosen in the simulator).
    pub key: KeyMode,
    /// Characters of each part of the key. Default 1024.
    pub prefix_chars: Spanned<usize>,
    /// Header whose value, when present, is the key. Default `"x-session-id"`.
    pub key_header: String,
    /// Seed of the key hash. Default 0.
    pub hash_seed: u64,
    /// Ring points per unit of weight. Default 160.
    pub vnodes: Spanned<u32>,
    /// In-flight cap per unit of weight. Default 16 (chosen in the simulator).
    pub max_in_flight: Spanned<u32>,
    /// Optional CHWBL relative bound `c ≥ 1.0`. Default: none.
    pub load_factor: Option<Spanned<f64>>,
    /// What to do when every node is at cap. Default `"queue"`.
    pub when_saturated: WhenSaturated,
    /// Waiting requests per pool before 503. Default 1024.
    pub max_queue: Spanned<usize>,
    /// Longest wait in the queue. Default `"30s"`.
    pub queue_timeout: Dur,
    /// Nodes tried per request (first try included). Default 3.
    pub max_attempts: Spanned<u32>,
    /// Ask streams for their usage chunk (and hide it from clients that did not ask),
    /// to count the fleet's real prefix-cache hits. Default true.
    pub track_usage: bool,
    /// Paths forwarded besides the OpenAI APIs and `/generate` (e.g.
    /// `"/v1/rerank"`); any other path is answered 404. Default none.
    pub extra_paths: Spanned<Vec<String>>,
}

impl Default for RoutingSection {
    fn default() -> Self {
        RoutingSection {
            key: KeyMode::Hybrid,
            prefix_chars: unspanned(1024),
            key_header: "x-session-id".to_string(),
            hash_seed: 0,
            vnodes: unspanned(160),
            max_in_flight: unspanned(16),
            load_factor: None,
            when_saturated: WhenSaturated::Queue,
            max_queue: unspanned(1024),
            queue_timeout: Dur::secs(30),
            max_attempts: unspanned(3),
            track_usage: true,
            extra_paths: unspanned(Vec::new()),
        }
    }
}

/// `[breaker]`: the TTFT-measuring circuit breaker of every node.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerSection {
    /// Consecutive failures that open a node's breaker. Default 2.
    pub failure_threshold: Spanned<u32>,
    /// How long an open breaker refuses traffic. Default `"30s"`.
    pub open_for: Dur,
    /// A stream slower than this to its first token counts as slow. Default `"3s"`.
    pub slow_ttft: Dur,
    /// Share of slow streams in the window that opens the breaker. Default 0.5.
    pub slow_ratio: Spanned<f64>,
    /// Streams the window needs before it may open the breaker or shunt. Default 10.
    pub min_samples: Spanned<usize>,
    /// How far back TTFT samples count. Default `"60s"`.
    pub window: Dur,
    /// Shares of a recovering node's keys admitted, one step per `canary_step`.
    /// Default `[0.1, 0.3, 0.7, 1.0]`.
    pub canary_steps: Spanned<Vec<f64>>,
    /// Duration of each canary step. Default `"10s"`.
    pub canary_step: Dur,
    /// Latency-staged shunting. Default `[{ p90 = "2s", divert = 0.2 }, { p90 = "2.5s", divert = 0.5 }]`.
    pub shunt_steps: Spanned<Vec<ShuntStepSection>>,
}

/// One `[[breaker.shunt_steps]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShuntStepSection {
    pub p90: Dur,
    pub divert: f64,
}

impl Default for BreakerSection {
    fn default() -> Self {
        let d = BreakerSettings::default();
        BreakerSection {
            failure_threshold: unspanned(d.failure_threshold),
            open_for: Dur(d.open_for),
            slow_ttft: Dur(d.slow_ttft),
            slow_ratio: unspanned(d.slow_ratio),
            min_samples: unspanned(d.min_samples),
            window: Dur(d.window),
            canary_steps: unspanned(d.canary_steps),
            canary_step: Dur(d.canary_step),
            shunt_steps: unspanned(
                d.shunt_steps
                    .iter()
                    .map(|s| ShuntStepSection {
                        p90: Dur(s.p90),
                        divert: s.divert,
                    })
                    .collect(),
            ),
        }
    }
}

/// `[health]`: active health checks of every node.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSection {
    /// Path probed with GET on each node. Default `"/health"`.
    pub path: String,
    /// Time between checks. Default `"5s"`.
    pub interval: Dur,
    /// Time a check may take. Default `"2s"`.
    pub timeout: Dur,
    /// Consecutive failed checks that mark a node down. Default 2.
    pub unhealthy_after: Spanned<u32>,
    /// Consecutive passed checks that mark it up again. Default 1.
    pub healthy_after: Spanned<u32>,
}

/// `[auth]`: optional API keys for the client listener.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSection {
    /// A file of accepted keys, one per line (`#` comments and blank lines ignored),
    /// relative to the config file; re-read on every reload. Default: none.
    pub api_keys_file: Option<Spanned<String>>,
    /// An environment variable holding accepted keys (separated by commas, spaces or
    /// newlines). Default: none.
    pub api_keys_env: Option<Spanned<String>>,
    /// Remove the client's `Authorization` header before forwarding. Default false.
    pub strip: bool,
}

impl Default for HealthSection {
    fn default() -> Self {
        HealthSection {
            path: "/health".into(),
            interval: Dur::secs(5),
            timeout: Dur::secs(2),
            unhealthy_after: unspanned(2),
            healthy_after: unspanned(1),
        }
    }
}

/// `routing.key`: which part of the prompt text the hash covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyMode {
    /// System/developer text plus the first user message: every turn of a
    /// conversation shares the key, even behind one long shared system prompt.
    Conversation,
    /// The first `prefix_chars` characters of the whole prompt.
    Prefix,
    /// The `conversation` key, placed within its prefix group: a long system/developer
    /// part picks the group's nodes, and the group spreads over as many of them as
    /// its share of the traffic calls for (see [`crate::group`]); a short one spreads
    /// over the whole pool. Every turn of a conversation lands on one node, and
    /// single-turn requests sharing a long prompt gather where it is cached. The
    /// default: best overall in the simulator.
    Hybrid,
}

impl KeyMode {
    /// The TOML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyMode::Conversation => "conversation",
            KeyMode::Prefix => "prefix",
            KeyMode::Hybrid => "hybrid",
        }
    }
}

impl WhenSaturated {
    /// The TOML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            WhenSaturated::Queue => "queue",
            WhenSaturated::Reject => "reject",
            WhenSaturated::LeastLoaded => "least_loaded",
        }
    }
}

/// `routing.when_saturated`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenSaturated {
    /// Wait (FIFO, bounded), re-running selection whenever a slot frees.
    Queue,
    /// 503 at once.
    Reject,
    /// Overcommit the least loaded node.
    LeastLoaded,
}

/// `[[pools]]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSection {
    /// Pool name (unique).
    pub name: Spanned<String>,
    /// `model` values this pool serves. Default: the pool name.
    #[serde(default)]
    pub models: Vec<Spanned<String>>,
    /// Budget for the first generated token. Default `"60s"`.
    #[serde(default = "default_first_token_timeout")]
    pub first_token_timeout: Dur,
    /// Pools tried, in order, when this one has no available node. Default none.
    #[serde(default)]
    pub fallbacks: Vec<Spanned<String>>,
    /// Whether requests that ask for reasoning may come here. Default true.
    #[serde(default = "yes")]
    pub supports_thinking: bool,
    /// The pool for requests naming an unknown model. Default false.
    #[serde(default = "no")]
    pub default: Spanned<bool>,
    /// The engines.
    #[serde(default)]
    pub nodes: Vec<NodeSection>,
}

/// `[[pools.nodes]]`
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Node id, unique across all pools; its ring points derive from it.
    pub id: Spanned<String>,
    /// Base URL of the engine, e.g. `http://10.0.0.5:8000`.
    pub url: Spanned<String>,
    /// Relative capacity: ring points and in-flight cap scale with it. Default 1.
    #[serde(default = "one")]
    pub weight: Spanned<u32>,
}

fn default_first_token_timeout() -> Dur {
    Dur::secs(60)
}
fn yes() -> bool {
    true
}
fn no() -> Spanned<bool> {
    unspanned(false)
}
fn one() -> Spanned<u32> {
    unspanned(1)
}
fn unspanned<T>(value: T) -> Spanned<T> {
    Spanned::new(0..0, value)
}

/// A duration written as a string: `"250ms"`, `"30s"`, `"1.5s"`, `"2m"`, `"1h"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl Dur {
    const fn secs(s: u64) -> Dur {
        Dur(Duration::from_secs(s))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(Dur)
            .map_err(serde::de::Error::custom)
    }
}

/// The longest duration any setting takes: far beyond any sensible timeout, and far
/// from the point where adding it to a clock reading would overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Parses `"250ms"`, `"30s"`, `"1.5s"`, `"2m"`, `"1h"`, `"100us"` (at most
/// [`MAX_DURATION`]).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {s:?} has no unit (use e.g. \"30s\" or \"250ms\")"))?;
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("duration {s:?} does not start with a number"))?;
    let secs = match unit {
        "us" | "µs" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "duration {s:?} has unknown unit {unit:?} (use us, ms, s, m or h)"
            ))
        }
    };
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d <= MAX_DURATION => Ok(d),
        _ => Err(format!("duration {s:?} is longer than the limit of 7 days")),
    }
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

// ---------------------------------------------------------------------------------
// Runtime layer: validated.
// ---------------------------------------------------------------------------------

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub routing: RoutingConfig,
    pub breaker: BreakerSettings,
    pub health: HealthConfig,
    pub auth: AuthConfig,
    pub pools: Vec<PoolConfig>,
}

/// Accepted API keys of the client listener (none: no check).
#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    pub keys: Vec<Secret>,
    pub strip: bool,
}

impl AuthConfig {
    /// Whether an `Authorization` header value carries an accepted key. Every key is
    /// compared (no early exit), each in constant time.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        if self.keys.is_empty() {
            return true;
        }
        let Some(token) = authorization.and_then(|v| v.strip_prefix(b"Bearer ")) else {
            return false;
        };
        self.keys
            .iter()
            .fold(false, |ok, key| key.matches(token) | ok)
    }
}

#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
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
    pub shutdown_grace: Duration,
    pub watch_config: bool,
    pub header_read_timeout: Duration,
    pub max_headers: usize,
    pub max_header_bytes: usize,
    pub http2_keep_alive_interval: Duration,
    pub max_connections: usize,
    pub body_read_timeout: Duration,
    pub max_buffered_bytes: usize,
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
    pub extra_paths: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub name: String,
    pub models: Vec<String>,
    pub first_token_timeout: Duration,
    pub fallbacks: Vec<String>,
    pub supports_thinking: bool,
    pub default: bool,
    pub nodes: Vec<NodeConfig>,
}

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub id: String,
    /// Base URL with no trailing slash, e.g. `http://10.0.0.5:8000` or
    /// `http://host:8000/prefix`.
    pub url: http::Uri,
    pub weight: u32,
}

impl NodeConfig {
    /// The engine URL for a request path (and query) on the balancer.
    pub fn upstream_uri(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        let base = self.url.path().trim_end_matches('/');
        let mut parts = http::uri::Builder::new()
            .scheme(self.url.scheme_str().unwrap_or("http"))
            .authority(self.url.authority().map(|a| a.as_str()).unwrap_or(""));
        parts = parts.path_and_query(format!("{base}{path_and_query}"));
        parts.build()
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
        validate(raw, dir).map_err(|(span, msg)| at(span, msg))
    }
}

type Invalid = (Option<Range<usize>>, String);

fn invalid<T>(span: Range<usize>, msg: impl Into<String>) -> Result<T, Invalid> {
    let span = if span.is_empty() && span.start == 0 {
        None
    } else {
        Some(span)
    };
    Err((span, msg.into()))
}

/// `value` if it lies in `range`, else an error at its span.
fn within<T>(
    value: &Spanned<T>,
    range: std::ops::RangeInclusive<T>,
    key: &str,
) -> Result<T, Invalid>
where
    T: PartialOrd + Copy + fmt::Display,
{
    let v = *value.get_ref();
    if range.contains(&v) {
        Ok(v)
    } else {
        invalid(
            value.span(),
            format!(
                "{key} {v} is out of range {}..={}",
                range.start(),
                range.end()
            ),
        )
    }
}

fn validate(raw: FileConfig, dir: &Path) -> Result<Config, Invalid> {
    let server = validate_server(raw.server)?;
    let routing = validate_routing(raw.routing)?;
    let breaker = validate_breaker(raw.breaker)?;
    let health = validate_health(raw.health)?;
    let auth = validate_auth(raw.auth, dir)?;
    if raw.pools.is_empty() {
        return invalid(
            0..0,
            "no [[pools]]: at least one pool with nodes is required",
        );
    }

    let mut pool_names = HashSet::new();
    let mut node_ids = HashSet::new();
    let mut model_owner: HashMap<String, String> = HashMap::new();
    let mut default_pool: Option<String> = None;
    let mut pools = Vec::with_capacity(raw.pools.len());
    let all_names: HashSet<String> = raw.pools.iter().map(|p| p.name.get_ref().clone()).collect();

    for p in raw.pools {
        let name = p.name.get_ref().trim().to_string();
        if name.is_empty() {
            return invalid(p.name.span(), "pool name is empty");
        }
        if !pool_names.insert(name.clone()) {
            return invalid(p.name.span(), format!("duplicate pool name {name:?}"));
        }
        if *p.default.get_ref() {
            if let Some(other) = &default_pool {
                return invalid(
                    p.default.span(),
                    format!(
                        "pools {other:?} and {name:?} are both marked default; only one may be"
                    ),
                );
            }
            default_pool = Some(name.clone());
        }
        let mut models = Vec::new();
        if p.models.is_empty() {
            models.push(name.clone());
        }
        for m in &p.models {
            models.push(m.get_ref().clone());
        }
        for (i, m) in models.iter().enumerate() {
            if let Some(owner) = model_owner.insert(m.clone(), name.clone()) {
                let span = p.models.get(i).map(|s| s.span()).unwrap_or(p.name.span());
                return invalid(
                    span,
                    format!("model {m:?} is served by pools {owner:?} and {name:?}; a model belongs to one pool"),
                );
            }
        }
        let mut fallbacks = Vec::new();
        for f in &p.fallbacks {
            let target = f.get_ref();
            if !all_names.contains(target) {
                return invalid(f.span(), format!("fallback {target:?} names no pool"));
            }
            if *target == name {
                return invalid(
                    f.span(),
                    format!("pool {name:?} lists itself as a fallback"),
                );
            }
            fallbacks.push(target.clone());
        }
        if p.nodes.is_empty() {
            return invalid(
                p.name.span(),
                format!("pool {name:?} has no nodes (add [[pools.nodes]] with id and url)"),
            );
        }
        let mut nodes = Vec::with_capacity(p.nodes.len());
        for n in p.nodes {
            let id = n.id.get_ref().trim().to_string();
            if id.is_empty() {
                return invalid(n.id.span(), "node id is empty");
            }
            if !node_ids.insert(id.clone()) {
                return invalid(
                    n.id.span(),
                    format!("duplicate node id {id:?} (ids are unique across pools)"),
                );
            }
            let url = parse_node_url(n.url.get_ref()).or_else(|m| invalid(n.url.span(), m))?;
            let weight = *n.weight.get_ref();
            if weight == 0 || weight > 1000 {
                return invalid(
                    n.weight.span(),
                    format!("weight {weight} is out of range 1..=1000"),
                );
            }
            nodes.push(NodeConfig { id, url, weight });
        }
        pools.push(PoolConfig {
            name,
            models,
            first_token_timeout: p.first_token_timeout.0,
            fallbacks,
            supports_thinking: p.supports_thinking,
            default: *p.default.get_ref(),
            nodes,
        });
    }
    Ok(Config {
        server,
        routing,
        breaker,
        health,
        auth,
        pools,
    })
}

fn validate_auth(a: AuthSection, dir: &Path) -> Result<AuthConfig, Invalid> {
    let mut keys = Vec::new();
    let mut configured = None;
    if let Some(file) = &a.api_keys_file {
        let path = dir.join(file.get_ref());
        let text = std::fs::read_to_string(&path).or_else(|e| {
            invalid(
                file.span(),
                format!("api_keys_file {}: {e}", path.display()),
            )
        })?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(Secret::new),
        );
        configured = Some(file.span());
    }
    if let Some(var) = &a.api_keys_env {
        let value = std::env::var(var.get_ref()).or_else(|_| {
            invalid(
                var.span(),
                format!(
                    "api_keys_env: environment variable {} is not set",
                    var.get_ref()
                ),
            )
        })?;
        keys.extend(
            value
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|k| !k.is_empty())
                .map(Secret::new),
        );
        configured = Some(var.span());
    }
    if let (Some(span), true) = (configured, keys.is_empty()) {
        return invalid(
            span,
            "[auth] names no API keys: every request would be refused",
        );
    }
    Ok(AuthConfig {
        keys,
        strip: a.strip,
    })
}

fn validate_breaker(b: BreakerSection) -> Result<BreakerSettings, Invalid> {
    let failure_threshold = within(&b.failure_threshold, 1..=1000, "failure_threshold")?;
    let min_samples = within(&b.min_samples, 1..=512, "min_samples")?;
    if b.canary_steps.get_ref().len() > 64 || b.shunt_steps.get_ref().len() > 16 {
        return invalid(
            b.canary_steps.span(),
            "at most 64 canary_steps and 16 shunt_steps",
        );
    }
    let ratio = *b.slow_ratio.get_ref();
    if !(ratio > 0.0 && ratio <= 1.0) {
        return invalid(
            b.slow_ratio.span(),
            format!("slow_ratio {ratio} must be in (0, 1]"),
        );
    }
    let steps = b.canary_steps.get_ref();
    let ascending = steps.windows(2).all(|w| w[0] < w[1]);
    if steps.is_empty()
        || !ascending
        || steps.iter().any(|s| !(*s > 0.0 && *s <= 1.0))
        || steps.last() != Some(&1.0)
    {
        return invalid(
            b.canary_steps.span(),
            "canary_steps must be ascending shares in (0, 1] ending with 1.0, e.g. [0.1, 0.3, 0.7, 1.0]",
        );
    }
    let shunts = b.shunt_steps.get_ref();
    if shunts
        .windows(2)
        .any(|w| w[0].p90.0 >= w[1].p90.0 || w[0].divert > w[1].divert)
        || shunts.iter().any(|s| !(s.divert > 0.0 && s.divert < 1.0))
    {
        return invalid(
            b.shunt_steps.span(),
            "shunt_steps must ascend in p90 and divert, with divert in (0, 1)",
        );
    }
    if b.canary_step.0.is_zero() || b.open_for.0.is_zero() || b.window.0.is_zero() {
        return invalid(
            0..0,
            "open_for, window and canary_step must be longer than 0",
        );
    }
    Ok(BreakerSettings {
        failure_threshold,
        open_for: b.open_for.0,
        slow_ttft: b.slow_ttft.0,
        slow_ratio: ratio,
        min_samples,
        window: b.window.0,
        canary_steps: steps.clone(),
        canary_step: b.canary_step.0,
        shunt_steps: shunts
            .iter()
            .map(|s| ShuntStep {
                p90: s.p90.0,
                divert: s.divert,
            })
            .collect(),
    })
}

fn validate_health(h: HealthSection) -> Result<HealthConfig, Invalid> {
    if !h.path.starts_with('/') {
        return invalid(
            0..0,
            format!("health.path {:?} must start with '/'", h.path),
        );
    }
    if h.interval.0.is_zero() || h.timeout.0.is_zero() {
        return invalid(
            0..0,
            "health.interval and health.timeout must be longer than 0",
        );
    }
    Ok(HealthConfig {
        path: h.path,
        interval: h.interval.0,
        timeout: h.timeout.0,
        unhealthy_after: within(&h.unhealthy_after, 1..=1000, "unhealthy_after")?,
        healthy_after: within(&h.healthy_after, 1..=1000, "healthy_after")?,
    })
}

fn validate_server(s: ServerSection) -> Result<ServerConfig, Invalid> {
    let addr = |v: &Spanned<String>, key: &str| -> Result<SocketAddr, Invalid> {
        v.get_ref().parse().or_else(|_| {
            invalid(
                v.span(),
                format!(
                    "{key} {:?} is not an address like \"0.0.0.0:8080\"",
                    v.get_ref()
                ),
            )
        })
    };
    const GIB: u64 = 1 << 30;
    let max_body_bytes = within(&s.max_body_bytes, 1..=GIB, "max_body_bytes")?;
    let max_buffered_bytes = within(&s.max_buffered_bytes, 1..=1024 * GIB, "max_buffered_bytes")?;
    if max_buffered_bytes < max_body_bytes {
        return invalid(
            s.max_buffered_bytes.span(),
            format!("max_buffered_bytes {max_buffered_bytes} is below max_body_bytes {max_body_bytes}: no body that size could be read"),
        );
    }
    let positive = [
        (s.request_timeout, "request_timeout"),
        (s.connect_timeout, "connect_timeout"),
        (s.idle_stream_timeout, "idle_stream_timeout"),
        (s.header_read_timeout, "header_read_timeout"),
        (s.http2_keep_alive_interval, "http2_keep_alive_interval"),
        (s.body_read_timeout, "body_read_timeout"),
    ];
    if let Some((_, key)) = positive.iter().find(|(d, _)| d.0.is_zero()) {
        return invalid(0..0, format!("server.{key} must be longer than 0"));
    }
    Ok(ServerConfig {
        listen: addr(&s.listen, "listen")?,
        admin_listen: addr(&s.admin_listen, "admin_listen")?,
        admin_token: s.admin_token.filter(|t| !t.expose().is_empty()),
        max_body_bytes: max_body_bytes as usize,
        request_timeout: s.request_timeout.0,
        connect_timeout: s.connect_timeout.0,
        idle_stream_timeout: s.idle_stream_timeout.0,
        shutdown_grace: s.shutdown_grace.0,
        watch_config: s.watch_config,
        header_read_timeout: s.header_read_timeout.0,
        max_headers: within(&s.max_headers, 1..=10_000, "max_headers")?,
        max_header_bytes: within(&s.max_header_bytes, 8192..=16 << 20, "max_header_bytes")?,
        http2_keep_alive_interval: s.http2_keep_alive_interval.0,
        max_connections: within(&s.max_connections, 1..=1_000_000, "max_connections")?,
        body_read_timeout: s.body_read_timeout.0,
        max_buffered_bytes: max_buffered_bytes as usize,
    })
}

fn validate_routing(r: RoutingSection) -> Result<RoutingConfig, Invalid> {
    let key_header = http::HeaderName::from_bytes(r.key_header.to_ascii_lowercase().as_bytes())
        .or_else(|_| {
            invalid(
                0..0,
                format!("key_header {:?} is not a valid header name", r.key_header),
            )
        })?;
    let prefix_chars = within(&r.prefix_chars, 1..=1 << 20, "prefix_chars")?;
    let vnodes = within(&r.vnodes, 1..=10_000, "vnodes")?;
    let max_in_flight = within(&r.max_in_flight, 1..=100_000, "max_in_flight")?;
    let max_attempts = within(&r.max_attempts, 1..=16, "max_attempts")?;
    let max_queue = within(&r.max_queue, 0..=1_000_000, "max_queue")?;
    for p in r.extra_paths.get_ref() {
        if !p.starts_with('/') || p.contains(['?', '#']) {
            return invalid(
                r.extra_paths.span(),
                format!("extra_paths entry {p:?} must be a path like \"/v1/rerank\""),
            );
        }
    }
    let load_factor = match r.load_factor {
        Some(lf) if !(*lf.get_ref() >= 1.0 && lf.get_ref().is_finite()) => {
            return invalid(
                lf.span(),
                format!("load_factor {} must be a number ≥ 1.0", lf.get_ref()),
            );
        }
        Some(lf) => Some(*lf.get_ref()),
        None => None,
    };
    Ok(RoutingConfig {
        key: r.key,
        prefix_chars,
        key_header,
        hash_seed: r.hash_seed,
        vnodes,
        max_in_flight,
        load_factor,
        when_saturated: r.when_saturated,
        max_queue,
        queue_timeout: r.queue_timeout.0,
        max_attempts,
        track_usage: r.track_usage,
        extra_paths: r.extra_paths.into_inner(),
    })
}

fn parse_node_url(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s
        .parse()
        .map_err(|e| format!("url {s:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "url {s:?}: https to engines is not supported; engines are reached over plain HTTP on a trusted network"
            ))
        }
        _ => return Err(format!("url {s:?} needs a scheme and host, e.g. \"http://10.0.0.5:8000\"")),
    }
    if uri.authority().is_none() {
        return Err(format!("url {s:?} has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("url {s:?} must not have a query"));
    }
    Ok(uri)
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
mod tests {
    use super::*;

    const MIN: &str = r#"
[[pools]]
name = "llama"
nodes = [{ id = "a", url = "http://127.0.0.1:8001" }]
"#;

    fn err(text: &str) -> ConfigError {
        Config::parse(text, "t.toml").unwrap_err()
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = Config::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.server.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(c.server.admin_listen.to_string(), "127.0.0.1:9091");
        assert_eq!(c.server.max_body_bytes, 16 << 20);
        assert_eq!(c.server.request_timeout, Duration::from_secs(600));
        assert_eq!(c.routing.key, KeyMode::Hybrid);
        assert_eq!(c.routing.prefix_chars, 1024);
        assert_eq!(c.routing.vnodes, 160);
        assert_eq!(c.routing.max_in_flight, 16);
        assert_eq!(c.routing.max_attempts, 3);
        assert_eq!(c.routing.max_queue, 1024);
        assert_eq!(c.routing.when_saturated, WhenSaturated::Queue);
        assert_eq!(c.pools[0].models, vec!["llama".to_string()]);
        assert_eq!(c.pools[0].nodes[0].weight, 1);
    }

    #[test]
    fn shipped_example_is_valid() {
        let text = include_str!("../config/prefixlb.toml");
        let c = Config::parse(text, "config/prefixlb.toml").unwrap();
        assert_eq!(c.routing.vnodes, 160);
    }

    #[test]
    fn unknown_key_is_located() {
        let e = err("[routing]\nvnodes = 10\nmax_inflight = 3\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
        assert_eq!((e.line, e.col), (3, 1), "{e}");
        assert!(e.message.contains("unknown field `max_inflight`"), "{e}");
        assert!(e.to_string().starts_with("t.toml:3:1: "));
    }

    #[test]
    fn semantic_errors_point_at_the_value() {
        let dup = err("[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"},{id=\"a\",url=\"http://h:2\"}]\n");
        assert_eq!(dup.line, 3);
        assert!(dup.message.contains("duplicate node id"), "{dup}");

        let url = err("[[pools]]\nname=\"p\"\n[[pools.nodes]]\nid=\"a\"\nurl=\"h:1:2\"\n");
        assert_eq!((url.line, url.col), (5, 5), "{url}");

        let w =
            err("[[pools]]\nname=\"p\"\n[[pools.nodes]]\nid=\"a\"\nurl=\"http://h:1\"\nweight=0\n");
        assert_eq!(w.line, 6);
        assert!(w.message.contains("weight 0"), "{w}");

        let fb = err(
            "[[pools]]\nname=\"p\"\nfallbacks=[\"q\"]\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n",
        );
        assert_eq!(fb.line, 3);
        assert!(fb.message.contains("names no pool"), "{fb}");

        let d = err("[server]\nrequest_timeout=\"10 parsecs\"\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
        assert_eq!(d.line, 2);
        assert!(d.message.contains("unit"), "{d}");

        let none = err("[routing]\nvnodes=1\n");
        assert!(none.message.contains("no [[pools]]"), "{none}");

        let lf = err("[routing]\nload_factor=0.5\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
        assert_eq!(lf.line, 2);
    }

    #[test]
    fn secrets_never_print() {
        let c = Config::parse(
            &format!("[server]\nadmin_token = \"tok-3f9a\"\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("tok-3f9a"), "{shown}");
        assert!(c.server.admin_token.unwrap().matches(b"tok-3f9a"));
    }

    #[test]
    fn values_are_bounded_where_they_are_written() {
        for (line, key) in [
            ("[server]\nrequest_timeout = \"1e999s\"", "unit"),
            (
                "[server]\nrequest_timeout = \"99999999999999999999999s\"",
                "limit",
            ),
            ("[server]\nconnect_timeout = \"8d\"", "unit"),
            (
                "[server]\nmax_body_bytes = 99999999999999",
                "max_body_bytes",
            ),
            ("[server]\nmax_connections = 0", "max_connections"),
            ("[routing]\nmax_attempts = 100", "max_attempts"),
            ("[routing]\nprefix_chars = 9999999999", "prefix_chars"),
            ("[breaker]\nmin_samples = 100000", "min_samples"),
            ("[health]\nunhealthy_after = 0", "unhealthy_after"),
            ("[routing]\nextra_paths = [\"v1/x\"]", "extra_paths"),
        ] {
            let e = err(&format!("{line}\n{MIN}"));
            assert_eq!(e.line, 2, "{line}: {e}");
            assert!(e.message.contains(key), "{line}: {e}");
        }
        assert_eq!(
            parse_duration("168h").unwrap(),
            MAX_DURATION,
            "7 days is the limit"
        );
        assert!(parse_duration("169h").is_err());
    }

    #[test]
    fn api_keys_come_from_a_file_and_the_environment() {
        let dir = std::env::temp_dir().join(format!("prefixlb-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("keys"), "# comment\n  k1  \n\nk2\n").unwrap();
        std::env::set_var("PREFIXLB_UNIT_KEYS", "k3,k4 k5");
        let text = format!(
            "[auth]\napi_keys_file = \"keys\"\napi_keys_env = \"PREFIXLB_UNIT_KEYS\"\n{MIN}"
        );
        let file = dir.join("c.toml");
        let c = Config::parse(&text, file.to_str().unwrap()).unwrap();
        assert_eq!(c.auth.keys.len(), 5);
        for k in ["k1", "k2", "k3", "k5"] {
            assert!(c.auth.admits(Some(format!("Bearer {k}").as_bytes())), "{k}");
        }
        assert!(!c.auth.admits(Some(b"Bearer k6")));
        assert!(!c.auth.admits(Some(b"k1")), "the Bearer scheme is required");
        assert!(!c.auth.admits(None));
        assert!(
            Config::parse(MIN, "t").unwrap().auth.admits(None),
            "no keys: open"
        );
        let missing = err(&format!("[auth]\napi_keys_file = \"nope\"\n{MIN}"));
        assert_eq!(missing.line, 2);
        let unset = err(&format!(
            "[auth]\napi_keys_env = \"PREFIXLB_UNSET_VAR_1\"\n{MIN}"
        ));
        assert!(unset.message.contains("not set"), "{unset}");
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn upstream_uri_keeps_base_path() {
        let n = NodeConfig {
            id: "a".into(),
            url: "http://h:8000/engine/".parse().unwrap(),
            weight: 1,
        };
        assert_eq!(
            n.upstream_uri("/v1/chat/completions?x=1")
                .unwrap()
                .to_string(),
            "http://h:8000/engine/v1/chat/completions?x=1"
        );
    }
}
