//! Workloads for the simulator and the load generator: seeded synthetic generators
//! (`multi-turn`, `shared-prefix`, `rag`, `agentic`, …) that produce real chat
//! messages, [`continuations`] (production-shaped prompt strings that continue earlier
//! requests, as block chains), and Mooncake traces ([`trace`]). Pure: text in, text out.

use std::sync::Arc;

use crate::tools::engine_model::Prompt;

pub mod continuations;
pub mod trace;

pub use trace::{to_trace, token_ids, trace, trace_text};

/// A small seeded generator (xorshift64*): the same seed gives the same workload.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

const WORDS: [&str; 32] = [
    "cluster",
    "latency",
    "token",
    "cache",
    "prefix",
    "engine",
    "request",
    "stream",
    "model",
    "batch",
    "memory",
    "kernel",
    "driver",
    "queue",
    "replica",
    "shard",
    "tensor",
    "layer",
    "weight",
    "budget",
    "scheduler",
    "node",
    "router",
    "ring",
    "block",
    "attention",
    "decode",
    "prefill",
    "throughput",
    "window",
    "session",
    "context",
];

/// About `tokens` tokens (≈ 4 chars each) of seeded prose.
pub fn prose(rng: &mut Rng, tokens: usize) -> String {
    let chars = tokens * 4;
    let mut s = String::with_capacity(chars + 16);
    while s.len() < chars {
        s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        s.push(if rng.next_u64() % 9 == 0 { '\n' } else { ' ' });
    }
    s.truncate(chars);
    s
}

/// A chat message.
#[derive(Debug, Clone)]
pub struct Message {
    pub role: &'static str,
    pub content: Arc<str>,
}

/// The API a synthetic request is sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnApi {
    /// `/v1/chat/completions` with the messages.
    Chat,
    /// `/v1/completions` with the messages rendered by a ChatML chat template into one
    /// `prompt` (what a client that applies its own template sends); a trace request's
    /// blocks as text.
    Completions,
    /// A trace request's blocks as token ids: `/v1/completions` with a token array.
    TokenIds,
    /// A trace request's blocks as token ids: SGLang's `/generate` with `input_ids`.
    Generate,
    /// Anthropic's `/v1/messages` with the messages as an agent client sends them
    /// (system on top, content as text blocks, a cache marker on the newest block).
    Messages,
}

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct Turn {
    /// This request's messages (earlier turns and answers included).
    pub messages: Vec<Message>,
    pub api: TurnApi,
    pub output_tokens: usize,
    /// Seconds after the previous turn's answer (think time); for a conversation's
    /// first turn (or a trace request), its arrival time.
    pub delay: f64,
    /// Trace requests: the prompt as given.
    pub trace: Option<Prompt>,
}

/// A sequence of turns; turn k + 1 is sent `delay` after turn k's answer.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub turns: Vec<Turn>,
    /// Whose it is, where the workload says (`multi-tenant-flood`).
    pub tenant: Option<Tenant>,
}

/// A conversation's tenant and priority class (0 is the highest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant {
    pub name: &'static str,
    pub class: usize,
}

/// A workload: conversations, replayed conversation-faithfully.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: String,
    pub conversations: Vec<Conversation>,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.conversations.iter().map(|c| c.turns.len()).sum()
    }
}

impl Turn {
    /// The prompt text as an engine renders it (`role \n content \n` per message, as
    /// `mock-engine` does; a completions prompt as it is), for the cache model.
    pub fn prompt(&self) -> Prompt {
        if let Some(p) = &self.trace {
            return p.clone();
        }
        if self.api == TurnApi::Completions {
            return Prompt::from_text(&chatml(&self.messages));
        }
        let mut text = String::new();
        for m in &self.messages {
            text.push_str(m.role);
            text.push('\n');
            text.push_str(&m.content);
            text.push('\n');
        }
        Prompt::from_text(&text)
    }

