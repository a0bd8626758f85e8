//! The latency samples of one node's breaker window: each stream's raw TTFT (for
//! operators) and its normalized TTFT (what the breaker judges, see [`super::latency`]),
//! kept in arrival order (to drop the old ones) and sorted (so a quantile or the slow
//! share costs a short walk, not a sort per request). Bounded in size.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::time::{Duration, Instant};

use super::latency::Norm;

/// Most samples kept, whatever the window: bounds memory and quantile work.
pub(super) const MAX_SAMPLES: usize = 512;

/// A multiset of values that answers quantiles and "how many above" by walking from
/// the top.
#[derive(Debug)]
struct Sorted<T>(BTreeMap<T, u32>);

impl<T> Default for Sorted<T> {
    fn default() -> Self {
        Sorted(BTreeMap::new())
    }
}

impl<T: Ord + Copy> Sorted<T> {
    fn insert(&mut self, v: T) {
        *self.0.entry(v).or_insert(0) += 1;
    }

    fn remove(&mut self, v: T) {
        if let Some(n) = self.0.get_mut(&v) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&v);
            }
        }
    }

    /// The q-quantile (nearest rank) of `n` values, walking down from the largest.
    fn quantile(&self, q: f64, n: usize) -> Option<T> {
        if n == 0 {
            return None;
        }
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        let mut from_top = n - rank + 1;
        for (v, count) in self.0.iter().rev() {
            if *count as usize >= from_top {
                return Some(*v);
            }
            from_top -= *count as usize;
        }
        None
    }

    fn above(&self, threshold: T) -> usize {
        self.0
            .range((Bound::Excluded(threshold), Bound::Unbounded))
            .map(|(_, c)| *c as usize)
            .sum()
    }
}

/// Recent successful streams of one node: when each finished, its TTFT and its
/// normalized TTFT.
#[derive(Debug, Default)]
pub(super) struct TtftWindow {
    by_time: VecDeque<(Instant, Duration, Norm)>,
    ttft: Sorted<Duration>,
    norm: Sorted<Norm>,
}

impl TtftWindow {
    pub(super) fn len(&self) -> usize {
        self.by_time.len()
    }

    pub(super) fn push(&mut self, at: Instant, ttft: Duration, norm: Norm) {
        self.by_time.push_back((at, ttft, norm));
        self.ttft.insert(ttft);
        self.norm.insert(norm);
        if self.by_time.len() > MAX_SAMPLES {
            self.pop_oldest();
        }
    }

    pub(super) fn pop_oldest(&mut self) {
        if let Some((_, t, n)) = self.by_time.pop_front() {
            self.ttft.remove(t);
            self.norm.remove(n);
        }
    }

    /// Drops samples older than `window`.
    pub(super) fn prune(&mut self, window: Duration, now: Instant) {
        while let Some(&(at, _, _)) = self.by_time.front() {
            if now.saturating_duration_since(at) <= window {
                break;
            }
            self.pop_oldest();
        }
    }

    pub(super) fn clear(&mut self) {
        self.by_time.clear();
        self.ttft = Sorted::default();
        self.norm = Sorted::default();
    }

    /// The q-quantile of raw TTFT.
    pub(super) fn ttft_quantile(&self, q: f64) -> Option<Duration> {
        self.ttft.quantile(q, self.len())
    }

    /// The q-quantile of normalized TTFT.
    pub(super) fn norm_quantile(&self, q: f64) -> Option<Norm> {
        self.norm.quantile(q, self.len())
    }

    /// Samples whose normalized TTFT is above `threshold`.
    pub(super) fn norm_above(&self, threshold: Norm) -> usize {
        self.norm.above(threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_keeps_quantiles_exact() {
        let t0 = Instant::now();
        let mut w = TtftWindow::default();
        for ms in [5u64, 1, 4, 2, 3, 3, 9, 7, 8, 6] {
            w.push(t0, Duration::from_millis(ms), Norm(ms as u32 * 100));
        }
        let ms = |q| w.ttft_quantile(q).unwrap().as_millis();
        assert_eq!((ms(0.1), ms(0.5), ms(0.9), ms(1.0)), (1, 4, 8, 9));
        assert_eq!(w.norm_quantile(0.9), Some(Norm(800)));
        assert_eq!(w.norm_above(Norm(600)), 3);
        w.pop_oldest();
        assert_eq!(w.len(), 9);
        assert_eq!(w.norm_above(Norm(400)), 4);
        w.prune(Duration::ZERO, t0 + Duration::from_millis(1));
        assert_eq!(w.len(), 0);
        assert_eq!(w.norm_quantile(0.5), None);
    }
}
