//! The membership watcher of `serve`: every `poll_interval` one round trip to Redis
//! heartbeats this replica and reads the live engines and replicas, and hands them to
//! the balancer's control plane ([`Members`]), which rebuilds its table when the set of
//! engines changed (a node that leaves drains: its in-flight
//! requests hold their slots to the end; one that comes back finds its breaker history).
//!
//! Fail static: when Redis is unreachable, slow or refuses, the last membership stays,
//! `prefixlb_redis_up` is 0, one line is logged per change of state, and calls are
//! retried with capped exponential backoff; when Redis answers again membership is
//! read afresh. A Redis that comes back empty (restarted without persistence) would
//! list no engine until their agents heartbeat again, so for one `heartbeat_ttl`
//! after an outage engines are added but none is removed. Nothing here is on the
//! request path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use std::net::SocketAddr;

use super::record::Membership;
use super::store::{connection_info, unix_now, Store, StoreError};
use crate::config::RedisConfig;
use crate::telemetry::metrics::FleetMetrics;

/// What the watcher reads its settings from and feeds: the balancer's control plane.
pub trait Members: Send + Sync {
    /// The `[redis]` settings in force now (none: static membership only).
    fn redis(&self) -> Option<RedisConfig>;
    /// The balancer's client address, announced in its heartbeat.
    fn listen(&self) -> SocketAddr;
    /// Applies a membership read (or, with no `[redis]` any more, an empty one).
    fn apply(&self, membership: &Membership);
}

/// Longest wait between tries while Redis is down.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// This replica's id in Redis: host name, process id and start time.
pub fn replica_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "prefixlb".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{host}-{}-{nanos:x}", std::process::id())
}

/// Watches membership until `stop` turns true, then removes this replica's heartbeat.
pub async fn run(
    members: Arc<dyn Members>,
    metrics: Arc<FleetMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let id = replica_id();
    let started_at = unix_now();
    let mut store: Option<(RedisConfig, Store)> = None;
    let mut up: Option<bool> = None;
    let mut failures: u32 = 0;
    let mut seen = Seen::default();
    loop {
        let Some(cfg) = members.redis() else {
            // No [redis] (any more): static membership only.
            if store.take().is_some() {
                members.apply(&Default::default());
            }
            let _ = metrics.redis_up.remove_label_values::<&str>(&[]);
            up = None;
            if wait(&mut stop, Duration::from_secs(1)).await {
                return;
            }
            continue;
        };
        let deadline = cfg
            .poll_interval
            .clamp(Duration::from_millis(200), Duration::from_secs(2));
        if store.as_ref().is_some_and(|(c, _)| *c != cfg) {
            store = None;
        }
        let result = match &mut store {
            Some((_, s)) => poll(&*members, &metrics, s, &id, started_at, &cfg, &mut seen).await,
            None => match connect(&cfg, deadline).await {
                Ok(mut s) => {
                    let r = poll(
                        &*members, &metrics, &mut s, &id, started_at, &cfg, &mut seen,
                    )
                    .await;
                    store = Some((cfg.clone(), s));
                    r
                }
                Err(e) => Err(e),
            },
        };
        let ok = result.is_ok();
        metrics
            .redis_up
            .with_label_values::<&str>(&[])
            .set(i64::from(ok));
        if !ok {
            seen.outage = true;
        }
        if up != Some(ok) {
            match &result {
                Ok(()) => tracing::info!("redis up: membership from heartbeats"),
                Err(e) => {
                    tracing::warn!(error = %e, "redis unreachable: membership frozen as last known")
                }
            }
            up = Some(ok);
        }
        let pause = if ok {
            failures = 0;
            cfg.poll_interval
        } else {
            failures = failures.saturating_add(1);
            backoff(cfg.poll_interval, failures)
        };
        if wait(&mut stop, pause).await {
            if let Some((_, mut s)) = store {
                let _ = s.remove_balancer(&id).await;
            }
            return;
        }
    }
}

async fn connect(cfg: &RedisConfig, deadline: Duration) -> Result<Store, StoreError> {
    let url = String::from_utf8_lossy(cfg.url.expose()).into_owned();
    let info = connection_info(&url, cfg.password_env.as_deref())?;
    Store::connect(info, &cfg.key_prefix, deadline).await
}

/// What the watcher applied last, and whether Redis was lost since.
#[derive(Default)]
struct Seen {
    applied: Membership,
    outage: bool,
    /// After an outage: until then, nodes are added but not removed.
    keep_until: Option<Instant>,
}

impl Seen {
    /// What to apply of what was read: all of it, except within the grace after an
    /// outage, when nodes applied before and missing now are kept.
    fn settle(&mut self, read: Membership, ttl: Duration) -> Membership {
        if std::mem::take(&mut self.outage) && !self.applied.nodes.is_empty() {
            self.keep_until = Some(Instant::now() + ttl);
        }
        let mut m = read;
        if self.keep_until.is_some_and(|t| Instant::now() < t) {
            for old in &self.applied.nodes {
                if !m.nodes.iter().any(|n| n.id == old.id) {
                    m.nodes.push(old.clone());
                }
            }
            m.nodes.sort_by(|a, b| a.id.cmp(&b.id));
        } else {
            self.keep_until = None;
        }
        self.applied = m.clone();
        m
    }
}

async fn poll(
    members: &dyn Members,
    metrics: &FleetMetrics,
    store: &mut Store,
    id: &str,
    started_at: u64,
    cfg: &RedisConfig,
    seen: &mut Seen,
) -> Result<(), StoreError> {
    let me = serde_json::json!({
        "id": id,
        "listen": members.listen().to_string(),
        "started_at": started_at,
    })
    .to_string();
    let (membership, unreadable) = store.poll(id, &me, cfg.heartbeat_ttl).await?;
    for why in unreadable {
        tracing::warn!("{why}");
    }
    let membership = seen.settle(membership, cfg.heartbeat_ttl);
    members.apply(&membership);
    metrics
        .balancer_replicas
        .set(i64::from(membership.replicas));
    Ok(())
}

/// `poll × 2^failures`, at most [`MAX_BACKOFF`].
fn backoff(poll: Duration, failures: u32) -> Duration {
    poll.saturating_mul(1 << failures.min(16))
        .min(MAX_BACKOFF.max(poll))
}

/// Sleeps `d`; true if `stop` turned true meanwhile.
async fn wait(stop: &mut watch::Receiver<bool>, d: Duration) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = stop.wait_for(|s| *s) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap() {
        let p = Duration::from_secs(2);
        assert_eq!(backoff(p, 1), Duration::from_secs(4));
        assert_eq!(backoff(p, 2), Duration::from_secs(8));
        assert_eq!(backoff(p, 3), MAX_BACKOFF);
        assert_eq!(backoff(p, 40), MAX_BACKOFF);
        assert_eq!(backoff(Duration::from_secs(30), 1), Duration::from_secs(30));
    }
}
