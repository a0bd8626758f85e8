//! Active health checks: every `health.interval`, `GET health.path` on every node of
//! the current snapshot, concurrently, each bounded by `health.timeout`.
//! `unhealthy_after` consecutive failures take a node out of every walk,
//! `healthy_after` passes bring it back, and a passing check moves an open breaker
//! whose `open_for` is over to half_open, so recovery starts even with no traffic.
//! A node that passes has its engine's `/v1/models` read too (the LoRA adapters it
//! serves), at once and then every [`MODELS_EVERY`] rounds. Checks go over the data plane's engine-side HTTP/1.1 code (TLS included)
//! on connections of their own, and why the last
//! one failed is kept for `/admin/nodes`. Each round ends by sweeping expired idle
//! connections out of the upstream pool.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::proxy::Proxy;

/// A passing node's `/v1/models` is read again every this many rounds (every 30 s at
/// the default `health.interval`), and on every round while it is not known.
const MODELS_EVERY: u64 = 6;

/// Checks every node until `stop` turns true.
pub async fn run(proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>) {
    for round in 0u64.. {
        let table = proxy.table();
        let h = &table.config.health;
        let mut checks = JoinSet::new();
        for pool in &table.pools {
            for node in pool.balancer.nodes() {
                let (proxy, node, settings, h) = (
                    proxy.clone(),
                    node.clone(),
                    pool.balancer.settings().clone(),
                    h.clone(),
                );
                checks.spawn(async move {
                    let result = proxy.check_node(&node, &h.path, h.timeout).await;
                    let passed = result.is_ok();
                    let now = tokio::time::Instant::now().into_std();
                    node.state().record_check_result(
                        result,
                        h.unhealthy_after,
                        h.healthy_after,
                        &settings,
                        now,
                    );
                    // The model list: at once, then every few rounds.
                    let stale = round % MODELS_EVERY == 0 || node.state().served().is_none();
                    if passed && stale {
                        proxy.learn_models(&node, h.timeout).await;
                    }
                });
            }
        }
        while checks.join_next().await.is_some() {}
        proxy.sweep_idle_connections();
        tokio::select! {
            _ = tokio::time::sleep(h.interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
