//! Prefix depth found from the traffic (`key = "hybrid"`). A request's canonical text
//! (tools, instructions, then each message as `role` and raw content; or a completions
//! prompt) is cut into chunks of [`CHUNK`] bytes, restarting at every message, and the
//! chunks are chain-hashed (`h_i = xxh3(chunk_i, seed = h_{i-1})`), so two requests
//! share a chain hash exactly as far as they share their text from the start.
//!
//! A [`PrefixTable`] per pool counts, in a fixed table of atomics, how many recent
//! requests went through each chain hash and which chunk came next. A chunk is *hot*
//! when enough of the recent traffic shares it; it is a *branch point* when different
//! chunks have followed it. The prefix group of a request ends at its deepest hot
//! branch point: a shared preamble of any length and wherever it sits branches where
//! conversations diverge, while a conversation's own history never branches (its later
//! turns all continue it the same way), so the group, and the key after it, stay put
//! from turn to turn. The walk stops at the first cold chunk, so its cost follows the
//! length of the hot prefix; a few chunks past it are counted so that a new preamble
//! is learned within a few hundred requests. Pure but for the table's atomics.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;
use wide::u64x2;
use xxhash_rust::const_xxh3::const_custom_default_secret;
use xxhash_rust::xxh3::{xxh3_64_with_secret, xxh3_64_with_seed};

use super::Mode;

#[cfg(test)]
mod tests;

/// Bytes per chunk. Smaller chunks find a boundary more precisely and cost more per
/// request; a preamble's last partial chunk goes into the conversation part.
pub const CHUNK: usize = 512;

/// Tokens per chunk of a token-id prompt (`input_ids`, a completions token array):
/// chunks end after whole tokens, and hash the token values, so how a client spaces
/// its numbers does not matter.
pub const TOKEN_CHUNK: usize = 128;

/// One piece of the canonical text: a message (`tag` its role), tools, instructions or
/// a prompt. `body` is the raw JSON text of its value.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    pub tag: &'a str,
    pub body: &'a [u8],
}

/// A position in the canonical text: segment, byte offset in its body, and bytes of
/// canonical text before it (bodies only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pos {
    pub seg: usize,
    pub offset: usize,
    pub bytes: usize,
}

/// One chunk: its chain hash and where it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub hash: u64,
    pub end: Pos,
}

/// The chunks of a canonical text, hashed as they are taken (so a walk that stops
/// early hashes no more).
pub struct Chunks<'s, 'a> {
    segments: &'s [Segment<'a>],
    seg: usize,
    offset: usize,
    bytes: usize,
    chain: u64,
    started: bool,
    limit: usize,
    /// The walk stopped at `limit`, not at the end of the text.
    limited: bool,
    /// The text may grow at its end (a prompt string, whose next turn continues the
    /// last chunk): a partial last chunk is left out.
    growing: bool,
    /// The current segment is a token-id array: chunked by [`TOKEN_CHUNK`] tokens.
    tokens: bool,
    /// The first `lead` segments (a system part), and the last chunk taken that ends
    /// in them (see [`Chunks::lead_end`]).
    lead: usize,
    lead_end: Option<Chunk>,
}

impl<'s, 'a> Chunks<'s, 'a> {
    /// The chunks of `segments`, at most `max_scan` bytes of them, chained from `seed`.
    /// `growing`: the text is one prompt string whose later turns continue it, so its
    /// partial last chunk (different in every turn) is left out.
    pub fn new(segments: &'s [Segment<'a>], seed: u64, max_scan: usize, growing: bool) -> Self {
        Chunks {
            segments,
            seg: 0,
            offset: 0,
            bytes: 0,
            chain: seed ^ 0x7072_6566_6978_6c62,
            started: false,
            limit: max_scan,
            limited: false,
            growing,
            tokens: false,
            lead: 0,
            lead_end: None,
        }
    }

    /// The same chunks, remembering where the first `lead` segments end.
    pub fn marking(self, lead: usize) -> Self {
        Chunks { lead, ..self }
    }

    /// The last chunk that ends in the first `lead` segments ([`Chunks::marking`]):
    /// the chunks a walk took are not hashed again, only those it left before the
    /// lead's end.
    pub fn lead_end(&mut self) -> Option<Chunk> {
        while self.seg < self.lead && self.next().is_some() {}
        self.lead_end
    }

    fn taken(&mut self, chunk: Chunk) -> Option<Chunk> {
        if chunk.end.seg < self.lead {
            self.lead_end = Some(chunk);
        }
        Some(chunk)
    }
}

