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
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::proxy::Proxy;

/// The health checker's own HTTP client (requests go through the data plane's engine
/// connections, not this).
type HealthClient = Client<HttpConnector, Full<Bytes>>;

/// Checks every node until `stop` turns true.
pub async fn run(proxy: Arc<Proxy>, mut stop: watch::Receiver<bool>) {
    let client = health_client(proxy.table().config.server.connect_timeout);
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
                    client.clone(),
                    node.state().clone(),
                    pool.balancer.settings().clone(),
                );
                let (timeout, down_after, up_after) =
                    (h.timeout, h.unhealthy_after, h.healthy_after);
                checks.spawn(async move {
                    let passed = check(&client, uri, timeout).await;
                    let now = tokio::time::Instant::now().into_std();
                    state.record_check(passed, down_after, up_after, &settings, now);
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
async fn check(client: &HealthClient, uri: Uri, timeout: Duration) -> bool {
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

/// Pooled keep-alive connections for the checks, dropped after 4 s idle (engines close
/// theirs after 5 s; one reused past that would fail a healthy node's check).
fn health_client(connect_timeout: Duration) -> HealthClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(4))
        .build(connector)
}
