//! Counts kept per serving thread and added up when read. A counter every thread
//! updates lives on one cache line, and each update from another core than the last
//! must fetch that line first (about 35 ns here, measured with two threads adding to
//! one atomic against two atomics of their own): with two lanes answering requests, a
//! dozen shared metric updates per request cost more than the rest of the metrics'
//! work. Here each thread adds to its own copy ([`PerThread::mine`]), on its own
//! lines, and a scrape sums the copies ([`PerThread::all`]). Nothing is lost or late:
//! the updates are atomic adds, read whole at any time. Threads beyond
//! [`COPIES`] share copies, which costs transfers again but stays exact.
//!
//! [`Hist`] is a histogram kept this way: a count per bucket and an integer sum, so
//! copies add up exactly.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Copies per counted thing: more than the threads that serve requests on the hosts we
/// run on (lanes or runtime workers, one per core), fewer than would make every node's
/// series large (a copy of a node's series is about 600 bytes).
pub const COPIES: usize = 16;

/// The copy index of the calling thread: threads take indexes in the order they first
/// count anything.
fn copy_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Ordering::Relaxed) % COPIES;
    }
    INDEX.with(|i| *i)
}

/// A value on cache lines of its own (128 bytes: adjacent-line prefetch pairs lines).
#[derive(Default)]
#[repr(align(128))]
struct Padded<T>(T);

/// One `T` per thread (see the module's header).
pub struct PerThread<T> {
    copies: Box<[Padded<T>]>,
}

impl<T: Default> Default for PerThread<T> {
    fn default() -> Self {
        PerThread {
            copies: (0..COPIES).map(|_| Padded::default()).collect(),
        }
    }
}

impl<T> PerThread<T> {
    /// The calling thread's copy.
    pub fn mine(&self) -> &T {
        &self.copies[copy_index()].0
    }

    /// Every copy, to be added up.
    pub fn all(&self) -> impl Iterator<Item = &T> {
        self.copies.iter().map(|c| &c.0)
    }
}

/// Adds `n` to a count only this thread's copy holds (relaxed: counts carry no order).
pub fn add(count: &AtomicU64, n: u64) {
    count.fetch_add(n, Ordering::Relaxed);
}

/// A count's value.
pub fn read(count: &AtomicU64) -> u64 {
    count.load(Ordering::Relaxed)
}

/// The most buckets a [`Hist`] has, besides the last one (`+Inf`).
pub const MAX_BOUNDS: usize = 16;

/// One copy of a histogram: observations per bucket (bucket `i` holds values up to
/// bound `i`, the last one the rest) and their sum in integer units (nanoseconds,
/// positions), so that copies add up exactly.
#[derive(Default)]
pub struct Hist {
    counts: [AtomicU64; MAX_BOUNDS + 1],
    sum: AtomicU64,
}

impl Hist {
    /// Records `value` (in the sum's unit) against `bounds` (in the same unit,
    /// ascending, at most [`MAX_BOUNDS`]).
    pub fn observe(&self, bounds: &[u64], value: u64) {
        let bucket = bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(bounds.len());
        add(&self.counts[bucket], 1);
        add(&self.sum, value);
    }
}

/// Histogram copies added up: cumulative counts per bound (as Prometheus shows them),
/// the count and the sum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistTotal {
    pub cumulative: Vec<u64>,
    pub count: u64,
    pub sum: u64,
}

impl HistTotal {
    /// The total of `copies` over `bounds` buckets (and the rest).
    pub fn of<'a>(bounds: usize, copies: impl Iterator<Item = &'a Hist>) -> HistTotal {
        let mut per_bucket = vec![0u64; bounds + 1];
        let mut sum = 0u64;
        for h in copies {
            for (total, c) in per_bucket.iter_mut().zip(&h.counts) {
                *total += read(c);
            }
            sum = sum.wrapping_add(read(&h.sum));
        }
        let mut running = 0;
        let mut cumulative: Vec<u64> = per_bucket
            .iter()
            .map(|c| {
                running += c;
                running
            })
            .collect();
        let count = cumulative.pop().unwrap_or(0);
        HistTotal {
            cumulative,
            count,
            sum,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn copies_of_many_threads_add_up_to_every_update() {
        let counts: Arc<PerThread<AtomicU64>> = Arc::default();
        let threads: Vec<_> = (0..COPIES + 5)
            .map(|_| {
                let counts = counts.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        add(counts.mine(), 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            counts.all().map(read).sum::<u64>(),
            (COPIES as u64 + 5) * 1000
        );
        // Each thread wrote one copy: more than one copy was written.
        assert!(counts.all().filter(|c| read(c) > 0).count() > 1);
    }

    #[test]
    fn a_thread_keeps_its_copy() {
        let counts: PerThread<AtomicU64> = PerThread::default();
        add(counts.mine(), 3);
        add(counts.mine(), 4);
        assert_eq!(counts.all().filter(|c| read(c) > 0).count(), 1);
        assert_eq!(read(counts.mine()), 7);
    }

    #[test]
    fn histogram_buckets_take_values_up_to_their_bound() {
        let bounds = [10, 20, 40];
        let (a, b) = (Hist::default(), Hist::default());
        for v in [0, 10] {
            a.observe(&bounds, v);
        }
        for v in [11, 40, 41, 1000] {
            b.observe(&bounds, v);
        }
        let total = HistTotal::of(bounds.len(), [&a, &b].into_iter());
        assert_eq!(
            total,
            HistTotal {
                cumulative: vec![2, 3, 4],
                count: 6,
                sum: 1102,
            }
        );
    }
}