impl Iterator for Chunks<'_, '_> {
    type Item = Chunk;

    /// Inlined: called, its `Option<Chunk>` came back through memory, written 8 bytes
    /// at a time and read back 16 at a time, a store-forwarding stall a chunk
    /// (docs/performance.md, "An eighteenth sitting").
    #[inline(always)]
    fn next(&mut self) -> Option<Chunk> {
        loop {
            let s = self.segments.get(self.seg)?;
            if !self.started {
                // A segment's tag (its role) is chained in before its first chunk.
                self.chain = xxh3_64_with_seed(s.tag.as_bytes(), self.chain);
                self.started = true;
                self.tokens = is_token_ids(s.body);
                if s.body.is_empty() {
                    self.advance_segment();
                    return self.taken(self.chunk(self.seg - 1, 0));
                }
            }
            if self.offset >= s.body.len() {
                self.advance_segment();
                continue;
            }
            if self.bytes >= self.limit {
                self.limited = true;
                return None;
            }
            let (end, whole) = if self.tokens {
                token_chunk_end(s.body, self.offset)
            } else {
                let end = (self.offset + CHUNK).min(s.body.len());
                (end, end - self.offset == CHUNK)
            };
            if self.growing && !whole && self.seg + 1 == self.segments.len() {
                return None;
            }
            let piece = &s.body[self.offset..end];
            self.chain = if self.tokens {
                hash_token_ids(piece, self.chain)
            } else {
                seeded_xxh3(piece, self.chain)
            };
            self.bytes += end - self.offset;
            self.offset = end;
            return self.taken(self.chunk(self.seg, end));
        }
    }
}

/// xxh3's default secret, from which a seed's secret is derived.
const DEFAULT_SECRET: [u8; 192] = const_custom_default_secret(0);

/// `xxh3_64_with_seed(piece, seed)`, the same value, sooner for a whole chunk. Past
/// 240 bytes, xxh3 derives a secret from the seed (its default secret, with the seed
/// added to each 16 bytes' low half and taken from the high half) and hashes with it.
/// xxhash-rust writes that secret 8 bytes at a time and its SIMD loop reads it back 16
/// at a time, which stalls the CPU's store forwarding; derived here with 16-byte
/// stores, a 512-byte chunk hashes about 3 ns sooner (docs/performance.md, "A
/// seventeenth sitting"). The secret's words are little-endian, as the lanes are only
/// on a little-endian CPU; elsewhere xxh3 derives it.
pub(super) fn seeded_xxh3(piece: &[u8], seed: u64) -> u64 {
    if piece.len() <= 240 || seed == 0 || cfg!(target_endian = "big") {
        return xxh3_64_with_seed(piece, seed);
    }
    let add = u64x2::new([seed, seed.wrapping_neg()]);
    let mut secret = [0u8; 192];
    for (out, default) in secret
        .chunks_exact_mut(16)
        .zip(DEFAULT_SECRET.chunks_exact(16))
    {
        let default: [u8; 16] = default.try_into().unwrap_or_default();
        let derived: [u8; 16] = bytemuck::cast(bytemuck::cast::<_, u64x2>(default) + add);
        out.copy_from_slice(&derived);
    }
    xxh3_64_with_secret(piece, &secret)
}

/// Whether a segment's JSON text is an array of numbers (token ids).
pub(super) fn is_token_ids(body: &[u8]) -> bool {
    let mut rest = body.iter().skip_while(|b| b.is_ascii_whitespace());
    if rest.next() != Some(&b'[') {
        return false;
    }
    rest.find(|b| !b.is_ascii_whitespace())
        .is_some_and(u8::is_ascii_digit)
}

/// Where the token chunk starting at `from` ends (just after the comma that follows
/// its [`TOKEN_CHUNK`]-th token, or at the end), and whether it is whole.
fn token_chunk_end(body: &[u8], from: usize) -> (usize, bool) {
    match memchr::memchr_iter(b',', &body[from..]).nth(TOKEN_CHUNK - 1) {
        Some(i) => (from + i + 1, true),
        None => (body.len(), false),
    }
}

/// Chains the token values of a piece of a token-id array (digits, separators and
/// brackets; anything else is skipped), each as 4 little-endian bytes. Out of line, so
/// that [`Chunks::next`], inlined, stays small.
#[inline(never)]
fn hash_token_ids(piece: &[u8], chain: u64) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(chain);
    let mut n: u32 = 0;
    let mut digits = false;
    for &b in piece {
        if b.is_ascii_digit() {
            n = n.wrapping_mul(10).wrapping_add(u32::from(b - b'0'));
            digits = true;
        } else if std::mem::take(&mut digits) {
            h.update(&n.to_le_bytes());
            n = 0;
        }
    }
    if digits {
        h.update(&n.to_le_bytes());
    }
    h.digest()
}

