//! Where each conversation lives: a bounded, lock-free table per pool from a key's
//! hash to the node that served its last turn. A later turn goes home; a new
//! conversation is placed by load and remembered. The table is a cache: a lost or
//! overwritten entry (a restart, another replica, a collision) sends the turn to its
//! key's deterministic first node, which costs cache hits, never correctness.

use std::sync::atomic::{AtomicU64, Ordering};

/// Entries (a power of two): 8 bytes each.
const SLOTS: usize = 1 << 17;

/// Key hash → node tag, direct-mapped. An entry is `key tag (40 bits) | node tag (24)`.
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
    (key >> 24) | 1
}

impl HomeTable {
    /// The node tag remembered for `key`.
    pub fn get(&self, key: u64) -> Option<u32> {
        let v = self.slots[key as usize & (SLOTS - 1)].load(Ordering::Relaxed);
        (v != 0 && v >> 24 == key_tag(key)).then_some(v as u32 & 0xFF_FFFF)
    }

    /// Remembers `node` as `key`'s home (replacing whatever held the slot).
    pub fn set(&self, key: u64, node: u32) {
        let v = (key_tag(key) << 24) | u64::from(node & 0xFF_FFFF);
        self.slots[key as usize & (SLOTS - 1)].store(v, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn homes_are_remembered_and_collisions_only_forget() {
        let t = HomeTable::default();
        let key = 0x9E37_79B9_7F4A_7C15_u64;
        assert_eq!(t.get(key), None);
        t.set(key, node_tag(7));
        assert_eq!(t.get(key), Some(node_tag(7)));
        // Same slot, other key: the old entry is gone, never misread.
        let clash = key ^ (0xABCD << 40);
        assert_eq!(t.get(clash), None);
        t.set(clash, node_tag(9));
        assert_eq!(t.get(key), None);
        assert_eq!(t.get(clash), Some(node_tag(9)));
    }
}
