//! Placement's tests: a new conversation's first node, and a guessed home corrected
//! after a miss.

use super::*;
use crate::routing::walk::tests::{balancer, chosen};
use std::time::Instant;

/// A key of a group as wide as the pool, with no home yet, and its first two nodes
/// (where a new conversation of it is placed).
fn grouped_key(b: &Balancer) -> (Target, Vec<usize>) {
    let target = Target {
        hash: 0xabcd_u64 << 32,
        group: Some((0xfeed_u64 << 40, b.nodes.len())),
        first: None,
    };
    (target, b.key_order(target).take(2).collect())
}

/// `n` other conversations made their home on `node` lately.
fn homes_on(b: &Balancer, node: usize, n: u64) {
    for i in 1..=n {
        b.remember(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), node, 1000);
    }
}

#[test]
fn a_guessed_home_that_finds_only_its_groups_prefix_flips_to_the_other_choice() {
    let b = balancer(8, 4, None);
    let (target, pair) = grouped_key(&b);
    let expecting = |expect, group_share| Stakes {
        expect,
        group_share,
        history: 9_000,
        ..Stakes::default()
    };
    // 90 % expected, 75 % of it the group's prefix (cached on every node of the
    // group): finding 76 % is finding none of the history. Without the floor (half
    // of 90 %) that is a hit; alone, a balancer judges so (its guesses are
    // forgotten homes, not another replica's placements).
    b.rehome(target, pair[0], &expecting(0.9, 0.0), 0.76);
    assert_eq!(b.home_of(target.hash), None, "no floor: 76 % ≥ 45 %");
    b.rehome(target, pair[0], &expecting(0.9, 0.75), 0.76);
    assert_eq!(b.home_of(target.hash), None, "one replica: no floor");
    b.load().set_replicas(2);
    b.rehome(target, pair[0], &expecting(0.9, 0.75), 0.76);
    assert_eq!(
        b.home_of(target.hash),
        Some(Home {
            index: pair[1],
            tokens: 8_960
        }),
        "the other choice, holding the history expected (in steps of 64)"
    );
    // Found most of the history above the floor: the guess was right.
    let other = Target {
        hash: 0x1234_u64 << 32,
        ..target
    };
    let first = b.key_order(other).next().unwrap();
    b.rehome(other, first, &expecting(0.9, 0.75), 0.86);
    assert_eq!(b.home_of(other.hash), None);
    // Too little above the floor to judge (estimates are rough): no flip.
    b.rehome(other, first, &expecting(0.8, 0.75), 0.5);
    assert_eq!(b.home_of(other.hash), None);
}

#[test]
fn with_replicas_a_first_node_piled_with_homes_loses_its_margin() {
    let b = balancer(8, 4, None);
    b.load().set_replicas(2);
    let (target, pair) = grouped_key(&b);
    // One request in flight on the key's first node, none on the other choice:
    // within the replica margin, so a new conversation stays on its key's first.
    let at_first = Target {
        first: Some(pair[0]),
        ..target
    };
    let held = chosen(b.choose(at_first, &[], Instant::now()));
    assert_eq!(held.index, pair[0]);
    let large = SMALL_OPENING_TOKENS + 1;
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[0]));
    // Five conversations made their home there lately (none elsewhere): piled up,
    // so the less loaded node takes the new one.
    homes_on(&b, pair[0], 5);
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[1]));
    drop(held);
}

