//! One node's per-request metric series, looked up once per request. A labelled
//! family (`requests_total{pool,node,outcome}`, …) finds a series by hashing its label
//! values on every update: six updates a request, about 730 instructions. The data
//! plane instead takes a [`NodeSeries`] for its pool and node when it commits an answer
//! (one lookup, keyed by the node id alone, hashed with xxh3) and updates the series
//! it holds.
//!
//! The updates go to the serving thread's own copy of the node's counts
//! ([`super::per_thread`]): two lanes updating one set of counters moved their cache
//! lines between the cores a dozen times a request. The page adds the copies up when
//! it is rendered: the counters into their Prometheus families
//! ([`SeriesCache::drain`]), the histograms through [`SeriesHistograms`], a collector
//! of the registry. Each series still appears on its first update, so the page shows
//! the same series as when every update went through a family. Request series are
//! never reset, and a node that a reload moved to another pool keeps its old series
//! on the page beside the new ones, as the families kept them.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::{Mutex, RwLock};
use prometheus::core::{Collector, Desc, Describer};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
use prometheus::{HistogramOpts, IntCounterVec};

use super::outcome::RequestOutcome;
use super::per_thread::{add, read, Hist, HistTotal, PerThread, MAX_BOUNDS};
use crate::name_hash::NameMap;
use crate::routing::route::{Route, RouteKind};

/// The counter families a node's series are added into (handles: clones share the
/// family).
#[derive(Clone)]
pub(super) struct Families {
    pub requests: IntCounterVec,
    pub routing_decisions: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    pub cached_prompt_tokens: IntCounterVec,
}

/// The three histograms the series keep: their descriptions and bounds.
pub(super) struct HistogramSpecs {
    pub request_duration: HistogramOpts,
    pub ttft: HistogramOpts,
    pub spill_distance: HistogramOpts,
}

/// A histogram's bounds as shown, and in the integer unit it is kept in.
struct Bounds {
    shown: Vec<f64>,
    kept: Vec<u64>,
    /// Kept units per shown unit (1e9: nanoseconds kept, seconds shown). A sum is
    /// shown divided by it: one correctly rounded division, where the families added
    /// floating-point seconds one request at a time.
    scale: f64,
}

impl Bounds {
    fn of(opts: &HistogramOpts, scale: f64) -> Bounds {
        let shown = opts.buckets.clone();
        assert!(shown.len() <= MAX_BOUNDS, "at most {MAX_BOUNDS} buckets");
        Bounds {
            kept: shown.iter().map(|b| (b * scale).round() as u64).collect(),
            shown,
            scale,
        }
    }
}

/// The bounds of the series' histograms.
struct AllBounds {
    duration: Bounds,
    ttft: Bounds,
    spill: Bounds,
}

/// Bits of [`NodeSeries::shown`]: which of its series have been updated.
const OUTCOME_BIT: u32 = 1;
const ROUTE_BIT: u32 = 1 << 8;
/// Both token counters (always counted together).
const TOKENS_BIT: u32 = 1 << 16;
const DURATION_BIT: u32 = 1 << 17;
const TTFT_BIT: u32 = 1 << 18;

/// One thread's counts of a node's requests.
#[derive(Default)]
struct NodeCounts {
    outcomes: [AtomicU64; RequestOutcome::ALL.len()],
    routes: [AtomicU64; RouteKind::ALL.len()],
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    duration: Hist,
    ttft: Hist,
    spill: Hist,
}

/// Counter totals already added into the families.
#[derive(Default)]
struct Drained {
    outcomes: [u64; RequestOutcome::ALL.len()],
    routes: [u64; RouteKind::ALL.len()],
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
}

/// A node's series in its pool, each shown from its first update.
pub struct NodeSeries {
    pool: Box<str>,
    node: Box<str>,
    bounds: Arc<AllBounds>,
    counts: PerThread<NodeCounts>,
    /// Which series have been updated (written once each, then only read).
    shown: AtomicU32,
    drained: Mutex<Drained>,
}

impl NodeSeries {
    fn new(bounds: Arc<AllBounds>, pool: &str, node: &str) -> NodeSeries {
        NodeSeries {
            pool: pool.into(),
            node: node.into(),
            bounds,
            counts: PerThread::default(),
            shown: AtomicU32::new(0),
            drained: Mutex::default(),
        }
    }

    /// Marks series shown; a bit already set costs a read of a line nobody writes.
    fn show(&self, bits: u32) {
        if self.shown.load(Ordering::Relaxed) & bits != bits {
            self.shown.fetch_or(bits, Ordering::Relaxed);
        }
    }

