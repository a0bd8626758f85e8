//! The runtime layer built from the file layer: every value checked and bounded,
//! names resolved, defaults applied. An error carries the span of what is wrong.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;

use toml::Spanned;

use super::file::{
    AuthSection, BreakerSection, DiscoverySection, FileConfig, HealthSection, LaneCount,
    NodeSection, PoolSection, RedisSection, RoutingSection, ServerSection, ShuntStepSection,
};
use super::{
    AuthConfig, BreakerSettings, Config, Disaggregation, Discover, DiscoveryConfig, HealthConfig,
    NamedNodes, NodeConfig, PoolConfig, RedisConfig, RoutingConfig, Secret, ServerConfig,
    ShuntStep, MAX_DATA_PARALLEL_SIZE,
};

/// What is wrong, and where (no span: the file as a whole).
pub(super) type Invalid = (Option<Range<usize>>, String);

fn invalid<T>(span: Range<usize>, msg: impl Into<String>) -> Result<T, Invalid> {
    let span = if span.is_empty() && span.start == 0 {
        None
    } else {
        Some(span)
    };
    Err((span, msg.into()))
}

/// Most serving lanes (`server.lanes`).
const MAX_LANES: usize = 256;

/// `server.lanes = "auto"`: one lane per CPU this process may use (its affinity mask
/// and any cgroup CPU quota), at most [`MAX_LANES`].
fn lanes_for_this_process() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_LANES)
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

/// Validates a parsed file; `dir` is the file's folder (for `api_keys_file`).
pub(super) fn config(raw: FileConfig, dir: &Path) -> Result<Config, Invalid> {
    let server = validate_server(raw.server, dir)?;
    let (tenant_header, priority_header, default_priority) = (
        raw.routing.tenant_header.clone(),
        raw.routing.priority_header.clone(),
        raw.routing.default_priority.clone(),
    );
    let from_certificate = raw.routing.tenant_from_client_certificate.clone();
    let asks_certificates = server.tls.as_ref().is_some_and(|t| t.clients.is_some());
    if *from_certificate.get_ref() && !asks_certificates {
        return Err((
            Some(from_certificate.span()),
            "routing.tenant_from_client_certificate needs server.tls_client_ca_file (only then do clients show certificates)".into(),
        ));
    }
    let routing = validate_routing(raw.routing)?;
    let mut tenancy = super::tenancy::validate(
        raw.priorities,
        raw.tenants,
        default_priority,
        tenant_header,
        priority_header,
        routing.max_queue,
    )?;
    let breaker = validate_breaker(raw.breaker)?;
    let health = validate_health(raw.health)?;
    let auth = validate_auth(raw.auth, dir)?;
    tenancy.tenant_from_certificate = *from_certificate.get_ref();
    tenancy.counts_usage = !tenancy.tenants.is_empty()
        || tenancy.tenant_header.is_some()
        || tenancy.tenant_from_certificate
        || auth.keys.iter().any(|(name, _)| name.is_some());
    let tls = super::tls::validate(raw.tls, dir)?;
    let tracing = raw.tracing.map(validate_tracing).transpose()?;
    let redis = raw.redis.map(validate_redis).transpose()?;
    let discovery = validate_discovery(raw.discovery)?;
    if raw.pools.is_empty() {
        return invalid(
            0..0,
            "no [[pools]]: at least one pool with nodes is required",
        );
    }
    let mut seen = Seen {
        all_pools: raw.pools.iter().map(|p| p.name.get_ref().clone()).collect(),
        dynamic: redis.is_some(),
        ..Seen::default()
    };
    let mut pools = Vec::with_capacity(raw.pools.len());
    for p in raw.pools {
        let (pool, decode) = validate_pool(p, &mut seen)?;
        pools.push(pool);
        pools.extend(decode);
    }
    // A fallback takes a request whole, which a disaggregated pool's engines do not.
    for pool in &pools {
        let split = |f: &&String| {
            pools
                .iter()
                .any(|q| q.name == **f && q.decode_pool.is_some())
        };
        if let Some(f) = pool.fallbacks.iter().find(split) {
            return invalid(
                0..0,
                format!("pool {:?} falls back to {f:?}, which is disaggregated: not built (a fallback takes the request whole); a disaggregated pool may have fallbacks of its own", pool.name),
            );
        }
    }
    Ok(Config {
        server,
        routing,
        breaker,
        health,
        auth,
        tls,
        tracing,
        tenancy,
        redis,
        discovery,
        pools,
    })
}