#[test]
fn an_opening_goes_where_fewer_conversations_live_lately() {
    let b = balancer(8, 4, None);
    let (target, pair) = grouped_key(&b);
    let (small, large) = (SMALL_OPENING_TOKENS, SMALL_OPENING_TOKENS + 1);
    // A request in flight on the other choice, none on the key's first: by load,
    // the key's first, whatever the opening.
    let at_other = Target {
        first: Some(pair[1]),
        ..target
    };
    let held = chosen(b.choose(at_other, &[], Instant::now()));
    assert_eq!(held.index, pair[1]);
    assert_eq!(b.first_of(target, None, Turn::First, small), Some(pair[0]));
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[0]));
    // Two conversations made their home on the key's first node lately: alone, an
    // opening goes where fewer live, among all the group's nodes (to one that neither
    // is a home lately nor holds a request), whatever its size.
    homes_on(&b, pair[0], 2);
    for opening in [small, large] {
        let goes = b.first_of(target, None, Turn::First, opening).unwrap();
        assert!(!pair.contains(&goes), "{opening}: {goes} {pair:?}");
    }
    // With replicas, a large opening still goes by load between its first two (a
    // replica that did not see it placed would pay its whole text to find it).
    b.load().set_replicas(2);
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[0]));
    b.load().set_replicas(1);
    // A later turn this balancer has no home for is not placed at all.
    assert_eq!(b.first_of(target, None, Turn::Later, small), None);
    drop(held);
}

#[test]
fn a_new_conversation_avoids_a_node_with_a_long_prefill_queued() {
    let b = balancer(8, 4, None);
    let (target, pair) = grouped_key(&b);
    let large = SMALL_OPENING_TOKENS + 1;
    // Nothing in flight: the key's first node.
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[0]));
    // It holds one request whose 30,000 uncached tokens are still prefilling (3 s at
    // the default 100 µs per token, a slot time of 2 s there): the other choice, one
    // request lighter in flight but with no prefill queued, takes the new one.
    let first = b.node(pair[0]).state();
    first.slot_time.observe(Duration::from_secs(2));
    let _prefilling = first.start_prefill(30_000);
    let held = chosen(b.choose(
        Target {
            first: Some(pair[0]),
            ..target
        },
        &[],
        Instant::now(),
    ));
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[1]));
    drop(held);
}

#[test]
fn with_replicas_a_prompt_string_stays_on_its_keys_first_node_unless_it_is_full() {
    let b = balancer(8, 4, None);
    b.load().set_replicas(2);
    let (target, pair) = grouped_key(&b);
    let large = SMALL_OPENING_TOKENS + 1;
    let at_first = Target {
        first: Some(pair[0]),
        ..target
    };
    let mut held: Vec<_> = (0..3)
        .map(|_| chosen(b.choose(at_first, &[], Instant::now())))
        .collect();
    // Three of four in flight there, none on the other choice: a chat opening (its
    // turn known, a miss would correct the other replica) goes to the other choice; a
    // prompt string stays, since no miss could tell the other replica where it went.
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[1]));
    assert_eq!(
        b.first_of(target, None, Turn::Unknown, large),
        Some(pair[0])
    );
    // Full: it goes to the other choice too.
    held.push(chosen(b.choose(at_first, &[], Instant::now())));
    assert_eq!(
        b.first_of(target, None, Turn::Unknown, large),
        Some(pair[1])
    );
    drop(held);
}

#[test]
fn alone_a_burst_of_small_openings_spreads_evenly_over_the_group() {
    // 24 agents start at once (nothing in flight yet): each goes where the fewest
    // conversations live, among all 8 nodes, so each node gets 3; two random choices
    // would leave some node with 4 (more than its cache holds once they grow).
    let b = balancer(8, 4, None);
    let mut homes = vec![0; 8];
    for k in 1..=24u64 {
        let target = Target {
            hash: k.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            group: Some((0xfeed_u64 << 40, 8)),
            first: None,
        };
        let node = b
            .first_of(target, None, Turn::First, SMALL_OPENING_TOKENS)
            .unwrap();
        b.remember(target.hash, node, 200);
        homes[node] += 1;
    }
    assert_eq!(homes, vec![3; 8]);
}

#[test]
fn under_load_factor_a_large_opening_goes_by_load_between_its_first_two() {
    // `load_factor` asks for balance by requests in flight: homes do not weigh, and a
    // large opening is compared with its key's second node only.
    let b = balancer(8, 4, Some(1.25));
    let (target, pair) = grouped_key(&b);
    homes_on(&b, pair[0], 2);
    let large = SMALL_OPENING_TOKENS + 1;
    assert_eq!(b.first_of(target, None, Turn::First, large), Some(pair[0]));
}
