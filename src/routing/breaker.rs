//! The per-node health state machine, measured by time-to-first-token:
//! `closed → open → half_open → recovering → closed`, plus latency-staged shunting.
//! Pure: the clock is passed in (`now`), so every transition is tested in virtual time.
//!
//! - closed: traffic flows. `failure_threshold` consecutive failures, or a window in
//!   which at least `slow_ratio` of at least `min_samples` streams had TTFT over
//!   `slow_ttft`, open it.
//! - open: no traffic for `open_for`; then half_open.
//! - half_open: exactly one probe request in flight; success → recovering, failure → open.
//! - recovering (canary): admits a growing share of the node's keys, `canary_steps`
//!   each for `canary_step`, chosen by key-hash bits so the same conversations come
//!   back first and stay; any failure → open.
//! - shunting (while closed): when the window's P90 TTFT passes a `shunt_steps`
//!   threshold, that share of the node's keys (again by key-hash bits) goes to the
//!   key's next node.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::ttft_window::TtftWindow;

pub use crate::config::{BreakerSettings, ShuntStep};

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
    Recovering = 3,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Recovering => "recovering",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => BreakerState::Open,
            2 => BreakerState::HalfOpen,
            3 => BreakerState::Recovering,
            _ => BreakerState::Closed,
        }
    }
}

/// How one exchange with the node ended, as far as its health goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It served (or answered 4xx: the client's fault, the node is fine).
    Success,
    /// Transport error, 5xx, first-token timeout, empty stream, mid-stream error.
    Failure,
    /// Says nothing about health: 429 (busy) or the client left first.
    Neutral,
}

/// Whether a node may take a request for a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admit,
    /// Admitted as the one half-open probe; its outcome must be recorded.
    Probe,
    Refuse,
}

/// A node's breaker.
#[derive(Debug)]
pub struct Breaker {
    /// Mirror of `inner.state` for the lock-free fast path.
    state: AtomicU8,
    /// Share of keys currently shunted, in 1/65536.
    shunt: AtomicU32,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    since: Instant,
    consecutive_failures: u32,
    probe_in_flight: bool,
    window: TtftWindow,
}

/// A key's position in [0, 1) for canary admission (low bits of its hash).
fn canary_point(hash: u64) -> f64 {
    (hash & 0xFFFF) as f64 / 65536.0
}

/// The share of keys a recovering node admits `elapsed` after it started recovering;
/// `None` once the ramp is over.
fn canary_share(s: &BreakerSettings, elapsed: Duration) -> Option<f64> {
    let step = elapsed.as_nanos() / s.canary_step.as_nanos().max(1);
    s.canary_steps.get(step as usize).copied()
}

/// A key's position in [0, 65536) for shunting (other bits than the canary's).
fn shunt_point(hash: u64) -> u32 {
    ((hash >> 16) & 0xFFFF) as u32
}