fn validate_discovery(d: DiscoverySection) -> Result<DiscoveryConfig, Invalid> {
    if d.interval.0 < std::time::Duration::from_millis(100) {
        return invalid(0..0, "discovery.interval must be at least 100ms");
    }
    let mut nameservers = Vec::new();
    for n in &d.nameservers {
        let text = n.get_ref().trim();
        let address = text
            .parse::<SocketAddr>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(|ip| (ip, 53).into()))
            .or_else(|_| {
                invalid(
                    n.span(),
                    format!("discovery.nameservers: {text:?} is not an address (\"10.96.0.10\" or \"10.96.0.10:53\")"),
                )
            })?;
        nameservers.push(address);
    }
    Ok(DiscoveryConfig {
        interval: d.interval.0,
        nameservers,
    })
}

fn validate_tracing(t: super::file::TracingSection) -> Result<super::TracingConfig, Invalid> {
    let ratio = *t.sample_ratio.get_ref();
    if !(0.0..=1.0).contains(&ratio) {
        return invalid(
            t.sample_ratio.span(),
            format!("tracing.sample_ratio must be between 0.0 and 1.0 (got {ratio})"),
        );
    }
    let span = t.otlp_endpoint.span();
    let raw = t.otlp_endpoint.into_inner();
    let url: http::Uri = match raw.trim().parse() {
        Ok(u) => u,
        Err(e) => return invalid(span, format!("tracing.otlp_endpoint {raw:?}: {e}")),
    };
    if url.scheme_str() != Some("http") || url.host().is_none() {
        return invalid(
            span,
            format!("tracing.otlp_endpoint {raw:?} must be http://host[:port][/path] (OTLP over HTTP; https is not supported)"),
        );
    }
    let path = url.path();
    let endpoint = if path.is_empty() || path == "/" {
        format!(
            "http://{}/v1/traces",
            url.authority().map_or("", |a| a.as_str())
        )
    } else {
        url.to_string()
    };
    if t.service_name.trim().is_empty() {
        return invalid(0..0, "tracing.service_name must not be empty");
    }
    Ok(super::TracingConfig {
        otlp_endpoint: endpoint,
        sample_ratio: ratio,
        service_name: t.service_name,
    })
}

fn validate_redis(r: RedisSection) -> Result<RedisConfig, Invalid> {
    let url = r.url.get_ref().trim();
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return invalid(
            r.url.span(),
            "redis.url must be redis://[user:pass@]host:port[/db] or rediss://… (TLS)",
        );
    }
    let prefix = r.key_prefix.get_ref().trim();
    if prefix.is_empty() || prefix.len() > 128 {
        return invalid(
            r.key_prefix.span(),
            "key_prefix must be 1 to 128 characters",
        );
    }
    let poll = r.poll_interval.0;
    let ttl = r.heartbeat_ttl.0;
    if poll < std::time::Duration::from_millis(50) || ttl < poll * 2 {
        return invalid(
            0..0,
            "redis.poll_interval must be at least 50ms and heartbeat_ttl at least twice it",
        );
    }
    Ok(RedisConfig {
        url: Secret::new(url),
        password_env: r.password_env.map(|e| e.into_inner()),
        key_prefix: prefix.to_string(),
        poll_interval: poll,
        heartbeat_ttl: ttl,
    })
}

