//! Active health checks: every `health.interval`, `GET health.path` on every node of
//! the current snapshot, concurrently, each bounded by `health.timeout`.
//! `unhealthy_after` consecutive failures take a node out of every walk,
//! `healthy_after` passes bring it back, and a passing check moves an open breaker
//! whose `open_for` is over to half_open, so recovery starts even with no traffic.
//! A node that passes has its engine's `/v1/models` read too (the LoRA adapters it
//! serves). Checks go over the data plane's engine-side HTTP/1.1 code (TLS included)
//! on connections of their own, and why the last
//! one failed is kept for `/admin/nodes`. Each round ends by sweeping expired idle
//! connections out of the upstream pool.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::proxy::Proxy;

/// Checks every node until `stop` turns true.
pub async fn run(proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>) {
    loop {
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
                    if result.is_ok() {
                        proxy.learn_models(&node, h.timeout).await;
                    }
                    let now = tokio::time::Instant::now().into_std();
                    node.state().record_check_result(
                        result,
                        h.unhealthy_after,
                        h.healthy_after,
                        &settings,
                        now,
                    );
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