impl Breaker {
    pub fn new(now: Instant) -> Self {
        Breaker {
            state: AtomicU8::new(BreakerState::Closed as u8),
            shunt: AtomicU32::new(0),
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                since: now,
                consecutive_failures: 0,
                probe_in_flight: false,
                window: TtftWindow::default(),
            }),
        }
    }

    pub fn state(&self) -> BreakerState {
        BreakerState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Share of this node's keys currently diverted by shunting.
    pub fn shunt_ratio(&self) -> f64 {
        self.shunt.load(Ordering::Relaxed) as f64 / 65536.0
    }

    /// Whether shunting diverts this key away from the node now.
    pub fn shunts(&self, hash: u64) -> bool {
        shunt_point(hash) < self.shunt.load(Ordering::Relaxed)
    }

    /// P50 and P90 TTFT over the window, if any samples.
    pub fn ttft_quantiles(
        &self,
        s: &BreakerSettings,
        now: Instant,
    ) -> Option<(Duration, Duration)> {
        let mut inner = self.inner.lock();
        inner.window.prune(s.window, now);
        Some((inner.window.quantile(0.5)?, inner.window.quantile(0.9)?))
    }

    /// What [`Breaker::admit`] would answer now, changing nothing (for explanations).
    pub fn peek(&self, hash: u64, s: &BreakerSettings, now: Instant) -> Admission {
        if self.state() == BreakerState::Closed {
            return Admission::Admit;
        }
        let inner = self.inner.lock();
        let elapsed = now.saturating_duration_since(inner.since);
        match inner.state {
            BreakerState::Closed => Admission::Admit,
            BreakerState::Open if elapsed < s.open_for => Admission::Refuse,
            // Open past `open_for` turns half_open on the next ask.
            BreakerState::Open => Admission::Probe,
            BreakerState::HalfOpen if inner.probe_in_flight => Admission::Refuse,
            BreakerState::HalfOpen => Admission::Probe,
            BreakerState::Recovering => match canary_share(s, elapsed) {
                Some(share) if canary_point(hash) >= share => Admission::Refuse,
                _ => Admission::Admit,
            },
        }
    }

    /// Asks whether the node may take a request for `hash`; returns the state it
    /// flipped to, if asking moved it (open → half_open, recovering → closed).
    pub fn admit(
        &self,
        hash: u64,
        s: &BreakerSettings,
        now: Instant,
    ) -> (Admission, Option<BreakerState>) {
        if self.state() == BreakerState::Closed {
            return (Admission::Admit, None);
        }
        let mut inner = self.inner.lock();
        let mut flip = None;
        if inner.state == BreakerState::Open
            && now.saturating_duration_since(inner.since) >= s.open_for
        {
            flip = self.enter(&mut inner, BreakerState::HalfOpen, now);
        }
        let admission = match inner.state {
            BreakerState::Closed => Admission::Admit,
            BreakerState::Open => Admission::Refuse,
            BreakerState::HalfOpen if inner.probe_in_flight => Admission::Refuse,
            BreakerState::HalfOpen => {
                inner.probe_in_flight = true;
                Admission::Probe
            }
            BreakerState::Recovering => {
                match canary_share(s, now.saturating_duration_since(inner.since)) {
                    None => {
                        flip = self.enter(&mut inner, BreakerState::Closed, now);
                        Admission::Admit
                    }
                    Some(share) if canary_point(hash) < share => Admission::Admit,
                    Some(_) => Admission::Refuse,
                }
            }
        };
        (admission, flip)
    }

    /// Records how an exchange ended. `ttft` is given for streams that produced a
    /// first token; `probe` says whether it was the half-open probe. Returns the state
    /// flipped to, if any.
    pub fn record(
        &self,
        outcome: Outcome,
        ttft: Option<Duration>,
        probe: bool,
        s: &BreakerSettings,
        now: Instant,
    ) -> Option<BreakerState> {
        let mut inner = self.inner.lock();
        if probe {
            inner.probe_in_flight = false;
        }
        match outcome {
            Outcome::Neutral => None,
            Outcome::Success => {
                inner.consecutive_failures = 0;
                if let Some(t) = ttft {
                    inner.window.push(now, t);
                }
                inner.window.prune(s.window, now);
                match inner.state {
                    BreakerState::HalfOpen if probe => {
                        self.enter(&mut inner, BreakerState::Recovering, now)
                    }
                    BreakerState::Closed if inner.too_slow(s) => {
                        self.enter(&mut inner, BreakerState::Open, now)
                    }
                    _ => {
                        self.update_shunt(&inner, s);
                        None
                    }
                }
            }
            Outcome::Failure => {
                inner.consecutive_failures += 1;
                match inner.state {
                    BreakerState::Closed if inner.consecutive_failures >= s.failure_threshold => {
                        self.enter(&mut inner, BreakerState::Open, now)
                    }
                    BreakerState::HalfOpen if probe => {
                        self.enter(&mut inner, BreakerState::Open, now)
                    }
                    BreakerState::Recovering => self.enter(&mut inner, BreakerState::Open, now),
                    _ => None,
                }
            }
        }
    }

    /// An active health check answered. A passing check moves an open breaker whose
    /// `open_for` is over to half_open, so recovery starts even with no traffic.
    pub fn on_health_check(
        &self,
        passed: bool,
        s: &BreakerSettings,
        now: Instant,
    ) -> Option<BreakerState> {
        let mut inner = self.inner.lock();
        if passed
            && inner.state == BreakerState::Open
            && now.saturating_duration_since(inner.since) >= s.open_for
        {
            return self.enter(&mut inner, BreakerState::HalfOpen, now);
        }
        None
    }

    fn enter(&self, inner: &mut Inner, to: BreakerState, now: Instant) -> Option<BreakerState> {
        if inner.state == to {
            return None;
        }
        inner.state = to;
        inner.since = now;
        inner.probe_in_flight = false;
        inner.consecutive_failures = 0;
        if to == BreakerState::Open {
            // The evidence that opened it must not re-open it after recovery.
            inner.window.clear();
        }
        self.state.store(to as u8, Ordering::Release);
        self.shunt.store(0, Ordering::Relaxed);
        Some(to)
    }

    fn update_shunt(&self, inner: &Inner, s: &BreakerSettings) {
        let p90 = match inner.window.quantile(0.9) {
            Some(p90)
                if inner.state == BreakerState::Closed && inner.window.len() >= s.min_samples =>
            {
                Some(p90)
            }
            _ => None,
        };
        let ratio = if let Some(p90) = p90 {
            s.shunt_steps
                .iter()
                .filter(|step| p90 >= step.p90)
                .map(|step| step.divert)
                .fold(0.0, f64::max)
        } else {
            0.0
        };
        self.shunt
            .store((ratio * 65536.0) as u32, Ordering::Relaxed);
    }
}

