//! Where each conversation lives: a bounded, lock-free table per pool from a key's
//! hash to the node that served its last turn, and how long that turn's prompt was (what
//! the node should hold of the conversation). A later turn goes home; a new
//! conversation is placed by load and remembered. The table is a cache: a lost or
//! overwritten entry (a restart, another replica, a collision) sends the turn to its
//! key's deterministic first node, which costs cache hits, never correctness. Beside
//! it, [`RecentHomes`]: how many conversations each node became home to lately.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

/// Entries (a power of two): 8 bytes each.
const SLOTS: usize = 1 << 17;

/// A conversation's home as remembered: its node's tag, and the prompt tokens it last
/// sent there (in steps of 64, at most about 4 million).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub node: u32,
    pub tokens: u32,
}

/// Tokens per step of [`Entry::tokens`].
const TOKEN_STEP: u32 = 64;

/// Key hash → entry, direct-mapped. An entry is `key tag (24 bits) | tokens / 64 (16) |
/// node tag (24)`; with the slot's 17 bits, 41 bits of the key tell keys apart.
pub struct HomeTable {
    slots: Box<[AtomicU64]>,
}

impl Default for HomeTable {
    fn default() -> Self {
        HomeTable {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl std::fmt::Debug for HomeTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HomeTable").finish_non_exhaustive()
    }
}

/// A node's 24-bit tag in the table (from the hash of its id; never 0).
pub fn node_tag(id_hash: u64) -> u32 {
    (id_hash as u32 & 0xFF_FFFF) | 1
}

fn key_tag(key: u64) -> u64 {
    (key >> 40) | 1
}

impl HomeTable {
    /// What is remembered for `key`.
    pub fn get(&self, key: u64) -> Option<Entry> {
        let v = self.slots[key as usize & (SLOTS - 1)].load(Ordering::Relaxed);
        (v != 0 && v >> 40 == key_tag(key)).then(|| Entry {
            node: v as u32 & 0xFF_FFFF,
            tokens: ((v >> 24) as u32 & 0xFFFF) * TOKEN_STEP,
        })
    }

    /// Remembers `entry` as `key`'s home (replacing whatever held the slot).
    pub fn set(&self, key: u64, entry: Entry) {
        let steps = u64::from((entry.tokens / TOKEN_STEP).min(0xFFFF));
        let v = (key_tag(key) << 40) | (steps << 24) | u64::from(entry.node & 0xFF_FFFF);
        self.slots[key as usize & (SLOTS - 1)].store(v, Ordering::Relaxed);
    }

    /// Forgets `key` (a slot another key holds is left as it is).
    pub fn forget(&self, key: u64) {
        let slot = &self.slots[key as usize & (SLOTS - 1)];
        let v = slot.load(Ordering::Relaxed);
        if v >> 40 == key_tag(key) {
            let _ = slot.compare_exchange(v, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// How many conversations each node became home to lately: a count over about the
/// last 64 (`RECENT_HOMES`) homes set, older ones weighing less (each new home scales
/// the others by `1 - 1/RECENT_HOMES`), so nodes that joined late or conversations
/// long gone do not skew it for long. Replicas whose home tables agree agree on these
/// counts too, unlike on each other's in-flight requests.
#[derive(Debug, Default)]
pub struct RecentHomes {
    /// (node tag, weight); nodes that leave fade out and are dropped.
    counts: Mutex<Vec<(u32, f64)>>,
}

/// The window of [`RecentHomes`], in homes set.
const RECENT_HOMES: f64 = 64.0;

impl RecentHomes {
    /// A conversation's home moved from `from` (if it had one) to `to`.
    pub fn moved(&self, from: Option<u32>, to: u32) {
        let keep = 1.0 - 1.0 / RECENT_HOMES;
        let mut counts = self.counts.lock();
        for (node, weight) in counts.iter_mut() {
            *weight *= keep;
            if Some(*node) == from {
                *weight = (*weight - 1.0).max(0.0);
            }
        }
        counts.retain(|&(node, weight)| node == to || weight > 1e-3);
        match counts.iter_mut().find(|(node, _)| *node == to) {
            Some((_, weight)) => *weight += 1.0,
            None => counts.push((to, 1.0)),
        }
    }

    /// The recent homes of `node`, less the mean of `nodes`' (the pool's).
    pub fn above_mean(&self, node: u32, nodes: &[u32]) -> f64 {
        self.above_mean_of(nodes).of(node)
    }

    /// [`RecentHomes::above_mean`] for any number of `nodes`' members: the counts
    /// locked and their mean taken once (held until the view is dropped).
    pub fn above_mean_of(&self, nodes: &[u32]) -> AboveMean<'_> {
        let counts = self.counts.lock();
        let mean =
            nodes.iter().map(|&t| weight_of(&counts, t)).sum::<f64>() / nodes.len().max(1) as f64;
        AboveMean { counts, mean }
    }
}

/// The recent homes of a pool's nodes, read once: see [`RecentHomes::above_mean_of`].
pub struct AboveMean<'a> {
    counts: MutexGuard<'a, Vec<(u32, f64)>>,
    mean: f64,
}

impl AboveMean<'_> {
    /// The recent homes of `node`, less the pool's mean.
    pub fn of(&self, node: u32) -> f64 {
        weight_of(&self.counts, node) - self.mean
    }
}

fn weight_of(counts: &[(u32, f64)], tag: u32) -> f64 {
    counts
        .iter()
        .find(|(n, _)| *n == tag)
        .map_or(0.0, |&(_, weight)| weight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_homes_count_moves_and_fade() {
        let r = RecentHomes::default();
        let nodes = [node_tag(0x10), node_tag(0x20)];
        for _ in 0..4 {
            r.moved(None, nodes[0]);
        }
        // About 4 against 0: 2 above the mean of the two.
        let above = r.above_mean(nodes[0], &nodes);
        assert!((above - 1.95).abs() < 0.1, "{above}");
        // A conversation moving away takes its count along.
        r.moved(Some(nodes[0]), nodes[1]);
        assert!(r.above_mean(nodes[0], &nodes) < above - 0.9);
        // Old homes fade: after four windows of homes elsewhere, the first is near even.
        for _ in 0..(4.0 * RECENT_HOMES) as usize {
            r.moved(None, node_tag(0x30));
        }
        let faded = r.above_mean(nodes[0], &nodes);
        assert!(faded.abs() < 0.1, "{faded}");
    }

    #[test]
    fn homes_are_remembered_and_collisions_only_forget() {
        let t = HomeTable::default();
        let key = 0x9E37_79B9_7F4A_7C15_u64;
        let at = |node, tokens| Entry {
            node: node_tag(node),
            tokens,
        };
        assert_eq!(t.get(key), None);
        t.set(key, at(7, 12_345));
        assert_eq!(t.get(key), Some(at(7, 12_288)), "tokens in steps of 64");
        t.set(key, at(7, u32::MAX));
        assert_eq!(t.get(key).map(|e| e.tokens), Some(0xFFFF * 64), "capped");
        // Same slot, other key: the old entry is gone, never misread.
        let clash = key ^ (0xABCD << 44);
        assert_eq!(t.get(clash), None);
        t.set(clash, at(9, 0));
        assert_eq!(t.get(key), None);
        assert_eq!(t.get(clash), Some(at(9, 0)));
    }
}