    /// The request body a client would send.
    pub fn body(&self, model: &str) -> Vec<u8> {
        if let Some(p) = &self.trace {
            // Traces carry block ids, not text: a completions prompt of their text, or
            // their token ids.
            let body = match self.api {
                TurnApi::TokenIds => {
                    serde_json::json!({"model": model, "prompt": trace::token_ids(p)})
                }
                TurnApi::Generate => {
                    serde_json::json!({"model": model, "input_ids": trace::token_ids(p)})
                }
                _ => serde_json::json!({"model": model, "prompt": trace_text(p)}),
            };
            return serde_json::to_vec(&body).unwrap_or_default();
        }
        if self.api == TurnApi::Completions {
            return serde_json::to_vec(&serde_json::json!({
                "model": model, "prompt": chatml(&self.messages), "max_tokens": self.output_tokens, "stream": true,
            }))
            .unwrap_or_default();
        }
        let messages: Vec<serde_json::Value> = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| crate::tools::bench::message_json(m.role, &m.content, i))
            .collect();
        if self.api == TurnApi::Messages {
            let body =
                crate::tools::bench::anthropic_body(model, &messages, self.output_tokens, true);
            return serde_json::to_vec(&body).unwrap_or_default();
        }
        serde_json::to_vec(&serde_json::json!({
            "model": model, "messages": messages, "max_tokens": self.output_tokens, "stream": true,
        }))
        .unwrap_or_default()
    }

    /// The path of `body`.
    pub fn path(&self) -> &'static str {
        match self.api {
            TurnApi::Generate => "/generate",
            _ if self.trace.is_some() => "/v1/completions",
            TurnApi::Chat => "/v1/chat/completions",
            TurnApi::Messages => "/v1/messages",
            TurnApi::Completions | TurnApi::TokenIds => "/v1/completions",
        }
    }
}

/// Messages rendered with the ChatML template, ready for the assistant's answer.
pub fn chatml(messages: &[Message]) -> String {
    let mut text = String::new();
    for m in messages {
        text.push_str("<|im_start|>");
        text.push_str(m.role);
        text.push('\n');
        text.push_str(&m.content);
        text.push_str("<|im_end|>\n");
    }
    text.push_str("<|im_start|>assistant\n");
    text
}

/// The synthetic workloads by name. Any of them with `-completions` appended is sent
/// to `/v1/completions`, its messages rendered by a ChatML template into one prompt;
/// with `-messages`, to Anthropic's `/v1/messages`.
pub const NAMES: [&str; 10] = [
    "multi-turn",
    "doc-qa",
    "shared-prefix",
    "rag",
    "agentic",
    "multi-tenant",
    "long-preamble-512",
    "long-preamble-2048",
    "long-preamble-8192",
    "multi-tenant-flood",
];

/// Builds a synthetic workload. `scale` multiplies its number of conversations.
pub fn synthetic(name: &str, seed: u64, scale: f64) -> Option<Workload> {
    let mut rng = Rng::new(seed);
    let n = |base: usize| ((base as f64 * scale).round() as usize).max(1);
    // `continuations[-VARIANT]`, as text prompts, or with `-tokens` / `-generate` as
    // token ids to `/v1/completions` / `/generate`.
    let (shape_name, api) = match (name.strip_suffix("-tokens"), name.strip_suffix("-generate")) {
        (Some(base), _) => (base, TurnApi::TokenIds),
        (_, Some(base)) => (base, TurnApi::Generate),
        _ => (name, TurnApi::Completions),
    };
    if let Some(shape) = continuations::shape_of(shape_name) {
        return Some(continuations::generate(name, shape, seed, scale, api));
    }
    let (base, api) = match (
        name.strip_suffix("-completions"),
        name.strip_suffix("-messages"),
    ) {
        (Some(base), _) => (base, TurnApi::Completions),
        (_, Some(base)) => (base, TurnApi::Messages),
        _ => (name, TurnApi::Chat),
    };
    let mut conversations = match base {
        "multi-turn" => multi_turn(&mut rng, n(96), 8),
        "doc-qa" => doc_qa(&mut rng, n(12), 4),
        "shared-prefix" => shared_prefix(&mut rng, n(64), 16),
        "rag" => rag(&mut rng, n(800)),
        "agentic" => agentic(&mut rng, n(24), 16),
        "multi-tenant" => multi_tenant(&mut rng, n(96), 8),
        "long-preamble-512" => long_preamble(&mut rng, n(96), 8, 512),
        "long-preamble-2048" => long_preamble(&mut rng, n(96), 8, 2048),
        "long-preamble-8192" => long_preamble(&mut rng, n(96), 8, 8192),
        "multi-tenant-flood" => multi_tenant_flood(&mut rng, n(48), n(400)),
        _ => return None,
    };
    for turn in conversations.iter_mut().flat_map(|c| c.turns.iter_mut()) {
        turn.api = api;
    }
    Some(Workload {
        name: name.to_string(),
        conversations,
    })
}

