//! `continuations`: production-shaped prompt strings, built like the held-out trace the
//! balancer is judged on (its own shape, not its data). Every request opens with the
//! platform's preamble; most open a sequence of their own, the rest continue an
//! earlier request (its blocks, its answer, new text), and now and then one request is
//! continued twice (a retry, an edit, a parallel branch), so conversation prefixes
//! branch. Prompts are long and skewed (median ~7,000 tokens, mean ~12,000), answers
//! ~350 tokens, and requests arrive in bursts. Requests are block chains (Mooncake
//! style, 512-token blocks), sent as untemplated `/v1/completions` prompts, or as token
//! ids. Pure and seeded.

use super::{Conversation, Rng, Turn, TurnApi, Workload};
use crate::tools::engine_model::Prompt;

/// Tokens per block of a generated request.
pub const BLOCK_TOKENS: usize = 512;

/// What a `continuations` workload looks like.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Blocks of the preamble every request opens with (1 = 512 tokens).
    pub preamble_blocks: usize,
    /// Share of requests that continue an earlier one.
    pub continued: f64,
    /// Arrivals per second, on average.
    pub rate: f64,
    /// How long the requests keep arriving.
    pub seconds: f64,
}

impl Default for Shape {
    /// The held-out trace's shape: a 512-token preamble, 39 % of requests continuing
    /// an earlier one, 3.4 requests per second for an hour (about half the slots of 8
    /// engines at 4 in flight each).
    fn default() -> Self {
        Shape {
            preamble_blocks: 1,
            continued: 0.39,
            rate: 3.4,
            seconds: 3600.0,
        }
    }
}

/// The named variants: what a router could overfit (preamble length, how much
/// continues, how loaded the fleet is), each a change of one number.
pub fn shape_of(name: &str) -> Option<Shape> {
    let base = Shape::default();
    Some(match name {
        "continuations" => base,
        "continuations-no-preamble" => Shape {
            preamble_blocks: 0,
            ..base
        },
        "continuations-preamble-4096" => Shape {
            preamble_blocks: 8,
            ..base
        },
        "continuations-20" => Shape {
            continued: 0.2,
            ..base
        },
        "continuations-60" => Shape {
            continued: 0.6,
            ..base
        },
        "continuations-busy" => Shape {
            rate: 1.5 * base.rate,
            ..base
        },
        _ => return None,
    })
}

/// The variants by name.
pub const NAMES: [&str; 6] = [
    "continuations",
    "continuations-no-preamble",
    "continuations-preamble-4096",
    "continuations-20",
    "continuations-60",
    "continuations-busy",
];

/// One generated request: when, how long, its blocks.
struct Request {
    at: f64,
    tokens: usize,
    output: usize,
    blocks: Vec<u64>,
}

/// A draw from a log-normal of this median and shape (`sigma` of the log), clamped.
fn log_normal(rng: &mut Rng, median: f64, sigma: f64, lo: usize, hi: usize) -> usize {
    // Box–Muller.
    let (u, v) = (rng.unit().max(1e-12), rng.unit());
    let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
    ((median * (sigma * z).exp()) as usize).clamp(lo, hi)
}

/// An exponential draw of this mean.
fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.unit()).max(1e-12).ln()
}

/// Generates the workload of `shape` for `seconds × scale`, every request its own
/// one-turn conversation arriving at its time (a trace, open loop).
pub fn generate(name: &str, shape: Shape, seed: u64, scale: f64, api: TurnApi) -> Workload {
    let mut rng = Rng::new(seed ^ 0xC0_4717);
    let horizon = shape.seconds * scale;
    let mut next_id = shape.preamble_blocks as u64;
    let mut fresh = |n: usize| {
        let ids = (next_id..next_id + n as u64).collect::<Vec<_>>();
        next_id += n as u64;
        ids
    };
    let preamble: Vec<u64> = (0..shape.preamble_blocks as u64).collect();
    let preamble_tokens = shape.preamble_blocks * BLOCK_TOKENS;
    // Sequences open in bursts (an agent fanning out, a batch submitted at once).
    let mut requests: Vec<Request> = Vec::new();
    let burst_mean = 2.0;
    let opening_rate = shape.rate * (1.0 - shape.continued) / burst_mean;
    let mut t = 0.0;
    loop {
        t += exponential(&mut rng, 1.0 / opening_rate.max(1e-9));
        if t >= horizon {
            break;
        }
        let size = 1 + (exponential(&mut rng, burst_mean - 1.0)).round() as usize;
        for k in 0..size {
            let own = log_normal(&mut rng, 6_000.0, 1.0, 256, 100_000);
            let tokens = preamble_tokens + own;
            let mut blocks = preamble.clone();
            blocks.extend(fresh(tokens.div_ceil(BLOCK_TOKENS) - preamble.len()));
            requests.push(Request {
                at: t + 0.05 * k as f64 + 0.1 * rng.unit(),
                tokens,
                output: log_normal(&mut rng, 250.0, 0.8, 8, 4_000),
                blocks,
            });
        }
    }
    // Continuations, in order of their parents: each request is continued once with
    // probability `continued` × 0.9 (its next turn, after its answer and some thought)
    // and once more with `continued` × 0.1 (a retry or an edit soon after), so a
    // `continued` share of all requests continue another and about one shared
    // conversation prefix in ten branches.
    let (next, again) = (shape.continued * 0.9, shape.continued * 0.1);
    let mut i = 0;
    while i < requests.len() {
        for (p, gap) in [(next, 20.0), (again, 5.0)] {
            if rng.unit() >= p {
                continue;
            }
            let parent = &requests[i];
            let at = parent.at + 2.0 + exponential(&mut rng, gap);
            if at >= horizon {
                continue;
            }
            let added = parent.output + log_normal(&mut rng, 700.0, 1.2, 16, 32_000);
            let tokens = parent.tokens + added;
            let kept = parent.tokens / BLOCK_TOKENS;
            let mut blocks = parent.blocks[..kept].to_vec();
            blocks.extend(fresh(tokens.div_ceil(BLOCK_TOKENS) - kept));
            let output = log_normal(&mut rng, 250.0, 0.8, 8, 4_000);
            requests.push(Request {
                at,
                tokens,
                output,
                blocks,
            });
        }
        i += 1;
    }
    requests.sort_by(|a, b| a.at.total_cmp(&b.at));
    let conversations = requests
        .into_iter()
        .map(|r| Conversation {
            tenant: None,
            turns: vec![Turn {
                messages: Vec::new(),
                api,
                output_tokens: r.output,
                delay: r.at,
                trace: Some(Prompt::from_blocks(r.tokens, r.blocks, BLOCK_TOKENS)),
            }],
        })
        .collect();
    Workload {
        name: name.to_string(),
        conversations,
    }
}

