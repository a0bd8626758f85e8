//! Nodes found in DNS: a `[[pools.nodes]]` entry with `discover = "dns"` names a host
//! that stands for several engines (a Kubernetes headless Service lists each ready
//! pod's address, a Compose service each replica's), and every address it resolves
//! to is an engine server of its own, `{id}-{address}`, with the entry's port, path,
//! weight and ranks. With `discover = "srv"` the host's SRV records name the engines
//! and their ports (Consul, a Kubernetes Service's named port): each target's
//! addresses, `{id}-{address}:{port}`. The names are looked up every
//! `discovery.interval` in a task of its own (never on a request's path); the control
//! plane rebuilds its table when an answer differs ([`Discovered`]).
//!
//! Fail static, as with Redis: a lookup that fails or finds no address keeps the
//! name's last addresses (`prefixlb_dns_up{name}` turns 0, one line is logged per
//! change of state), and the health checks take out an engine that is gone. How the
//! addresses become nodes is pure ([`expand`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use crate::config::{Config, Discover, DiscoveryConfig, Endpoint};
use crate::telemetry::metrics::FleetMetrics;

/// A name to look up, and how.
pub type Name = (Discover, String);

/// The endpoints each name gave when last it answered, sorted.
pub type Addresses = BTreeMap<Name, Vec<Endpoint>>;

/// A lookup never waits longer than this, whatever the interval.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// What the discovery task reads its settings from and feeds: the control plane.
pub trait Discovered: Send + Sync {
    /// The `[discovery]` settings and the names to look up now.
    fn discovery(&self) -> (DiscoveryConfig, Vec<Name>);
    /// Applies the addresses every name has now.
    fn apply_addresses(&self, addresses: &Addresses);
}

/// The config with each `discover` entry's engine servers made from its
/// name's addresses, the ids of the nodes made, and why any was left out (an id the
/// config's own nodes already have).
pub fn expand(config: &Config, addresses: &Addresses) -> (Config, HashSet<String>, Vec<String>) {
    let mut config = config.clone();
    let mut ids: HashSet<String> = config
        .pools
        .iter()
        .flat_map(|p| p.nodes.iter().map(|n| n.id.clone()))
        .collect();
    let mut made = HashSet::new();
    let mut skipped = Vec::new();
    for pool in &mut config.pools {
        for entry in &pool.named {
            let name = (entry.discover, entry.name().to_string());
            let Some(found) = addresses.get(&name) else {
                continue;
            };
            for &endpoint in found {
                let nodes = entry.at(endpoint);
                if let Some(clash) = nodes.iter().find(|n| ids.contains(&n.id)) {
                    skipped.push(format!(
                        "{}'s address {} is left out: node id {:?} is taken",
                        entry.name(),
                        endpoint.ip,
                        clash.id
                    ));
                    continue;
                }
                for node in nodes {
                    ids.insert(node.id.clone());
                    made.insert(node.id.clone());
                    pool.nodes.push(node);
                }
            }
        }
    }
    (config, made, skipped)
}

