//! The status page on the admin listener: `GET /` serves one self-contained HTML page
//! (`status.html`: no external scripts, styles or fonts; it works offline), which polls
//! `/admin/nodes` and `/admin/summary` and keeps the last minutes of each node in
//! sparklines. The page itself holds no data, so it is served without the admin token;
//! the page asks for the token and sends it on every call (drain and undrain too).
//!
//! `/admin/summary` is what the page needs beyond the nodes: each pool's queue and
//! load, the realized cache hit rate per node (the engines' own usage counts), the
//! hottest learned prefix groups (hash tags and widths, never text), Redis, the
//! DNS names of `discover` entries, and when the config's TLS certificates expire.

use serde_json::{json, Value};

use super::control::Control;

/// The page, compiled in.
pub const PAGE: &str = include_str!("status.html");

/// Groups listed per pool.
const GROUPS_SHOWN: usize = 8;

/// `GET /admin/summary`.
pub fn summary(control: &Control) -> Value {
    let table = control.table();
    let metrics = control.metrics();
    let pools: Vec<Value> = table
        .pools
        .iter()
        .map(|pool| {
            let b = &pool.balancer;
            let load = b.load();
            let classes: serde_json::Map<String, Value> = table
                .config
                .tenancy
                .classes
                .iter()
                .enumerate()
                .map(|(i, c)| (c.name.to_string(), json!(load.queued_in(i))))
                .collect();
            let nodes: Vec<Value> = b
                .nodes()
                .iter()
                .map(|n| {
                    let (prompt, cached) = metrics.requests.tokens_of(n.id());
                    json!({"id": n.id(), "prompt_tokens": prompt, "cached_tokens": cached})
                })
                .collect();
            let groups: Vec<Value> = load
                .groups
                .hottest(GROUPS_SHOWN)
                .into_iter()
                .map(|g| {
                    json!({
                        "tag": format!("{:08x}", g.tag),
                        "recent_requests": g.recent,
                        "share": g.share,
                        "width": g.width,
                    })
                })
                .collect();
            json!({
                "name": pool.config.name,
                "models": pool.config.models,
                // A disaggregated pool's two: the pool of its decode engines, or the
                // pool whose decode engines these are.
                "decode_pool": pool.config.decode_pool,
                "decodes_for": pool.config.decodes_for,
                "key": table.config.routing.key.as_str(),
                "queued": load.queued(),
                "queued_by_priority": classes,
                "in_flight": b.nodes().iter().map(|n| n.state().in_flight()).sum::<u32>(),
                "cap": b.nodes().iter().map(|n| b.cap_of(n)).sum::<u32>(),
                "nodes": nodes,
                "groups": groups,
            })
        })
        .collect();
    let fleet = &metrics.fleet;
    // Whether each DNS name answered when last looked up (a name not looked up yet has
    // no series).
    let answered: std::collections::HashMap<String, bool> =
        prometheus::core::Collector::collect(&fleet.dns_up)
            .iter()
            .flat_map(|family| family.get_metric())
            .filter_map(|m| {
                let name = m.get_label().iter().find(|l| l.name() == "name")?;
                Some((name.value().to_string(), m.get_gauge().get_value() == 1.0))
            })
            .collect();
    // Whether membership was read from Redis when last polled (no series: no
    // `[redis]`, or not polled yet).
    let redis_up = prometheus::core::Collector::collect(&fleet.redis_up)
        .iter()
        .flat_map(|family| family.get_metric())
        .map(|m| m.get_gauge().get_value())
        .next();
    // Each `discover` entry: whether its name answered when last looked up (null: not
    // yet) and how many engine servers it gives now.
    let addresses = control.dns_addresses();
    let dns: Vec<Value> = table
        .pools
        .iter()
        .flat_map(|pool| &pool.config.named)
        .map(|e| {
            let name = (e.discover, e.name().to_string());
            json!({
                "entry": e.id,
                "name": e.name(),
                "discover": e.discover.as_str(),
                "up": answered.get(e.name()).copied(),
                "servers": addresses.get(&name).map_or(0, Vec::len),
            })
        })
        .collect();
    // Each certificate of the config: when it expires, and in how many days.
    let now = crate::config::unix_now();
    let certificate = |e: Option<crate::config::Expiry>| {
        e.map(|e| json!({"expires": e.to_string(), "days_left": e.days_left(now)}))
    };
    let tls = json!({
        "listener": certificate(table.config.server.tls.as_ref().map(|t| t.expires)),
        "engine_client": certificate(table.config.tls.client_certificate_expires()),
    });
    json!({
        "dns": dns,
        "tls": tls,
        "version": env!("CARGO_PKG_VERSION"),
        "redis": {
            "configured": table.config.redis.is_some(),
            "up": table.config.redis.is_some().then(|| redis_up == Some(1.0)),
            "replicas": fleet.balancer_replicas.get(),
        },
        "routing": {
            "max_in_flight": table.config.routing.max_in_flight,
            "when_saturated": table.config.routing.when_saturated.as_str(),
        },
        "pools": pools,
    })
}