/// What earlier pools claimed: names, node ids, models, the default.
#[derive(Default)]
struct Seen {
    all_pools: HashSet<String>,
    pools: HashSet<String>,
    node_ids: HashSet<String>,
    model_owner: HashMap<String, String>,
    default_pool: Option<String>,
    /// Nodes may come from Redis: a pool may list none.
    dynamic: bool,
}

/// A pool, and for a disaggregated one the pool of its decode engines.
fn validate_pool(
    p: PoolSection,
    seen: &mut Seen,
) -> Result<(PoolConfig, Option<PoolConfig>), Invalid> {
    let name = p.name.get_ref().trim().to_string();
    if name.is_empty() {
        return invalid(p.name.span(), "pool name is empty");
    }
    if !seen.pools.insert(name.clone()) {
        return invalid(p.name.span(), format!("duplicate pool name {name:?}"));
    }
    if *p.default.get_ref() {
        if let Some(other) = &seen.default_pool {
            return invalid(
                p.default.span(),
                format!("pools {other:?} and {name:?} are both marked default; only one may be"),
            );
        }
        seen.default_pool = Some(name.clone());
    }
    let mut models = Vec::new();
    if p.models.is_empty() {
        models.push(name.clone());
    }
    models.extend(p.models.iter().map(|m| m.get_ref().clone()));
    for (i, m) in models.iter().enumerate() {
        if let Some(owner) = seen.model_owner.insert(m.clone(), name.clone()) {
            let span = p.models.get(i).map(|s| s.span()).unwrap_or(p.name.span());
            return invalid(
                span,
                format!("model {m:?} is served by pools {owner:?} and {name:?}; a model belongs to one pool"),
            );
        }
    }
    let mut adapters = Vec::new();
    for a in &p.adapters {
        let adapter = a.get_ref().trim();
        if adapter.is_empty() {
            return invalid(a.span(), format!("pool {name:?} has an empty adapter name"));
        }
        if let Some(owner) = seen.model_owner.insert(adapter.to_string(), name.clone()) {
            return invalid(
                a.span(),
                format!("adapter {adapter:?} of pool {name:?} is already a model or adapter of pool {owner:?}; a name belongs to one pool"),
            );
        }
        adapters.push(adapter.to_string());
    }
    let mut aliases = Vec::new();
    for (alias, model) in p.aliases.get_ref() {
        let span = p.aliases.span();
        if alias.trim().is_empty() {
            return invalid(span, format!("pool {name:?} has an empty alias"));
        }
        if !models.contains(model) && !adapters.contains(model) {
            return invalid(
                span,
                format!("alias {alias:?} of pool {name:?} stands for {model:?}, which the pool does not serve (its models and adapters: {})", models.iter().chain(&adapters).cloned().collect::<Vec<_>>().join(", ")),
            );
        }
        if let Some(owner) = seen.model_owner.insert(alias.clone(), name.clone()) {
            return invalid(
                span,
                format!("alias {alias:?} of pool {name:?} is already a model or alias of pool {owner:?}; a name belongs to one pool"),
            );
        }
        aliases.push((alias.clone(), model.clone()));
    }
    let mut fallbacks = Vec::new();
    for f in &p.fallbacks {
        let target = f.get_ref();
        if !seen.all_pools.contains(target) {
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
    if p.nodes.is_empty() && !seen.dynamic {
        return invalid(
            p.name.span(),
            format!("pool {name:?} has no nodes (add [[pools.nodes]] with id and url, or a [redis] section for nodes that heartbeat)"),
        );
    }
    let disaggregation = match p.disaggregation.as_ref().map(|d| (d.span(), d.get_ref().as_str())) {
        None => None,
        Some((_, "vllm")) => Some(Disaggregation::Vllm),
        Some((_, "sglang")) => Some(Disaggregation::Sglang),
        Some((span, other)) => {
            return invalid(
                span,
                format!("disaggregation = {other:?}: \"vllm\" (prefill, then decode with vLLM's kv_transfer_params) or \"sglang\" (prefill and decode at once, with SGLang's bootstrap_host, bootstrap_port and bootstrap_room), or leave it out"),
            )
        }
    };
    // Each role's nodes and named entries: [whole or prefill, decode].
    let mut nodes = [Vec::new(), Vec::new()];
    let mut named = [Vec::new(), Vec::new()];
    for n in p.nodes {
        let side = usize::from(node_role(&n, &name, disaggregation.is_some())?);
        if let Some(port) = &n.bootstrap_port {
            let id = n.id.get_ref();
            if disaggregation != Some(Disaggregation::Sglang) || side == 1 {
                return invalid(
                    port.span(),
                    format!("node {id:?} has a bootstrap_port: only a prefill engine of a pool with disaggregation = \"sglang\" has one"),
                );
            }
            if *port.get_ref() == 0 {
                return invalid(port.span(), format!("node {id:?}: bootstrap_port 0"));
            }
        }
        match n.discover.as_ref().map(|d| (d.span(), d.get_ref().as_str())) {
            None => nodes[side].extend(validate_node(n, &mut seen.node_ids)?),
            Some((_, "dns")) => {
                named[side].push(validate_named(n, Discover::Dns, &mut seen.node_ids)?)
            }
            Some((_, "srv")) => {
                named[side].push(validate_named(n, Discover::Srv, &mut seen.node_ids)?)
            }
            Some((span, other)) => {
                return invalid(
                    span,
                    format!("discover = {other:?}: nodes are discovered by \"dns\" (each address of the url's host) or \"srv\" (each target and port of its SRV records), or leave it out"),
                )
            }
        }
    }
    let [nodes, decode_nodes] = nodes;
    let [named, decode_named] = named;
    let decode_pool = match disaggregation {
        None => None,
        Some(how) => {
            let span = p
                .disaggregation
                .as_ref()
                .map_or(p.name.span(), |d| d.span());
            for (role, nodes, named) in [
                ("prefill", &nodes, &named),
                ("decode", &decode_nodes, &decode_named),
            ] {
                // With [redis], engines of either role may all heartbeat in.
                if nodes.is_empty() && named.is_empty() && !seen.dynamic {
                    return invalid(
                        span,
                        format!("pool {name:?} has disaggregation = \"{}\" and no node with role = \"{role}\"", how.as_str()),
                    );
                }
            }
            let decode_name = PoolConfig::decode_pool_name(&name);
            if seen.all_pools.contains(&decode_name) || !seen.pools.insert(decode_name.clone()) {
                return invalid(
                    span,
                    format!("pool {name:?} names its decode engines' pool {decode_name:?}, and another pool has that name"),
                );
            }
            Some(decode_name)
        }
    };
    let pool = PoolConfig {
        name,
        models,
        aliases,
        adapters,
        first_token_timeout: p.first_token_timeout.0,
        fallbacks,
        supports_thinking: p.supports_thinking,
        default: *p.default.get_ref(),
        nodes,
        named,
        disaggregation,
        decode_pool,
        decodes_for: None,
        max_in_flight: None,
    };
    let decode_cap = match (&p.decode_max_in_flight, disaggregation) {
        (None, _) => None,
        (Some(m), Some(_)) => Some(within(m, 1..=100_000, "decode_max_in_flight")?),
        (Some(m), None) => {
            return invalid(
                m.span(),
                format!(
                "pool {:?} has decode_max_in_flight and no disaggregation: it caps decode engines",
                pool.name
            ),
            )
        }
    };
    // The decode engines' pool: the same models (its engines serve them), reached only
    // from its prefill pool, with no fallbacks of its own.
    let decode = pool.decode_pool.clone().map(|decode_name| PoolConfig {
        name: decode_name,
        fallbacks: Vec::new(),
        default: false,
        nodes: decode_nodes,
        named: decode_named,
        disaggregation: None,
        decode_pool: None,
        decodes_for: Some(pool.name.clone()),
        max_in_flight: decode_cap,
        ..pool.clone()
    });
    Ok((pool, decode))
}

/// Whether a `[[pools.nodes]]` entry is a decode engine: `role` is required in a
/// disaggregated pool and refused elsewhere.
fn node_role(n: &NodeSection, pool: &str, disaggregated: bool) -> Result<bool, Invalid> {
    let id = n.id.get_ref();
    match (n.role.as_ref().map(|r| (r.span(), r.get_ref().as_str())), disaggregated) {
        (None, false) => Ok(false),
        (None, true) => invalid(
            n.id.span(),
            format!("node {id:?} of pool {pool:?} (disaggregated) needs role = \"prefill\" or \"decode\""),
        ),
        (Some((span, _)), false) => invalid(
            span,
            format!("node {id:?} has a role, and pool {pool:?} has no disaggregation to give it one"),
        ),
        (Some((_, "prefill")), true) => Ok(false),
        (Some((_, "decode")), true) => Ok(true),
        (Some((span, other)), true) => invalid(
            span,
            format!("node {id:?}: role = {other:?}: \"prefill\" or \"decode\""),
        ),
    }
}

/// What every `[[pools.nodes]]` entry gives, checked: its id, URL, weight and
/// data-parallel size.
struct Entry {
    id: String,
    url: http::Uri,
    weight: u32,
    data_parallel_size: u32,
}

fn validate_entry(n: &NodeSection) -> Result<Entry, Invalid> {
    let id = n.id.get_ref().trim().to_string();
    if id.is_empty() {
        return invalid(n.id.span(), "node id is empty");
    }
    let url = parse_node_url(n.url.get_ref()).or_else(|m| invalid(n.url.span(), m))?;
    let weight = within(&n.weight, 1..=1000, "weight")?;
    let data_parallel_size = within(
        &n.data_parallel_size,
        1..=MAX_DATA_PARALLEL_SIZE,
        "data_parallel_size",
    )?;
    Ok(Entry {
        id,
        url,
        weight,
        data_parallel_size,
    })
}

/// Takes node id `id` (ids are unique across pools).
fn claim_id(ids: &mut HashSet<String>, id: &str, span: Range<usize>) -> Result<(), Invalid> {
    if !ids.insert(id.to_string()) {
        return invalid(
            span,
            format!("duplicate node id {id:?} (ids are unique across pools)"),
        );
    }
    Ok(())
}

/// A `discover` entry: its URL's host must be a name (with SRV, one with no port:
/// the records give each engine's), and its nodes' ids are made as the name resolves.
fn validate_named(
    n: NodeSection,
    discover: Discover,
    ids: &mut HashSet<String>,
) -> Result<NamedNodes, Invalid> {
    let how = discover.as_str();
    let Entry {
        id,
        url,
        weight,
        data_parallel_size,
    } = validate_entry(&n)?;
    let host = url.host().unwrap_or_default();
    if host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok()
    {
        return invalid(
            n.url.span(),
            format!("node {id:?} has discover = \"{how}\" but its url's host {host:?} is an address: give the DNS name that stands for the engines"),
        );
    }
    if discover == Discover::Srv && url.port_u16().is_some() {
        return invalid(
            n.url.span(),
            format!("node {id:?}: with discover = \"srv\" each engine's port comes from its SRV record; leave the port out of the url"),
        );
    }
    claim_id(ids, &id, n.id.span())?;
    Ok(NamedNodes {
        id,
        url,
        discover,
        weight,
        data_parallel_size,
        bootstrap_port: n.bootstrap_port.as_ref().map(|p| *p.get_ref()),
    })
}

/// One `[[pools.nodes]]` entry: a node, or one per data-parallel rank.
fn validate_node(n: NodeSection, ids: &mut HashSet<String>) -> Result<Vec<NodeConfig>, Invalid> {
    let e = validate_entry(&n)?;
    let mut nodes = NodeConfig::ranks(e.id, e.url, e.weight, e.data_parallel_size);
    for node in &mut nodes {
        claim_id(ids, &node.id, n.id.span())?;
        node.bootstrap_port = n.bootstrap_port.as_ref().map(|p| *p.get_ref());
    }
    Ok(nodes)
}

/// A key, or `name:key`: the name is the tenant of the requests that carry the key.
fn named_key(entry: &str) -> (Option<String>, Secret) {
    match entry.split_once(':') {
        Some((name, key)) if !name.is_empty() && !key.is_empty() => {
            (Some(name.trim().to_string()), Secret::new(key.trim()))
        }
        _ => (None, Secret::new(entry)),
    }
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
                .map(named_key),
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
                .map(named_key),
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
    let slow_streams = within(&b.slow_streams, 1..=512, "slow_streams")?;
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
    let shunts = shunt_steps(&b.shunt_steps)?;
    let factor = *b.slow_factor.get_ref();
    if !(1.0..=100.0).contains(&factor) {
        return invalid(
            b.slow_factor.span(),
            format!("slow_factor {factor} must be in [1, 100] (a multiple of the pool's median normalized TTFT)"),
        );
    }
    let share = *b.max_ejected_share.get_ref();
    if !(0.0..=1.0).contains(&share) {
        return invalid(
            b.max_ejected_share.span(),
            format!("max_ejected_share {share} must be in [0, 1]"),
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
        slow_factor: factor,
        slow_ratio: ratio,
        slow_streams,
        min_samples,
        window: b.window.0,
        canary_steps: steps.clone(),
        canary_step: b.canary_step.0,
        shunt_steps: shunts,
        max_ejected_share: share,
    })
}

/// `shunt_steps`: ascending in `over_pool` and `divert`, each divert in (0, 1).
fn shunt_steps(steps: &Spanned<Vec<ShuntStepSection>>) -> Result<Vec<ShuntStep>, Invalid> {
    let mut out = Vec::with_capacity(steps.get_ref().len());
    for s in steps.get_ref() {
        let Some(over_pool) = s.over_pool else {
            let why = if s.p90.is_some() {
                "shunt_steps now take `over_pool` (a multiple of the pool's normalized TTFT), not a raw `p90` time; e.g. [{ over_pool = 1.5, divert = 0.2 }, { over_pool = 2.0, divert = 0.5 }] (see docs/resilience.md)"
            } else {
                "each shunt step needs `over_pool` and `divert`, e.g. { over_pool = 1.5, divert = 0.2 }"
            };
            return invalid(steps.span(), why);
        };
        out.push(ShuntStep {
            over_pool,
            divert: s.divert,
        });
    }
    if out
        .windows(2)
        .any(|w| w[0].over_pool >= w[1].over_pool || w[0].divert > w[1].divert)
        || out
            .iter()
            .any(|s| !(s.divert > 0.0 && s.divert < 1.0 && (1.0..=100.0).contains(&s.over_pool)))
    {
        return invalid(
            steps.span(),
            "shunt_steps must ascend in over_pool (each in [1, 100]) and divert (each in (0, 1))",
        );
    }
    Ok(out)
}

fn validate_health(h: HealthSection) -> Result<HealthConfig, Invalid> {
    if !h.path.starts_with('/') {
        return invalid(
            0..0,
            format!("health.path {:?} must start with '/'", h.path),
        );
    }
    if !(h.metrics_path.is_empty() || h.metrics_path.starts_with('/')) {
        return invalid(
            0..0,
            format!(
                "health.metrics_path {:?} must start with '/' (or be \"\" to read none)",
                h.metrics_path
            ),
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
        metrics_path: (!h.metrics_path.is_empty()).then_some(h.metrics_path),
    })
}

fn validate_server(s: ServerSection, dir: &Path) -> Result<ServerConfig, Invalid> {
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
    let tls = super::tls::listener(&s, dir)?;
    if *s.admin_tls.get_ref() && tls.is_none() {
        return Err((
            Some(s.admin_tls.span()),
            "server.admin_tls needs server.tls_cert_file and tls_key_file (the admin port shows the client port's certificate)".into(),
        ));
    }
    Ok(ServerConfig {
        listen: addr(&s.listen, "listen")?,
        admin_listen: addr(&s.admin_listen, "admin_listen")?,
        admin_token: s.admin_token.filter(|t| !t.expose().is_empty()),
        max_body_bytes: max_body_bytes as usize,
        request_timeout: s.request_timeout.0,
        connect_timeout: s.connect_timeout.0,
        idle_stream_timeout: s.idle_stream_timeout.0,
        sse_keepalive: match s.sse_keepalive.0 {
            d if d.is_zero() || d >= std::time::Duration::from_millis(100) => d,
            _ => {
                return invalid(
                    0..0,
                    "server.sse_keepalive must be 0s (off) or at least 100ms",
                )
            }
        },
        request_ids: s.request_ids,
        shutdown_grace: s.shutdown_grace.0,
        watch_config: s.watch_config,
        header_read_timeout: s.header_read_timeout.0,
        max_headers: within(&s.max_headers, 1..=10_000, "max_headers")?,
        max_header_bytes: within(&s.max_header_bytes, 8192..=16 << 20, "max_header_bytes")?,
        http2_keep_alive_interval: s.http2_keep_alive_interval.0,
        max_connections: within(&s.max_connections, 1..=1_000_000, "max_connections")?,
        lanes: match *s.lanes.get_ref() {
            LaneCount::Auto => lanes_for_this_process(),
            LaneCount::Count(n) if n <= MAX_LANES as u64 => n as usize,
            LaneCount::Count(n) => {
                return invalid(
                    s.lanes.span(),
                    format!("lanes {n} is out of range 0..={MAX_LANES} (or \"auto\")"),
                )
            }
        },
        pin_threads: s.pin_threads,
        yield_after: match s.yield_after.0 {
            d if d <= std::time::Duration::from_secs(1) => d,
            _ => return invalid(0..0, "server.yield_after must be at most 1s"),
        },
        body_read_timeout: s.body_read_timeout.0,
        max_buffered_bytes: max_buffered_bytes as usize,
        tls,
        admin_tls: *s.admin_tls.get_ref(),
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
                format!("extra_paths entry {p:?} must be a path like \"/v1/moderations\""),
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
        max_scan_bytes: within(&r.max_scan_bytes, 512..=16 << 20, "max_scan_bytes")?,
        extra_paths: r.extra_paths.into_inner(),
        split_cap_across_replicas: r.split_cap_across_replicas,
    })
}

/// A node's base URL: `http` or `https` (see `[tls]`), a host, a port if any in
/// 1..=65535, no credentials, no query, and a base path (prepended to each request's
/// path) that does not end in `/v1`: the client's own path starts with it.
pub fn parse_node_url(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s
        .parse()
        .map_err(|e| format!("url {s:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => {
            return Err(format!(
                "url {s:?} needs a scheme and host, e.g. \"http://10.0.0.5:8000\""
            ))
        }
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("url {s:?} has no host"));
    };
    if authority.as_str().contains('@') {
        // Never echo the secret itself.
        return Err(format!(
            "url of host {:?} carries credentials (user:password@): engines are not reached with URL credentials, and they would be sent as the Host header; remove them",
            authority.host()
        ));
    }
    if uri.query().is_some() {
        return Err(format!("url {s:?} must not have a query"));
    }
    // `http` reads a port past 65535 as none (and connects to 80).
    let port = authority.as_str()[authority.host().len()..].trim_start_matches(':');
    if !port.is_empty() && !port.parse::<u16>().is_ok_and(|p| p > 0) {
        return Err(format!("url {s:?} has port {port}: a port is 1 to 65535"));
    }
    let base = uri.path().trim_end_matches('/');
    if let Some(root_path) = base.strip_suffix("/v1") {
        let root = format!(
            "{}://{authority}{root_path}",
            uri.scheme_str().unwrap_or("http")
        );
        return Err(format!(
            "url {s:?} ends in /v1, but requests keep their own path (/v1/chat/completions), so the engine would get {base}/v1/…; give the engine's root, {root:?}"
        ));
    }
    Ok(uri)
}