impl Inner {
    fn too_slow(&self, s: &BreakerSettings) -> bool {
        let n = self.window.len();
        n >= s.min_samples.max(1)
            && self.window.slower_than(s.slow_ttft) as f64 / n as f64 >= s.slow_ratio
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn settings() -> BreakerSettings {
        BreakerSettings::default()
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// A key whose canary point is `p` (low 16 bits) and shunt point `q`.
    fn key(p: f64, q: f64) -> u64 {
        ((q * 65536.0) as u64) << 16 | (p * 65536.0) as u64
    }

    fn open_it(b: &Breaker, s: &BreakerSettings, t0: Instant) {
        assert_eq!(b.record(Outcome::Failure, None, false, s, t0), None);
        assert_eq!(
            b.record(Outcome::Failure, None, false, s, t0),
            Some(BreakerState::Open)
        );
    }

    #[test]
    fn consecutive_failures_open_and_success_resets_the_count() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        b.record(Outcome::Failure, None, false, &s, t0);
        b.record(Outcome::Success, None, false, &s, t0);
        assert_eq!(
            b.record(Outcome::Failure, None, false, &s, t0),
            None,
            "the count was reset"
        );
        assert_eq!(b.record(Outcome::Neutral, None, false, &s, t0), None);
        assert_eq!(
            b.record(Outcome::Failure, None, false, &s, t0),
            Some(BreakerState::Open)
        );
        assert_eq!(b.admit(1, &s, t0 + secs(29)).0, Admission::Refuse);
    }

    #[test]
    fn after_open_for_exactly_one_probe_goes_and_its_success_starts_the_canary() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        open_it(&b, &s, t0);
        let t1 = t0 + secs(30);
        assert_eq!(
            b.admit(1, &s, t1),
            (Admission::Probe, Some(BreakerState::HalfOpen))
        );
        assert_eq!(
            b.admit(2, &s, t1).0,
            Admission::Refuse,
            "one probe at a time"
        );
        assert_eq!(
            b.record(
                Outcome::Success,
                Some(Duration::from_millis(100)),
                true,
                &s,
                t1
            ),
            Some(BreakerState::Recovering)
        );
    }