/// The share of a workload's prompt blocks that an infinite cache could serve: those
/// that lead a prompt as far as some earlier prompt led with the same blocks.
pub fn reusable_share(w: &Workload) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut reusable, mut all) = (0usize, 0usize);
    for t in w.conversations.iter().flat_map(|c| c.turns.iter()) {
        let p = t.prompt();
        let hit = p.blocks.iter().take_while(|b| seen.contains(*b)).count();
        reusable += hit;
        all += p.blocks.len();
        seen.extend(p.blocks.iter().copied());
    }
    reusable as f64 / all.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn prompts(w: &Workload) -> Vec<Prompt> {
        w.conversations
            .iter()
            .map(|c| c.turns[0].prompt())
            .collect()
    }

    /// The share of prompts whose block at `at` (their first block of their own, past
    /// the preamble) led an earlier prompt too: the share that continues another.
    fn continued_share(prompts: &[Prompt], at: usize) -> f64 {
        let mut seen = HashSet::new();
        let continued = prompts
            .iter()
            .filter(|p| p.blocks.get(at).is_some_and(|b| !seen.insert(*b)))
            .count();
        continued as f64 / prompts.len() as f64
    }

    #[test]
    fn the_default_has_the_held_out_traces_shape() {
        let w = generate(
            "continuations",
            Shape::default(),
            1,
            0.25,
            TurnApi::Completions,
        );
        let prompts = prompts(&w);
        let n = prompts.len() as f64;
        let rate = n / (0.25 * 3600.0);
        assert!((3.0..3.8).contains(&rate), "{rate} requests/s");
        let mut tokens: Vec<usize> = prompts.iter().map(|p| p.tokens).collect();
        tokens.sort_unstable();
        let mean = tokens.iter().sum::<usize>() as f64 / n;
        let median = tokens[tokens.len() / 2];
        assert!((10_000.0..14_000.0).contains(&mean), "mean {mean}");
        assert!((5_500..8_500).contains(&median), "median {median}");
        assert!(prompts.iter().all(|p| p.blocks[0] == 0), "the preamble");
        let continued = continued_share(&prompts, 1);
        assert!((0.33..0.45).contains(&continued), "continued {continued}");
        let reusable = reusable_share(&w);
        assert!((0.30..0.43).contains(&reusable), "reusable {reusable}");
        let arrivals: Vec<f64> = w.conversations.iter().map(|c| c.turns[0].delay).collect();
        let same_second = arrivals
            .windows(2)
            .filter(|w| w[0].floor() == w[1].floor())
            .count() as f64
            / n;
        assert!(same_second > 0.5, "bursts: {same_second}");
    }

    #[test]
    fn variants_change_one_thing_each() {
        let of = |name| generate(name, shape_of(name).unwrap(), 2, 0.1, TurnApi::Completions);
        let none = prompts(&of("continuations-no-preamble"));
        assert!(
            continued_share(&none, 0) < 0.5,
            "no block opens every prompt"
        );
        let long = prompts(&of("continuations-preamble-4096"));
        assert!(long
            .iter()
            .all(|p| p.blocks[..8] == [0, 1, 2, 3, 4, 5, 6, 7]));
        let (few, many) = (
            continued_share(&prompts(&of("continuations-20")), 1),
            continued_share(&prompts(&of("continuations-60")), 1),
        );
        assert!(few < 0.27 && many > 0.5, "{few} {many}");
        let busy = of("continuations-busy").requests() as f64;
        let base = of("continuations").requests() as f64;
        assert!((1.35..1.65).contains(&(busy / base)), "{busy} vs {base}");
        let a = generate("x", Shape::default(), 3, 0.05, TurnApi::Completions);
        let b = generate("x", Shape::default(), 3, 0.05, TurnApi::Completions);
        assert_eq!(prompts(&a), prompts(&b), "seeded");
    }
}
