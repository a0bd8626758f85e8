//! One node's per-request metric series, looked up once per request. A labelled
//! family (`requests_total{pool,node,outcome}`, …) finds a series by hashing its label
//! values on every update: six updates a request, about 730 instructions. The data
//! plane instead takes a [`NodeSeries`] for its pool and node when it commits an answer
//! (one lookup, keyed by the node id alone, hashed with xxh3) and updates the series
//! it holds. Each series is still made on its first use, so the page shows the same
//! series as when every update went through the family. Request series are never
//! reset, so a handle stays the page's series for the life of the process.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::RwLock;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec};

use super::outcome::RequestOutcome;
use crate::name_hash::NameMap;
use crate::routing::route::{Route, RouteKind};

/// The families a node's series belong to (handles: clones share the family).
#[derive(Clone)]
pub(super) struct Families {
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub ttft: HistogramVec,
    pub routing_decisions: IntCounterVec,
    pub spill_distance: Histogram,
    pub prompt_tokens: IntCounterVec,
    pub cached_prompt_tokens: IntCounterVec,
}

/// A node's series in its pool, each made on its first update.
pub struct NodeSeries {
    families: Families,
    pool: Box<str>,
    node: Box<str>,
    outcomes: [OnceLock<IntCounter>; RequestOutcome::ALL.len()],
    routes: [OnceLock<IntCounter>; RouteKind::ALL.len()],
    request_duration: OnceLock<Histogram>,
    ttft: OnceLock<Histogram>,
    prompt_tokens: OnceLock<IntCounter>,
    cached_prompt_tokens: OnceLock<IntCounter>,
}

impl NodeSeries {
    fn new(families: Families, pool: &str, node: &str) -> NodeSeries {
        NodeSeries {
            families,
            pool: pool.into(),
            node: node.into(),
            outcomes: Default::default(),
            routes: Default::default(),
            request_duration: OnceLock::new(),
            ttft: OnceLock::new(),
            prompt_tokens: OnceLock::new(),
            cached_prompt_tokens: OnceLock::new(),
        }
    }

    /// Counts a finished request.
    pub fn observe_request(&self, outcome: RequestOutcome, duration: Duration) {
        let f = &self.families;
        let (pool, node) = (&*self.pool, &*self.node);
        self.outcomes[outcome as usize]
            .get_or_init(|| {
                f.requests
                    .with_label_values(&[pool, node, outcome.as_str()])
            })
            .inc();
        self.request_duration
            .get_or_init(|| f.request_duration.with_label_values(&[pool, node]))
            .observe(duration.as_secs_f64());
    }

    /// Counts where a request went (in this node's pool), and how far along its key's
    /// walk.
    pub fn count_decision(&self, route: &Route, distance: usize) {
        let (f, kind) = (&self.families, route.kind());
        self.routes[kind as usize]
            .get_or_init(|| {
                f.routing_decisions
                    .with_label_values(&[&self.pool, kind.as_str()])
            })
            .inc();
        f.spill_distance.observe(distance as f64);
    }

    pub fn observe_ttft(&self, ttft: Duration) {
        let f = &self.families;
        self.ttft
            .get_or_init(|| f.ttft.with_label_values(&[&self.pool, &self.node]))
            .observe(ttft.as_secs_f64());
    }

    /// Counts a request's prompt tokens and those its engine served from cache.
    pub fn count_tokens(&self, prompt: u64, cached: u64) {
        let f = &self.families;
        self.prompt_tokens
            .get_or_init(|| f.prompt_tokens.with_label_values(&[&self.node]))
            .inc_by(prompt);
        self.cached_prompt_tokens
            .get_or_init(|| f.cached_prompt_tokens.with_label_values(&[&self.node]))
            .inc_by(cached);
    }
}

/// The [`NodeSeries`] handed out so far, by node id (unique across pools; a node that
/// a reload moved to another pool gets new series).
pub(super) struct SeriesCache {
    families: Families,
    by_node: RwLock<NameMap<Box<str>, Arc<NodeSeries>>>,
}