fn msg(role: &'static str, content: String) -> Message {
    Message {
        role,
        content: content.into(),
    }
}

/// Users chatting: one shared system prompt (~200 tokens), an opening message of
/// 200–600 tokens, follow-ups of 30–150, answers of 50–250; 5–20 s of thought.
fn multi_turn(rng: &mut Rng, users: usize, rounds: usize) -> Vec<Conversation> {
    let system: Arc<str> = format!(
        "You are a helpful assistant for GPU cluster operators. {}",
        prose(rng, 180)
    )
    .into();
    chats(rng, users, rounds, |_| Opening::System(system.clone()))
}

/// Questions about a document: each conversation opens with its own document (400–800
/// tokens, no system prompt) and a question, then asks short follow-ups (20–60
/// tokens). Small enough for CPU engines (`scripts/real_engine.sh`).
fn doc_qa(rng: &mut Rng, users: usize, rounds: usize) -> Vec<Conversation> {
    (0..users)
        .map(|u| {
            let mut history = Vec::new();
            let mut turns = Vec::new();
            for r in 0..rounds {
                let text = if r == 0 {
                    let doc = rng.range(400, 800) as usize;
                    format!(
                        "Document {u}: {}\n\nQuestion: {}",
                        prose(rng, doc),
                        prose(rng, 20)
                    )
                } else {
                    let len = rng.range(20, 60) as usize;
                    format!("Follow-up {r}: {}", prose(rng, len))
                };
                history.push(msg("user", text));
                let output = rng.range(30, 120) as usize;
                turns.push(Turn {
                    messages: history.clone(),
                    api: TurnApi::Chat,
                    output_tokens: output,
                    delay: if r == 0 {
                        u as f64 * 0.5
                    } else {
                        2.0 + rng.unit() * 8.0
                    },
                    trace: None,
                });
                history.push(msg("assistant", prose(rng, output)));
            }
            Conversation {
                turns,
                tenant: None,
            }
        })
        .collect()
}

/// `multi-turn` with no system prompt: every conversation's first user message starts
/// with the same block of `block_tokens` tokens (instructions or a document pasted
/// into the prompt text, as production traffic often has it), then its own text.
fn long_preamble(
    rng: &mut Rng,
    users: usize,
    rounds: usize,
    block_tokens: usize,
) -> Vec<Conversation> {
    let block: Arc<str> = format!(
        "Read these operating instructions before you answer. {}\n\n",
        prose(rng, block_tokens)
    )
    .into();
    chats(rng, users, rounds, |_| Opening::Preamble(block.clone()))
}

/// `multi-turn` behind many short system prompts: 40 tenants (~25 tokens of prompt
/// each), users drawn Zipf (s = 1) over them, so a few tenants are hot and most cold.
fn multi_tenant(rng: &mut Rng, users: usize, rounds: usize) -> Vec<Conversation> {
    let tenants: Vec<Arc<str>> = (0..40)
        .map(|t| format!("You are the assistant of tenant {t}. {}", prose(rng, 20)).into())
        .collect();
    let weights: Vec<f64> = (1..=tenants.len()).map(|k| 1.0 / k as f64).collect();
    let of_user: Vec<usize> = (0..users).map(|_| zipf(rng, &weights)).collect();
    chats(rng, users, rounds, |u| {
        Opening::System(tenants[of_user[u]].clone())
    })
}

