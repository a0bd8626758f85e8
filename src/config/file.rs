//! The file layer: serde structs that mirror the TOML as written. Every field has a
//! `///` comment with its default; every section rejects unknown keys (they are typos);
//! values that can be wrong keep their span, so validation can point at them.

use serde::Deserialize;
use toml::Spanned;

use super::{BreakerSettings, Dur, Secret};

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
    /// How engines behind `https://` URLs are trusted. Default: the system's roots.
    #[serde(default)]
    pub tls: TlsSection,
    /// Priority classes of the admission queue, highest first. Default: one.
    #[serde(default)]
    pub priorities: Vec<super::tenancy::PrioritySection>,
    /// Tenants' classes, weights and rate limits. Default: none.
    #[serde(default)]
    pub tenants: Vec<super::tenancy::TenantSection>,
    /// OpenTelemetry traces sent to a collector. Default: none (no spans are made).
    pub tracing: Option<TracingSection>,
    /// Dynamic membership from Redis heartbeats. Default: none (static nodes only).
    pub redis: Option<RedisSection>,
    /// How the names of `discover` nodes are looked up. Default: every `"5s"`,
    /// with the system's resolver settings.
    #[serde(default)]
    pub discovery: DiscoverySection,
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
    /// A stream the client has had nothing of for this long (queued, a cold prefill,
    /// a pause mid-stream) gets an SSE comment, `: keep-alive`; the first commits the
    /// stream (a 200 head). `"0s"` never sends one. Default `"0s"`.
    pub sse_keepalive: Dur,
    /// Every request has an id in `x-request-id` (the client's, else a new one), sent
    /// to the engine, returned in the answer and logged. Default true.
    pub request_ids: bool,
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
    /// Open client connections at most; past it, new ones wait unserved (one per
    /// lane accepted, the rest in the kernel's backlog).
    /// Default 10000.
    pub max_connections: Spanned<usize>,
    /// Serving lanes: that many threads, each a single-threaded runtime with its own
    /// `SO_REUSEPORT` listener on `listen` and its own engine connections; 0 serves
    /// every connection from one shared multi-threaded runtime. Default `"auto"`: one
    /// lane per CPU the process may use.
    pub lanes: Spanned<LaneCount>,
    /// Whether each serving thread (each lane, or with `lanes = 0` each worker of the
    /// shared runtime) is pinned to a CPU of its own, the n-th of the CPUs the process
    /// may run on (as `taskset` or a cpuset leaves them). Default `"auto"`.
    pub pin_threads: PinThreads,
    /// A serving thread (a lane, or a worker of the shared runtime) that has run this
    /// long without running out of work offers its CPU to other threads waiting for it
    /// before its next request; `"0s"` never does. Default `"750us"`.
    pub yield_after: Dur,
    /// Time a client has to send its whole request body (408 after). Default `"30s"`.
    pub body_read_timeout: Dur,
    /// Request bytes buffered at once across all connections (queued requests
    /// included); over it, 503 with `Retry-After`. Default 1 GiB.
    pub max_buffered_bytes: Spanned<u64>,
    /// A PEM certificate chain (the listener's own certificate first): with
    /// `tls_key_file`, `listen` serves HTTPS (HTTP/2 and HTTP/1.1 by ALPN), re-read on
    /// every reload. Relative to the config file. Default: none (plain HTTP).
    pub tls_cert_file: Option<Spanned<String>>,
    /// Its PEM private key. Default: none.
    pub tls_key_file: Option<Spanned<String>>,
    /// The admin listener serves HTTPS too, with the same certificate, asking no
    /// client for one (probes and scrapers show `admin_token`). Default false.
    pub admin_tls: Spanned<bool>,
    /// PEM CA certificates: with HTTPS, every client must show a certificate one of
    /// them signed (mTLS), or its handshake fails. Default: none (no client
    /// certificates asked for).
    pub tls_client_ca_file: Option<Spanned<String>>,
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
            sse_keepalive: Dur::secs(0),
            request_ids: true,
            shutdown_grace: Dur::secs(30),
            watch_config: false,
            header_read_timeout: Dur::secs(10),
            max_headers: unspanned(100),
            max_header_bytes: unspanned(64 * 1024),
            http2_keep_alive_interval: Dur::secs(20),
            max_connections: unspanned(10_000),
            lanes: unspanned(LaneCount::Auto),
            pin_threads: PinThreads::Auto,
            yield_after: Dur(std::time::Duration::from_micros(750)),
            body_read_timeout: Dur::secs(30),
            max_buffered_bytes: unspanned(1 << 30),
            tls_cert_file: None,
            tls_key_file: None,
            admin_tls: unspanned(false),
            tls_client_ca_file: None,
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
    /// Characters of each part of the key (`"hybrid"`: of the conversation part after
    /// the shared prefix). Default 1024.
    pub prefix_chars: Spanned<usize>,
    /// Header whose value, when present, is the key. Default `"x-session-id"`.
    pub key_header: String,
    /// Seed of the key hash. Default 0.
    pub hash_seed: u64,
    /// Ring points per unit of weight. Default 160.
    pub vnodes: Spanned<u32>,
    /// In-flight cap per unit of weight. Default 4 (the product's design).
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
    /// `key = "hybrid"`: most bytes of prompt text walked to find the shared prefix in
    /// front of the conversation. Default 65536.
    pub max_scan_bytes: Spanned<usize>,
    /// Paths forwarded besides the APIs served (e.g. `"/v1/moderations"`); any other
    /// path is answered 404. Default none.
    pub extra_paths: Spanned<Vec<String>>,
    /// Divide each node's cap by the number of balancer replicas heartbeating in
    /// Redis (rounded up, at least 1), so N replicas together keep the cap. Default
    /// false.
    pub split_cap_across_replicas: bool,
    /// A header naming a request's tenant when its API key has no name. Default:
    /// none (such requests are tenant `default`).
    pub tenant_header: Option<String>,
    /// The name in a client's TLS certificate (its subject's common name, else its
    /// first DNS name or URI) is its requests' tenant, when their API key has no name
    /// (before `tenant_header`). Needs `server.tls_client_ca_file`. Default false.
    pub tenant_from_client_certificate: Spanned<bool>,
    /// A header by which a request may ask for a priority class at or below its
    /// tenant's. Default: none.
    pub priority_header: Option<String>,
    /// The class of tenants that name none. Default: the first of `[[priorities]]`.
    pub default_priority: Option<Spanned<String>>,
}