impl SeriesCache {
    pub fn new(families: Families) -> SeriesCache {
        SeriesCache {
            families,
            by_node: RwLock::default(),
        }
    }

    pub fn families(&self) -> &Families {
        &self.families
    }

    pub fn get(&self, pool: &str, node: &str) -> Arc<NodeSeries> {
        if let Some(s) = self.by_node.read().get(node).filter(|s| &*s.pool == pool) {
            return s.clone();
        }
        let series = Arc::new(NodeSeries::new(self.families.clone(), pool, node));
        self.by_node.write().insert(node.into(), series.clone());
        series
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::core::Collector;
    use prometheus::{HistogramOpts, Opts};

    fn families() -> Families {
        let counter = |name: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, "help"), labels).unwrap()
        };
        let hist =
            |name: &str| HistogramVec::new(HistogramOpts::new(name, "help"), &["pool", "node"]);
        Families {
            requests: counter("requests", &["pool", "node", "outcome"]),
            request_duration: hist("duration").unwrap(),
            ttft: hist("ttft").unwrap(),
            routing_decisions: counter("decisions", &["pool", "route"]),
            spill_distance: Histogram::with_opts(HistogramOpts::new("spill", "help")).unwrap(),
            prompt_tokens: counter("prompt", &["node"]),
            cached_prompt_tokens: counter("cached", &["node"]),
        }
    }

    #[test]
    fn a_handle_updates_the_familys_own_series_and_makes_them_on_first_use() {
        let cache = SeriesCache::new(families());
        let f = cache.families.clone();
        let s = cache.get("p", "n0");
        // Nothing is shown before an update.
        let shown = |v: &IntCounterVec| v.collect()[0].get_metric().len();
        assert_eq!((shown(&f.requests), shown(&f.routing_decisions)), (0, 0));
        s.observe_request(RequestOutcome::Success, Duration::from_millis(5));
        s.observe_request(RequestOutcome::Error, Duration::from_millis(5));
        cache
            .get("p", "n0")
            .observe_request(RequestOutcome::Success, Duration::ZERO);
        s.count_decision(&Route::walked(1, false), 1);
        s.observe_ttft(Duration::from_millis(20));
        s.count_tokens(100, 60);
        // Only the outcomes and routes that happened are shown.
        assert_eq!((shown(&f.requests), shown(&f.routing_decisions)), (2, 1));
        let count = |v: &IntCounterVec, l: &[&str]| v.with_label_values(l).get();
        assert_eq!(count(&f.requests, &["p", "n0", "success"]), 2);
        assert_eq!(count(&f.requests, &["p", "n0", "error"]), 1);
        assert_eq!(count(&f.routing_decisions, &["p", "spill"]), 1);
        assert_eq!(count(&f.prompt_tokens, &["n0"]), 100);
        assert_eq!(count(&f.cached_prompt_tokens, &["n0"]), 60);
        assert_eq!(
            f.request_duration
                .with_label_values(&["p", "n0"])
                .get_sample_count(),
            3
        );
        assert_eq!(f.ttft.with_label_values(&["p", "n0"]).get_sample_count(), 1);
        assert!(
            Arc::ptr_eq(&s, &cache.get("p", "n0")),
            "one handle per node"
        );
    }

    #[test]
    fn a_node_in_another_pool_gets_that_pools_series() {
        let cache = SeriesCache::new(families());
        let f = cache.families.clone();
        cache
            .get("a", "n0")
            .observe_request(RequestOutcome::Success, Duration::ZERO);
        cache
            .get("b", "n0")
            .observe_request(RequestOutcome::Success, Duration::ZERO);
        let count = |pool: &str| f.requests.with_label_values(&[pool, "n0", "success"]).get();
        assert_eq!((count("a"), count("b")), (1, 1));
    }
}