/// A shared pool under a batch flood: `chats` interactive users (tenant `chat`, class
/// 0, multi-turn chats as `multi-turn`'s) while tenant `batch` (class 1) sends `jobs`
/// single requests all in the first ten seconds (1,000-2,000-token documents to
/// summarize, 300-600 output tokens each): far more than the fleet serves at once.
fn multi_tenant_flood(rng: &mut Rng, chats_n: usize, jobs: usize) -> Vec<Conversation> {
    let mut out = multi_turn(rng, chats_n, 8);
    for c in &mut out {
        c.tenant = Some(Tenant {
            name: "chat",
            class: 0,
        });
    }
    let system: Arc<str> = "Summarize the document for the weekly report.".into();
    for _ in 0..jobs {
        let len = rng.range(1000, 2000) as usize;
        let doc = prose(rng, len);
        out.push(Conversation {
            tenant: Some(Tenant {
                name: "batch",
                class: 1,
            }),
            turns: vec![Turn {
                messages: vec![
                    Message {
                        role: "system",
                        content: system.clone(),
                    },
                    msg("user", doc),
                ],
                api: TurnApi::Chat,
                output_tokens: rng.range(300, 600) as usize,
                delay: rng.unit() * 10.0,
                trace: None,
            }],
        });
    }
    out
}

/// What comes before a chat's own text.
enum Opening {
    /// A system message.
    System(Arc<str>),
    /// No system message; the first user message starts with this text.
    Preamble(Arc<str>),
}

/// An index drawn with probability proportional to `weights`.
fn zipf(rng: &mut Rng, weights: &[f64]) -> usize {
    let mut x = rng.unit() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len() - 1
}

/// Multi-turn chats, user `u` behind `opening_of(u)`.
fn chats(
    rng: &mut Rng,
    users: usize,
    rounds: usize,
    opening_of: impl Fn(usize) -> Opening,
) -> Vec<Conversation> {
    (0..users)
        .map(|u| {
            let (mut history, preamble) = match opening_of(u) {
                Opening::System(system) => (
                    vec![Message {
                        role: "system",
                        content: system,
                    }],
                    None,
                ),
                Opening::Preamble(text) => (Vec::new(), Some(text)),
            };
            let mut turns = Vec::new();
            for r in 0..rounds {
                let len = if r == 0 {
                    rng.range(200, 600)
                } else {
                    rng.range(30, 150)
                };
                let lead = match (&preamble, r) {
                    (Some(p), 0) => &**p,
                    _ => "",
                };
                history.push(msg(
                    "user",
                    format!("{lead}user {u} turn {r}: {}", prose(rng, len as usize)),
                ));
                let output = rng.range(50, 250) as usize;
                let delay = if r == 0 {
                    u as f64 * 0.2
                } else {
                    5.0 + rng.unit() * 15.0
                };
                turns.push(Turn {
                    messages: history.clone(),
                    api: TurnApi::Chat,
                    output_tokens: output,
                    delay,
                    trace: None,
                });
                history.push(msg("assistant", prose(rng, output)));
            }
            Conversation {
                turns,
                tenant: None,
            }
        })
        .collect()
}