    fn shows(&self, bits: u32) -> bool {
        self.shown.load(Ordering::Relaxed) & bits == bits
    }

    /// Counts a finished request.
    pub fn observe_request(&self, outcome: RequestOutcome, duration: Duration) {
        let c = self.counts.mine();
        add(&c.outcomes[outcome as usize], 1);
        c.duration
            .observe(&self.bounds.duration.kept, nanos(duration));
        self.show(OUTCOME_BIT << outcome as u32 | DURATION_BIT);
    }

    /// Counts where a request went (in this node's pool), and how far along its key's
    /// walk.
    pub fn count_decision(&self, route: &Route, distance: usize) {
        let (c, kind) = (self.counts.mine(), route.kind());
        add(&c.routes[kind as usize], 1);
        c.spill.observe(&self.bounds.spill.kept, distance as u64);
        self.show(ROUTE_BIT << kind as u32);
    }

    pub fn observe_ttft(&self, ttft: Duration) {
        self.counts
            .mine()
            .ttft
            .observe(&self.bounds.ttft.kept, nanos(ttft));
        self.show(TTFT_BIT);
    }

    /// Counts a request's prompt tokens and those its engine served from cache.
    pub fn count_tokens(&self, prompt: u64, cached: u64) {
        let c = self.counts.mine();
        add(&c.prompt_tokens, prompt);
        add(&c.cached_prompt_tokens, cached);
        self.show(TOKENS_BIT);
    }

    /// The pool and node the series are of.
    pub fn names(&self) -> (&str, &str) {
        (&self.pool, &self.node)
    }

    /// Shows the TTFT series before any stream committed (at zero).
    pub(super) fn show_ttft(&self) {
        self.show(TTFT_BIT);
    }

    /// Prompt tokens and cached prompt tokens counted so far.
    pub(super) fn tokens(&self) -> (u64, u64) {
        (
            self.total(|n| &n.prompt_tokens),
            self.total(|n| &n.cached_prompt_tokens),
        )
    }

    fn total(&self, count: impl Fn(&NodeCounts) -> &AtomicU64) -> u64 {
        self.counts.all().map(|n| read(count(n))).sum()
    }

    /// Adds what was counted since the last call into the counter families.
    fn drain(&self, f: &Families) {
        let mut d = self.drained.lock();
        let (pool, node) = (&*self.pool, &*self.node);
        for (i, outcome) in RequestOutcome::ALL.into_iter().enumerate() {
            if self.shows(OUTCOME_BIT << i) {
                let total = self.total(|n| &n.outcomes[i]);
                f.requests
                    .with_label_values(&[pool, node, outcome.as_str()])
                    .inc_by(total - d.outcomes[i]);
                d.outcomes[i] = total;
            }
        }
        for (i, kind) in RouteKind::ALL.into_iter().enumerate() {
            if self.shows(ROUTE_BIT << i) {
                let total = self.total(|n| &n.routes[i]);
                f.routing_decisions
                    .with_label_values(&[pool, kind.as_str()])
                    .inc_by(total - d.routes[i]);
                d.routes[i] = total;
            }
        }
        if self.shows(TOKENS_BIT) {
            let (prompt, cached) = self.tokens();
            f.prompt_tokens
                .with_label_values(&[node])
                .inc_by(prompt - d.prompt_tokens);
            f.cached_prompt_tokens
                .with_label_values(&[node])
                .inc_by(cached - d.cached_prompt_tokens);
            (d.prompt_tokens, d.cached_prompt_tokens) = (prompt, cached);
        }
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(u64::MAX)) as u64
}

/// Every series made, in the order made.
type AllSeries = Arc<RwLock<Vec<&'static NodeSeries>>>;

/// The [`NodeSeries`] handed out so far, by node id (unique across pools; a node that
/// a reload moved to another pool gets new series).
///
/// A series is kept for the life of the process (the page shows it as long), so it is
/// handed out as `&'static`: a request holds it without a reference count to update,
/// and finds it in a map read without a lock (`arc-swap`'s load touches only the
/// reading thread's own slots), where a shared count and a read lock were four
/// cache-line transfers between lanes a request. A series is made once per node and
/// pool; a [`SeriesCache`] dropped (tests make several) leaves its series behind.
pub(super) struct SeriesCache {
    families: Families,
    bounds: Arc<AllBounds>,
    by_node: ArcSwap<NameMap<Box<str>, &'static NodeSeries>>,
    all: AllSeries,
}

