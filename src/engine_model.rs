//! A model of an inference engine with prefix caching, shared by `mock-engine` (which
//! sleeps for the times it computes) and the simulator (which advances virtual time).
//! Prompts become chained block hashes (≈ 4 chars per token, 16-token blocks, like
//! vLLM's hashed KV blocks); a bounded LRU of blocks says how much of a prompt is
//! cached; costs turn uncached tokens into prefill time. Pure: no I/O, no clocks.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens per KV block.
pub const BLOCK_TOKENS: usize = 16;
/// Characters per token in the approximation `tokens ≈ chars / 4`.
pub const CHARS_PER_TOKEN: usize = 4;

/// A prompt as the cache sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: usize,
    /// One hash per full block; hash `i` covers the whole prefix up to block `i`, so
    /// two prompts share cached blocks exactly as far as their text agrees.
    pub blocks: Vec<u64>,
    /// Tokens per block (16 for text; a trace's own block size for traces).
    pub block_tokens: usize,
}

impl Prompt {
    /// Tokenizes text approximately: `ceil(chars / 4)` tokens.
    pub fn from_text(text: &str) -> Prompt {
        let bytes = text.as_bytes();
        let chars = text.chars().count();
        let tokens = chars.div_ceil(CHARS_PER_TOKEN);
        let block_bytes = BLOCK_TOKENS * CHARS_PER_TOKEN;
        // Blocks are cut on bytes; for ASCII text that is chars. Only full blocks count.
        let full = (tokens / BLOCK_TOKENS).min(bytes.len() / block_bytes);
        let mut blocks = Vec::with_capacity(full);
        let mut prev = 0u64;
        for chunk in bytes.chunks_exact(block_bytes).take(full) {
            prev = xxh3_64_with_seed(chunk, prev);
            blocks.push(prev);
        }
        Prompt {
            tokens,
            blocks,
            block_tokens: BLOCK_TOKENS,
        }
    }

    /// A prompt given directly as chained block ids of `block_tokens` each (trace replay).
    pub fn from_blocks(tokens: usize, blocks: Vec<u64>, block_tokens: usize) -> Prompt {
        Prompt {
            tokens,
            blocks,
            block_tokens: block_tokens.max(1),
        }
    }
}

/// A bounded LRU set of KV blocks.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    tick: u64,
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl PrefixCache {
    /// A cache holding up to `capacity_tokens` tokens in blocks of `block_tokens`.
    pub fn new(capacity_tokens: usize, block_tokens: usize) -> Self {
        PrefixCache {
            capacity: capacity_tokens / block_tokens.max(1),
            tick: 0,
            last_use: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }

    /// Number of leading blocks of `blocks` that are cached (without touching them).
    pub fn cached_prefix(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.last_use.contains_key(b))
            .count()
    }

    /// Serves a prompt: returns the cached leading blocks, then stores all its blocks as
    /// most recently used, evicting the least recently used beyond capacity.
    pub fn serve(&mut self, blocks: &[u64]) -> usize {
        let hit = self.cached_prefix(blocks);
        for &b in blocks {
            self.touch(b);
        }
        while self.last_use.len() > self.capacity {
            let Some((_, victim)) = self.by_age.pop_first() else {
                break;
            };
            self.last_use.remove(&victim);
        }
        hit
    }

    fn touch(&mut self, block: u64) {
        self.tick += 1;
        if let Some(old) = self.last_use.insert(block, self.tick) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.tick, block);
    }
}

/// The engine's cost model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// Prefill time per uncached prompt token. Default 100 µs.
    pub prefill_per_token: Duration,
    /// Decode time per output token. Default 10 ms.
    pub decode_per_token: Duration,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            prefill_per_token: Duration::from_micros(100),
            decode_per_token: Duration::from_millis(10),
        }
    }
}

/// What serving one prompt costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillPlan {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Time to prefill the uncached tokens.
    pub prefill: Duration,
}

/// An engine: its cache and costs.
#[derive(Debug)]
pub struct EngineModel {
    pub cache: PrefixCache,
    pub costs: Costs,
}

impl EngineModel {
    /// An engine whose cache holds `cache_tokens` tokens in blocks of `block_tokens`.
    pub fn new(cache_tokens: usize, block_tokens: usize, costs: Costs) -> Self {
        EngineModel {
            cache: PrefixCache::new(cache_tokens, block_tokens),
            costs,
        }
    }

    /// Admits a prompt: how much is cached and how long its prefill takes. The prompt's
    /// blocks are cached from now on.
    pub fn prefill(&mut self, prompt: &Prompt) -> PrefillPlan {
        let hit_blocks = self.cache.serve(&prompt.blocks);
        let cached_tokens = (hit_blocks * prompt.block_tokens).min(prompt.tokens);
        let uncached = prompt.tokens - cached_tokens;
        PrefillPlan {
            prompt_tokens: prompt.tokens,
            cached_tokens,
            prefill: self.costs.prefill_per_token * uncached as u32,
        }
    }

    /// Time to decode `tokens` output tokens.
    pub fn decode(&self, tokens: usize) -> Duration {
        self.costs.decode_per_token * tokens as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_blocks() {
        let base = "a".repeat(640);
        let a = Prompt::from_text(&format!("{base}{}", "x".repeat(128)));
        let b = Prompt::from_text(&format!("{base}{}", "y".repeat(128)));
        assert_eq!(a.tokens, 192);
        assert_eq!(a.blocks.len(), 12);
        assert_eq!(a.blocks[..10], b.blocks[..10]);
        assert_ne!(a.blocks[10], b.blocks[10]);
    }

    #[test]
    fn second_turn_hits_the_first_turns_blocks() {
        let mut e = EngineModel::new(200_000, BLOCK_TOKENS, Costs::default());
        let turn1 = "s".repeat(4000);
        let p1 = e.prefill(&Prompt::from_text(&turn1));
        assert_eq!(p1.cached_tokens, 0);
        assert_eq!(p1.prefill, Duration::from_micros(100 * 1000));
        let p2 = e.prefill(&Prompt::from_text(&format!("{turn1} and more text here")));
        assert_eq!(p2.cached_tokens, 992, "all full blocks of turn 1 (62 × 16)");
        assert!(p2.prefill < Duration::from_millis(3));
    }

    #[test]
    fn lru_evicts_the_oldest_blocks() {
        let mut c = PrefixCache::new(4 * BLOCK_TOKENS, BLOCK_TOKENS);
        c.serve(&[1, 2, 3]);
        c.serve(&[10, 11]);
        assert_eq!(c.len(), 4);
        assert_eq!(c.cached_prefix(&[1]), 0, "block 1 was the oldest");
        assert_eq!(c.cached_prefix(&[2, 3]), 2);
        assert_eq!(c.serve(&[10, 11, 12]), 2);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn decode_is_linear() {
        let e = EngineModel::new(0, BLOCK_TOKENS, Costs::default());
        assert_eq!(e.decode(16), Duration::from_millis(160));
    }
}
