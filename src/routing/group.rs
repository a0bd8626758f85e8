//! Prefix groups for `key = "hybrid"`: requests that share a long system prompt form a
//! group (a short one forms none: see [`crate::routing::key::MIN_GROUP_BYTES`]); the group's
//! hash picks an ordered list of nodes (its ring walk), and each
//! conversation of the group lands on one of the first `width` of them, picked by its
//! own hash by rendezvous hashing. `width` follows the group's share of the
//! pool's recent requests: a system prompt that fronts all the traffic spreads its
//! conversations over the whole fleet (its prefix is then cached everywhere, which is
//! cheap), while one of many few-shot or batch prompts stays on one node (its long
//! prefix is cached once). Every turn of a conversation computes the same node as long
//! as the width holds; a width change moves only the conversations that must move
//! (`1/(w+1)` of them on growth). A fixed table of atomic counters: counting takes no
//! lock; the periodic halving is done by whichever thread wins a `try_lock`, and the
//! others never wait for it.

use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

use super::Mode;

/// How a key is placed. `Ring`: its ring walk (`conversation` and `prefix` keys, key
/// headers, and APIs without a system part). `Pool`: a `hybrid` key whose system part
/// is short or absent: every node, ranked by rendezvous with the key (a perfectly even
/// spread, with no counting). `Group`: a `hybrid` key with a long system part: the
/// group's first `width` nodes. `T` is the group's key length in the request's facts
/// and its hash in a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping<T> {
    Ring,
    Pool,
    Group(T),
}

/// Counter slots, in pairs: a group takes one of two, tagged with its hash, and a new
/// group replaces the colder of the pair (so groups never silently share counts).
const SLOTS: usize = 1 << 14;
/// All counters halve once the total reaches this many requests, so shares follow the
/// last few thousand requests.
const WINDOW: u32 = 8192;
/// A group gets about `SPREAD × share × nodes` nodes: twice its fair share, so the
/// nodes it lands on keep headroom for its bursts.
const SPREAD: f64 = 2.0;
/// A group narrows only when `SHRINK_AT × SPREAD × share × nodes` is below its width:
/// the band between growing and narrowing keeps widths from flapping.
const SHRINK_AT: f64 = 1.5;

/// One group as [`GroupHeat::hottest`] lists it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupSummary {
    pub tag: u32,
    pub recent: u32,
    pub share: f64,
    pub width: u32,
}

/// The recent request counts of a pool's groups, and each group's current width.
pub struct GroupHeat {
    tags: Box<[AtomicU32]>,
    counts: Box<[AtomicU32]>,
    widths: Box<[AtomicU32]>,
    total: AtomicU32,
    decay: Mutex<()>,
}

impl Default for GroupHeat {
    fn default() -> Self {
        GroupHeat {
            tags: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            counts: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            widths: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            total: AtomicU32::new(0),
            decay: Mutex::new(()),
        }
    }
}