impl SeriesCache {
    /// The cache, and the collector that shows its histograms (to be registered).
    pub fn new(families: Families, specs: HistogramSpecs) -> (SeriesCache, SeriesHistograms) {
        let bounds = Arc::new(AllBounds {
            duration: Bounds::of(&specs.request_duration, 1e9),
            ttft: Bounds::of(&specs.ttft, 1e9),
            spill: Bounds::of(&specs.spill_distance, 1.0),
        });
        let all = AllSeries::default();
        let describe = |o: &HistogramOpts| o.describe().expect("histogram options are valid");
        let histograms = SeriesHistograms {
            descs: [
                describe(&specs.request_duration),
                describe(&specs.ttft),
                describe(&specs.spill_distance),
            ],
            bounds: bounds.clone(),
            all: all.clone(),
        };
        let cache = SeriesCache {
            families,
            bounds,
            by_node: ArcSwap::default(),
            all,
        };
        (cache, histograms)
    }

    pub fn families(&self) -> &Families {
        &self.families
    }

    pub fn get(&self, pool: &str, node: &str) -> &'static NodeSeries {
        if let Some(&s) = self.by_node.load().get(node).filter(|s| &*s.pool == pool) {
            return s;
        }
        // Made or found under the list's lock, so a node and pool get one series.
        let mut all = self.all.write();
        // A node back in a pool it was in before takes up its old series again.
        let series = match all.iter().find(|s| &*s.pool == pool && &*s.node == node) {
            Some(&s) => s,
            None => {
                let s: &'static NodeSeries =
                    Box::leak(Box::new(NodeSeries::new(self.bounds.clone(), pool, node)));
                all.push(s);
                s
            }
        };
        self.by_node.rcu(|by_node| {
            let mut by_node = NameMap::clone(by_node);
            by_node.insert(node.into(), series);
            by_node
        });
        series
    }

    /// Adds every series' counts since the last call into the counter families (before
    /// the page is rendered).
    pub fn drain(&self) {
        for series in self.all.read().iter() {
            series.drain(&self.families);
        }
    }

    /// A node's prompt tokens and cached prompt tokens counted so far (in its pools).
    pub fn tokens_of(&self, node: &str) -> (u64, u64) {
        self.all
            .read()
            .iter()
            .filter(|s| &*s.node == node)
            .map(|s| s.tokens())
            .fold((0, 0), |(p, c), (sp, sc)| (p + sp, c + sc))
    }
}

/// The registry's collector of the series' histograms: `request_duration_seconds` and
/// `ttft_seconds` by pool and node, and `spill_distance` over all of them, each
/// series' copies added up as the page is rendered.
pub struct SeriesHistograms {
    descs: [Desc; 3],
    bounds: Arc<AllBounds>,
    all: AllSeries,
}

impl Collector for SeriesHistograms {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let all = self.all.read();
        let b = &self.bounds;
        let per_node = |desc: &Desc, bit: u32, bounds: &Bounds, hist: fn(&NodeCounts) -> &Hist| {
            let metrics = all
                .iter()
                .filter(|s| s.shows(bit))
                .map(|s| {
                    let total = HistTotal::of(bounds.kept.len(), s.counts.all().map(hist));
                    let labels = [("node", &*s.node), ("pool", &*s.pool)];
                    histogram_metric(&labels, bounds, &total)
                })
                .collect();
            family(desc, metrics)
        };
        let spill = HistTotal::of(
            b.spill.kept.len(),
            all.iter().flat_map(|s| s.counts.all().map(|n| &n.spill)),
        );
        vec![
            per_node(&self.descs[0], DURATION_BIT, &b.duration, |n| &n.duration),
            per_node(&self.descs[1], TTFT_BIT, &b.ttft, |n| &n.ttft),
            family(
                &self.descs[2],
                vec![histogram_metric(&[], &b.spill, &spill)],
            ),
        ]
    }
}

fn family(desc: &Desc, metrics: Vec<proto::Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(desc.fq_name.clone());
    f.set_help(desc.help.clone());
    f.set_field_type(MetricType::HISTOGRAM);
    f.set_metric(metrics);
    f
}