/// The names of every `discover` entry, each once with each way it is looked up.
pub fn names(config: &Config) -> Vec<Name> {
    let mut names: Vec<Name> = config
        .pools
        .iter()
        .flat_map(|p| p.named.iter().map(|e| (e.discover, e.name().to_string())))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// A resolver asking `nameservers`, or the system's when none are given. It keeps no
/// answer: each round asks the server afresh, whatever the records' TTL (as Envoy
/// does unless told to respect it), so `discovery.interval` is how soon a change is
/// seen.
fn resolver(nameservers: &[SocketAddr]) -> Result<TokioResolver, String> {
    let provider = TokioRuntimeProvider::default();
    let mut builder = if nameservers.is_empty() {
        TokioResolver::builder(provider).map_err(|e| e.to_string())?
    } else {
        let servers = nameservers
            .iter()
            .map(|addr| {
                let mut server = NameServerConfig::udp_and_tcp(addr.ip());
                for c in &mut server.connections {
                    c.port = addr.port();
                }
                server
            })
            .collect();
        TokioResolver::builder_with_config(ResolverConfig::from_name_servers(servers), provider)
    };
    let options = builder.options_mut();
    // IPv4 addresses, IPv6 only for a name with none: a dual-stack pod has one of each,
    // and both as nodes would be one engine twice (Envoy too takes one family unless
    // told `ALL`).
    options.ip_strategy = LookupIpStrategy::Ipv4thenIpv6;
    options.cache_size = 0;
    options.positive_max_ttl = Some(Duration::ZERO);
    options.negative_max_ttl = Some(Duration::ZERO);
    builder.build().map_err(|e| e.to_string())
}

/// Every address `name` resolves to (its IPv4 ones; IPv6 if it has none), sorted, or
/// why none.
async fn addresses_of(resolver: &TokioResolver, name: &str) -> Result<Vec<IpAddr>, String> {
    let answer = tokio::time::timeout(LOOKUP_TIMEOUT, resolver.lookup_ip(name))
        .await
        .map_err(|_| format!("no answer in {LOOKUP_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    let mut found: Vec<IpAddr> = answer.iter().collect();
    found.sort();
    found.dedup();
    if found.is_empty() {
        return Err("no address".into());
    }
    Ok(found)
}

/// Every target address and port of `name`'s SRV records (the targets looked up at
/// once; one whose name does not resolve is left out), or why none.
async fn targets_of(resolver: &TokioResolver, name: &str) -> Result<Vec<Endpoint>, String> {
    let answer = tokio::time::timeout(LOOKUP_TIMEOUT, resolver.srv_lookup(name))
        .await
        .map_err(|_| format!("no answer in {LOOKUP_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())?;
    let mut lookups = JoinSet::new();
    for record in answer.answers() {
        let RData::SRV(srv) = &record.data else {
            continue;
        };
        let (resolver, target, port) = (resolver.clone(), srv.target.to_string(), srv.port);
        lookups.spawn(async move {
            let ips = addresses_of(&resolver, &target).await;
            (target, port, ips)
        });
    }
    let mut found = Vec::new();
    let mut unresolved = Vec::new();
    while let Some(joined) = lookups.join_next().await {
        match joined {
            Ok((_, port, Ok(ips))) => found.extend(ips.into_iter().map(|ip| Endpoint {
                ip,
                port: Some(port),
            })),
            Ok((target, _, Err(e))) => unresolved.push(format!("{target}: {e}")),
            Err(e) => unresolved.push(e.to_string()),
        }
    }
    found.sort();
    found.dedup();
    if found.is_empty() {
        unresolved.sort();
        return Err(match unresolved.is_empty() {
            true => "no SRV record".into(),
            false => format!("no target resolves ({})", unresolved.join("; ")),
        });
    }
    Ok(found)
}

/// The endpoints `name` gives, looked up as it says.
async fn lookup(resolver: &TokioResolver, name: &Name) -> Result<Vec<Endpoint>, String> {
    match name.0 {
        Discover::Dns => Ok(addresses_of(resolver, &name.1)
            .await?
            .into_iter()
            .map(|ip| Endpoint { ip, port: None })
            .collect()),
        Discover::Srv => targets_of(resolver, &name.1).await,
    }
}

/// Each name looked up once, with its addresses or why none (for `prefixlb check`).
pub async fn look_up_once(
    nameservers: &[SocketAddr],
    names: Vec<Name>,
) -> Vec<(Name, Result<Vec<Endpoint>, String>)> {
    let resolver = match resolver(nameservers) {
        Ok(r) => r,
        Err(e) => return names.into_iter().map(|n| (n, Err(e.clone()))).collect(),
    };
    let mut found = Vec::new();
    for name in names {
        let answer = lookup(&resolver, &name).await;
        found.push((name, answer));
    }
    found
}

/// An endpoint as written: its address, and `:port` for a port of its own.
pub fn endpoint_text(e: &Endpoint) -> String {
    match e.port {
        Some(port) => std::net::SocketAddr::new(e.ip, port).to_string(),
        None => e.ip.to_string(),
    }
}

/// Looks every name up at once. A name that answers has its endpoints put in `now`;
/// one that fails keeps what `now` has for it (fail static). `up` says whether each
/// name's last lookup answered (one log line per change of state).
async fn look_up_all(
    resolver: &TokioResolver,
    names: Vec<Name>,
    now: &mut Addresses,
    up: &mut HashMap<Name, bool>,
    metrics: &FleetMetrics,
) {
    let mut lookups = JoinSet::new();
    for name in names {
        let resolver = resolver.clone();
        lookups.spawn(async move {
            let found = lookup(&resolver, &name).await;
            (name, found)
        });
    }
    while let Some(joined) = lookups.join_next().await {
        let Ok((name, found)) = joined else {
            continue;
        };
        let answered = found.is_ok();
        metrics
            .dns_up
            .with_label_values(&[&name.1])
            .set(answered.into());
        match found {
            Ok(found) => {
                if up.get(&name) == Some(&false) {
                    tracing::info!(name = %name.1, addresses = found.len(), "DNS answers again");
                }
                now.insert(name.clone(), found);
            }
            Err(e) if up.get(&name) != Some(&false) => {
                let kept = now.get(&name).map_or(0, Vec::len);
                tracing::warn!(name = %name.1, error = %e, kept, "DNS lookup failed; the name's last addresses stay");
            }
            Err(_) => {}
        }
        up.insert(name, answered);
    }
}

/// Looks the names up until `stop` turns true. `first` is sent once the first round
/// has been applied (the balancer waits for it, briefly, before it serves).
pub async fn run(
    control: Arc<dyn Discovered>,
    metrics: Arc<FleetMetrics>,
    mut stop: watch::Receiver<bool>,
    first: oneshot::Sender<()>,
) {
    let mut first = Some(first);
    let mut built: Option<(Vec<SocketAddr>, TokioResolver)> = None;
    // Why the resolver could not be made, when last it could not.
    let mut no_resolver: Option<String> = None;
    let mut addresses = Addresses::new();
    // Whether each name's last lookup answered, for one line per change of state.
    let mut up: HashMap<Name, bool> = HashMap::new();
    loop {
        let (settings, names) = control.discovery();
        let mut now = addresses.clone();
        now.retain(|name, _| names.contains(name));
        // A name no entry has any more (a reload) takes its series with it.
        up.retain(|name, _| {
            let kept = names.contains(name);
            if !kept && !names.iter().any(|n| n.1 == name.1) {
                let _ = metrics.dns_up.remove_label_values(&[&name.1]);
            }
            kept
        });
        if !names.is_empty() && built.as_ref().map(|(n, _)| n) != Some(&settings.nameservers) {
            // A resolver that cannot be made (no readable /etc/resolv.conf) is tried
            // again every round, said once, and every name counts as not answering.
            match resolver(&settings.nameservers) {
                Ok(r) => built = Some((settings.nameservers.clone(), r)),
                Err(e) => {
                    if no_resolver.as_ref() != Some(&e) {
                        tracing::error!(error = %e, "no DNS resolver: the nodes of `discover` entries stay as they are");
                    }
                    for name in &names {
                        metrics.dns_up.with_label_values(&[&name.1]).set(0);
                        up.insert(name.clone(), false);
                    }
                    no_resolver = Some(e);
                    built = None;
                }
            }
        }
        if let Some((_, resolver)) = built.as_ref().filter(|_| !names.is_empty()) {
            no_resolver = None;
            look_up_all(resolver, names, &mut now, &mut up, &metrics).await;
        }
        if now != addresses {
            for (name, found) in &now {
                if addresses.get(name) != Some(found) {
                    let found: Vec<String> = found.iter().map(endpoint_text).collect();
                    tracing::info!(name = %name.1, addresses = ?found, "DNS addresses changed");
                }
            }
            addresses = now;
            control.apply_addresses(&addresses);
        }
        if let Some(first) = first.take() {
            let _ = first.send(());
        }
        let pause = settings.interval;
        if *stop.borrow() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::parse(text, "t.toml").unwrap()
    }

    const TWO_POOLS: &str = "[[pools]]\nname = \"a\"\nnodes = [{ id = \"fixed\", url = \"http://10.0.0.9:8000\" }, { id = \"vllm\", url = \"http://vllm.llm.svc:8000/base\", discover = \"dns\", weight = 2 }]\n\
        [[pools]]\nname = \"b\"\nnodes = [{ id = \"dp\", url = \"http://sglang:30000\", discover = \"dns\", data_parallel_size = 2 }, { id = \"c\", url = \"http://_vllm._tcp.service.consul\", discover = \"srv\" }]\n";

    /// Endpoints at `list` ("ip" or "ip:port").
    fn endpoints(list: &[&str]) -> Vec<Endpoint> {
        list.iter()
            .map(|a| match a.parse::<std::net::SocketAddr>() {
                Ok(s) => Endpoint {
                    ip: s.ip(),
                    port: Some(s.port()),
                },
                Err(_) => Endpoint {
                    ip: a.parse().unwrap(),
                    port: None,
                },
            })
            .collect()
    }

    fn dns(name: &str) -> Name {
        (Discover::Dns, name.to_string())
    }

    /// (id, url, weight) of a pool's nodes.
    fn nodes(c: &Config, pool: usize) -> Vec<(String, String, u32)> {
        c.pools[pool]
            .nodes
            .iter()
            .map(|n| (n.id.clone(), n.url.to_string(), n.weight))
            .collect()
    }

    /// Each address of a name is an engine server with the entry's port, path, weight
    /// and ranks; a name not yet answered has none; the config's own nodes stay.
    #[test]
    fn each_address_of_a_name_is_an_engine_server_of_its_own() {
        let config = config(TWO_POOLS);
        assert_eq!(
            names(&config),
            [
                dns("sglang"),
                dns("vllm.llm.svc"),
                (Discover::Srv, "_vllm._tcp.service.consul".into())
            ]
        );
        let mut addresses = Addresses::new();
        addresses.insert(dns("vllm.llm.svc"), endpoints(&["10.1.0.4", "fd00::7"]));
        let (built, made, skipped) = expand(&config, &addresses);
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(
            nodes(&built, 0),
            [
                ("fixed".into(), "http://10.0.0.9:8000/".into(), 1),
                (
                    "vllm-10.1.0.4".into(),
                    "http://10.1.0.4:8000/base".into(),
                    2
                ),
                (
                    "vllm-fd00::7".into(),
                    "http://[fd00::7]:8000/base".into(),
                    2
                ),
            ]
        );
        assert!(built.pools[1].nodes.is_empty());
        assert_eq!(made.len(), 2);
        assert!(!made.contains("fixed"));

        addresses.insert(dns("sglang"), endpoints(&["10.2.0.1"]));
        let (built, made, _) = expand(&config, &addresses);
        let b: Vec<(String, Option<u32>, String)> = built.pools[1]
            .nodes
            .iter()
            .map(|n| (n.id.clone(), n.data_parallel_rank, n.url.to_string()))
            .collect();
        assert_eq!(
            b,
            [
                (
                    "dp-10.2.0.1@0".into(),
                    Some(0),
                    "http://10.2.0.1:30000/".into()
                ),
                (
                    "dp-10.2.0.1@1".into(),
                    Some(1),
                    "http://10.2.0.1:30000/".into()
                ),
            ]
        );
        assert_eq!(made.len(), 4);
    }

    /// An SRV record's target is reached on the record's own port, and its id names
    /// the port: two engines on one host are two nodes.
    #[test]
    fn an_srv_target_is_reached_on_its_own_port() {
        let config = config(TWO_POOLS);
        let mut addresses = Addresses::new();
        addresses.insert(
            (Discover::Srv, "_vllm._tcp.service.consul".into()),
            endpoints(&["10.3.0.1:21000", "10.3.0.1:21001", "[fd00::9]:8000"]),
        );
        let (built, _, _) = expand(&config, &addresses);
        assert_eq!(
            nodes(&built, 1),
            [
                (
                    "c-10.3.0.1:21000".into(),
                    "http://10.3.0.1:21000/".into(),
                    1
                ),
                (
                    "c-10.3.0.1:21001".into(),
                    "http://10.3.0.1:21001/".into(),
                    1
                ),
                (
                    "c-[fd00::9]:8000".into(),
                    "http://[fd00::9]:8000/".into(),
                    1
                ),
            ]
        );
        // The same name looked up by address only is another name.
        addresses.insert(dns("_vllm._tcp.service.consul"), endpoints(&["10.9.9.9"]));
        assert_eq!(expand(&config, &addresses).0.pools[1].nodes.len(), 3);
    }

    /// An address whose node id the config's own nodes already have is left out, and
    /// said so; the others of its name are kept.
    #[test]
    fn an_address_whose_id_is_taken_is_left_out() {
        let text = "[[pools]]\nname = \"a\"\nnodes = [{ id = \"e-10.0.0.1\", url = \"http://10.0.0.1:8000\" }, { id = \"e\", url = \"http://engines:8000\", discover = \"dns\" }]\n";
        let config = config(text);
        let mut addresses = Addresses::new();
        addresses.insert(dns("engines"), endpoints(&["10.0.0.1", "10.0.0.2"]));
        let (built, made, skipped) = expand(&config, &addresses);
        let ids: Vec<&str> = built.pools[0].nodes.iter().map(|n| n.id.as_str()).collect();
        assert_eq!(ids, ["e-10.0.0.1", "e-10.0.0.2"]);
        assert_eq!(made, HashSet::from(["e-10.0.0.2".to_string()]));
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(skipped[0].contains("10.0.0.1"), "{skipped:?}");
    }
}