impl std::fmt::Debug for GroupHeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupHeat")
            .field("recent_requests", &self.total.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl GroupHeat {
    /// The group's width among `nodes` for a request of it; a counted request
    /// (`mode.counts()`) is counted first, an explanation's width is the one the
    /// group's next request would get.
    pub fn width(&self, group: u64, nodes: usize, mode: Mode) -> usize {
        if !mode.counts() {
            return self.next_width(group, nodes);
        }
        let slot = self.claim(group);
        self.counts[slot].fetch_add(1, Ordering::Relaxed);
        if self.total.fetch_add(1, Ordering::Relaxed) + 1 >= WINDOW {
            self.halve();
        }
        let target = self.target(slot, nodes, 0);
        let width = &self.widths[slot];
        let current = width.load(Ordering::Relaxed) as usize;
        let next = next_width(current, target, nodes);
        if next != current {
            width.store(next as u32, Ordering::Relaxed);
        }
        next
    }

    /// The width the group's next request would get, counting nothing.
    fn next_width(&self, group: u64, nodes: usize) -> usize {
        let Some(slot) = self.find(group) else {
            // Unseen: as its first request would find it.
            let total = self.total.load(Ordering::Relaxed) + 1;
            let target = SPREAD * nodes as f64 / f64::from(total);
            return next_width(0, target, nodes);
        };
        let current = self.widths[slot].load(Ordering::Relaxed) as usize;
        next_width(current, self.target(slot, nodes, 1), nodes)
    }

    /// The `n` groups with the most recent requests: each one's hash tag (the low 32
    /// bits of its hash, the lowest set), recent requests, share of the pool's recent
    /// requests and width. Reads every slot (for the status page, not the data path).
    pub fn hottest(&self, n: usize) -> Vec<GroupSummary> {
        let total = self.total.load(Ordering::Relaxed).max(1);
        let mut all: Vec<GroupSummary> = (0..SLOTS)
            .filter_map(|s| {
                let tag = self.tags[s].load(Ordering::Relaxed);
                let recent = self.counts[s].load(Ordering::Relaxed);
                (tag != 0 && recent > 0).then(|| GroupSummary {
                    tag,
                    recent,
                    share: f64::from(recent) / f64::from(total),
                    width: self.widths[s].load(Ordering::Relaxed),
                })
            })
            .collect();
        all.sort_unstable_by(|a, b| b.recent.cmp(&a.recent).then(a.tag.cmp(&b.tag)));
        all.truncate(n);
        all
    }

    /// The group's slot, if it has one.
    fn find(&self, group: u64) -> Option<usize> {
        let (a, tag) = (slot_of(group), tag_of(group));
        [a, a ^ 1]
            .into_iter()
            .find(|&s| self.tags[s].load(Ordering::Relaxed) == tag)
    }

    /// The group's slot, taking the colder of its pair when it has none (racing
    /// claims at worst restart a group's count).
    fn claim(&self, group: u64) -> usize {
        if let Some(s) = self.find(group) {
            return s;
        }
        let a = slot_of(group);
        let count = |s: usize| self.counts[s].load(Ordering::Relaxed);
        let s = if count(a) <= count(a ^ 1) { a } else { a ^ 1 };
        self.counts[s].store(0, Ordering::Relaxed);
        self.widths[s].store(0, Ordering::Relaxed);
        self.tags[s].store(tag_of(group), Ordering::Relaxed);
        s
    }

    /// The group's share of recent requests (with `extra` more of its own), scaled to
    /// nodes (unrounded).
    fn target(&self, slot: usize, nodes: usize, extra: u32) -> f64 {
        let total = self.total.load(Ordering::Relaxed) + extra;
        let count = (self.counts[slot].load(Ordering::Relaxed) + extra).min(total);
        SPREAD * nodes as f64 * count as f64 / total.max(1) as f64
    }

    fn halve(&self) {
        // One thread decays; the others go on with slightly stale counts.
        let Some(_decaying) = self.decay.try_lock() else {
            return;
        };
        if self.total.load(Ordering::Relaxed) < WINDOW {
            return;
        }
        let mut sum = 0;
        for c in self.counts.iter() {
            let half = c.load(Ordering::Relaxed) / 2;
            c.store(half, Ordering::Relaxed);
            sum += half;
        }
        self.total.store(sum, Ordering::Relaxed);
    }
}

fn slot_of(group: u64) -> usize {
    (group >> 50) as usize % SLOTS
}

fn tag_of(group: u64) -> u32 {
    group as u32 | 1
}

/// Grows at once to `ceil(target)`; narrows only below `ceil(SHRINK_AT × target)`.
fn next_width(current: usize, target: f64, nodes: usize) -> usize {
    let grow = target.ceil() as usize;
    let shrink = (SHRINK_AT * target).ceil() as usize;
    let next = if current == 0 || grow > current {
        grow
    } else if shrink < current {
        shrink
    } else {
        current
    };
    next.clamp(1, nodes.max(1))
}

/// Rendezvous (highest random weight) score of a key on a node: the node with the
/// highest score is the key's pick, the next its first spill. When a node joins the
/// candidates, only the keys it outranks move (`1/(w+1)` of them), all to it.
pub fn rendezvous(key: u64, node: u64) -> u64 {
    // splitmix64's finalizer over the pair: cheap, and every input bit reaches every
    // output bit.
    let mut z = key ^ node.rotate_left(32) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Weighted rendezvous score (the logarithmic method: `weight / -ln(u)`, with `u`
/// uniform in (0, 1) from the pair's hash): a node is the pick for a share of keys
/// proportional to its weight, and equal weights rank as [`rendezvous`] does. The
/// score is a positive `f64`'s bits, which order as the floats do.
pub fn weighted_rendezvous(key: u64, node: u64, weight: u32) -> u64 {
    let u = ((rendezvous(key, node) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (f64::from(weight.max(1)) / -u.ln()).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick(key: u64, nodes: &[u64]) -> usize {
        (0..nodes.len())
            .max_by_key(|&i| rendezvous(key, nodes[i]))
            .unwrap()
    }

    #[test]
    fn the_hottest_groups_come_first_with_their_shares_and_widths() {
        let heat = GroupHeat::default();
        let (hot, warm) = (0xaaaa_0000_1234_5678_u64, 0x5555_0000_9abc_def0_u64);
        for _ in 0..30 {
            heat.width(hot, 8, Mode::Route);
        }
        for _ in 0..10 {
            heat.width(warm, 8, Mode::Route);
        }
        heat.width(warm, 8, Mode::Explain);
        let top = heat.hottest(5);
        assert_eq!(top.len(), 2, "{top:?}");
        assert_eq!((top[0].tag, top[0].recent), (0x1234_5679, 30));
        assert_eq!((top[1].tag, top[1].recent), (0x9abc_def1, 10));
        assert!((top[0].share - 0.75).abs() < 1e-9, "{top:?}");
        assert!(top[0].width > top[1].width && top[1].width >= 1, "{top:?}");
        assert_eq!(heat.hottest(1).len(), 1);
    }

    #[test]
    fn rendezvous_spreads_evenly_and_moves_only_to_the_new_node() {
        let keys: Vec<u64> = (0..20_000u64)
            .map(|i| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()))
            .collect();
        let nodes: Vec<u64> = (0..16u64)
            .map(|i| xxhash_rust::xxh3::xxh3_64(format!("n{i}").as_bytes()))
            .collect();
        let mut per = [0usize; 8];
        for &k in &keys {
            per[pick(k, &nodes[..8])] += 1;
        }
        for n in per {
            assert!((2_200..2_800).contains(&n), "{per:?}");
        }
        for w in 1..16 {
            let moved: Vec<usize> = keys
                .iter()
                .filter(|&&k| pick(k, &nodes[..w]) != pick(k, &nodes[..w + 1]))
                .map(|&k| pick(k, &nodes[..w + 1]))
                .collect();
            assert!(moved.iter().all(|&b| b == w), "moves only to the new node");
            let share = moved.len() as f64 / keys.len() as f64;
            assert!(
                (share - 1.0 / (w + 1) as f64).abs() < 0.02,
                "w {w}: {share}"
            );
        }
    }

    #[test]
    fn weighted_rendezvous_shares_keys_by_weight() {
        let nodes = [(11u64, 3u32), (22, 1), (33, 1)];
        let mut won = [0usize; 3];
        for i in 0..50_000u64 {
            let key = xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
            let best = (0..3)
                .max_by_key(|&n| weighted_rendezvous(key, nodes[n].0, nodes[n].1))
                .unwrap();
            won[best] += 1;
            // Equal weights rank exactly as plain rendezvous.
            let plain = (1..3).max_by_key(|&n| rendezvous(key, nodes[n].0)).unwrap();
            let weighted = (1..3)
                .max_by_key(|&n| weighted_rendezvous(key, nodes[n].0, 1))
                .unwrap();
            assert_eq!(plain, weighted);
        }
        let heavy = won[0] as f64 / 50_000.0;
        assert!((heavy - 0.6).abs() < 0.01, "weight 3 of 5: {heavy}");
    }

    #[test]
    fn a_group_fronting_all_traffic_spreads_over_every_node() {
        let heat = GroupHeat::default();
        assert_eq!(
            heat.width(7, 8, Mode::Explain),
            8,
            "an unseen group's first request: all nodes"
        );
        let widths: Vec<usize> = (0..100).map(|_| heat.width(7, 8, Mode::Route)).collect();
        assert!(widths.iter().all(|&w| w == 8), "{widths:?}");
    }

    #[test]
    fn one_of_many_groups_narrows_to_one_node() {
        let heat = GroupHeat::default();
        let groups: Vec<u64> = (0..64u64).map(|g| g << 54).collect();
        for round in 0..50 {
            for &g in &groups {
                let w = heat.width(g, 8, Mode::Route);
                if round >= 10 {
                    assert_eq!(w, 1, "64 equal groups on 8 nodes: one node each");
                }
            }
        }
        // Four equal groups: a quarter of the traffic each, so twice their fair share
        // is 4 nodes, and the band lets a group that started wider (the very first
        // request sees a share of 1) stay a little wider: up to ⌈1.5 × 4.0…⌉ = 7.
        let heat = GroupHeat::default();
        for _ in 0..500 {
            for g in 0..4u64 {
                heat.width(g << 54, 8, Mode::Route);
            }
        }
        for g in 0..4u64 {
            let w = heat.width(g << 54, 8, Mode::Explain);
            assert!((4..=7).contains(&w), "group {g}: {w}");
        }
    }

    #[test]
    fn widths_hold_inside_the_band_and_follow_a_lasting_change() {
        let heat = GroupHeat::default();
        let feed = |hot_every: u64, n: u64| {
            let mut last = 0;
            for i in 0..n {
                let g = if i % hot_every == 0 {
                    1 << 54
                } else {
                    (2 + i % 50) << 54
                };
                let w = heat.width(g, 8, Mode::Route);
                if g == 1 << 54 {
                    last = w;
                }
            }
            last
        };
        let settled = feed(3, 3_000);
        assert!(
            (6..=8).contains(&settled),
            "a third of 8 nodes, doubled: 5.3 → 6 (band to 8)"
        );
        // A dip to 25 % (target 4, shrink bound 6) narrows it at most to 6, not to 4.
        let dipped = feed(4, 20_000);
        assert!((6..=settled).contains(&dipped), "{dipped}");
        // A lasting drop to 5 % (target 0.8, shrink bound 1.2) narrows it.
        assert!(feed(20, 40_000) <= 2);
    }

    #[test]
    fn counts_decay_so_shares_follow_recent_traffic() {
        let heat = GroupHeat::default();
        for _ in 0..20_000 {
            heat.width(1 << 54, 8, Mode::Route);
        }
        for i in 0..40_000u64 {
            heat.width((2 + i % 64) << 54, 8, Mode::Route);
        }
        assert!(heat.total.load(Ordering::Relaxed) < WINDOW);
        assert_eq!(
            heat.width(1 << 54, 8, Mode::Explain),
            1,
            "the old hot group is forgotten"
        );
    }
}