impl Chunks<'_, '_> {
    fn advance_segment(&mut self) {
        self.seg += 1;
        self.offset = 0;
        self.started = false;
    }

    fn chunk(&self, seg: usize, offset: usize) -> Chunk {
        Chunk {
            hash: self.chain,
            end: Pos {
                seg,
                offset,
                bytes: self.bytes,
            },
        }
    }
}

/// Why a walk stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// At a chunk too few recent requests share.
    Cold,
    /// At `routing.max_scan_bytes`.
    MaxScan,
    /// At the end of the text.
    End,
}

impl Stop {
    pub fn as_str(self) -> &'static str {
        match self {
            Stop::Cold => "cold chunk",
            Stop::MaxScan => "max_scan_bytes",
            Stop::End => "end of prompt",
        }
    }
}

/// What a walk found: the deepest hot branch point, if any.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Depth {
    /// Where the group ends, and its chain hash.
    pub boundary: Option<Chunk>,
    /// The share of recent requests that went through the boundary chunk.
    pub share: f64,
    /// Hot chunks walked.
    pub hot_chunks: usize,
    pub stop: Stop,
}

/// Table slots (a power of two).
const SLOTS: usize = 1 << 16;
/// Counts halve once this many requests were walked, so hotness follows recent traffic.
const WINDOW: u32 = 8192;
/// A chunk is hot once at least this many recent requests went through it ...
const HOT_MIN: u32 = 3;
/// ... and at least this share of the recent requests (1/200: one conversation's own
/// turns rarely reach it, a preamble of any real use does).
const HOT_SHARE: u32 = 200;
/// Cold chunks counted past the first, so a long preamble is learned in fewer requests.
const LEARN_AHEAD: usize = 3;
/// A count at or above this is raised in strides: by `s` in one request of `s` (chosen
/// by the request's number and the chunk's hash), `s` being the count divided by this,
/// rounded up to a power of two, at most [`MAX_STRIDE`]. Its expected value is the exact count's;
/// far above the hot threshold (at most `WINDOW / HOT_SHARE`, 41) nothing reads it
/// but a preamble's share (against one half), which a few percent do not move. What it
/// buys: the slot of a chunk all traffic shares is written once in `s` requests, not
/// every time, so balancer threads on other cores stop taking its cache line from each
/// other (docs/performance.md, "The prefix table's writes").
const STRIDE_FROM: u32 = 256;
const MAX_STRIDE: u32 = 32;

/// One slot: tag (20 bits) | count (16) | tag of the first successor seen (24) |
/// branched (1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    tag: u32,
    count: u32,
    successor: u32,
    branched: bool,
}

impl Slot {
    fn unpack(v: u64) -> Slot {
        Slot {
            tag: (v >> 44) as u32 & 0xF_FFFF,
            count: (v >> 28) as u32 & 0xFFFF,
            successor: (v >> 4) as u32 & 0xFF_FFFF,
            branched: v & 1 == 1,
        }
    }

    fn pack(self) -> u64 {
        (u64::from(self.tag) << 44)
            | (u64::from(self.count.min(0xFFFF)) << 28)
            | (u64::from(self.successor) << 4)
            | u64::from(self.branched)
    }
}