    #[test]
    fn a_failed_probe_reopens() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        open_it(&b, &s, t0);
        let t1 = t0 + secs(30);
        assert_eq!(b.admit(1, &s, t1).0, Admission::Probe);
        assert_eq!(
            b.record(Outcome::Failure, None, true, &s, t1),
            Some(BreakerState::Open)
        );
        assert_eq!(b.admit(1, &s, t1 + secs(29)).0, Admission::Refuse);
        assert_eq!(b.admit(1, &s, t1 + secs(30)).0, Admission::Probe);
    }

    #[test]
    fn an_abandoned_probe_frees_the_slot() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        open_it(&b, &s, t0);
        let t1 = t0 + secs(30);
        assert_eq!(b.admit(1, &s, t1).0, Admission::Probe);
        b.record(Outcome::Neutral, None, true, &s, t1);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.admit(2, &s, t1).0, Admission::Probe);
    }

    #[test]
    fn canary_ramp_admits_growing_shares_of_the_same_keys() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        open_it(&b, &s, t0);
        let t1 = t0 + secs(30);
        b.admit(0, &s, t1);
        b.record(Outcome::Success, None, true, &s, t1);
        let admitted = |at: Instant| {
            (0..1000)
                .filter(|i| {
                    b.admit(key((*i as f64 + 0.5) / 1000.0, 0.0), &s, at).0 == Admission::Admit
                })
                .count()
        };
        assert_eq!(admitted(t1), 100);
        assert_eq!(admitted(t1 + secs(10)), 300);
        assert_eq!(admitted(t1 + secs(20)), 700);
        assert_eq!(admitted(t1 + secs(30)), 1000);
        assert_eq!(b.state(), BreakerState::Recovering);
        // The first 10 % stay admitted at every step: they are the same conversations.
        assert_eq!(
            b.admit(key(0.05, 0.0), &s, t1 + secs(5)).0,
            Admission::Admit
        );
        assert_eq!(
            b.admit(key(0.5, 0.0), &s, t1 + secs(40)),
            (Admission::Admit, Some(BreakerState::Closed))
        );
    }

    #[test]
    fn a_failure_during_the_ramp_reopens() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        open_it(&b, &s, t0);
        let t1 = t0 + secs(30);
        b.admit(0, &s, t1);
        b.record(Outcome::Success, None, true, &s, t1);
        assert_eq!(
            b.record(Outcome::Failure, None, false, &s, t1 + secs(12)),
            Some(BreakerState::Open)
        );
        assert_eq!(
            b.admit(key(0.01, 0.0), &s, t1 + secs(13)).0,
            Admission::Refuse
        );
    }

    #[test]
    fn slow_ttft_shunts_then_opens() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        // 10 fast streams: nothing happens.
        for i in 0..10 {
            assert_eq!(
                b.record(
                    Outcome::Success,
                    Some(Duration::from_millis(500)),
                    false,
                    &s,
                    t0 + Duration::from_millis(i)
                ),
                None
            );
        }
        assert_eq!(b.shunt_ratio(), 0.0);
        // P90 passes 2 s (2 of 12 at 2.2 s): 20 % of keys shunted, by their own bits.
        b.record(
            Outcome::Success,
            Some(Duration::from_millis(2200)),
            false,
            &s,
            t0 + secs(1),
        );
        b.record(
            Outcome::Success,
            Some(Duration::from_millis(2200)),
            false,
            &s,
            t0 + secs(1),
        );
        assert!((b.shunt_ratio() - 0.2).abs() < 1e-3, "{}", b.shunt_ratio());
        assert!(b.shunts(key(0.0, 0.1)));
        assert!(!b.shunts(key(0.0, 0.3)));
        assert_eq!(
            b.admit(key(0.0, 0.1), &s, t0 + secs(1)).0,
            Admission::Admit,
            "shunting is not refusal"
        );
        // More than half slow over 3 s: open.
        let mut flip = None;
        for i in 0..12 {
            flip = flip.or(b.record(
                Outcome::Success,
                Some(Duration::from_millis(4000)),
                false,
                &s,
                t0 + secs(2) + Duration::from_millis(i),
            ));
        }
        assert_eq!(flip, Some(BreakerState::Open));
        assert_eq!(b.shunt_ratio(), 0.0);
    }

    #[test]
    fn samples_leave_the_window() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        for _ in 0..9 {
            b.record(Outcome::Success, Some(secs(5)), false, &s, t0);
        }
        // 61 s later the old slow samples no longer count: one more does not trip.
        assert_eq!(
            b.record(Outcome::Success, Some(secs(5)), false, &s, t0 + secs(61)),
            None
        );
        assert_eq!(b.ttft_quantiles(&s, t0 + secs(61)).unwrap().1, secs(5));
    }

    #[test]
    fn health_checks_move_open_to_half_open_after_open_for() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        open_it(&b, &s, t0);
        assert_eq!(b.on_health_check(true, &s, t0 + secs(10)), None);
        assert_eq!(b.on_health_check(false, &s, t0 + secs(31)), None);
        assert_eq!(
            b.on_health_check(true, &s, t0 + secs(31)),
            Some(BreakerState::HalfOpen)
        );
    }

    proptest! {
        #[test]
        fn half_open_never_admits_two_probes(ops in proptest::collection::vec((0u8..4, any::<u64>()), 1..200)) {
            let (s, t0) = (settings(), Instant::now());
            let b = Breaker::new(t0);
            open_it(&b, &s, t0);
            let now = t0 + secs(30);
            let mut probes_in_flight = 0;
            for (op, h) in ops {
                match op {
                    0 | 1 if b.admit(h, &s, now).0 == Admission::Probe => probes_in_flight += 1,
                    2 if probes_in_flight > 0 => {
                        b.record(Outcome::Neutral, None, true, &s, now);
                        probes_in_flight -= 1;
                    }
                    3 if probes_in_flight > 0 => {
                        b.record(Outcome::Failure, None, true, &s, now);
                        probes_in_flight -= 1;
                    }
                    _ => {}
                }
                prop_assert!(probes_in_flight <= 1);
            }
        }
    }
}
