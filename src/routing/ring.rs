//! The consistent-hash ring: `vnodes × weight` xxh3 points per node, sorted, looked up
//! by binary search. A successor walk goes clockwise from a key's hash and yields each
//! distinct node once, so the walk order is a key's stable list of homes (primary first).
//! Pure: no I/O, no clocks, no atomics.

use xxhash_rust::xxh3::xxh3_64;

/// A node as the ring sees it: an id and a weight (a node with weight 2 gets twice the
/// points, so twice the keys).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingMember {
    pub id: String,
    pub weight: u32,
}

/// A built ring over a fixed list of members. Node indices in walks refer to the order
/// of the members given to [`Ring::build`].
#[derive(Debug, Clone)]
pub struct Ring {
    /// (point hash, member index), sorted by hash then index so ties are deterministic.
    points: Vec<(u64, u32)>,
    members: usize,
}

impl Ring {
    /// Builds the ring. Each member gets `vnodes × weight` points, point `i` being
    /// `xxh3_64(id ‖ "#" ‖ i)` with `i` in decimal: the same id always lands on the same
    /// points, whatever the other members, so adding or removing a node moves only the
    /// keys next to its own points.
    pub fn build(members: &[RingMember], vnodes: u32) -> Ring {
        let total: usize = members.iter().map(|m| (vnodes * m.weight) as usize).sum();
        let mut points = Vec::with_capacity(total);
        let mut buf = Vec::with_capacity(64);
        for (idx, member) in members.iter().enumerate() {
            for i in 0..vnodes * member.weight {
                buf.clear();
                buf.extend_from_slice(member.id.as_bytes());
                buf.push(b'#');
                buf.extend_from_slice(i.to_string().as_bytes());
                points.push((xxh3_64(&buf), idx as u32));
            }
        }
        points.sort_unstable();
        Ring {
            points,
            members: members.len(),
        }
    }

    /// Number of members (distinct nodes).
    pub fn len(&self) -> usize {
        self.members
    }

    /// True when the ring has no members.
    pub fn is_empty(&self) -> bool {
        self.members == 0
    }

    /// Number of points on the ring.
    pub fn points(&self) -> usize {
        self.points.len()
    }

    /// The primary node for `hash`: the owner of the first point at or after it.
    pub fn primary(&self, hash: u64) -> Option<usize> {
        self.successors(hash).next()
    }

    /// Walks clockwise from `hash`, yielding each distinct member index once.
    pub fn successors(&self, hash: u64) -> Successors<'_> {
        let start = self.points.partition_point(|&(p, _)| p < hash);
        Successors {
            ring: self,
            pos: start,
            visited: 0,
            seen: SeenSet::new(self.members),
            yielded: 0,
        }
    }

    /// Share of the hash space owned by each member (sums to 1.0): the expected share of
    /// keys each node is primary for.
    pub fn ownership(&self) -> Vec<f64> {
        let mut share = vec![0.0; self.members];
        if self.points.is_empty() {
            return share;
        }
        // Point k owns the arc (point k-1, point k]; the first point also owns the wrap.
        let n = self.points.len();
        for k in 0..n {
            let prev = if k == 0 {
                self.points[n - 1].0
            } else {
                self.points[k - 1].0
            };
            let arc = self.points[k].0.wrapping_sub(prev);
            let arc = if n == 1 { u64::MAX } else { arc };
            share[self.points[k].1 as usize] += arc as f64 / u64::MAX as f64;
        }
        share
    }
}

/// Iterator over distinct member indices in clockwise order from a hash.
pub struct Successors<'a> {
    ring: &'a Ring,
    pos: usize,
    visited: usize,
    seen: SeenSet,
    yielded: usize,
}

impl Iterator for Successors<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let n = self.ring.points.len();
        while self.yielded < self.ring.members && self.visited < n {
            let (_, idx) = self.ring.points[(self.pos + self.visited) % n];
            self.visited += 1;
            if self.seen.insert(idx as usize) {
                self.yielded += 1;
                return Some(idx as usize);
            }
        }
        None
    }
}

/// A set of member indices, inline for the common fleet of up to 128 nodes.
enum SeenSet {
    Small(u128),
    Large(Vec<u64>),
}

impl SeenSet {
    fn new(members: usize) -> Self {
        if members <= 128 {
            SeenSet::Small(0)
        } else {
            SeenSet::Large(vec![0; members.div_ceil(64)])
        }
    }

