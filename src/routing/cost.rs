//! What the balancer learns of its engines' speed, and the decision it drives: wait
//! for a full home node, or spill. A pool's prefill time per uncached prompt token is
//! a running median of (time to first token / uncached tokens) over recent streams; a
//! node's slot time is a moving average of how long its requests hold a slot. A
//! request whose home is full waits for it when the home should free a slot sooner
//! than the prefill that going elsewhere would cost. Pure but for atomics.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::facts::{RequestFacts, TokenEstimate, Turn};
use super::group::Grouping;
use super::latency::{is_base, Expectation};

/// Samples in the median.
const SAMPLES: usize = 63;
/// Until samples arrive: 100 µs per token (an 8B model on one GPU prefills ≈ 10k
/// tokens per second; the same as `mock-engine`'s default).
const DEFAULT_PER_TOKEN_NS: u32 = 100_000;
/// Until samples arrive: a base TTFT of 20 ms (one decode step and scheduling).
const DEFAULT_BASE_US: u32 = 20_000;

/// A running median of the last [`SAMPLES`] values, lock-free (a racing writer may
/// overwrite a sample; a median does not mind).
#[derive(Debug)]
struct RunningMedian {
    /// Recent samples (0 = empty).
    samples: Box<[AtomicU32]>,
    next: AtomicU32,
    median: AtomicU32,
}

impl RunningMedian {
    fn new(initial: u32) -> Self {
        RunningMedian {
            samples: (0..SAMPLES).map(|_| AtomicU32::new(0)).collect(),
            next: AtomicU32::new(0),
            median: AtomicU32::new(initial),
        }
    }

    fn push(&self, v: u32) {
        let at = self.next.fetch_add(1, Ordering::Relaxed) as usize % SAMPLES;
        self.samples[at].store(v.max(1), Ordering::Relaxed);
        let mut v: Vec<u32> = self
            .samples
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|&s| s > 0)
            .collect();
        v.sort_unstable();
        self.median.store(v[v.len() / 2], Ordering::Relaxed);
    }

    fn get(&self) -> u32 {
        self.median.load(Ordering::Relaxed)
    }

    /// Whether at least `n` samples were pushed.
    fn has(&self, n: u32) -> bool {
        self.next.load(Ordering::Relaxed) >= n
    }
}

/// Samples an estimate needs before latency is judged by it.
const LEARNED: u32 = 8;

/// A pool's prefill time per uncached token, and its base TTFT (a stream with almost
/// nothing to prefill).
#[derive(Debug)]
pub struct PrefillRate {
    /// ns per token, over streams with enough tokens to prefill (see [`is_base`]).
    per_token_ns: RunningMedian,
    /// µs, over streams with fewer.
    base_us: RunningMedian,
}

impl Default for PrefillRate {
    fn default() -> Self {
        PrefillRate {
            per_token_ns: RunningMedian::new(DEFAULT_PER_TOKEN_NS),
            base_us: RunningMedian::new(DEFAULT_BASE_US),
        }
    }
}

impl PrefillRate {
    /// One stream: its time to first token and the prompt tokens its node had to
    /// prefill before it (its own uncached ones, and those of the streams ahead of it).
    pub fn observe(&self, ttft: Duration, uncached: u32) {
        if is_base(uncached) {
            self.base_us
                .push(ttft.as_micros().min(u32::MAX as u128) as u32);
            return;
        }
        let ns = (ttft.as_nanos() / u128::from(uncached)).min(u32::MAX as u128) as u32;
        self.per_token_ns.push(ns);
    }

    pub fn per_token(&self) -> Duration {
        Duration::from_nanos(u64::from(self.per_token_ns.get()))
    }

    /// What a stream of the pool should take to its first token.
    pub fn expectation(&self) -> Expectation {
        Expectation {
            base: Duration::from_micros(u64::from(self.base_us.get())),
            per_token: self.per_token(),
            learned_base: self.base_us.has(LEARNED),
            learned_rate: self.per_token_ns.has(LEARNED),
        }
    }
}

/// A moving average of a node's slot time (weight 1/8 per request).
#[derive(Debug, Default)]
pub struct SlotTime {
    ns: AtomicU64,
}

impl SlotTime {
    pub fn observe(&self, held: Duration) {
        let new = held.as_nanos().min(u64::MAX as u128) as u64;
        let old = self.ns.load(Ordering::Relaxed);
        let avg = if old == 0 {
            new
        } else {
            old - old / 8 + new / 8
        };
        self.ns.store(avg, Ordering::Relaxed);
    }

    /// The average, if any request finished yet.
    pub fn get(&self) -> Option<Duration> {
        match self.ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }
}

/// What a spill costs, in prefills of the tokens it gives up: the prefill now, and about
/// as many tokens of other prefixes evicted from the cache of the node it lands on
/// (docs/evidence.md, "The constants behind the rules").
pub const SPILL_COST_FACTOR: u32 = 2;

