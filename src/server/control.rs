//! The control plane's state: the config as loaded, the engines heartbeating in Redis,
//! the addresses of the config's DNS names, and the registry of node and pool runtime
//! state. Whenever a source changes (a reload, a membership change, a DNS answer) it
//! builds a new routing snapshot, carrying state over by id, and hands it to the data
//! plane whole. The admin API, the reload triggers, the health checks, the membership
//! watcher and the DNS lookups all act through it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::config::{unix_now, Config, ConfigError, DiscoveryConfig, NodeConfig, RedisConfig};
use crate::fleet::dns::{self, Addresses, Discovered};
use crate::fleet::record::{self, Membership, NodeRecord};
use crate::fleet::watcher::Members;
use crate::proxy::Proxy;
use crate::routing::node::NodeSource;
use crate::routing::table::{Registry, Table};
use crate::server::tls::ClientTls;
use crate::telemetry::metrics::Metrics;

/// What a table is built from.
struct Sources {
    config: Config,
    /// Heartbeating engines (their identity: load figures and start times zeroed).
    members: Vec<NodeRecord>,
    /// The addresses of the `discover` entries' names.
    addresses: Addresses,
}

/// The balancer's control plane, around its data plane.
pub struct Control {
    proxy: Arc<Proxy>,
    registry: Registry,
    metrics: Arc<Metrics>,
    /// The config file, for reloads (none for in-process configs).
    source: Option<PathBuf>,
    /// Reloads run one at a time, whatever triggered them.
    reloading: Mutex<()>,
    /// The config as loaded and the engines heartbeating in Redis: the table is built
    /// from both, whichever changed (one rebuild at a time).
    sources: Mutex<Sources>,
    /// The client port's TLS, when it serves HTTPS: each reload rebuilds it from the
    /// files.
    client_tls: Option<Arc<ClientTls>>,
    /// The admin port's, when it serves HTTPS too (`server.admin_tls`).
    admin_tls: Option<Arc<ClientTls>>,
}

impl Control {
    /// A control plane and the data plane it feeds, serving `config`.
    pub fn new(config: Config, source: Option<PathBuf>) -> Arc<Control> {
        Control::with_lanes(config, source, 1)
    }

    /// A control plane whose data plane serves from `lanes` runtimes.
    pub fn with_lanes(config: Config, source: Option<PathBuf>, lanes: usize) -> Arc<Control> {
        warn_of_expiry(&config);
        let registry = Registry::default();
        let metrics = Arc::new(Metrics::new());
        // Every lane's series are on the page from the first scrape: the admin
        // listener answers before the lanes start counting.
        for lane in 0..lanes {
            let lane = lane.to_string();
            metrics.client_connections.with_label_values(&[&lane]);
            metrics.lane_yields.with_label_values(&[&lane]);
        }
        let table = Table::build(config.clone(), &registry);
        let client_tls = config
            .server
            .tls
            .as_ref()
            .map(|t| Arc::new(ClientTls::new(t)));
        let admin_tls = config
            .server
            .tls
            .as_ref()
            .filter(|_| config.server.admin_tls)
            .map(|t| Arc::new(ClientTls::for_admin(t)));
        Arc::new(Control {
            proxy: Proxy::with_lanes(table, metrics.requests.clone(), lanes),
            registry,
            metrics,
            source,
            reloading: Mutex::new(()),
            sources: Mutex::new(Sources {
                config,
                members: Vec::new(),
                addresses: Addresses::new(),
            }),
            client_tls,
            admin_tls,
        })
    }

    /// The client port's TLS server, when `server.tls_cert_file` is set.
    pub fn client_tls(&self) -> Option<&Arc<ClientTls>> {
        self.client_tls.as_ref()
    }

    /// The admin port's TLS server, when `server.admin_tls` is set.
    pub fn admin_tls(&self) -> Option<&Arc<ClientTls>> {
        self.admin_tls.as_ref()
    }

    /// The data plane.
    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// The current routing snapshot.
    pub fn table(&self) -> Arc<Table> {
        self.proxy.table()
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
        warn_of_expiry(&config);
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
            ("lanes", was.lanes != now.lanes),
            ("pin_threads", was.pin_threads != now.pin_threads),
            ("yield_after", was.yield_after != now.yield_after),
            // HTTPS turned on or off; new files for it are applied below.
            ("tls_cert_file", was.tls.is_some() != now.tls.is_some()),
            ("admin_tls", was.admin_tls != now.admin_tls),
        ];
        for (key, changed) in restart_only {
            if changed {
                tracing::warn!("server.{key} changed: that takes a restart; the rest is applied");
            }
        }
        if let (Some(tls), Some(new)) = (&self.client_tls, &now.tls) {
            // Rebuilt whatever changed (the certificate, the clients' CAs): new
            // handshakes get it.
            let renewed = tls.shown().cert != new.key.cert;
            tls.renew(new);
            if let Some(admin) = &self.admin_tls {
                admin.renew(&crate::server::tls::admin(new));
            }
            if renewed {
                tracing::info!(
                    "the client port's TLS certificate is renewed: new handshakes get it"
                );
            }
        }
        self.install(config);
        Ok(())
    }

    /// Builds a snapshot from `config` and the heartbeating engines (carrying node
    /// state over by id) and swaps it in.
    pub fn install(&self, config: Config) {
        let mut sources = self.sources.lock();
        sources.config = config;
        self.rebuild(&sources);
    }

    fn rebuild(&self, sources: &Sources) {
        let (config, from_dns, skipped) = dns::expand(&sources.config, &sources.addresses);
        for s in skipped {
            tracing::warn!("{s}");
        }
        let (config, from_redis, skipped) = record::merge(&config, &sources.members);
        for s in skipped {
            tracing::warn!("{s}");
        }
        let mut made: HashMap<String, NodeSource> = HashMap::new();
        made.extend(from_dns.into_iter().map(|id| (id, NodeSource::Dns)));
        made.extend(from_redis.into_iter().map(|id| (id, NodeSource::Redis)));
        self.proxy
            .install(Table::build_with(config, &self.registry, &made));
    }
}

