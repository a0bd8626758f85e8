//! The breaker's tests, in virtual time: every transition, the canary, shunting, the ejection cap.

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
    let b = Breaker::default();
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
fn after_open_for_exactly_one_trial_goes_and_its_success_starts_the_canary() {
    let (s, t0) = (settings(), Instant::now());
    let b = Breaker::default();
    open_it(&b, &s, t0);
    let t1 = t0 + secs(30);
    assert_eq!(
        b.admit(1, &s, t1),
        (Admission::Trial, Some(BreakerState::HalfOpen))
    );
    assert_eq!(
        b.admit(2, &s, t1).0,
        Admission::Refuse,
        "one trial at a time"
    );
    assert_eq!(
        b.record(Outcome::Success, true, &s, t1),
        Some(BreakerState::Recovering)
    );
}

#[test]
fn a_failed_trial_reopens() {
    let (s, t0) = (settings(), Instant::now());
    let b = Breaker::default();
    open_it(&b, &s, t0);
    let t1 = t0 + secs(30);
    assert_eq!(b.admit(1, &s, t1).0, Admission::Trial);
    assert_eq!(
        b.record(Outcome::Failure, true, &s, t1),
        Some(BreakerState::Open)
    );
    assert_eq!(b.admit(1, &s, t1 + secs(29)).0, Admission::Refuse);
    assert_eq!(b.admit(1, &s, t1 + secs(30)).0, Admission::Trial);
}

#[test]
fn an_abandoned_trial_frees_the_slot() {
    let (s, t0) = (settings(), Instant::now());
    let b = Breaker::default();
    open_it(&b, &s, t0);
    let t1 = t0 + secs(30);
    assert_eq!(b.admit(1, &s, t1).0, Admission::Trial);
    b.record(Outcome::Neutral, true, &s, t1);
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert_eq!(b.admit(2, &s, t1).0, Admission::Trial);
}

#[test]
fn canary_ramp_admits_growing_shares_of_the_same_keys() {
    let (s, t0) = (settings(), Instant::now());
    let b = Breaker::default();
    open_it(&b, &s, t0);
    let t1 = t0 + secs(30);
    b.admit(0, &s, t1);
    b.record(Outcome::Success, true, &s, t1);
    let admitted = |at: Instant| {
        (0..1000)
            .filter(|i| b.admit(key((*i as f64 + 0.5) / 1000.0, 0.0), &s, at).0 == Admission::Admit)
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
    let b = Breaker::default();
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
        recent: None,
        may_eject,
    }
}

#[test]
fn slow_for_its_peers_shunts_then_opens() {
    let (s, t0) = (settings(), Instant::now());
    let b = Breaker::default();
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
    let b = Breaker::default();
    let peers = Peers {
        reference: Some(Norm(5500)),
        recent: None,
        may_eject: true,
    };
    for i in 0..40 {
        let flip = b.observe_latency(secs(5), Norm(5000 + 20 * i), &peers, &s, t0 + ms(i as u64));
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
    let b = Breaker::default();
    for i in 0..12 {
        let flip = b.observe_latency(secs(3), Norm(6000), &healthy_peers(false), &s, t0 + ms(i));
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
    let b = Breaker::default();
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
    let b = Breaker::default();
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
    fn half_open_never_admits_two_trials(ops in proptest::collection::vec((0u8..4, any::<u64>()), 1..200)) {
        let (s, t0) = (settings(), Instant::now());
        let b = Breaker::default();
        open_it(&b, &s, t0);
        let now = t0 + secs(30);
        let mut trials_in_flight = 0;
        for (op, h) in ops {
            match op {
                0 | 1 if b.admit(h, &s, now).0 == Admission::Trial => trials_in_flight += 1,
                2 if trials_in_flight > 0 => {
                    b.record(Outcome::Neutral, true, &s, now);
                    trials_in_flight -= 1;
                }
                3 if trials_in_flight > 0 => {
                    b.record(Outcome::Failure, true, &s, now);
                    trials_in_flight -= 1;
                }
                _ => {}
            }
            prop_assert!(trials_in_flight <= 1);
        }
    }
}

#[test]
fn slow_streams_in_a_row_open_it_whatever_the_window_holds() {
    // The window remembers a pool-wide slowdown (every node 35x for a minute): against
    // its peers' P90 of the same minute, a node slow alone again looks fine. Against
    // what its peers do now, it is 35x: five such streams in a row open it.
    let (s, t0) = (settings(), Instant::now());
    let b = Breaker::default();
    let remembered = Peers {
        reference: Some(Norm(35_000)),
        recent: Some(Norm(35_000)),
        may_eject: true,
    };
    for i in 0..30 {
        let flip = b.observe_latency(secs(4), Norm(35_000), &remembered, &s, t0 + ms(i));
        assert_eq!(flip, None, "the pool-wide slowdown opens nothing");
    }
    let recovered = Peers {
        recent: Some(Norm::EXPECTED),
        ..remembered
    };
    for i in 0..4 {
        let flip = b.observe_latency(secs(4), Norm(35_000), &recovered, &s, t0 + ms(100 + i));
        assert_eq!(flip, None, "stream {i}");
    }
    // One stream as fast as the peers breaks the run.
    b.observe_latency(ms(50), Norm::EXPECTED, &recovered, &s, t0 + ms(110));
    for i in 0..4 {
        assert_eq!(
            b.observe_latency(secs(4), Norm(35_000), &recovered, &s, t0 + ms(120 + i)),
            None
        );
    }
    assert_eq!(
        b.observe_latency(secs(4), Norm(35_000), &recovered, &s, t0 + ms(130)),
        Some(BreakerState::Open),
        "the fifth in a row"
    );
    // Past the ejection cap it stays in, degraded.
    let c = Breaker::default();
    let capped = Peers {
        may_eject: false,
        ..recovered
    };
    for i in 0..5 {
        assert_eq!(
            c.observe_latency(secs(4), Norm(35_000), &capped, &s, t0 + ms(i)),
            None
        );
    }
    assert!(c.is_degraded());
}