impl Default for RoutingSection {
    fn default() -> Self {
        RoutingSection {
            key: KeyMode::Hybrid,
            prefix_chars: unspanned(1024),
            key_header: "x-session-id".to_string(),
            hash_seed: 0,
            vnodes: unspanned(160),
            max_in_flight: unspanned(4),
            load_factor: None,
            when_saturated: WhenSaturated::Queue,
            max_queue: unspanned(1024),
            queue_timeout: Dur::secs(30),
            max_attempts: unspanned(3),
            track_usage: true,
            max_scan_bytes: unspanned(64 * 1024),
            extra_paths: unspanned(Vec::new()),
            split_cap_across_replicas: false,
            tenant_header: None,
            tenant_from_client_certificate: unspanned(false),
            priority_header: None,
            default_priority: None,
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
    /// A stream that reached its first token within this is never slow, whatever its
    /// normalized TTFT. Default `"1s"`.
    pub slow_ttft: Dur,
    /// A stream is slow when its normalized TTFT is over this multiple of its pool
    /// peers' reference (the median of their P90s). Default 3.0.
    pub slow_factor: Spanned<f64>,
    /// Share of slow streams in the window that opens the breaker. Default 0.5.
    pub slow_ratio: Spanned<f64>,
    /// Streams in a row, each over `slow_factor` times what the peers' latest streams
    /// took (normalized), that open the breaker whatever the window holds. Default 5.
    pub slow_streams: Spanned<u32>,
    /// Streams the window needs before it may open the breaker or shunt. Default 10.
    pub min_samples: Spanned<usize>,
    /// How far back TTFT samples count. Default `"60s"`.
    pub window: Dur,
    /// Shares of a recovering node's keys admitted, one step per `canary_step`.
    /// Default `[0.1, 0.3, 0.7, 1.0]`.
    pub canary_steps: Spanned<Vec<f64>>,
    /// Duration of each canary step. Default `"10s"`.
    pub canary_step: Dur,
    /// Latency-staged shunting, by the median normalized TTFT over the peers' reference.
    /// Default `[{ over_pool = 1.5, divert = 0.2 }, { over_pool = 2.0, divert = 0.5 }]`.
    pub shunt_steps: Spanned<Vec<ShuntStepSection>>,
    /// Latency never takes more than this share of a pool's nodes out of rotation.
    /// Default 0.5.
    pub max_ejected_share: Spanned<f64>,
}

/// One `[[breaker.shunt_steps]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShuntStepSection {
    /// A multiple of the peers' reference (the median of their P90 normalized TTFT).
    #[serde(default)]
    pub over_pool: Option<f64>,
    /// The raw-TTFT threshold of earlier versions: read only to say what replaced it.
    #[serde(default)]
    pub p90: Option<toml::Value>,
    pub divert: f64,
}

impl Default for BreakerSection {
    fn default() -> Self {
        let d = BreakerSettings::default();
        BreakerSection {
            failure_threshold: unspanned(d.failure_threshold),
            open_for: Dur(d.open_for),
            slow_ttft: Dur(d.slow_ttft),
            slow_factor: unspanned(d.slow_factor),
            slow_ratio: unspanned(d.slow_ratio),
            slow_streams: unspanned(d.slow_streams),
            min_samples: unspanned(d.min_samples),
            window: Dur(d.window),
            canary_steps: unspanned(d.canary_steps),
            canary_step: Dur(d.canary_step),
            shunt_steps: unspanned(
                d.shunt_steps
                    .iter()
                    .map(|s| ShuntStepSection {
                        over_pool: Some(s.over_pool),
                        p90: None,
                        divert: s.divert,
                    })
                    .collect(),
            ),
            max_ejected_share: unspanned(d.max_ejected_share),
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
    /// Path read with GET, after each passed check, for the load the engine reports
    /// (its running and waiting sequences, its KV cache in use; nodes of the config
    /// only: an agent reads a heartbeating node's). Default `"/metrics"`; `""`: not read.
    pub metrics_path: String,
}

/// `[redis]`: membership from heartbeats (`prefixlb agent`), and this balancer's own.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSection {
    /// `redis://[user:pass@]host:port[/db]` or `rediss://` (TLS). Required.
    pub url: Spanned<String>,
    /// An environment variable holding the password (instead of one in the URL).
    /// Default: none.
    #[serde(default)]
    pub password_env: Option<Spanned<String>>,
    /// Prefix of every key, so several fleets share one Redis. Default `"prefixlb"`.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: Spanned<String>,
    /// How often membership is read (and this balancer heartbeats). Default `"2s"`.
    #[serde(default = "default_poll")]
    pub poll_interval: Dur,
    /// How long this balancer's own heartbeat lives. Default `"6s"`.
    #[serde(default = "default_ttl")]
    pub heartbeat_ttl: Dur,
}

fn default_key_prefix() -> Spanned<String> {
    unspanned("prefixlb".to_string())
}

fn default_poll() -> Dur {
    Dur::secs(2)
}

fn default_ttl() -> Dur {
    Dur::secs(6)
}

/// `[tls]`: engines behind `https://` node URLs. Paths are relative to the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsSection {
    /// PEM CA certificates to trust instead of the system's roots. Default: none.
    pub ca_file: Option<Spanned<String>>,
    /// A PEM client certificate chain shown to the engines (mTLS). Default: none.
    pub client_cert_file: Option<Spanned<String>>,
    /// Its PEM private key. Default: none.
    pub client_key_file: Option<Spanned<String>>,
}

/// `[tracing]`: OpenTelemetry traces, exported as OTLP over HTTP (protobuf). Read at
/// start: a reload does not change it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingSection {
    /// The collector's OTLP/HTTP URL, e.g. `"http://127.0.0.1:4318"` (a URL with no
    /// path gets `/v1/traces`). Required.
    pub otlp_endpoint: Spanned<String>,
    /// The share of new traces kept, 0.0 to 1.0; a request whose `traceparent` says
    /// sampled (or not) is kept (or not) as its caller decided. Default 1.0.
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: Spanned<f64>,
    /// `service.name` of the spans. Default `"prefixlb"`.
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_sample_ratio() -> Spanned<f64> {
    Spanned::new(0..0, 1.0)
}

fn default_service_name() -> String {
    "prefixlb".into()
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
            metrics_path: "/metrics".into(),
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

/// `server.lanes`: a count, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneCount {
    /// One lane per CPU the process may use (its affinity mask and any cgroup CPU
    /// quota, as `std::thread::available_parallelism` reads them).
    Auto,
    /// That many lanes; 0 serves the port from the shared runtime.
    Count(u64),
}

impl<'de> Deserialize<'de> for LaneCount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Spelling;
        impl serde::de::Visitor<'_> for Spelling {
            type Value = LaneCount;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"auto\" or a count of lanes (0: the shared runtime)")
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<LaneCount, E> {
                u64::try_from(n)
                    .map(LaneCount::Count)
                    .map_err(|_| E::custom("lanes must be \"auto\" or 0 or more"))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<LaneCount, E> {
                Ok(LaneCount::Count(n))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<LaneCount, E> {
                match v {
                    "auto" => Ok(LaneCount::Auto),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(Spelling)
    }
}

/// `server.pin_threads`: `"auto"`, `"always"` or `"never"` (`true` and `false` read as
/// `"always"` and `"never"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinThreads {
    /// Pinned when the serving threads are at least as many as the CPUs the process
    /// may run on (a host or cpuset sized for them); left to the scheduler when there
    /// are CPUs to spare, as in a container with a CPU quota on a large host.
    Auto,
    /// Pinned, whatever the count (with more threads than CPUs, round again).
    Always,
    /// Left to the scheduler.
    Never,
}

impl<'de> Deserialize<'de> for PinThreads {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Spelling;
        impl serde::de::Visitor<'_> for Spelling {
            type Value = PinThreads;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"auto\", \"always\", \"never\", true or false")
            }
            fn visit_bool<E: serde::de::Error>(self, pin: bool) -> Result<PinThreads, E> {
                Ok(if pin {
                    PinThreads::Always
                } else {
                    PinThreads::Never
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PinThreads, E> {
                match v {
                    "auto" => Ok(PinThreads::Auto),
                    "always" => Ok(PinThreads::Always),
                    "never" => Ok(PinThreads::Never),
                    _ => Err(E::unknown_variant(v, &["auto", "always", "never"])),
                }
            }
        }
        d.deserialize_any(Spelling)
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
    /// Other names clients may use, each for one of `models` or `adapters`: `{ "gpt-4o"
    /// = "meta-llama/Llama-3.1-8B-Instruct" }`. The body's `model` is rewritten to the
    /// name it stands for on the way in. Default none.
    #[serde(default = "no_aliases")]
    pub aliases: Spanned<std::collections::BTreeMap<String, String>>,
    /// LoRA adapters of the pool's model its engines serve (`model` names forwarded as
    /// they are): each is keyed apart from the model and from the other adapters, since
    /// an engine caches prefixes per adapter. Default none.
    #[serde(default)]
    pub adapters: Vec<Spanned<String>>,
    /// Budget for the first generated token. Default `"60s"`.
    #[serde(default = "default_first_token_timeout")]
    pub first_token_timeout: Dur,
    /// Pools tried, in order, when this one has no available node (a disaggregated
    /// pool: no prefill or no decode engine for a leg; the fallback takes the request
    /// whole). None may be a disaggregated pool. Default none.
    #[serde(default)]
    pub fallbacks: Vec<Spanned<String>>,
    /// Whether requests that ask for reasoning may come here. Default true.
    #[serde(default = "yes")]
    pub supports_thinking: bool,
    /// The pool for requests naming an unknown model. Default false.
    #[serde(default = "no")]
    pub default: Spanned<bool>,
    /// `"vllm"`: the pool's engines are split into prefill and decode engines (each
    /// node's `role`), and a chat or completions request goes to a prefill engine
    /// first, then with its `kv_transfer_params` to a decode engine (vLLM's
    /// `NixlConnector` and other KV connectors). `"sglang"`: a chat, completions or
    /// `/generate` request goes to a prefill and a decode engine at once, both with the
    /// prefill engine's `bootstrap_host`, `bootstrap_port` and a new `bootstrap_room`
    /// (SGLang's `--disaggregation-mode`). Default: none (each request whole to one
    /// node).
    pub disaggregation: Option<Spanned<String>>,
    /// With `disaggregation`: each decode engine's in-flight cap (per unit of its
    /// `weight`), for as long as it streams an answer. Default: `routing.max_in_flight`.
    /// A decode engine prefills nothing and batches many streams: set it near the
    /// sequences one runs at once (vLLM's `--max-num-seqs`).
    pub decode_max_in_flight: Option<Spanned<u32>>,
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
    /// Data-parallel ranks the engine server runs behind this URL, each with its own
    /// KV cache (vLLM `--data-parallel-size`, SGLang `--dp-size`): N > 1 makes N nodes,
    /// `{id}@0` … `{id}@{N-1}`, each request naming its rank in `x-data-parallel-rank`.
    /// Default 1 (the server is one node).
    #[serde(default = "one")]
    pub data_parallel_size: Spanned<u32>,
    /// `"dns"`: the URL's host is a DNS name standing for several engines (a
    /// Kubernetes headless Service, a Compose service's replicas): each address it
    /// resolves to is a node, `{id}-{address}`, with this entry's port, path, weight
    /// and ranks, looked up again every `discovery.interval`. `"srv"`: the host's SRV
    /// records give the engines and their ports (Consul, a Kubernetes named port), a
    /// node per target address and port, `{id}-{address}:{port}`; the URL has no port.
    /// With `https://`, each engine's certificate is checked against the host's name.
    /// Default: none (one node, its name resolved when each connection is made).
    pub discover: Option<Spanned<String>>,
    /// In a pool with `disaggregation`: `"prefill"` or `"decode"`, what the engine does
    /// for the pool's requests. Required there, refused elsewhere.
    pub role: Option<Spanned<String>>,
    /// A prefill engine's SGLang bootstrap port (`--disaggregation-bootstrap-port`), in
    /// a pool with `disaggregation = "sglang"`; refused elsewhere. Default: none
    /// (`null` is sent, and the engines use their own default, 8998).
    pub bootstrap_port: Option<Spanned<u16>>,
}

/// `[discovery]`
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoverySection {
    /// How often the names of `discover` nodes are looked up. Default `"5s"`.
    pub interval: Dur,
    /// DNS servers to ask, `"ip:port"` (port 53 if left out). Default: none, the
    /// system's (/etc/resolv.conf, with its search domains; /etc/hosts).
    pub nameservers: Vec<Spanned<String>>,
}

impl Default for DiscoverySection {
    fn default() -> Self {
        DiscoverySection {
            interval: Dur::secs(5),
            nameservers: Vec::new(),
        }
    }
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
fn no_aliases() -> Spanned<std::collections::BTreeMap<String, String>> {
    unspanned(std::collections::BTreeMap::new())
}
fn one() -> Spanned<u32> {
    unspanned(1)
}
pub(super) fn unspanned<T>(value: T) -> Spanned<T> {
    Spanned::new(0..0, value)
}