/// One histogram series; `labels` in name order, as the Prometheus families keep them.
fn histogram_metric(labels: &[(&str, &str)], bounds: &Bounds, total: &HistTotal) -> proto::Metric {
    let mut h = proto::Histogram::default();
    h.set_sample_count(total.count);
    h.set_sample_sum(total.sum as f64 / bounds.scale);
    h.set_bucket(
        bounds
            .shown
            .iter()
            .zip(&total.cumulative)
            .map(|(&bound, &count)| {
                let mut b = proto::Bucket::default();
                b.set_upper_bound(bound);
                b.set_cumulative_count(count);
                b
            })
            .collect(),
    );
    let mut m = proto::Metric::from_label(
        labels
            .iter()
            .map(|(name, value)| {
                let mut l = LabelPair::default();
                l.set_name(name.to_string());
                l.set_value(value.to_string());
                l
            })
            .collect(),
    );
    m.set_histogram(h);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{Encoder, Histogram, HistogramVec, Opts, Registry, TextEncoder};

    fn families() -> Families {
        let counter = |name: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, "help"), labels).unwrap()
        };
        Families {
            requests: counter("requests", &["pool", "node", "outcome"]),
            routing_decisions: counter("decisions", &["pool", "route"]),
            prompt_tokens: counter("prompt", &["node"]),
            cached_prompt_tokens: counter("cached", &["node"]),
        }
    }

    const DURATION: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 600.0];
    const SPILL: &[f64] = &[0.0, 1.0, 2.0, 4.0, 16.0];

    fn specs() -> HistogramSpecs {
        let labelled = |name: &str| {
            HistogramOpts::new(name, "help")
                .buckets(DURATION.to_vec())
                .variable_labels(vec!["pool".into(), "node".into()])
        };
        HistogramSpecs {
            request_duration: labelled("duration"),
            ttft: labelled("ttft"),
            spill_distance: HistogramOpts::new("spill", "help").buckets(SPILL.to_vec()),
        }
    }

    /// A registry holding a cache's families and histograms, the cache, and its page.
    fn registry() -> (Registry, SeriesCache) {
        let f = families();
        let r = Registry::new();
        register_counters(&r, &f);
        let (cache, histograms) = SeriesCache::new(f, specs());
        r.register(Box::new(histograms)).unwrap();
        (r, cache)
    }

    fn register_counters(r: &Registry, f: &Families) {
        for c in [
            &f.requests,
            &f.routing_decisions,
            &f.prompt_tokens,
            &f.cached_prompt_tokens,
        ] {
            r.register(Box::new(c.clone())).unwrap();
        }
    }

    fn page(r: &Registry) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&r.gather(), &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// The families the series replaced, updated directly as before.
    struct Direct {
        registry: Registry,
        families: Families,
        duration: HistogramVec,
        ttft: HistogramVec,
        spill: Histogram,
    }

    impl Direct {
        fn new() -> Direct {
            let (registry, families, s) = (Registry::new(), families(), specs());
            let labels = &["pool", "node"];
            let duration = HistogramVec::new(s.request_duration.variable_labels(vec![]), labels);
            let ttft = HistogramVec::new(s.ttft.variable_labels(vec![]), labels);
            let spill = Histogram::with_opts(s.spill_distance).unwrap();
            let (duration, ttft) = (duration.unwrap(), ttft.unwrap());
            register_counters(&registry, &families);
            registry.register(Box::new(duration.clone())).unwrap();
            registry.register(Box::new(ttft.clone())).unwrap();
            registry.register(Box::new(spill.clone())).unwrap();
            Direct {
                registry,
                families,
                duration,
                ttft,
                spill,
            }
        }
    }

    /// One request's updates: to the series, and to the families directly.
    struct Update {
        pool: &'static str,
        node: &'static str,
        outcome: RequestOutcome,
        duration_ms: u64,
        route: Route,
        distance: usize,
        ttft_ms: Option<u64>,
        tokens: Option<(u64, u64)>,
    }

    impl Update {
        fn to_series(&self, cache: &SeriesCache) {
            let s = cache.get(self.pool, self.node);
            s.count_decision(&self.route, self.distance);
            if let Some(t) = self.ttft_ms {
                s.observe_ttft(Duration::from_millis(t));
            }
            s.observe_request(self.outcome, Duration::from_millis(self.duration_ms));
            if let Some((p, c)) = self.tokens {
                s.count_tokens(p, c);
            }
        }

        fn to_families(&self, d: &Direct) {
            let (p, n) = (self.pool, self.node);
            let f = &d.families;
            f.routing_decisions
                .with_label_values(&[p, self.route.kind().as_str()])
                .inc();
            d.spill.observe(self.distance as f64);
            if let Some(t) = self.ttft_ms {
                d.ttft.with_label_values(&[p, n]).observe(t as f64 / 1000.0);
            }
            f.requests
                .with_label_values(&[p, n, self.outcome.as_str()])
                .inc();
            d.duration
                .with_label_values(&[p, n])
                .observe(self.duration_ms as f64 / 1000.0);
            if let Some((prompt, cached)) = self.tokens {
                f.prompt_tokens.with_label_values(&[n]).inc_by(prompt);
                f.cached_prompt_tokens
                    .with_label_values(&[n])
                    .inc_by(cached);
            }
        }
    }

    /// Requests over two pools and three nodes: bounds hit exactly, values past the
    /// last bound, zero tokens, every outcome and route; durations are binary fractions
    /// of a second, so the families' floating-point sums are exact too.
    fn updates() -> Vec<Update> {
        let outcomes = RequestOutcome::ALL;
        let routes = [
            Route::Primary,
            Route::Spill(2),
            Route::Shunt,
            Route::Queued,
            Route::Fallback("b".into()),
        ];
        let durations = [0, 125, 250, 500, 2000, 30_000, 700_000, 1000];
        (0..40)
            .map(|i| Update {
                pool: if i % 5 == 4 { "b" } else { "a" },
                node: ["n0", "n1", "n2"][i % 3],
                outcome: outcomes[i % outcomes.len()],
                duration_ms: durations[i % durations.len()],
                route: routes[i % routes.len()].clone(),
                distance: [0, 1, 3, 20][i % 4],
                ttft_ms: (i % 3 != 1).then_some(durations[(i + 3) % durations.len()]),
                tokens: (i % 4 != 2).then_some(((i * 100) as u64, (i % 2 * 50) as u64)),
            })
            .collect()
    }

    #[test]
    fn the_page_reads_as_the_families_updated_directly_wrote_it() {
        let (registry, cache) = registry();
        let direct = Direct::new();
        let updates = Arc::new(updates());
        // From three threads, so that the counts are split over copies.
        let cache = Arc::new(cache);
        let threads: Vec<_> = (0..3)
            .map(|t| {
                let (cache, updates) = (cache.clone(), updates.clone());
                std::thread::spawn(move || {
                    for u in updates.iter().skip(t).step_by(3) {
                        u.to_series(&cache);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for u in updates.iter() {
            u.to_families(&direct);
        }
        cache.drain();
        let ours = page(&registry);
        assert_eq!(ours, page(&direct.registry));
        assert!(
            ours.contains("ttft_bucket{node=\"n0\",pool=\"a\",le=\"0.25\"}"),
            "{ours}"
        );
        // Drained again with nothing new: the counters do not move.
        cache.drain();
        assert_eq!(page(&registry), ours);
        // And more requests later add on.
        for u in updates.iter().take(7) {
            u.to_series(&cache);
            u.to_families(&direct);
        }
        cache.drain();
        assert_eq!(page(&registry), page(&direct.registry));
    }

    #[test]
    fn a_series_is_shown_from_its_first_update() {
        let (registry, cache) = registry();
        let s = cache.get("p", "n0");
        cache.drain();
        // Nothing is shown before an update but the spill histogram (always there).
        let shown = page(&registry);
        assert!(!shown.contains("n0"), "{shown}");
        assert!(shown.contains("spill_count 0"), "{shown}");
        s.observe_request(RequestOutcome::Error, Duration::from_millis(5));
        s.count_tokens(100, 0);
        cache.drain();
        let shown = page(&registry);
        assert!(
            shown.contains("requests{node=\"n0\",outcome=\"error\",pool=\"p\"} 1"),
            "{shown}"
        );
        assert!(!shown.contains("outcome=\"success\""), "{shown}");
        assert!(
            shown.contains("duration_count{node=\"n0\",pool=\"p\"} 1"),
            "{shown}"
        );
        // Zero cached tokens still shows the series, as `inc_by(0)` made it.
        assert!(shown.contains("cached{node=\"n0\"} 0"), "{shown}");
        assert!(!shown.contains("ttft_count"), "{shown}");
        s.show_ttft();
        assert!(page(&registry).contains("ttft_count{node=\"n0\",pool=\"p\"} 0"));
        assert_eq!(cache.tokens_of("n0"), (100, 0));
        assert!(std::ptr::eq(s, cache.get("p", "n0")), "one handle per node");
    }

    #[test]
    fn a_node_in_another_pool_gets_that_pools_series_and_keeps_the_old_ones() {
        let (registry, cache) = registry();
        cache
            .get("a", "n0")
            .observe_request(RequestOutcome::Success, Duration::ZERO);
        cache
            .get("b", "n0")
            .observe_request(RequestOutcome::Success, Duration::ZERO);
        cache.drain();
        let f = cache.families();
        let count = |pool: &str| f.requests.with_label_values(&[pool, "n0", "success"]).get();
        assert_eq!((count("a"), count("b")), (1, 1));
        let shown = page(&registry);
        for pool in ["a", "b"] {
            assert!(
                shown.contains(&format!("duration_count{{node=\"n0\",pool=\"{pool}\"}} 1")),
                "{shown}"
            );
        }
    }
}
