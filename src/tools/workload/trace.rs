//! Mooncake JSON-lines traces (`{"timestamp", "input_length", "output_length",
//! "hash_ids"}`): read into a workload, written from one, and rendered as prompt text
//! for the balancer's key. Pure.

use std::collections::HashMap;

use serde::Deserialize;

use super::{Conversation, Turn, TurnApi, Workload};
use crate::tools::engine_model::Prompt;

/// A trace prompt as text: each block is its id padded to the block's length in
/// characters (≈ 4 per token), so requests sharing leading blocks share leading text,
/// a routing key of `prefix_chars` characters covers as many tokens as it would of
/// real text, and an engine model counts about the trace's tokens.
pub fn trace_text(p: &Prompt) -> String {
    let per_block = p.block_tokens * crate::tools::engine_model::CHARS_PER_TOKEN;
    let mut text = String::with_capacity(p.blocks.len() * per_block);
    for b in &p.blocks {
        let id = format!("{b:016x} ");
        text.push_str(&id);
        let pad = per_block.saturating_sub(id.len());
        text.extend(std::iter::repeat_n('.', pad));
    }
    text
}

/// A trace prompt as token ids: each block its `block_tokens` ids derived from its id
/// (the last block cut to the prompt's length), so prompts sharing leading blocks share
/// leading ids.
pub fn token_ids(p: &Prompt) -> Vec<u32> {
    let mut ids = Vec::with_capacity(p.tokens);
    for &b in &p.blocks {
        let mut x = b.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for _ in 0..p.block_tokens {
            if ids.len() == p.tokens {
                return ids;
            }
            // xorshift: a vocabulary of 32,000 ids.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ids.push((x % 32_000) as u32);
        }
    }
    ids
}

/// One line of a Mooncake trace.
#[derive(Debug, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake JSON-lines trace; each request is its own conversation, arriving
/// at its timestamp (ms).
pub fn trace(text: &str, block_tokens: usize) -> Result<Workload, String> {
    let mut conversations = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let t: TraceLine =
            serde_json::from_str(line).map_err(|e| format!("trace line {}: {e}", i + 1))?;
        conversations.push(Conversation {
            tenant: None,
            turns: vec![Turn {
                messages: Vec::new(),
                api: TurnApi::Completions,
                output_tokens: t.output_length,
                delay: t.timestamp / 1000.0,
                trace: Some(Prompt::from_blocks(
                    t.input_length,
                    t.hash_ids,
                    block_tokens,
                )),
            }],
        });
    }
    Ok(Workload {
        name: "trace".into(),
        conversations,
    })
}

/// Writes a workload as a Mooncake trace (512-token blocks, ids numbered in order of
/// first appearance; timestamps assume answers take no time).
pub fn to_trace(w: &Workload) -> String {
    let mut ids: HashMap<u64, u64> = HashMap::new();
    let mut lines = Vec::new();
    for c in &w.conversations {
        let mut at = 0.0;
        for (k, t) in c.turns.iter().enumerate() {
            at = if k == 0 { t.delay } else { at + t.delay };
            let p = t.prompt();
            // The last block hash of every 512 tokens names the prefix up to there (every
            // 32nd of a text prompt's 16-token blocks; each of a 512-token trace's).
            let per = (512 / p.block_tokens.max(1)).max(1);
            let hash_ids: Vec<u64> = p
                .blocks
                .iter()
                .skip(per - 1)
                .step_by(per)
                .map(|h| {
                    let next = ids.len() as u64;
                    *ids.entry(*h).or_insert(next)
                })
                .collect();
            lines.push((
                at,
                serde_json::json!({
                    "timestamp": (at * 1000.0).round() as u64, "input_length": p.tokens,
                    "output_length": t.output_tokens, "hash_ids": hash_ids,
                }),
            ));
        }
    }
    lines.sort_by(|a, b| a.0.total_cmp(&b.0));
    lines
        .into_iter()
        .map(|(_, l)| l.to_string() + "\n")
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::workload::synthetic;

    #[test]
    fn traces_round_trip() {
        let w = synthetic("shared-prefix", 3, 0.05).unwrap();
        let text = to_trace(&w);
        let t = trace(&text, 512).unwrap();
        assert_eq!(t.requests(), w.requests());
        let first = t.conversations[0].turns[0].trace.as_ref().unwrap();
        assert_eq!(first.block_tokens, 512);
        assert!(
            first.tokens > 2048 && first.blocks.len() == 4,
            "{} tokens, {} blocks",
            first.tokens,
            first.blocks.len()
        );
        assert!(trace("{\"timestamp\": 1}", 512).is_err());
    }
}
