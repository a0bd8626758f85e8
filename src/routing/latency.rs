//! What a stream's time to first token says about its node, judged against the work
//! and against the node's peers, never by raw TTFT alone.
//!
//! A stream's expected TTFT is the pool's base TTFT (what a prompt the engine has all
//! cached takes) plus its prefill: the prompt tokens the node had to prefill before its
//! first token (its own uncached tokens, and the estimated uncached tokens of the
//! streams ahead of it on that node) times the pool's learned time per token. Its
//! normalized TTFT is the measured TTFT over that expectation: about 1 on a healthy
//! engine whether the prompt was a 30k-token cold RAG prompt or a warm chat turn; 5 on
//! an engine that prefills five times slower. A TTFT under `slow_ttft` is never worse
//! than expected (nobody is ejected for being fast enough).
//!
//! A node is then compared with its peers: the median of the other nodes' P90
//! normalized TTFT, never below 1. When every node is slow (a global overload, or all
//! engines slowed together), the peers are as slow as the node and nothing is judged
//! slow: overload is for bounded loads, the queue and 503s. Pure.

use std::time::Duration;

/// A stream with fewer uncached tokens says little about prefill speed.
const MIN_UNCACHED: u32 = 64;

/// Whether a stream with `tokens` to prefill measures the base TTFT rather than the
/// time per token.
pub fn is_base(tokens: u32) -> bool {
    tokens < MIN_UNCACHED
}

/// A normalized TTFT in thousandths: 1000 = exactly as expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Norm(pub u32);

impl Norm {
    /// As expected.
    pub const EXPECTED: Norm = Norm(1000);

    pub fn as_f64(self) -> f64 {
        f64::from(self.0) / 1000.0
    }

    /// This times `factor`.
    pub fn scaled(self, factor: f64) -> Norm {
        Norm((f64::from(self.0) * factor).min(f64::from(u32::MAX)) as u32)
    }
}

/// What the pool's engines take to a first token: a fixed part and a time per prompt
/// token to prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Expectation {
    /// TTFT of a stream with (almost) nothing to prefill.
    pub base: Duration,
    /// Prefill time per uncached prompt token.
    pub per_token: Duration,
    /// Whether each was learned from enough streams yet (else it is a default, and a
    /// stream that it would judge is not judged).
    pub learned_base: bool,
    pub learned_rate: bool,
}

/// An expectation below this is not trusted as a denominator.
const MIN_EXPECTED: Duration = Duration::from_millis(1);

impl Expectation {
    /// The TTFT expected of a stream whose node had `ahead` tokens of other prompts to
    /// prefill before its own `uncached` ones.
    pub fn ttft(&self, ahead: u32, uncached: u32) -> Duration {
        let tokens = ahead.saturating_add(uncached);
        self.base
            .saturating_add(self.per_token.saturating_mul(tokens))
            .max(MIN_EXPECTED)
    }

    /// The stream's normalized TTFT; one that reached its first token within `floor`
    /// counts as no worse than expected. `None` until the pool has learned the part of
    /// the expectation this stream depends on: a default says nothing of an engine.
    pub fn normalize(
        &self,
        ttft: Duration,
        ahead: u32,
        uncached: u32,
        floor: Duration,
    ) -> Option<Norm> {
        let learned = if is_base(ahead.saturating_add(uncached)) {
            self.learned_base
        } else {
            self.learned_rate
        };
        if !learned {
            return None;
        }
        let expected = self.ttft(ahead, uncached).as_secs_f64();
        let norm = Norm((ttft.as_secs_f64() / expected * 1000.0).min(f64::from(u32::MAX)) as u32);
        Some(if ttft < floor {
            norm.min(Norm::EXPECTED)
        } else {
            norm
        })
    }
}

/// How a node's peers in its pool are doing: what its latency is judged against, and
/// whether latency may take one more node out of rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Peers {
    /// The median of the peers' P90 normalized TTFT, at least [`Norm::EXPECTED`];
    /// `None`: no peer has enough samples, and nothing is judged.
    ///
    /// Their P90, not their median: when every engine slows down at once, a peer's P90
    /// moves as soon as a tenth of its window is slow, long before the node's own
    /// median (which opens or shunts it) can, so a pool-wide slowdown never looks like
    /// one slow node, whichever node sees it first.
    pub reference: Option<Norm>,
    /// The median of the peers' latest normalized TTFT, at least [`Norm::EXPECTED`]:
    /// how they are doing now, whatever their windows remember. `None`: no peer has a
    /// sample.
    pub recent: Option<Norm>,
    /// Latency may open this node: the pool's nodes out of rotation are below the cap.
    pub may_eject: bool,
}

