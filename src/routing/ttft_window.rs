//! The TTFT samples of one node's breaker window: kept in arrival order (to drop the
//! old ones) and sorted (so a quantile or the slow share costs a short walk, not a sort
//! per request). Bounded in size.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Most samples kept, whatever the window: bounds memory and P90 work.
pub(super) const MAX_SAMPLES: usize = 512;

/// TTFTs of recent successful streams, in arrival order and sorted, so that a
/// quantile or the slow share costs a short walk, not a sort, on every request.
#[derive(Debug, Default)]
pub(super) struct TtftWindow {
    by_time: VecDeque<(Instant, Duration)>,
    sorted: BTreeMap<Duration, u32>,
}

impl TtftWindow {
    pub(super) fn len(&self) -> usize {
        self.by_time.len()
    }

    pub(super) fn push(&mut self, at: Instant, ttft: Duration) {
        self.by_time.push_back((at, ttft));
        *self.sorted.entry(ttft).or_insert(0) += 1;
        if self.by_time.len() > MAX_SAMPLES {
            self.pop_oldest();
        }
    }

    pub(super) fn pop_oldest(&mut self) {
        if let Some((_, t)) = self.by_time.pop_front() {
            if let Some(n) = self.sorted.get_mut(&t) {
                *n -= 1;
                if *n == 0 {
                    self.sorted.remove(&t);
                }
            }
        }
    }

    /// Drops samples older than `window`.
    pub(super) fn prune(&mut self, window: Duration, now: Instant) {
        while let Some(&(at, _)) = self.by_time.front() {
            if now.saturating_duration_since(at) <= window {
                break;
            }
            self.pop_oldest();
        }
    }

    pub(super) fn clear(&mut self) {
        self.by_time.clear();
        self.sorted.clear();
    }

    /// The q-quantile (nearest rank), walking down from the largest.
    pub(super) fn quantile(&self, q: f64) -> Option<Duration> {
        let n = self.len();
        if n == 0 {
            return None;
        }
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        let mut from_top = n - rank + 1;
        for (t, count) in self.sorted.iter().rev() {
            if *count as usize >= from_top {
                return Some(*t);
            }
            from_top -= *count as usize;
        }
        None
    }

    /// Samples slower than `threshold`.
    pub(super) fn slower_than(&self, threshold: Duration) -> usize {
        self.sorted
            .range((
                std::ops::Bound::Excluded(threshold),
                std::ops::Bound::Unbounded,
            ))
            .map(|(_, c)| *c as usize)
            .sum()
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
            w.push(t0, Duration::from_millis(ms));
        }
        let ms = |q| w.quantile(q).unwrap().as_millis();
        assert_eq!((ms(0.1), ms(0.5), ms(0.9), ms(1.0)), (1, 4, 8, 9));
        assert_eq!(w.slower_than(Duration::from_millis(6)), 3);
        w.pop_oldest();
        assert_eq!(w.len(), 9);
        assert_eq!(w.slower_than(Duration::from_millis(4)), 4);
    }
}