impl Control {
    /// What each DNS name of a `discover` entry gave when last it answered.
    pub fn dns_addresses(&self) -> Addresses {
        self.sources.lock().addresses.clone()
    }
}

impl Discovered for Control {
    fn discovery(&self) -> (DiscoveryConfig, Vec<dns::Name>) {
        let sources = self.sources.lock();
        (
            sources.config.discovery.clone(),
            dns::names(&sources.config),
        )
    }

    /// Applies what the DNS lookups found: a new snapshot when any name's addresses
    /// changed.
    fn apply_addresses(&self, addresses: &Addresses) {
        let mut sources = self.sources.lock();
        if sources.addresses != *addresses {
            sources.addresses = addresses.clone();
            self.rebuild(&sources);
        }
    }
}

impl Members for Control {
    fn redis(&self) -> Option<RedisConfig> {
        self.table().config.redis.clone()
    }

    fn listen(&self) -> SocketAddr {
        self.table().config.server.listen
    }

    /// Applies what the Redis watcher read: each engine's load figures, the number of
    /// balancer replicas, and, when the set of engines changed, a new snapshot.
    fn apply(&self, m: &Membership) {
        // A server split into data-parallel ranks: each rank's node shows its rank's
        // figures (none if the engine's metrics do not name ranks), never the whole
        // server's, which is no one rank's.
        for r in &m.nodes {
            match r.data_parallel_size {
                Some(ranks) if ranks > 1 => {
                    for rank in 0..ranks {
                        let load = r.rank_loads.get(rank as usize).copied().flatten();
                        let id = NodeConfig::rank_id(&r.id, rank);
                        self.registry.node(&id).set_engine_load(load);
                    }
                }
                _ => self.registry.node(&r.id).set_engine_load(r.load),
            }
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
                rank_loads: Vec::new(),
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
}

/// Logs a warning for each certificate of the config that has expired or expires
/// within 14 days (`prefixlb_tls_certificate_expiry_timestamp_seconds` has them all).
fn warn_of_expiry(config: &Config) {
    let now = unix_now();
    let certificates = [
        (
            "server.tls_cert_file",
            config.server.tls.as_ref().map(|t| t.expires),
        ),
        (
            "[tls] client_cert_file",
            config.tls.client_certificate_expires(),
        ),
    ];
    for (file, expires) in certificates {
        if let Some(e) = expires.filter(|e| e.is_near(now)) {
            tracing::warn!("the certificate of {file} {}: renew it", e.describe(now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::node::EngineLoad;

    /// Each rank's node of a data-parallel server shows its rank's load (none where the
    /// metrics named no rank); a change of load alone rebuilds no routing table.
    #[test]
    fn a_data_parallel_server_s_ranks_show_their_own_load_without_a_rebuild() {
        let text = "[redis]\nurl = \"redis://127.0.0.1:1\"\n[[pools]]\nname = \"p\"\n";
        let config = Config::parse(text, "t.toml").unwrap();
        let control = Control::new(config, None);
        let running = |n: f64| {
            Some(EngineLoad {
                running: Some(n),
                ..EngineLoad::default()
            })
        };
        let server = |rank_loads: Vec<Option<EngineLoad>>| Membership {
            nodes: vec![NodeRecord {
                id: "d".into(),
                pool: "p".into(),
                url: "http://127.0.0.1:1".into(),
                weight: 1,
                models: vec![],
                started_at: 1,
                load: running(9.0),
                data_parallel_size: Some(3),
                rank_loads,
            }],
            replicas: 1,
        };
        control.apply(&server(vec![running(2.0), None, running(7.0)]));
        let table = control.table();
        let load = |id: &str| {
            control
                .registry
                .node(id)
                .engine_load()
                .and_then(|l| l.running)
        };
        assert_eq!(
            [load("d@0"), load("d@1"), load("d@2"), load("d")],
            [Some(2.0), None, Some(7.0), None]
        );
        control.apply(&server(vec![running(1.0), running(4.0)]));
        assert_eq!(
            [load("d@0"), load("d@1"), load("d@2")],
            [Some(1.0), Some(4.0), None]
        );
        assert!(
            Arc::ptr_eq(&table, &control.table()),
            "rebuilt on a load change"
        );
    }

    /// A scrape racing startup finds every lane's connection count and yields, at zero.
    #[test]
    fn every_lanes_connection_count_is_on_the_first_page() {
        let text =
            "[[pools]]\nname = \"p\"\nnodes = [{ id = \"a\", url = \"http://127.0.0.1:1\" }]\n";
        let config = Config::parse(text, "t.toml").unwrap();
        let control = Control::with_lanes(config, None, 3);
        let page = control.metrics().render(&control.table());
        for lane in 0..3 {
            for name in ["prefixlb_client_connections", "prefixlb_lane_yields_total"] {
                let series = format!("{name}{{lane=\"{lane}\"}} 0");
                assert!(page.contains(&series), "no {series} in {page}");
            }
        }
    }
}