impl Peers {
    /// From the P90 of each peer with enough samples, and the latest sample of each
    /// peer with one.
    pub fn of(p90s: &mut [Norm], latest: &mut [Norm], may_eject: bool) -> Peers {
        Peers {
            reference: median(p90s).map(|m| m.max(Norm::EXPECTED)),
            recent: median(latest).map(|m| m.max(Norm::EXPECTED)),
            may_eject,
        }
    }
}

fn median(values: &mut [Norm]) -> Option<Norm> {
    values.sort_unstable();
    let mid = values.len() / 2;
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[mid]),
        _ => Some(Norm(
            ((u64::from(values[mid - 1].0) + u64::from(values[mid].0)) / 2) as u32,
        )),
    }
}

/// Whether latency may take one more of a pool's `nodes` out of rotation when `out`
/// are out already: never more than `max_share` of them (rounded down, so a pool of
/// one or a cap of 0 ejects nothing for latency).
pub fn may_eject(out: usize, nodes: usize, max_share: f64) -> bool {
    let cap = (max_share * nodes as f64 + 1e-9).floor() as usize;
    out < cap
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_long_cold_prompt_on_a_healthy_engine_is_as_expected() {
        let e = Expectation {
            base: ms(30),
            per_token: Duration::from_micros(100),
            learned_base: true,
            learned_rate: true,
        };
        let norm =
            |ttft, ahead, uncached, floor| e.normalize(ttft, ahead, uncached, floor).unwrap();
        // 20,000 uncached tokens: 2.03 s expected, 2.1 s measured.
        assert_eq!(norm(ms(2100), 0, 20_000, ms(100)), Norm(1034));
        // A warm turn: 12 tokens to prefill, 32 ms.
        assert_eq!(norm(ms(32), 0, 12, Duration::ZERO), Norm(1025));
        // Behind 3 other prompts of 5,000 tokens, 1.6 s is as expected too.
        assert_eq!(norm(ms(1530), 15_000, 0, ms(100)), Norm(1000));
        // Five times slower prefill.
        assert_eq!(norm(ms(10_030), 0, 20_000, ms(100)), Norm(4940));
        // Under the floor: never slow.
        assert_eq!(norm(ms(90), 0, 12, ms(100)), Norm::EXPECTED);
        assert_eq!(norm(ms(1), 0, 12, ms(100)), Norm(32));
        // Until the pool has learned what a part of the expectation is, nothing that
        // depends on it is judged.
        let fresh = Expectation {
            learned_base: false,
            ..e
        };
        assert_eq!(fresh.normalize(ms(900), 0, 12, ms(100)), None);
        assert!(fresh.normalize(ms(900), 0, 2_000, ms(100)).is_some());
    }

    #[test]
    fn peers_give_the_median_p90_never_below_expected() {
        let p = Peers::of(
            &mut [Norm(1500), Norm(6000), Norm(2000)],
            &mut [Norm(900)],
            true,
        );
        assert_eq!(
            (p.reference, p.recent),
            (Some(Norm(2000)), Some(Norm::EXPECTED))
        );
        assert_eq!(
            Peers::of(&mut [Norm(1500), Norm(2500)], &mut [], true).reference,
            Some(Norm(2000))
        );
        let p = Peers::of(&mut [Norm(800)], &mut [Norm(3000), Norm(1200)], false);
        assert_eq!((p.reference, p.may_eject), (Some(Norm::EXPECTED), false));
        assert_eq!(p.recent, Some(Norm(2100)));
        let none = Peers::of(&mut [], &mut [], true);
        assert_eq!((none.reference, none.recent), (None, None));
    }

    #[test]
    fn the_ejection_cap_rounds_down() {
        assert!(may_eject(0, 4, 0.5) && may_eject(1, 4, 0.5) && !may_eject(2, 4, 0.5));
        assert!(may_eject(0, 3, 0.5) && !may_eject(1, 3, 0.5));
        assert!(
            !may_eject(0, 1, 0.5),
            "a pool of one has nowhere to send its keys"
        );
        assert!(!may_eject(0, 8, 0.0));
    }
}
