//! The hasher of the request path's maps keyed by names from the config: node ids
//! (metric series), model names (a pool's models) and engine origins (idle
//! connections). The std hasher, SipHash, costs a few hundred instructions per lookup
//! on such short keys; xxh3 costs a few dozen. SipHash's keyed seed defends a map
//! whose keys a client chooses against colliding inserts; these maps' keys come from
//! the config (a lookup with a client's model name inserts nothing), so a fixed seed
//! is safe.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map keyed by config names, hashed with [`NameHasher`].
pub type NameMap<K, V> = HashMap<K, V, BuildHasherDefault<NameHasher>>;

/// xxh3 over a key's bytes.
#[derive(Default)]
pub struct NameHasher(u64);

impl Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }

    /// The terminator `str` writes after its bytes: mixed in without another xxh3 call.
    fn write_u8(&mut self, byte: u8) {
        self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_and_distinct_names_differ() {
        let mut m: NameMap<String, usize> = NameMap::default();
        for (i, name) in ["gpu-0", "gpu-1", "llama", "llama-3.1-8b", "", "a"]
            .iter()
            .enumerate()
        {
            m.insert(name.to_string(), i);
        }
        assert_eq!(m.get("llama"), Some(&2));
        assert_eq!(m.get(""), Some(&4));
        assert_eq!(m.get("gpu-2"), None);
        let hash = |s: &str| {
            let mut h = NameHasher::default();
            std::hash::Hash::hash(s, &mut h);
            h.finish()
        };
        assert_ne!(hash("ab"), hash("ba"));
        assert_ne!(hash(""), hash("\u{ff}"));
    }
}
