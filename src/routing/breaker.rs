//! The per-node health state machine, measured by time-to-first-token:
//! `closed → open → half_open → recovering → closed`, plus latency-staged shunting.
//! Pure: the clock is passed in (`now`), and the node's peers are summarized by the
//! caller ([`Peers`]), so every transition is tested in virtual time.
//!
//! - closed: traffic flows. `failure_threshold` consecutive failures open it. So does
//!   latency: a window in which at least `slow_ratio` of at least `min_samples`
//!   streams had a normalized TTFT ([`super::latency`]) over `slow_factor` times the
//!   peers' reference ([`Peers`]), or `slow_streams` streams in a row over
//!   `slow_factor` times what the peers do now (their latest streams), whatever the
//!   window remembers; but only while the pool's nodes out of rotation stay under
//!   `max_ejected_share`; past it the node stays in, marked degraded.
//! - open: no traffic for `open_for`; then half_open.
//! - half_open: exactly one trial request in flight; success → recovering, failure → open.
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
    /// Admitted as the one half-open trial; its outcome must be recorded.
    Trial,
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
    /// The latest normalized TTFT (0: none in the window).
    norm_latest: AtomicU32,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    /// When it entered its state (none: closed since it was made).
    since: Option<Instant>,
    consecutive_failures: u32,
    trial_in_flight: bool,
    /// Streams in a row slow against the peers' latest (see [`Peers::recent`]).
    slow_run: u32,
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

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: AtomicU8::new(BreakerState::Closed as u8),
            shunt: AtomicU32::new(0),
            degraded: AtomicBool::new(false),
            norm_p50: AtomicU32::new(0),
            norm_p90: AtomicU32::new(0),
            samples: AtomicU32::new(0),
            norm_latest: AtomicU32::new(0),
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                since: None,
                consecutive_failures: 0,
                trial_in_flight: false,
                slow_run: 0,
                window: TtftWindow::default(),
            }),
        }
    }
}

impl Breaker {
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

    /// The latest normalized TTFT judged here, while the window holds samples.
    pub fn latest(&self) -> Option<Norm> {
        let n = self.samples.load(Ordering::Relaxed);
        let latest = self.norm_latest.load(Ordering::Relaxed);
        (n > 0 && latest > 0).then_some(Norm(latest))
    }

    /// What [`Breaker::admit`] would answer now, changing nothing (for explanations).
    pub fn peek(&self, hash: u64, s: &BreakerSettings, now: Instant) -> Admission {
        if self.state() == BreakerState::Closed {
            return Admission::Admit;
        }
        let inner = self.inner.lock();
        let elapsed = inner.elapsed(now);
        match inner.state {
            BreakerState::Closed => Admission::Admit,
            BreakerState::Open if elapsed < s.open_for => Admission::Refuse,
            // Open past `open_for` turns half_open on the next ask.
            BreakerState::Open => Admission::Trial,
            BreakerState::HalfOpen if inner.trial_in_flight => Admission::Refuse,
            BreakerState::HalfOpen => Admission::Trial,
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
        if inner.state == BreakerState::Open && inner.elapsed(now) >= s.open_for {
            flip = self.enter(&mut inner, BreakerState::HalfOpen, now);
        }
        let admission = match inner.state {
            BreakerState::Closed => Admission::Admit,
            BreakerState::Open => Admission::Refuse,
            BreakerState::HalfOpen if inner.trial_in_flight => Admission::Refuse,
            BreakerState::HalfOpen => {
                inner.trial_in_flight = true;
                Admission::Trial
            }
            BreakerState::Recovering => match canary_share(s, inner.elapsed(now)) {
                None => {
                    flip = self.enter(&mut inner, BreakerState::Closed, now);
                    Admission::Admit
                }
                Some(share) if canary_point(hash) < share => Admission::Admit,
                Some(_) => Admission::Refuse,
            },
        };
        (admission, flip)
    }

    /// Records how an exchange ended, as far as errors go (latency is judged apart, by
    /// [`Breaker::observe_latency`], once the stream's work is known); `trial` says
    /// whether it was the half-open trial. Returns the state flipped to, if any.
    pub fn record(
        &self,
        outcome: Outcome,
        trial: bool,
        s: &BreakerSettings,
        now: Instant,
    ) -> Option<BreakerState> {
        let mut inner = self.inner.lock();
        if trial {
            inner.trial_in_flight = false;
        }
        match outcome {
            Outcome::Neutral => None,
            Outcome::Success => {
                inner.consecutive_failures = 0;
                match inner.state {
                    BreakerState::HalfOpen if trial => {
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
                    BreakerState::HalfOpen if trial => {
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
        self.norm_latest.store(norm.0.max(1), Ordering::Relaxed);
        if inner.state != BreakerState::Closed {
            return None;
        }
        // What the node does now, against what its peers do now: a window still full of
        // a pool-wide slowdown (every node slow, then all fast again) must not hide one
        // node that is slow alone.
        let slow_now = peers
            .recent
            .is_some_and(|recent| norm >= recent.scaled(s.slow_factor));
        inner.slow_run = if slow_now { inner.slow_run + 1 } else { 0 };
        let too_slow = inner.too_slow(peers, s) || inner.slow_run >= s.slow_streams;
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
        if passed && inner.state == BreakerState::Open && inner.elapsed(now) >= s.open_for {
            return self.enter(&mut inner, BreakerState::HalfOpen, now);
        }
        None
    }

    fn enter(&self, inner: &mut Inner, to: BreakerState, now: Instant) -> Option<BreakerState> {
        if inner.state == to {
            return None;
        }
        inner.state = to;
        inner.since = Some(now);
        inner.trial_in_flight = false;
        inner.consecutive_failures = 0;
        inner.slow_run = 0;
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
    /// Time in the current state.
    fn elapsed(&self, now: Instant) -> Duration {
        self.since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }

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
mod tests;