/// How long a request whose home is full should wait for it: `Some(budget)` when the
/// home is expected to free a slot (`slot_time / cap` per request waiting for it,
/// this one included) sooner than a spill would cost: the prefill of the `saved` tokens
/// the home holds cached, times [`SPILL_COST_FACTOR`], plus `lane_gap` tokens (how many
/// more prompt tokens are queued for prefill at the spill's node than at the home: an
/// engine prefills one prompt at a time, so a spill waits for those queued before it);
/// `None`: spill now.
pub fn wait_budget(
    saved_tokens: u32,
    lane_gap: u32,
    per_token: Duration,
    slot_time: Option<Duration>,
    cap: u32,
    waiting: u32,
) -> Option<Duration> {
    let tokens = saved_tokens
        .saturating_mul(SPILL_COST_FACTOR)
        .saturating_add(lane_gap);
    let saving = per_token.saturating_mul(tokens);
    let slot_time = slot_time?;
    let expected = slot_time / cap.max(1) * (waiting + 1);
    (expected <= saving && !saving.is_zero()).then_some(saving)
}

/// What a request stands to lose by leaving its home, and what it should find there.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stakes {
    /// Tokens its home holds for it: a later turn's history; for a known home, at
    /// least its key's own text and as much of the prompt it last sent there as this
    /// one repeats (for a prompt string, the only sign of its history).
    pub history: u32,
    /// Tokens of its group's prefix (cached on the group's nodes only).
    pub group_tokens: u32,
    /// Tokens of its prompt above its group's prefix: its conversation's own text (for
    /// a new conversation, what a balancer that did not place it could miss).
    pub own_tokens: u32,
    /// The share of its prompt it should find cached at home (0: nothing expected).
    pub expect: f64,
    /// The share of its prompt that is its group's prefix (found on any of the
    /// group's nodes).
    pub group_share: f64,
    /// It was routed with no remembered home: a miss says another node holds it.
    pub guessed: bool,
}

impl Stakes {
    /// The stakes of a request with these `facts` (placed by `grouping`) whose home
    /// this balancer remembers, having last sent it `home_tokens` prompt tokens, or not.
    pub fn of(facts: &RequestFacts, grouping: Grouping<u64>, home_tokens: Option<u32>) -> Stakes {
        let own = facts.own_tokens();
        let t = facts.tokens;
        let history = match (home_tokens, facts.turn) {
            (Some(last), _) => t.history.max(own).max(last.min(t.prompt)),
            (None, Turn::Later) => t.history,
            (None, _) => 0,
        };
        let group_tokens = match grouping {
            Grouping::Group(_) => facts.prefix.map_or(0, |p| {
                (p.bytes / TokenEstimate::BYTES_PER_TOKEN).min(u32::MAX as usize) as u32
            }),
            _ => 0,
        };
        let expect = match (home_tokens, facts.turn) {
            _ if t.prompt == 0 => 0.0,
            (Some(_), _) => f64::from(history) / f64::from(t.prompt),
            (None, Turn::Later) if t.history > 0 => f64::from(t.history) / f64::from(t.prompt),
            (None, Turn::Later) => 1.0 - f64::from(own) / f64::from(t.prompt),
            (None, _) => 0.0,
        };
        let group_share = if t.prompt == 0 {
            0.0
        } else {
            f64::from(group_tokens) / f64::from(t.prompt)
        };
        Stakes {
            history,
            group_tokens,
            own_tokens: t.prompt.saturating_sub(group_tokens),
            expect: expect.clamp(0.0, 1.0),
            group_share: group_share.clamp(0.0, 1.0),
            guessed: home_tokens.is_none(),
        }
    }

    /// Tokens a spill to a node inside or outside the group's nodes gives up.
    pub fn saved(&self, in_group: bool) -> u32 {
        self.history + if in_group { 0 } else { self.group_tokens }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_a_median_robust_to_outliers() {
        let r = PrefillRate::default();
        assert_eq!(r.per_token(), Duration::from_micros(100), "the default");
        for _ in 0..20 {
            r.observe(Duration::from_millis(200), 1000); // 200 µs per token
        }
        r.observe(Duration::from_secs(30), 1000); // one engine stall
        r.observe(Duration::from_millis(5), 10); // too few tokens: a base sample
        assert_eq!(r.per_token(), Duration::from_micros(200));
        assert_eq!(r.expectation().base, Duration::from_millis(5));
    }

    #[test]
    fn wait_when_home_frees_sooner_than_the_prefill_saved() {
        let per = Duration::from_micros(100);
        let slot = Some(Duration::from_secs(2)); // cap 4: a slot every 0.5 s
                                                 // 10,000 tokens at 100 µs: 1 s of prefill, a spill costs 2 s.
        assert_eq!(
            wait_budget(10_000, 0, per, slot, 4, 0),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            wait_budget(10_000, 0, per, slot, 4, 3),
            Some(Duration::from_secs(2))
        );
        assert_eq!(wait_budget(10_000, 0, per, slot, 4, 4), None, "2.5 s > 2 s");
        assert_eq!(
            wait_budget(1_000, 0, per, slot, 4, 0),
            None,
            "0.5 s > 0.2 s"
        );
        assert_eq!(
            wait_budget(0, 0, per, slot, 4, 0),
            None,
            "nothing cached at home"
        );
        assert_eq!(
            wait_budget(10_000, 0, per, None, 4, 0),
            None,
            "no slot time yet"
        );
        // The spill's node has 5,000 more tokens queued for prefill: it waits 0.5 s
        // longer for its lane, so waiting at home pays sooner.
        assert_eq!(
            wait_budget(10_000, 5_000, per, slot, 4, 4),
            Some(Duration::from_millis(2_500))
        );
        assert_eq!(
            wait_budget(1_000, 5_000, per, slot, 4, 0),
            Some(Duration::from_millis(700)),
            "a small saving, but a deep lane at the spill"
        );
    }
}
