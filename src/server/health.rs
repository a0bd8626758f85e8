//! Active health checks: every `health.interval`, `GET health.path` on every engine
//! server of the current snapshot, concurrently, each bounded by `health.timeout`; one
//! check per URL, whose answer is every node's behind it (the ranks of a
//! data-parallel server).
//! `unhealthy_after` consecutive failures take a node out of every walk,
//! `healthy_after` passes bring it back, and a passing check moves an open breaker
//! whose `open_for` is over to half_open, so recovery starts even with no traffic.
//! A node that passes has its engine's `/v1/models` read too (the LoRA adapters it
//! serves), at once and then every [`MODELS_EVERY`] rounds, and, for the nodes of the
//! config and of DNS, its `health.metrics_path` on every round, for the load the
//! engine reports ([`engine_load`]; an agent relays a heartbeating node's). Checks go over the data
//! plane's engine-side HTTP/1.1 code (TLS included) on connections of their own, and
//! why the last one failed is kept for `/admin/nodes`. Each round ends by sweeping
//! expired idle connections out of the upstream pool.

use std::collections::hash_map::{Entry, HashMap};
use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::engine_load;
use crate::proxy::Proxy;
use crate::routing::breaker::BreakerSettings;
use crate::routing::node::Node;
use crate::routing::table::Table;

/// A passing node's `/v1/models` is read again every this many rounds (every 30 s at
/// the default `health.interval`), and on every round while it is not known.
const MODELS_EVERY: u64 = 6;

/// The reads of the engines' metrics, across rounds. A read is not waited for by its
/// round (a slow metrics page must not slow every engine's checks).
#[derive(Default)]
struct Reads {
    /// Engine URLs being read: a URL is read again only once its last read has ended.
    reading: HashSet<http::Uri>,
    /// The rank advice last logged for each URL, so that it is logged once.
    advised: HashMap<http::Uri, String>,
}

type Reading = Arc<parking_lot::Mutex<Reads>>;

/// Checks every node until `stop` turns true.
pub async fn run(proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>) {
    let reading = Reading::default();
    for round in 0u64.. {
        let table = proxy.table();
        let h = &table.config.health;
        let mut checks = JoinSet::new();
        for server in servers(&table) {
            let (proxy, h, reading) = (proxy.clone(), h.clone(), reading.clone());
            checks.spawn(async move {
                // The first node asks; its answer is every node's behind the URL.
                let first = &server[0].0;
                let result = proxy.check_node(first, &h.path, h.timeout).await;
                let passed = result.is_ok();
                let now = tokio::time::Instant::now().into_std();
                for (node, settings) in &server {
                    node.state().record_check_result(
                        result.clone(),
                        h.unhealthy_after,
                        h.healthy_after,
                        settings,
                        now,
                    );
                }
                // The model list: at once, then every few rounds.
                let unknown = server.iter().any(|(n, _)| n.state().served().is_none());
                if passed && (round % MODELS_EVERY == 0 || unknown) {
                    let served = proxy.read_models(first, h.timeout).await;
                    for (node, _) in &server {
                        node.state().set_served(served.clone());
                    }
                }
                // The load its engine reports, for the nodes of the config and of DNS
                // (an agent relays a heartbeating node's): none while it fails its
                // checks. Read last, on the connection the check and the model list used.
                if server.iter().any(|(n, _)| n.source().reads_engine_load()) {
                    match (passed, h.metrics_path.clone()) {
                        (true, Some(path)) => {
                            if reading.lock().reading.insert(first.url().clone()) {
                                tokio::spawn(async move {
                                    let first = &server[0].0;
                                    let text = proxy.read_metrics(first, &path, h.timeout).await;
                                    let report = text.map(|t| {
                                        let ranks = highest_rank(&server).map_or(0, |r| r + 1);
                                        engine_load::read(&String::from_utf8_lossy(&t), ranks)
                                    });
                                    show_engine_load(&server, report.as_ref());
                                    let mut reads = reading.lock();
                                    reads.reading.remove(first.url());
                                    if let Some(report) = &report {
                                        advise(&mut reads.advised, &server, report);
                                    }
                                });
                            }
                        }
                        _ => show_engine_load(&server, None),
                    }
                }
            });
        }
        while checks.join_next().await.is_some() {}
        proxy.sweep_idle_connections();
        tokio::select! {
            _ = tokio::time::sleep(h.interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The highest rank among the nodes behind one URL (none: not a data-parallel server).
fn highest_rank(server: &[(Node, Arc<BreakerSettings>)]) -> Option<u32> {
    server
        .iter()
        .filter_map(|(n, _)| n.data_parallel_rank())
        .max()
}

/// Sets the engine load of the nodes of the config or of DNS behind one URL from what
/// its engine's metrics said (`None`: not read): the server's own, or each rank's its
/// rank's.
fn show_engine_load(server: &[(Node, Arc<BreakerSettings>)], report: Option<&engine_load::Report>) {
    for (node, _) in server
        .iter()
        .filter(|(n, _)| n.source().reads_engine_load())
    {
        let load = report.and_then(|r| match node.data_parallel_rank() {
            None => r.whole,
            Some(rank) => r.by_rank.get(rank as usize).copied().flatten(),
        });
        node.state().set_engine_load(load);
    }
}

/// Shows on its nodes, and logs once, an engine server whose metrics name another
/// number of data-parallel ranks than its nodes of the config (or of DNS) have
/// ([`engine_load::Report::rank_advice`]).
fn advise(
    advised: &mut HashMap<http::Uri, String>,
    server: &[(Node, Arc<BreakerSettings>)],
    report: &engine_load::Report,
) {
    let own = || {
        server
            .iter()
            .map(|(n, _)| n)
            .filter(|n| n.source().reads_engine_load())
    };
    let Some(first) = own().next() else {
        return;
    };
    // Distinct ranks: a server in two pools is each rank's node twice.
    let ranks = own()
        .filter_map(|n| n.data_parallel_rank())
        .collect::<HashSet<_>>()
        .len() as u32;
    let url = first.url();
    let advice = report.rank_advice(ranks);
    for node in own() {
        node.state().set_engine_advice(advice.clone());
    }
    match advice {
        Some(advice) if advised.get(url) != Some(&advice) => {
            // A rank's node id is its server's, `@`, its rank.
            let id = match first.data_parallel_rank() {
                Some(_) => first.id().rsplit_once('@').map_or(first.id(), |(id, _)| id),
                None => first.id(),
            };
            tracing::warn!(node = %id, url = %url, "{advice}");
            advised.insert(url.clone(), advice);
        }
        Some(_) => {}
        None => {
            advised.remove(url);
        }
    }
}

/// Every node of every pool, grouped by URL, in config order, each with its pool's
/// breaker settings: the ranks of a data-parallel server share one URL, and one
/// health check (one `/v1/models` read) answers for all of them.
fn servers(table: &Table) -> Vec<Vec<(Node, Arc<BreakerSettings>)>> {
    let mut servers: Vec<Vec<(Node, Arc<BreakerSettings>)>> = Vec::new();
    let mut by_url: HashMap<&http::Uri, usize> = HashMap::new();
    for pool in &table.pools {
        for node in pool.balancer.nodes() {
            let member = (node.clone(), pool.balancer.settings().clone());
            match by_url.entry(node.url()) {
                Entry::Occupied(at) => servers[*at.get()].push(member),
                Entry::Vacant(at) => {
                    at.insert(servers.len());
                    servers.push(vec![member]);
                }
            }
        }
    }
    servers
}
