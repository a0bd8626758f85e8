//! The per-node health state machine, measured by time-to-first-token:
//! `closed → open → half_open → recovering → closed`, plus latency-staged shunting.
//! Pure: the clock is passed in (`now`), and the node's peers are summarized by the
//! caller ([`Peers`]), so every transition is tested in virtual time.
//!
//! - closed: traffic flows. `failure_threshold` consecutive failures open it. So does
//!   latency: a window in which at least `slow_ratio` of at least `min_samples`
//!   streams had a normalized TTFT ([`super::latency`]) over `slow_factor` times the
//!   peers' reference ([`Peers`]), but only while the pool's nodes out of rotation stay
//!   under `max_ejected_share`; past it the node stays in, marked degraded.
//! - open: no traffic for `open_for`; then half_open.
//! - half_open: exactly one probe request in flight; success → recovering, failure → open.
//! - recovering (canary): admits a growing share of the node's keys, `canary_steps`
//!   each for `canary_step`, chosen by key-hash bits so the same conversations come
//!   back first and stay; any failure → open.
//! - shunting (while closed): when the window's median normalized TTFT passes a
//!   `shunt_steps` multiple (`over_pool`) of the peers' reference, that share of the
//!   node's keys (again by key-hash bits) goes to the key's next node. A node a little
//!   slow is shunted; one `slow_factor` slow is opened.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::latency::{Norm, Peers};
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
    /// Latency says open, the ejection cap says no.
    degraded: AtomicBool,
    /// The window's median and P90 normalized TTFT and its size, for peers to read
    /// without the lock.
    norm_p50: AtomicU32,
    norm_p90: AtomicU32,
    samples: AtomicU32,
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
            degraded: AtomicBool::new(false),
            norm_p50: AtomicU32::new(0),
            norm_p90: AtomicU32::new(0),
            samples: AtomicU32::new(0),
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

    /// Latency would have opened this node, but the pool's ejection cap keeps it in.
    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    /// P50 and P90 TTFT over the window, if any samples.
    pub fn ttft_quantiles(
        &self,
        s: &BreakerSettings,
        now: Instant,
    ) -> Option<(Duration, Duration)> {
        let mut inner = self.inner.lock();
        inner.window.prune(s.window, now);
        Some((
            inner.window.ttft_quantile(0.5)?,
            inner.window.ttft_quantile(0.9)?,
        ))
    }

    /// The window's median and P90 normalized TTFT as last published, when it holds at
    /// least `min_samples` (what its peers are judged against).
    pub fn summary(&self, min_samples: usize) -> Option<(Norm, Norm)> {
        let n = self.samples.load(Ordering::Relaxed) as usize;
        (n >= min_samples.max(1)).then(|| {
            (
                Norm(self.norm_p50.load(Ordering::Relaxed)),
                Norm(self.norm_p90.load(Ordering::Relaxed)),
            )
        })
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

    /// Records how an exchange ended, as far as errors go (latency is judged apart, by
    /// [`Breaker::observe_latency`], once the stream's work is known); `probe` says
    /// whether it was the half-open probe. Returns the state flipped to, if any.
    pub fn record(
        &self,
        outcome: Outcome,
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
                match inner.state {
                    BreakerState::HalfOpen if probe => {
                        self.enter(&mut inner, BreakerState::Recovering, now)
                    }
                    _ => None,
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

    /// Judges one successful stream's latency: its raw `ttft` (kept for operators) and
    /// its normalized TTFT, against the node's `peers`. A closed node too slow for its
    /// peers opens, if `peers.may_eject`, or is marked degraded; otherwise its P90 sets
    /// the shunted share. Returns the state flipped to, if any.
    pub fn observe_latency(
        &self,
        ttft: Duration,
        norm: Norm,
        peers: &Peers,
        s: &BreakerSettings,
        now: Instant,
    ) -> Option<BreakerState> {
        let mut inner = self.inner.lock();
        if !matches!(inner.state, BreakerState::Closed | BreakerState::Recovering) {
            // Streams sent before it opened: stale evidence either way.
            return None;
        }
        inner.window.push(now, ttft, norm);
        inner.window.prune(s.window, now);
        self.publish(&inner);
        if inner.state != BreakerState::Closed {
            return None;
        }
        let too_slow = inner.too_slow(peers, s);
        self.degraded
            .store(too_slow && !peers.may_eject, Ordering::Relaxed);
        if too_slow && peers.may_eject {
            return self.enter(&mut inner, BreakerState::Open, now);
        }
        self.update_shunt(&inner, peers, s);
        None
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
            self.publish(inner);
        }
        self.state.store(to as u8, Ordering::Release);
        self.shunt.store(0, Ordering::Relaxed);
        self.degraded.store(false, Ordering::Relaxed);
        Some(to)
    }

    fn publish(&self, inner: &Inner) {
        let w = &inner.window;
        let q = |q| w.norm_quantile(q).unwrap_or_default().0;
        self.norm_p50.store(q(0.5), Ordering::Relaxed);
        self.norm_p90.store(q(0.9), Ordering::Relaxed);
        self.samples
            .store(w.len().min(u32::MAX as usize) as u32, Ordering::Relaxed);
    }

    fn update_shunt(&self, inner: &Inner, peers: &Peers, s: &BreakerSettings) {
        let ratio = match (inner.window.norm_quantile(0.5), peers.reference) {
            (Some(p50), Some(pool)) if inner.window.len() >= s.min_samples => s
                .shunt_steps
                .iter()
                .filter(|step| p50 >= pool.scaled(step.over_pool))
                .map(|step| step.divert)
                .fold(0.0, f64::max),
            _ => 0.0,
        };
        self.shunt
            .store((ratio * 65536.0) as u32, Ordering::Relaxed);
    }
}

impl Inner {
    /// At least `slow_ratio` of at least `min_samples` streams were over `slow_factor`
    /// times the peers' reference; never without peers to compare with.
    fn too_slow(&self, peers: &Peers, s: &BreakerSettings) -> bool {
        let n = self.window.len();
        let Some(pool) = peers.reference else {
            return false;
        };
        n >= s.min_samples.max(1)
            && self.window.norm_above(pool.scaled(s.slow_factor)) as f64 / n as f64 >= s.slow_ratio
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
        assert_eq!(b.record(Outcome::Failure, false, s, t0), None);
        assert_eq!(
            b.record(Outcome::Failure, false, s, t0),
            Some(BreakerState::Open)
        );
    }

    #[test]
    fn consecutive_failures_open_and_success_resets_the_count() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        b.record(Outcome::Failure, false, &s, t0);
        b.record(Outcome::Success, false, &s, t0);
        assert_eq!(
            b.record(Outcome::Failure, false, &s, t0),
            None,
            "the count was reset"
        );
        assert_eq!(b.record(Outcome::Neutral, false, &s, t0), None);
        assert_eq!(
            b.record(Outcome::Failure, false, &s, t0),
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
            b.record(Outcome::Success, true, &s, t1),
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
            b.record(Outcome::Failure, true, &s, t1),
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
        b.record(Outcome::Neutral, true, &s, t1);
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
        b.record(Outcome::Success, true, &s, t1);
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
        b.record(Outcome::Success, true, &s, t1);
        assert_eq!(
            b.record(Outcome::Failure, false, &s, t1 + secs(12)),
            Some(BreakerState::Open)
        );
        assert_eq!(
            b.admit(key(0.01, 0.0), &s, t1 + secs(13)).0,
            Admission::Refuse
        );
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Peers whose P90 is as expected.
    fn healthy_peers(may_eject: bool) -> Peers {
        Peers {
            reference: Some(Norm::EXPECTED),
            may_eject,
        }
    }

    #[test]
    fn slow_for_its_peers_shunts_then_opens() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        let peers = healthy_peers(true);
        // 10 streams as expected: nothing happens, however long they took.
        for i in 0..10 {
            let flip = b.observe_latency(secs(20), Norm(1100), &peers, &s, t0 + ms(i));
            assert_eq!(flip, None);
        }
        assert_eq!(b.shunt_ratio(), 0.0);
        assert_eq!(b.summary(10), Some((Norm(1100), Norm(1100))));
        // The median passes 1.5× the peers' reference: 20 % of keys shunted, by their
        // own bits; at 2×, half.
        for i in 0..12 {
            b.observe_latency(ms(900), Norm(1600), &peers, &s, t0 + secs(1) + ms(i));
        }
        assert!((b.shunt_ratio() - 0.2).abs() < 1e-3, "{}", b.shunt_ratio());
        assert!(b.shunts(key(0.0, 0.1)));
        assert!(!b.shunts(key(0.0, 0.3)));
        assert_eq!(
            b.admit(key(0.0, 0.1), &s, t0 + secs(1)).0,
            Admission::Admit,
            "shunting is not refusal"
        );
        for i in 0..30 {
            b.observe_latency(ms(900), Norm(2200), &peers, &s, t0 + secs(2) + ms(i));
        }
        assert!((b.shunt_ratio() - 0.5).abs() < 1e-3, "{}", b.shunt_ratio());
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "2.2× is shunted, not opened"
        );
        // More than half over 3× the peers' reference: open.
        let mut flip = None;
        for i in 0..60 {
            let at = t0 + secs(3) + ms(i);
            flip = flip.or(b.observe_latency(ms(900), Norm(4000), &peers, &s, at));
        }
        assert_eq!(flip, Some(BreakerState::Open));
        assert_eq!(b.shunt_ratio(), 0.0);
        assert_eq!(b.summary(1), None, "the evidence is cleared");
    }

    #[test]
    fn as_slow_as_its_peers_is_not_slow() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        let peers = Peers {
            reference: Some(Norm(5500)),
            may_eject: true,
        };
        for i in 0..40 {
            let flip =
                b.observe_latency(secs(5), Norm(5000 + 20 * i), &peers, &s, t0 + ms(i as u64));
            assert_eq!(flip, None);
        }
        assert_eq!(b.shunt_ratio(), 0.0);
        // With no peer to compare with, nothing is judged either.
        let alone = Peers::default();
        for i in 0..40 {
            assert_eq!(
                b.observe_latency(secs(5), Norm(9000), &alone, &s, t0 + secs(1) + ms(i)),
                None
            );
        }
        assert_eq!((b.state(), b.shunt_ratio()), (BreakerState::Closed, 0.0));
    }

    #[test]
    fn past_the_ejection_cap_a_slow_node_stays_in_degraded() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        for i in 0..12 {
            let flip =
                b.observe_latency(secs(3), Norm(6000), &healthy_peers(false), &s, t0 + ms(i));
            assert_eq!(flip, None);
        }
        assert!(b.is_degraded());
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.shunt_ratio() >= 0.5, "still shunted");
        // Once a node of the pool comes back, the cap allows it: it opens.
        let flip = b.observe_latency(secs(3), Norm(6000), &healthy_peers(true), &s, t0 + secs(1));
        assert_eq!(flip, Some(BreakerState::Open));
        assert!(!b.is_degraded());
    }

    #[test]
    fn samples_leave_the_window() {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::new(t0);
        let peers = healthy_peers(true);
        for _ in 0..9 {
            b.observe_latency(secs(5), Norm(9000), &peers, &s, t0);
        }
        // 61 s later the old slow samples no longer count: one more does not trip.
        assert_eq!(
            b.observe_latency(secs(5), Norm(9000), &peers, &s, t0 + secs(61)),
            None
        );
        assert_eq!(b.ttft_quantiles(&s, t0 + secs(61)).unwrap().1, secs(5));
        assert_eq!(b.summary(1), Some((Norm(9000), Norm(9000))));
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
                        b.record(Outcome::Neutral, true, &s, now);
                        probes_in_flight -= 1;
                    }
                    3 if probes_in_flight > 0 => {
                        b.record(Outcome::Failure, true, &s, now);
                        probes_in_flight -= 1;
                    }
                    _ => {}
                }
                prop_assert!(probes_in_flight <= 1);
            }
        }
    }
}
