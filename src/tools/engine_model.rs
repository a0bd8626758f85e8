//! A model of an inference engine with prefix caching, shared by `mock-engine` (which
//! sleeps for the times it computes) and the simulator (which advances virtual time).
//! Prompts become chained block hashes (≈ 4 chars per token, 16-token blocks, like
//! vLLM's hashed KV blocks); a bounded LRU of blocks says how much of a prompt is
//! cached; costs turn uncached tokens into prefill time. Prefill is compute-bound, so an
//! engine runs one prefill at a time (later prompts wait in its prefill lane: a cache
//! miss delays everyone behind it), and a decode step slows as the batch grows. Pure:
//! no I/O, no clocks (callers pass the time).

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

    /// A prompt given as token ids (a completions prompt of ids, SGLang's `input_ids`):
    /// one token each, its blocks chained over each [`BLOCK_TOKENS`] ids.
    pub fn from_ids(ids: &[u64]) -> Prompt {
        let mut prev = 0u64;
        let blocks = ids
            .chunks_exact(BLOCK_TOKENS)
            .map(|block| {
                let bytes: Vec<u8> = block.iter().flat_map(|id| id.to_le_bytes()).collect();
                prev = xxh3_64_with_seed(&bytes, prev);
                prev
            })
            .collect();
        Prompt {
            tokens: ids.len(),
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
    /// Decode time per output token for a sequence running alone. Default 10 ms.
    pub decode_per_token: Duration,
    /// Extra decode time per token for each other running sequence, as a share of
    /// `decode_per_token`. Default 0.02: a batch of 64 decodes 2.3× slower per
    /// sequence than one alone (memory-bound decode on a GPU, roughly).
    pub batch_slowdown: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            prefill_per_token: Duration::from_micros(100),
            decode_per_token: Duration::from_millis(10),
            batch_slowdown: 0.02,
        }
    }
}

impl Costs {
    /// Time per output token while `running` sequences (this one included) decode.
    pub fn decode_step(&self, running: usize) -> Duration {
        let others = running.saturating_sub(1) as f64;
        self.decode_per_token
            .mul_f64(1.0 + self.batch_slowdown.max(0.0) * others)
    }
}

/// What serving one prompt costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillPlan {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Time waiting for the prefills admitted before this one.
    pub queued: Duration,
    /// Time to prefill the uncached tokens.
    pub prefill: Duration,
}

impl PrefillPlan {
    /// From admission to the first token.
    pub fn first_token(&self) -> Duration {
        self.queued + self.prefill
    }
}

/// An engine: its cache and costs.
#[derive(Debug)]
pub struct EngineModel {
    pub cache: PrefixCache,
    pub costs: Costs,
    /// When the prefill lane frees, on the caller's clock.
    lane_free: Duration,
}

impl EngineModel {
    /// An engine whose cache holds `cache_tokens` tokens in blocks of `block_tokens`.
    pub fn new(cache_tokens: usize, block_tokens: usize, costs: Costs) -> Self {
        EngineModel {
            cache: PrefixCache::new(cache_tokens, block_tokens),
            costs,
            lane_free: Duration::ZERO,
        }
    }

    /// Admits a prompt at `now` (any clock, as long as it is the same one every call):
    /// how much is cached, how long it waits for the prefill lane and how long its own
    /// prefill takes. The prompt's blocks are cached from now on.
    /// A prompt whose KV cache another engine computed and this one received (a
    /// disaggregated decode): held from now on, every token counted as cached, no
    /// prefill.
    pub fn receive(&mut self, prompt: &Prompt) -> PrefillPlan {
        self.cache.serve(&prompt.blocks);
        PrefillPlan {
            prompt_tokens: prompt.tokens,
            cached_tokens: prompt.tokens,
            queued: Duration::ZERO,
            prefill: Duration::ZERO,
        }
    }

    pub fn prefill(&mut self, prompt: &Prompt, now: Duration) -> PrefillPlan {
        let hit_blocks = self.cache.serve(&prompt.blocks);
        let cached_tokens = (hit_blocks * prompt.block_tokens).min(prompt.tokens);
        let uncached = prompt.tokens - cached_tokens;
        let prefill = self.costs.prefill_per_token * uncached as u32;
        let start = self.lane_free.max(now);
        self.lane_free = start + prefill;
        PrefillPlan {
            prompt_tokens: prompt.tokens,
            cached_tokens,
            queued: start - now,
            prefill,
        }
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
        let p1 = e.prefill(&Prompt::from_text(&turn1), Duration::ZERO);
        assert_eq!(p1.cached_tokens, 0);
        assert_eq!(p1.prefill, Duration::from_micros(100 * 1000));
        let later = Duration::from_secs(1);
        let p2 = e.prefill(
            &Prompt::from_text(&format!("{turn1} and more text here")),
            later,
        );
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
    fn prefills_queue_in_one_lane() {
        let mut e = EngineModel::new(0, BLOCK_TOKENS, Costs::default());
        let prompt = Prompt::from_text(&"q".repeat(4000)); // 1,000 tokens: 100 ms
        let t0 = Duration::from_millis(5);
        let a = e.prefill(&prompt, t0);
        let b = e.prefill(&prompt, t0 + Duration::from_millis(40));
        assert_eq!(
            (a.queued, a.first_token()),
            (Duration::ZERO, Duration::from_millis(100))
        );
        assert_eq!(
            b.queued,
            Duration::from_millis(60),
            "waits for the first prefill"
        );
        let c = e.prefill(&prompt, Duration::from_secs(1));
        assert_eq!(c.queued, Duration::ZERO, "an idle lane does not wait");
    }

    #[test]
    fn decode_slows_with_the_batch() {
        let c = Costs::default();
        assert_eq!(c.decode_step(1), Duration::from_millis(10));
        assert_eq!(c.decode_step(0), Duration::from_millis(10));
        assert_eq!(c.decode_step(11), Duration::from_millis(12));
        let flat = Costs {
            batch_slowdown: 0.0,
            ..c
        };
        assert_eq!(flat.decode_step(64), Duration::from_millis(10));
    }
}
