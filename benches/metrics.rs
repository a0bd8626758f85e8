//! A request's metric updates from two threads at once, as two serving lanes make
//! them: the node series the data plane updates (each thread its own copy, see
//! `telemetry/per_thread.rs`) against the same updates on shared Prometheus series
//! (how they were made before). Each thread does some other work between requests
//! (about 4 µs), so the shared series' cache lines go back and forth between the cores
//! as they do under load. The time reported is per request, per thread, work included:
//! the difference between the two is what the updates cost.
//!
//! ```sh
//! cargo bench --bench metrics
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use prefixlb::routing::route::Route;
use prefixlb::telemetry::metrics::Metrics;
use prefixlb::telemetry::outcome::RequestOutcome;
use prometheus::{Histogram, HistogramOpts, IntCounter, Opts};

/// About 4 µs of work that stays in registers (the request's own).
fn work(seed: u64) -> u64 {
    let mut v = seed;
    for _ in 0..3000 {
        v = black_box(
            v.wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        );
    }
    v
}

type Update = Arc<dyn Fn() + Send + Sync>;

/// Time per request of two threads each making `iters` requests.
fn two_threads(iters: u64, update: &Update) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let update = update.clone();
            s.spawn(move || {
                let mut acc = 0;
                for i in 0..iters {
                    acc ^= work(i);
                    update();
                }
                black_box(acc);
            });
        }
    });
    start.elapsed()
}

fn updates(c: &mut Criterion) {
    let metrics = Metrics::new();
    let series = metrics.requests.series("pool", "gpu-0");
    let per_thread: Update = Arc::new(move || {
        series.count_decision(&Route::Primary, 0);
        series.observe_ttft(Duration::from_micros(800));
        series.observe_request(RequestOutcome::Success, Duration::from_micros(900));
        series.count_tokens(250, 200);
    });
    let hist =
        |b: &[f64]| Histogram::with_opts(HistogramOpts::new("h", "h").buckets(b.to_vec())).unwrap();
    let counter = || IntCounter::with_opts(Opts::new("c", "c")).unwrap();
    let (outcome, route, prompt, cached) = (counter(), counter(), counter(), counter());
    let duration = hist(&[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 600.0]);
    let ttft = hist(&[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 60.0]);
    let spill = hist(&[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0]);
    let shared: Update = Arc::new(move || {
        route.inc();
        spill.observe(0.0);
        ttft.observe(0.0008);
        outcome.inc();
        duration.observe(0.0009);
        prompt.inc_by(250);
        cached.inc_by(200);
    });
    let nothing: Update = Arc::new(|| {});
    let mut g = c.benchmark_group("metric_updates_two_threads");
    for (name, update) in [
        ("work_alone", &nothing),
        ("shared_series", &shared),
        ("per_thread_series", &per_thread),
    ] {
        g.bench_function(name, |b| b.iter_custom(|iters| two_threads(iters, update)));
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = updates
}
criterion_main!(benches);