/// What request number `seq` adds to a chunk (`hash`) counted `count` times: 1 below
/// [`STRIDE_FROM`]; from it on, the stride `s` in one request of `s` and 0 in the
/// others.
fn increment(count: u32, seq: u32, hash: u64) -> u32 {
    if count < STRIDE_FROM {
        return 1;
    }
    let stride = (count / STRIDE_FROM).next_power_of_two().min(MAX_STRIDE);
    // Mixed with the hash, so the chunks of one request are not all counted together.
    let pick = (hash ^ u64::from(seq)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    if pick & u64::from(stride - 1) == 0 {
        stride
    } else {
        0
    }
}

fn slot_of(hash: u64) -> usize {
    hash as usize & (SLOTS - 1)
}

fn tag_of(hash: u64) -> u32 {
    (hash >> 44) as u32 | 1
}

fn successor_tag(hash: u64) -> u32 {
    (hash >> 40) as u32 & 0xFF_FFFF | 1
}

/// The recent traffic of one pool's chunks.
pub struct PrefixTable {
    slots: Box<[AtomicU64]>,
    /// Requests walked in the current window.
    total: AtomicU32,
    decay: Mutex<()>,
}

impl Default for PrefixTable {
    fn default() -> Self {
        PrefixTable {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            total: AtomicU32::new(0),
            decay: Mutex::new(()),
        }
    }
}

impl std::fmt::Debug for PrefixTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTable")
            .field("recent_requests", &self.total.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl PrefixTable {
    /// Walks a request's chunks while they are hot and returns the deepest hot branch
    /// point. A counted walk (`mode.counts()`) counts the request in each chunk (and in
    /// a few cold ones past the first); an explanation's changes nothing.
    pub fn walk(&self, chunks: &mut Chunks<'_, '_>, mode: Mode) -> Depth {
        // The request's number in the window, when it is counted.
        let seq = mode.counts().then(|| {
            let seq = self.total.fetch_add(1, Ordering::Relaxed);
            if seq + 1 >= WINDOW {
                self.halve();
            }
            seq
        });
        self.walk_counting(chunks, seq)
    }

    fn hot_threshold(&self) -> u32 {
        HOT_MIN.max(self.total.load(Ordering::Relaxed) / HOT_SHARE)
    }

    fn walk_counting(&self, chunks: &mut Chunks<'_, '_>, seq: Option<u32>) -> Depth {
        let count = seq.is_some();
        let hot = self.hot_threshold();
        let mut depth = Depth {
            boundary: None,
            share: 0.0,
            hot_chunks: 0,
            stop: Stop::End,
        };
        let total = f64::from(self.total.load(Ordering::Relaxed).max(1));
        // Cold chunks still to count once the first cold one is met.
        let mut cold_left: Option<usize> = None;
        let mut current = chunks.next();
        while let Some(chunk) = current {
            let next = chunks.next();
            let slot = if let Some(seq) = seq {
                self.visit(chunk.hash, next.map(|c| c.hash), seq)
            } else {
                self.look(chunk.hash)
            };
            match cold_left.as_mut() {
                Some(0) => return depth,
                Some(left) => *left -= 1,
                None if slot.is_some_and(|s| s.count >= hot) => {
                    depth.hot_chunks += 1;
                    if let Some(s) = slot.filter(|s| s.branched) {
                        depth.boundary = Some(chunk);
                        depth.share = (f64::from(s.count) / total).min(1.0);
                    }
                }
                None => {
                    depth.stop = Stop::Cold;
                    if !count {
                        return depth;
                    }
                    cold_left = Some(LEARN_AHEAD);
                }
            }
            current = next;
        }
        if depth.stop == Stop::End && chunks.limited {
            depth.stop = Stop::MaxScan;
        }
        depth
    }

    fn look(&self, hash: u64) -> Option<Slot> {
        let slot = Slot::unpack(self.slots[slot_of(hash)].load(Ordering::Relaxed));
        (slot.tag == tag_of(hash)).then_some(slot)
    }

    /// Counts request number `seq` through `hash`, followed by `next` (a count above
    /// [`STRIDE_FROM`] in strides). Races between requests may lose an update; that only
    /// delays learning by a request. The slot is written only when it changes.
    fn visit(&self, hash: u64, next: Option<u64>, seq: u32) -> Option<Slot> {
        let cell = &self.slots[slot_of(hash)];
        let was = cell.load(Ordering::Relaxed);
        let mut slot = Slot::unpack(was);
        if slot.tag != tag_of(hash) {
            if slot.count >= 2 {
                // A busier chunk holds the slot: this one stays untracked (cold).
                return None;
            }
            slot = Slot {
                tag: tag_of(hash),
                count: 0,
                successor: 0,
                branched: false,
            };
        }
        slot.count = (slot.count + increment(slot.count, seq, hash)).min(0xFFFF);
        if let Some(next) = next.map(successor_tag) {
            match slot.successor {
                0 => slot.successor = next,
                s if s != next => slot.branched = true,
                _ => {}
            }
        }
        let now = slot.pack();
        if now != was {
            cell.store(now, Ordering::Relaxed);
        }
        Some(slot)
    }

    fn halve(&self) {
        // One thread decays; the others go on with slightly stale counts.
        let Some(_decaying) = self.decay.try_lock() else {
            return;
        };
        if self.total.load(Ordering::Relaxed) < WINDOW {
            return;
        }
        for cell in self.slots.iter() {
            let v = cell.load(Ordering::Relaxed);
            if v != 0 {
                let mut slot = Slot::unpack(v);
                slot.count /= 2;
                cell.store(slot.pack(), Ordering::Relaxed);
            }
        }
        self.total.store(WINDOW / 2, Ordering::Relaxed);
    }
}
