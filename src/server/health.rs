//! Active health checks: every `health.interval`, `GET health.path` on every node of
//! the current snapshot, concurrently, each bounded by `health.timeout`.
//! `unhealthy_after` consecutive failures take a node out of every walk,
//! `healthy_after` passes bring it back, and a passing check moves an open breaker
//! whose `open_for` is over to half_open, so recovery starts even with no traffic.
//! Each round ends by sweeping expired idle connections out of the upstream pool.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::proxy::{Proxy, UpstreamClient};

/// Checks every node until `stop` turns true.
pub async fn run(proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>) {
    loop {
        let table = proxy.table();
        let h = &table.config.health;
        let mut checks = JoinSet::new();
        for pool in &table.pools {
            for node in pool.balancer.nodes() {
                let Ok(uri) = node.upstream_uri(&h.path) else {
                    continue;
                };
                let (client, state, settings) = (
                    proxy.client().clone(),
                    node.state().clone(),
                    pool.balancer.settings().clone(),
                );
                let (timeout, down_after, up_after) =
                    (h.timeout, h.unhealthy_after, h.healthy_after);
                checks.spawn(async move {
                    let passed = check(&client, uri, timeout).await;
                    state.record_check(passed, down_after, up_after, &settings);
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

/// One check: a 2xx within `timeout`, body read to the end (so the connection is reused).
async fn check(client: &UpstreamClient, uri: Uri, timeout: Duration) -> bool {
    let Ok(req) = Request::get(uri).body(Full::new(Bytes::new())) else {
        return false;
    };
    let exchange = async {
        let resp = client.request(req).await.ok()?;
        let ok = resp.status().is_success();
        resp.into_body().collect().await.ok()?;
        Some(ok)
    };
    matches!(
        tokio::time::timeout(timeout, exchange).await,
        Ok(Some(true))
    )
}