    /// Inserts `i`; returns true if it was not there yet.
    fn insert(&mut self, i: usize) -> bool {
        match self {
            SeenSet::Small(bits) => {
                let mask = 1u128 << i;
                let fresh = *bits & mask == 0;
                *bits |= mask;
                fresh
            }
            SeenSet::Large(words) => {
                let mask = 1u64 << (i % 64);
                let word = &mut words[i / 64];
                let fresh = *word & mask == 0;
                *word |= mask;
                fresh
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn members(n: usize) -> Vec<RingMember> {
        (0..n)
            .map(|i| RingMember {
                id: format!("node-{i}"),
                weight: 1,
            })
            .collect()
    }

    fn key_hash(i: u64) -> u64 {
        xxh3_64(format!("key-{i}").as_bytes())
    }

    #[test]
    fn golden_keys_map_to_fixed_nodes() {
        // Fixed inputs, fixed outputs: a change here changes every deployed fleet's
        // placement, so it must be deliberate.
        let ring = Ring::build(&members(4), 160);
        let homes: Vec<usize> = (0..16)
            .map(|i| ring.primary(key_hash(i)).unwrap())
            .collect();
        assert_eq!(homes, GOLDEN_HOMES);
        assert_eq!(ring.points(), 640);
    }
    const GOLDEN_HOMES: [usize; 16] = [2, 3, 3, 2, 1, 2, 2, 2, 2, 3, 3, 3, 1, 2, 3, 2];

    #[test]
    fn removing_one_node_moves_only_its_keys() {
        let n = 8;
        let all = members(n);
        let before = Ring::build(&all, 160);
        let removed = 3;
        let rest: Vec<RingMember> = all
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != removed)
            .map(|(_, m)| m.clone())
            .collect();
        let after = Ring::build(&rest, 160);
        let keys = 20_000;
        let mut moved = 0;
        for k in 0..keys {
            let h = key_hash(k);
            let old = &all[before.primary(h).unwrap()].id;
            let new = &rest[after.primary(h).unwrap()].id;
            if old != new {
                assert_eq!(
                    old, &all[removed].id,
                    "a key not owned by the removed node moved"
                );
                moved += 1;
            }
        }
        let share = moved as f64 / keys as f64;
        assert!((share - 1.0 / n as f64).abs() < 0.04, "moved share {share}");
        // The removed node's keys go to what was their second home.
        for k in 0..keys {
            let h = key_hash(k);
            let walk: Vec<&str> = before.successors(h).map(|i| all[i].id.as_str()).collect();
            if walk[0] == all[removed].id {
                assert_eq!(rest[after.primary(h).unwrap()].id, walk[1]);
            }
        }
    }

    #[test]
    fn weight_scales_points_and_share() {
        let mut m = members(3);
        m[0].weight = 2;
        let ring = Ring::build(&m, 160);
        assert_eq!(ring.points(), 640);
        let own = ring.ownership();
        assert!((own.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(own[0] > own[1] && own[0] > own[2], "{own:?}");
    }

    #[test]
    fn empty_ring_has_no_successors() {
        let ring = Ring::build(&[], 160);
        assert_eq!(ring.successors(42).count(), 0);
        assert!(ring.is_empty());
    }

    #[test]
    fn large_rings_use_the_wide_seen_set() {
        let ring = Ring::build(&members(300), 4);
        let walk: Vec<usize> = ring.successors(7).collect();
        assert_eq!(walk.len(), 300);
        let mut sorted = walk.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 300);
    }

    proptest! {
        #[test]
        fn successor_walk_visits_every_node_once(n in 1usize..40, vnodes in 1u32..50, h in any::<u64>()) {
            let ring = Ring::build(&members(n), vnodes);
            let mut walk: Vec<usize> = ring.successors(h).collect();
            prop_assert_eq!(walk.len(), n);
            walk.sort_unstable();
            walk.dedup();
            prop_assert_eq!(walk.len(), n);
        }

        #[test]
        fn primary_is_owner_of_next_point(n in 1usize..20, h in any::<u64>()) {
            let ring = Ring::build(&members(n), 16);
            let p = ring.primary(h).unwrap();
            let next = ring.points.iter().find(|(pt, _)| *pt >= h).unwrap_or(&ring.points[0]);
            prop_assert_eq!(p, next.1 as usize);
        }
    }
}