/// SGLang's generated-shared-prefix: groups sharing a 2,048-token prefix, each with
/// single-turn 128-token questions, arriving interleaved.
fn shared_prefix(rng: &mut Rng, groups: usize, per_group: usize) -> Vec<Conversation> {
    let prefixes: Vec<Arc<str>> = (0..groups)
        .map(|g| format!("group {g}: {}", prose(rng, 2048)).into())
        .collect();
    let total = groups * per_group;
    let mut order: Vec<usize> = (0..total).collect();
    for i in (1..total).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
        .into_iter()
        .enumerate()
        .map(|(k, i)| {
            let g = i % groups;
            Conversation {
                tenant: None,
                turns: vec![Turn {
                    messages: vec![
                        Message {
                            role: "system",
                            content: prefixes[g].clone(),
                        },
                        msg("user", prose(rng, 128)),
                    ],
                    api: TurnApi::Chat,
                    output_tokens: rng.range(32, 128) as usize,
                    delay: k as f64 * 0.05,
                    trace: None,
                }],
            }
        })
        .collect()
}

/// Retrieval-augmented questions: a shared template, then two documents drawn Zipf
/// (s = 1) from a pool of 200 (~500 tokens each), then a question.
fn rag(rng: &mut Rng, requests: usize) -> Vec<Conversation> {
    let template: Arc<str> = format!("Answer from the documents only. {}", prose(rng, 300)).into();
    let docs: Vec<String> = (0..200)
        .map(|d| format!("[doc {d}] {}", prose(rng, 500)))
        .collect();
    let weights: Vec<f64> = (1..=docs.len()).map(|k| 1.0 / k as f64).collect();
    (0..requests)
        .map(|k| {
            let (a, b) = (zipf(rng, &weights), zipf(rng, &weights));
            Conversation {
                tenant: None,
                turns: vec![Turn {
                    messages: vec![
                        Message {
                            role: "system",
                            content: template.clone(),
                        },
                        msg(
                            "user",
                            format!("{}\n{}\nQuestion: {}", docs[a], docs[b], prose(rng, 60)),
                        ),
                    ],
                    api: TurnApi::Chat,
                    output_tokens: rng.range(40, 160) as usize,
                    delay: k as f64 * 0.02,
                    trace: None,
                }],
            }
        })
        .collect()
}

/// Agents in tool loops: a long system prompt with tool descriptions (~1,500 tokens),
/// a task, then per step a short tool call and a long tool result (200–800 tokens),
/// half a second apart.
fn agentic(rng: &mut Rng, agents: usize, steps: usize) -> Vec<Conversation> {
    let system: Arc<str> = format!("You are a coding agent. Tools: {}", prose(rng, 1500)).into();
    (0..agents)
        .map(|a| {
            let mut history = vec![
                Message {
                    role: "system",
                    content: system.clone(),
                },
                msg("user", format!("task {a}: {}", prose(rng, 200))),
            ];
            let mut turns = Vec::new();
            for s in 0..steps {
                turns.push(Turn {
                    messages: history.clone(),
                    api: TurnApi::Chat,
                    output_tokens: rng.range(30, 80) as usize,
                    delay: if s == 0 { a as f64 * 0.5 } else { 0.5 },
                    trace: None,
                });
                history.push(msg("assistant", format!("call tool {}", prose(rng, 40))));
                let result_len = rng.range(200, 800) as usize;
                history.push(msg("tool", prose(rng, result_len)));
            }
            Conversation {
                turns,
                tenant: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generators_are_deterministic_and_conversations_grow() {
        for name in NAMES {
            let a = synthetic(name, 7, 0.1).unwrap();
            let b = synthetic(name, 7, 0.1).unwrap();
            assert_eq!(a.requests(), b.requests());
            let (pa, pb) = (
                a.conversations[0].turns[0].prompt(),
                b.conversations[0].turns[0].prompt(),
            );
            assert_eq!(pa, pb, "{name}");
        }
        let w = synthetic("multi-turn", 1, 0.1).unwrap();
        let c = &w.conversations[0];
        let (p0, p1) = (c.turns[0].prompt(), c.turns[1].prompt());
        assert!(p1.tokens > p0.tokens);
        assert_eq!(
            p1.blocks[..p0.blocks.len() - 1],
            p0.blocks[..p0.blocks.len() - 1],
            "turn 2 extends turn 1"
        );
    }
}
