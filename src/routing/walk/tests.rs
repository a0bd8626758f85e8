//! The walk's tests: orders, caps, the screen shared by `choose` and `peek`, and the
//! cap under concurrent reservations.

use super::*;
use crate::routing::latency::{Norm, Peers};
use proptest::prelude::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// `n` identical nodes of cap `cap` on 160 vnodes each.
pub(in crate::routing) fn balancer(n: usize, cap: u32, load_factor: Option<f64>) -> Balancer {
    Balancer::uniform(n, 160, cap, load_factor)
}

#[test]
fn a_grouped_walk_starts_within_the_groups_first_nodes() {
    let b = balancer(8, 1, None);
    let group = 0xfeed_u64 << 40;
    let ring: Vec<usize> = b.ring.successors(group).collect();
    let conversations: Vec<u64> = (0..400u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    for width in [1, 3, 8] {
        let mut primaries = std::collections::HashSet::new();
        for &c in &conversations {
            let t = Target {
                hash: c,
                group: Some((group, width)),
                first: None,
            };
            let walk: Vec<usize> = b.order(t).collect();
            let mut sorted = walk.clone();
            sorted.sort();
            assert_eq!(sorted, (0..8).collect::<Vec<_>>(), "each node once");
            let mut head = walk[..width].to_vec();
            head.sort();
            let mut first = ring[..width].to_vec();
            first.sort();
            assert_eq!(head, first, "the group's first {width} nodes come first");
            assert_eq!(walk[width..], ring[width..], "then the group's ring walk");
            assert_eq!(walk, b.order(t).collect::<Vec<_>>(), "deterministic");
            primaries.insert(walk[0]);
        }
        assert_eq!(
            primaries.len(),
            width,
            "conversations use all {width} nodes"
        );
    }
    // A bounded walk spills within the group first: width 2, cap 1.
    let t = Target {
        hash: 5,
        group: Some((group, 2)),
        first: None,
    };
    let first = chosen(b.choose(t, &[], Instant::now()));
    let second = chosen(b.choose(t, &[], Instant::now()));
    let third = chosen(b.choose(t, &[], Instant::now()));
    let mut pair = vec![first.index, second.index];
    pair.sort();
    let mut head = ring[..2].to_vec();
    head.sort();
    assert_eq!(pair, head);
    assert_eq!((second.distance, third.index), (1, ring[2]));
}

/// The choice of a walk that must have found a node.
pub(in crate::routing) fn chosen(w: Walk) -> Choice {
    match w {
        Walk::Chosen(c) => c,
        other => panic!("expected a node, got {other:?}"),
    }
}

/// `peek` must name the node `choose` then takes, whatever state the nodes are in.
fn assert_peek_is_choose(b: &Balancer, keys: &[u64], now: Instant, what: &str) {
    for &k in keys {
        let peeked = b.peek(k, &[], now);
        let taken = b.choose(k, &[], now);
        let found = match &taken {
            Walk::Chosen(c) => Peek::Node {
                index: c.index,
                distance: c.distance,
                shunted: c.shunted,
            },
            Walk::Saturated => Peek::Saturated,
            Walk::Unavailable => Peek::Unavailable,
        };
        assert_eq!(peeked, found, "{what}: key {k:x}");
        // Give a half-open trial back, so every key sees the same state.
        if let Walk::Chosen(c) = taken {
            if c.trial {
                c.reservation
                    .node()
                    .breaker
                    .record(Outcome::Neutral, true, &b.settings, now);
            }
        }
    }
}

#[test]
fn peek_names_the_node_choose_takes_in_every_state() {
    let b = balancer(4, 2, None);
    let s = b.settings.clone();
    let keys: Vec<u64> = (0..300u64).map(|i| xxh3_64(&i.to_le_bytes())).collect();
    let t0 = Instant::now();
    let at = |secs: u64| t0 + Duration::from_secs(secs);
    let n0 = &b.nodes[0].state().breaker;
    assert_peek_is_choose(&b, &keys, t0, "all closed");
    // Open: skipped until open_for is over.
    n0.record(Outcome::Failure, false, &s, t0);
    n0.record(Outcome::Failure, false, &s, t0);
    assert_peek_is_choose(&b, &keys, at(1), "open");
    // Past open_for: the next asker becomes the half-open trial.
    assert_peek_is_choose(&b, &keys, at(31), "open, past open_for");
    // Half-open with its trial out: refused.
    assert!(matches!(n0.admit(0, &s, at(31)).0, Admission::Trial));
    assert_peek_is_choose(&b, &keys, at(31), "half-open, trial taken");
    // Recovering: each canary step admits a share of the keys.
    n0.record(Outcome::Success, true, &s, at(31));
    assert_eq!(n0.state(), BreakerState::Recovering);
    for step in 0..4 {
        assert_peek_is_choose(&b, &keys, at(31 + 10 * step), "recovering");
    }
    // Shunting (another node): a fifth of its keys go on, by P90 normalized TTFT.
    let n1 = &b.nodes[1].state().breaker;
    let peers = Peers {
        reference: Some(Norm::EXPECTED),
        recent: None,
        may_eject: true,
    };
    for i in 0..12 {
        let norm = Norm(if i < 2 { 1000 } else { 1600 });
        n1.observe_latency(Duration::from_secs(2), norm, &peers, &s, at(80));
    }
    assert!(n1.shunt_ratio() > 0.0);
    assert_peek_is_choose(&b, &keys, at(80), "shunting");
    // Draining and at cap.
    b.nodes[2].state().set_draining(true);
    assert_peek_is_choose(&b, &keys, at(80), "draining");
    let held: Vec<Choice> = (0..2)
        .filter_map(|_| match b.choose(keys[0], &[], at(80)) {
            Walk::Chosen(c) => Some(c),
            _ => None,
        })
        .collect();
    assert_eq!(held.len(), 2);
    assert_peek_is_choose(&b, &keys[..1], at(80), "at cap");
    drop(held);
}

#[test]
fn overflow_fills_successors_in_ring_order() {
    let b = balancer(4, 4, None);
    let h = 12345;
    let order: Vec<usize> = b.ring.successors(h).collect();
    let mut held = Vec::new();
    for i in 0..16 {
        let c = chosen(b.choose(h, &[], Instant::now()));
        assert_eq!(c.index, order[i / 4], "request {i}");
        assert_eq!(c.distance, i / 4);
        held.push(c);
    }
    assert!(matches!(b.choose(h, &[], Instant::now()), Walk::Saturated));
    assert_eq!(b.load.in_flight(), 16);
    // Freeing a slot on the third node lets the next request land there.
    held.remove(9);
    assert_eq!(chosen(b.choose(h, &[], Instant::now())).index, order[2]);
    drop(held);
    assert!(b.nodes.iter().all(|m| m.state().in_flight() == 0));
}

#[test]
fn walk_skips_tried_draining_and_unhealthy_nodes() {
    let b = balancer(4, 4, None);
    let order: Vec<usize> = b.ring.successors(99).collect();
    assert_eq!(
        chosen(b.choose(99, &[order[0]], Instant::now())).index,
        order[1]
    );
    b.nodes[order[0]].state().set_draining(true);
    b.nodes[order[1]].state().set_healthy(false);
    let c = chosen(b.choose(99, &[], Instant::now()));
    assert_eq!((c.index, c.distance), (order[2], 2));
    assert!(matches!(
        b.choose(99, &order, Instant::now()),
        Walk::Unavailable
    ));
}

#[test]
fn load_factor_bounds_relative_load() {
    // c = 1.25 over 4 nodes: with nothing in flight each node may take ceil(1.25/4)=1.
    let b = balancer(4, 100, Some(1.25));
    let order: Vec<usize> = b.ring.successors(7).collect();
    let first = chosen(b.choose(7, &[], Instant::now()));
    assert_eq!(first.index, order[0]);
    // total 1 → ceil(1.25 × 2 / 4) = 1: the primary is full, spill.
    let second = chosen(b.choose(7, &[], Instant::now()));
    assert_eq!(second.index, order[1]);
}

#[test]
fn least_loaded_overcommits_the_emptiest_node() {
    let b = balancer(3, 1, None);
    let _held: Vec<Choice> = (0..3)
        .map(|_| chosen(b.choose(5, &[], Instant::now())))
        .collect();
    assert!(matches!(b.choose(5, &[], Instant::now()), Walk::Saturated));
    let extra = b.choose_least_loaded(5, &[]).unwrap();
    assert_eq!(b.nodes[extra.index].state().in_flight(), 2);
}

#[test]
fn queue_is_bounded_and_places_leave_on_drop() {
    let load: Arc<PoolLoad> = Arc::default();
    let who = || crate::routing::fair::Waiting {
        tenant: "t".into(),
        class: 0,
        weight: 1.0,
        cost: 1.0,
    };
    let a = load.enqueue(who(), 2, 2).unwrap();
    let _b = load.enqueue(who(), 2, 2).unwrap();
    assert!(load.enqueue(who(), 2, 2).is_none());
    drop(a);
    assert_eq!(load.queued(), 1);
    assert!(load.enqueue(who(), 2, 2).is_some());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn concurrent_reservations_never_exceed_caps(
        nodes in 1usize..6,
        cap in 1u32..5,
        threads in 2usize..8,
        seed in any::<u64>(),
    ) {
        let b = Arc::new(balancer(nodes, cap, None));
        let violations = Arc::new(AtomicU32::new(0));
        let handles: Vec<_> = (0..threads).map(|t| {
            let b = b.clone();
            let violations = violations.clone();
            std::thread::spawn(move || {
                let mut held: Vec<Choice> = Vec::new();
                let mut x = seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                for _ in 0..2_000 {
                    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                    if x % 3 == 0 && !held.is_empty() {
                        held.swap_remove((x as usize / 3) % held.len());
                    } else if let Walk::Chosen(c) = b.choose(x, &[], Instant::now()) {
                        held.push(c);
                    }
                    for m in b.nodes() {
                        if m.state().in_flight() > cap {
                            violations.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        }).collect();
        for h in handles {
            h.join().unwrap();
        }
        prop_assert_eq!(violations.load(Ordering::Relaxed), 0);
        prop_assert!(b.nodes.iter().all(|m| m.state().in_flight() == 0));
        prop_assert_eq!(b.load.in_flight(), 0);
    }
}
