//! The routing key: which bytes of a request decide its home on the ring, and its
//! hashes. The key comes from a key header, the prompt fields the facts scan kept, or
//! the raw body. `conversation` and `prefix` keys cut each part to `prefix_chars`
//! characters; a `hybrid` key is the conversation part that follows the request's
//! shared prefix (found from the pool's traffic by [`super::prefix`]), which also
//! names its prefix group. The work per request is bounded whatever the body's size.
//! Pure but for the prefix table's counters.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

use super::facts::{self, Envelope, Message, PrefixFound};
pub use super::facts::{
    Api, BodySpans, KeyError, KeySource, ObjectSpan, RequestFacts, StreamOptionsSpan,
    TokenEstimate, Turn,
};
pub use super::group::Grouping;
use super::key_text::KeyText;
use super::prefix::{Chunks, Pos, PrefixTable, Segment, Stop};
use crate::config::KeyMode;

/// How to build keys: the `[routing]` settings that matter here.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub mode: KeyMode,
    /// `conversation`/`prefix`: characters per part; `hybrid`: bytes of the
    /// conversation part.
    pub prefix_chars: usize,
    /// `hybrid`: most bytes of canonical text walked for the shared prefix.
    pub max_scan_bytes: usize,
    /// `routing.hash_seed`: seeds the prefix chain too, so replicas agree.
    pub seed: u64,
}

impl KeySpec {
    /// A spec with the default scan and seed.
    pub const fn new(mode: KeyMode, prefix_chars: usize) -> KeySpec {
        KeySpec {
            mode,
            prefix_chars,
            max_scan_bytes: 64 * 1024,
            seed: 0,
        }
    }
}

/// Where a `hybrid` key's shared prefix is learned: a pool's table, counted in
/// (`Observe`, a request being routed) or only read (`Peek`, an explanation); or
/// nowhere (the structural end of the system part is used).
#[derive(Debug, Clone, Copy)]
pub enum Learned<'t> {
    Nowhere,
    Observe(&'t PrefixTable),
    Peek(&'t PrefixTable),
}

/// Reads a request body for routing. `header_key` is the value of the key header, if
/// the request has one; it wins over the prompt.
pub fn extract(
    api: Api,
    body: &[u8],
    header_key: Option<&[u8]>,
    spec: KeySpec,
) -> Result<RequestFacts, KeyError> {
    let envelope = facts::read(api, body)?;
    Ok(facts_of(
        api,
        body,
        envelope.as_ref(),
        header_key,
        spec,
        Learned::Nowhere,
    ))
}

/// The facts of a body whose envelope was read already, with a `hybrid` key's prefix
/// learned where `learned` says.
pub fn facts_of(
    api: Api,
    body: &[u8],
    envelope: Option<&Envelope<'_>>,
    header_key: Option<&[u8]>,
    spec: KeySpec,
    learned: Learned<'_>,
) -> RequestFacts {
    let (model, stream, wants_reasoning, spans, include_usage) = match envelope {
        Some(env) => (
            env.model.as_deref().map(str::to_owned),
            env.stream == Some(true),
            env.wants_reasoning,
            env.spans.clone(),
            env.include_usage,
        ),
        None => (None, false, false, BodySpans::default(), false),
    };

    let raw = || PromptKey {
        key: raw_prefix(body, spec.prefix_chars),
        group: Grouping::Ring,
        prefix: None,
        turn: None,
    };
    let (k, source) = match (header_key, envelope) {
        (Some(h), _) => (
            PromptKey {
                key: h.to_vec(),
                group: Grouping::Ring,
                prefix: None,
                turn: None,
            },
            KeySource::Header,
        ),
        (None, Some(env)) if spec.mode == KeyMode::Hybrid => {
            match hybrid_key(api, env, spec, learned) {
                Some(k) => (k, KeySource::Prompt),
                None => (raw(), KeySource::Raw),
            }
        }
        (None, Some(env)) => match prompt_key(api, env, spec) {
            Some((text, group)) => (
                PromptKey {
                    key: text.into_bytes(),
                    group,
                    prefix: None,
                    turn: None,
                },
                KeySource::Prompt,
            ),
            None => (raw(), KeySource::Raw),
        },
        (None, None) => (raw(), KeySource::Raw),
    };
    let (turn, tokens) = envelope.map_or((Turn::Unknown, TokenEstimate::default()), |env| {
        shape(api, env, body.len())
    });
    let (turn, tokens) = match k.turn {
        Some((t, history)) => (t, TokenEstimate::of_bytes(body.len(), history)),
        None => (turn, tokens),
    };
    RequestFacts {
        model,
        stream,
        wants_reasoning,
        include_usage,
        spans,
        key: k.key,
        group: k.group,
        prefix: k.prefix,
        source,
        turn,
        tokens,
    }
}

/// Which turn a request is, and its size: a message list with an assistant or tool
/// message continues a conversation, whose history is everything before its last
/// message.
fn shape(api: Api, env: &Envelope<'_>, body_len: usize) -> (Turn, TokenEstimate) {
    let messages = match api {
        Api::Chat | Api::Other => env.messages.as_deref(),
        _ => None,
    };
    let Some(messages) = messages else {
        return (Turn::Unknown, TokenEstimate::of_bytes(body_len, 0));
    };
    let size = |m: &Message<'_>| m.content.map_or(0, str::len) + 8;
    let total: usize = messages.iter().map(size).sum::<usize>() + env.tools.map_or(0, str::len);
    let last = messages.last().map_or(0, size);
    let answered = messages
        .iter()
        .any(|m| matches!(m.role.as_deref(), Some("assistant" | "tool" | "function")));
    let turn = if answered { Turn::Later } else { Turn::First };
    (turn, TokenEstimate::of_bytes(total, total - last))
}

/// `h = xxh3_64(pool ‖ 0x00 ‖ key, seed)`: the key's position on the pool's ring.
/// Deterministic across processes, restarts and replicas.
pub fn key_hash(pool: &str, key: &[u8], seed: u64) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    h.update(pool.as_bytes());
    h.update(&[0]);
    h.update(key);
    h.digest()
}

/// A key, how it is placed, and for `hybrid` the prefix in front of it.
struct PromptKey {
    key: Vec<u8>,
    group: Grouping<u64>,
    prefix: Option<PrefixFound>,
    /// The turn, and the bytes of history before its last user turn, where the key's
    /// text shows them (a templated prompt string).
    turn: Option<(Turn, usize)>,
}

/// The key's hash for `pool`, and its placement with, for a prefix group, the group's
/// hash: `xxh3(pool ‖ 0x00 ‖ prefix chain hash)`, and the key's hash chained from it.
pub fn key_hashes(pool: &str, facts: &RequestFacts, seed: u64) -> (u64, Grouping<u64>) {
    let Some(prefix) = facts.prefix else {
        let placement = match facts.group {
            Grouping::Pool => Grouping::Pool,
            Grouping::Ring | Grouping::Group(_) => Grouping::Ring,
        };
        return (key_hash(pool, &facts.key, seed), placement);
    };
    let group_hash = key_hash(pool, &prefix.hash.to_le_bytes(), seed);
    let hash = xxh3_64_with_seed(&facts.key, group_hash);
    match facts.group {
        Grouping::Group(_) => (hash, Grouping::Group(group_hash)),
        Grouping::Pool | Grouping::Ring => (hash, Grouping::Pool),
    }
}

/// Old-style (`conversation`, `prefix`) key text and placement.
type TextKey = (String, Grouping<u64>);

fn prompt_key(api: Api, env: &Envelope<'_>, spec: KeySpec) -> Option<TextKey> {
    let n = spec.prefix_chars;
    let ungrouped = |text: Option<String>| text.map(|t| (t, Grouping::Ring));
    match api {
        Api::Chat | Api::Other if env.messages.is_some() => Some(messages_key(
            env.tools,
            None,
            env.messages.as_deref()?,
            spec,
        )),
        Api::Responses => {
            let items = match env.input {
                Some(raw) if raw.starts_with('[') => {
                    facts::rescan(raw, |sc| facts::read_messages(sc, "input items")).flatten()
                }
                _ => None,
            };
            match items {
                Some(items) => Some(messages_key(env.tools, env.instructions, &items, spec)),
                None => {
                    // String input: instructions are the "system" part, input the "user" part.
                    let mut text = KeyText::new(n);
                    if let Some(i) = env.instructions {
                        text.push_value(i);
                    }
                    let mut user = KeyText::new(n);
                    if let Some(i) = env.input {
                        user.push_value(i);
                    }
                    Some(join_parts(spec.mode, text, user, n))
                }
            }
        }
        Api::Completions => ungrouped(first_of(env.prompt, n)),
        Api::Generate => ungrouped(first_of(env.text, n).or_else(|| first_of(env.input_ids, n))),
        _ => ungrouped(env.input.map(|raw| {
            let mut text = KeyText::new(n);
            text.push_value(raw);
            text.out
        })),
    }
}

/// The `hybrid` key of a body: the canonical segments, the shared prefix in front of
/// the conversation (learned, or the structural end of the system part), and the
/// conversation part after it.
fn hybrid_key(
    api: Api,
    env: &Envelope<'_>,
    spec: KeySpec,
    learned: Learned<'_>,
) -> Option<PromptKey> {
    let items = match (api, env.input) {
        (Api::Responses, Some(raw)) if raw.starts_with('[') => {
            facts::rescan(raw, |sc| facts::read_messages(sc, "input items")).flatten()
        }
        _ => None,
    };
    let (segments, chat) = segments(api, env, items.as_deref())?;
    let walk = || Chunks::new(&segments, spec.seed, spec.max_scan_bytes, !chat);
    let depth = match learned {
        Learned::Observe(t) => Some(t.observe(walk())),
        Learned::Peek(t) => Some(t.peek(walk())),
        Learned::Nowhere => None,
    };
    let (hot_chunks, stop) = depth.map_or((0, Stop::End), |d| (d.hot_chunks, d.stop));
    let structural = structural_end(&segments, walk());
    let learned = depth.and_then(|d| {
        let b = d.boundary?;
        // Below the system part, only a preamble most of the traffic shares: one of
        // many documents is better keyed than grouped (see [`PREAMBLE_SHARE`]).
        match structural {
            Some((pos, _)) if b.end.bytes > pos.bytes && d.share < PREAMBLE_SHARE => None,
            _ => Some(b),
        }
    });
    let found = match learned {
        Some(b) => Some((b.end, b.hash, true)),
        None => structural.map(|(pos, hash)| (pos, hash, false)),
    };
    let Some((pos, hash, learned)) = found else {
        // Nothing shared in front: the conversation from the start, over the pool.
        let key = conversation_part(&segments, Pos::default(), chat, spec.prefix_chars);
        return Some(PromptKey {
            key,
            group: Grouping::Pool,
            prefix: None,
            turn: (!chat).then(|| templated_turn(segments[0].body)).flatten(),
        });
    };
    let group = if pos.bytes >= MIN_GROUP_BYTES {
        Grouping::Group(hash)
    } else {
        Grouping::Pool
    };
    Some(PromptKey {
        key: conversation_part(&segments, pos, chat, spec.prefix_chars),
        group,
        turn: (!chat).then(|| templated_turn(segments[0].body)).flatten(),
        prefix: Some(PrefixFound {
            hash,
            bytes: pos.bytes,
            hot_chunks,
            learned,
            stop,
        }),
    })
}

/// The canonical text of a body as segments, and whether it is a message list (else
/// one prompt string). Tools and instructions come first, then the messages in order.
fn segments<'a>(
    api: Api,
    env: &'a Envelope<'a>,
    items: Option<&'a [Message<'a>]>,
) -> Option<(Vec<Segment<'a>>, bool)> {
    let seg = |tag: &'a str, raw: &'a str| Segment {
        tag,
        body: raw.as_bytes(),
    };
    let mut out = Vec::with_capacity(8);
    let messages = match api {
        Api::Chat | Api::Other if env.messages.is_some() => env.messages.as_deref(),
        Api::Responses => items,
        _ => None,
    };
    if let Some(messages) = messages {
        out.extend(env.tools.map(|t| seg("tools", t)));
        out.extend(env.instructions.map(|i| seg("instructions", i)));
        out.extend(messages.iter().map(|m| Segment {
            tag: m.role.as_deref().unwrap_or(""),
            body: m.content.unwrap_or("").as_bytes(),
        }));
        return Some((out, true));
    }
    let prompt = match api {
        Api::Responses => {
            out.extend(env.instructions.map(|i| seg("instructions", i)));
            env.input
        }
        Api::Completions => env.prompt.map(first_raw),
        Api::Generate => env.text.or(env.input_ids).map(first_raw),
        _ => env.input,
    };
    out.push(seg("prompt", prompt?));
    Some((out, false))
}

/// A prompt array's first element (a string, or one token-id list); else the value.
fn first_raw(raw: &str) -> &str {
    if !raw.starts_with('[') {
        return raw;
    }
    let first = facts::rescan(raw, |sc| {
        let mut first = None;
        sc.array(|sc| {
            let v = sc.value()?;
            first.get_or_insert(v);
            Ok(())
        })?;
        Ok(first)
    })
    .flatten();
    first.filter(|f| f.starts_with(['"', '['])).unwrap_or(raw)
}

/// The end of the leading tools, instructions and system/developer messages (when
/// something follows them), and the chain hash there.
fn structural_end(segments: &[Segment<'_>], chunks: Chunks<'_, '_>) -> Option<(Pos, u64)> {
    let lead = segments
        .iter()
        .take_while(|s| matches!(s.tag, "tools" | "instructions" | "system" | "developer"))
        .count();
    if lead == 0 || lead == segments.len() {
        return None;
    }
    let end = chunks
        .take_while(|c| c.end.seg < lead)
        .last()
        .filter(|c| c.end.seg == lead - 1 && c.end.offset == segments[lead - 1].body.len())?;
    Some((end.end, end.hash))
}

/// Chat-template markers: where a user turn opens, and where any turn ends.
const USER_OPENS: [&[u8]; 5] = [
    b"<|im_start|>user",
    b"<|start_header_id|>user",
    b"[INST]",
    b"<start_of_turn>user",
    b"<|user|>",
];
const TURN_ENDS: [&[u8]; 7] = [
    b"<|im_end|>",
    b"<|eot_id|>",
    b"<end_of_turn>",
    b"<|end|>",
    b"[/INST]",
    b"</s>",
    b"<|endoftext|>",
];

/// The conversation part of a key: from `pos` on, at most `limit` bytes, ending with
/// the first user message at or after `pos` (a message list), or with the first user
/// turn of a templated prompt. Ending at the end of the user's first message is what
/// keeps it the same on every later turn, whose text only continues past it.
fn conversation_part(segments: &[Segment<'_>], pos: Pos, chat: bool, limit: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(limit.min(4096));
    let push = |out: &mut Vec<u8>, bytes: &[u8]| {
        let room = limit.saturating_sub(out.len());
        out.extend_from_slice(&bytes[..bytes.len().min(room)]);
        out.len() >= limit
    };
    let Some(first) = segments.get(pos.seg) else {
        return out;
    };
    let rest = &first.body[pos.offset.min(first.body.len())..];
    if !chat {
        push(&mut out, first_user_turn(rest, limit));
        return out;
    }
    if !rest.is_empty() && (push(&mut out, rest) || first.tag == "user") {
        return out;
    }
    for s in &segments[pos.seg + 1..] {
        if push(&mut out, s.tag.as_bytes())
            || push(&mut out, b"\n")
            || push(&mut out, s.body)
            || push(&mut out, b"\n")
            || s.tag == "user"
        {
            break;
        }
    }
    out
}

/// The turn of a templated prompt string, and its history (the bytes before its last
/// user turn): a second user turn (of the template whose user marker comes first) makes
/// it a later turn; one, a first; none, unknown.
fn templated_turn(text: &[u8]) -> Option<(Turn, usize)> {
    let (at, marker) = USER_OPENS
        .iter()
        .filter_map(|m| memchr::memmem::find(text, m).map(|i| (i, *m)))
        .min()?;
    match memchr::memmem::rfind(&text[at + marker.len()..], marker) {
        Some(last) => Some((Turn::Later, at + marker.len() + last)),
        None => Some((Turn::First, 0)),
    }
}

/// The start of a templated prompt up to the end of its first user turn (the first
/// turn end after a user turn opens, or the first turn end when no user turn opens in
/// `window` bytes), at most `window` bytes; the whole window when it has no markers.
fn first_user_turn(text: &[u8], window: usize) -> &[u8] {
    let text = &text[..text.len().min(window)];
    let find = |needles: &[&[u8]], from: usize| {
        needles
            .iter()
            .filter_map(|n| memchr::memmem::find(&text[from..], n).map(|i| from + i))
            .min()
    };
    let from = find(&USER_OPENS, 0).map_or(0, |u| u + 1);
    match find(&TURN_ENDS, from) {
        Some(end) if end > 0 => &text[..end],
        _ => text,
    }
}

/// A learned prefix that runs past the system part is used only when at least this
/// share of the pool's recent requests goes through it. With a system part the
/// conversation key starts at the first user message; a deeper group is right for a
/// preamble the traffic shares (instructions pasted into every prompt) but not for one
/// of many documents: grouping by a document spread each popular one over several
/// nodes and cost `rag` 4–5 points of hit rate in the simulator (52 % vs 57 %).
pub const PREAMBLE_SHARE: f64 = 0.5;

/// A shared prefix shorter than this (bytes of JSON text, ≈ 256 tokens) forms no
/// prefix group, and its conversations spread over the whole pool: it prefills in
/// milliseconds, so gathering them would buy nothing and coarsen the balance (many
/// tenants with one-line prompts lost 3–6 points of hit rate in the simulator when
/// grouped).
pub const MIN_GROUP_BYTES: usize = 1024;

/// In `conversation` mode, system and user parts are cut separately (each to
/// `prefix_chars`) so the user part survives a long shared system prompt; in `prefix`
/// mode the whole text is cut once.
fn join_parts(mode: KeyMode, mut system: KeyText, user: KeyText, n: usize) -> TextKey {
    match mode {
        KeyMode::Conversation | KeyMode::Hybrid => {
            system.out.push_str(&user.out);
            (system.out, Grouping::Ring)
        }
        KeyMode::Prefix => {
            let mut all = KeyText::new(n);
            all.push_str(&system.out);
            all.push_str(&user.out);
            (all.out, Grouping::Ring)
        }
    }
}

/// The key of a message list: `tools` (compact JSON), then `role \n text \n` per message.
fn messages_key(
    tools: Option<&str>,
    instructions: Option<&str>,
    messages: &[Message<'_>],
    spec: KeySpec,
) -> TextKey {
    let n = spec.prefix_chars;
    let mut head = KeyText::new(n);
    if let Some(tools) = tools {
        head.push_compact_json(tools);
    }
    if let Some(i) = instructions {
        head.push_value(i);
    }
    match spec.mode {
        KeyMode::Prefix => {
            for m in messages {
                if head.full() {
                    break;
                }
                push_message(&mut head, m);
            }
            (head.out, Grouping::Ring)
        }
        KeyMode::Conversation | KeyMode::Hybrid => {
            for m in messages.iter().filter(|m| is_system(m)) {
                if head.full() {
                    break;
                }
                push_message(&mut head, m);
            }
            let mut user = KeyText::new(n);
            if let Some(m) = messages.iter().find(|m| m.role.as_deref() == Some("user")) {
                push_message(&mut user, m);
            }
            join_parts(spec.mode, head, user, n)
        }
    }
}

fn is_system(m: &Message<'_>) -> bool {
    matches!(m.role.as_deref(), Some("system" | "developer"))
}

fn push_message(text: &mut KeyText, m: &Message<'_>) {
    text.push_str(m.role.as_deref().unwrap_or(""));
    text.push_str("\n");
    if let Some(content) = m.content {
        text.push_content(content);
    }
    text.push_str("\n");
}

/// `prompt`/`text`/`input_ids`: a string, the first of an array of strings, or token ids.
fn first_of(raw: Option<&str>, n: usize) -> Option<String> {
    let raw = raw?;
    let mut text = KeyText::new(n);
    if raw.starts_with('[') {
        let first = facts::rescan(raw, |sc| {
            let mut first = None;
            sc.array(|sc| {
                let v = sc.value()?;
                first.get_or_insert(v);
                Ok(())
            })?;
            Ok(first)
        })
        .flatten();
        // An array of strings (or of token-id arrays): the first one. Token ids: all.
        if let Some(first) = first.filter(|f| f.starts_with(['"', '['])) {
            text.push_value(first);
            return Some(text.out);
        }
    }
    text.push_value(raw);
    Some(text.out)
}

fn raw_prefix(body: &[u8], n: usize) -> Vec<u8> {
    match std::str::from_utf8(body) {
        Ok(s) => {
            let mut text = KeyText::new(n);
            text.push_str(s);
            text.out.into_bytes()
        }
        Err(_) => body[..body.len().min(n)].to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use xxhash_rust::xxh3::xxh3_64_with_seed;

    const CONV: KeySpec = KeySpec::new(KeyMode::Conversation, 1024);
    const PREFIX: KeySpec = KeySpec::new(KeyMode::Prefix, 1024);

    fn key(api: Api, body: &serde_json::Value, spec: KeySpec) -> String {
        let bytes = serde_json::to_vec(body).unwrap();
        String::from_utf8(extract(api, &bytes, None, spec).unwrap().key).unwrap()
    }

    fn chat(system: &str, turns: &[&str]) -> serde_json::Value {
        let mut messages = vec![json!({"role": "system", "content": system})];
        for (i, t) in turns.iter().enumerate() {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            messages.push(json!({"role": role, "content": t}));
        }
        json!({"model": "m", "messages": messages, "stream": true})
    }

    #[test]
    fn turns_of_one_conversation_share_the_key() {
        let t1 = key(Api::Chat, &chat("You are helpful.", &["hi there"]), CONV);
        let t2 = key(
            Api::Chat,
            &chat("You are helpful.", &["hi there", "hello!", "more"]),
            CONV,
        );
        let t3 = key(
            Api::Chat,
            &chat(
                "You are helpful.",
                &["hi there", "hello!", "more", "ok", "bye"],
            ),
            CONV,
        );
        assert_eq!(t1, t2);
        assert_eq!(t2, t3);
        assert_eq!(t1, "system\nYou are helpful.\nuser\nhi there\n");
    }

    #[test]
    fn different_system_prompts_give_different_keys() {
        let a = key(Api::Chat, &chat("You are a pirate.", &["hi"]), CONV);
        let b = key(Api::Chat, &chat("You are a lawyer.", &["hi"]), CONV);
        assert_ne!(a, b);
        let a = key(Api::Chat, &chat("You are a pirate.", &["hi"]), PREFIX);
        let b = key(Api::Chat, &chat("You are a lawyer.", &["hi"]), PREFIX);
        assert_ne!(a, b);
    }

    #[test]
    fn conversation_mode_keeps_the_user_part_behind_a_long_system_prompt() {
        let long = "x".repeat(5000);
        let a = key(Api::Chat, &chat(&long, &["question one"]), CONV);
        let b = key(Api::Chat, &chat(&long, &["question two"]), CONV);
        assert_ne!(
            a, b,
            "conversations sharing a system prompt must not collapse"
        );
        let pa = key(Api::Chat, &chat(&long, &["question one"]), PREFIX);
        let pb = key(Api::Chat, &chat(&long, &["question two"]), PREFIX);
        assert_eq!(pa, pb, "prefix mode hashes only the shared prefix");
        assert_eq!(pa.chars().count(), 1024);
    }

    #[test]
    fn hybrid_keys_are_conversation_keys_placed_by_their_system_part() {
        let spec = KeySpec::new(KeyMode::Hybrid, 1024);
        let facts = |body: &serde_json::Value| {
            extract(Api::Chat, &serde_json::to_vec(body).unwrap(), None, spec).unwrap()
        };
        // Before anything is learned, a long system part (≥ MIN_GROUP_BYTES) is the
        // group; the key is the first user message, the same on every turn.
        let long = format!("Group A few-shot prefix. {}", "Example. ".repeat(120));
        let turn1 = facts(&chat(&long, &["question one"]));
        let turn3 = facts(&chat(&long, &["question one", "answer", "more"]));
        let other = facts(&chat(&long, &["question two"]));
        assert_eq!(
            turn1.key, turn3.key,
            "every turn of a conversation: one key"
        );
        assert_eq!(turn1.key, b"user\n\"question one\"\n");
        assert_ne!(turn1.key, other.key);
        let prefix = turn1.prefix.unwrap();
        assert!(!prefix.learned);
        assert_eq!(
            prefix.bytes,
            long.len() + 2,
            "the system content's JSON text"
        );
        assert_eq!(turn1.prefix, other.prefix, "one group");
        assert!(matches!(turn1.group, Grouping::Group(h) if h == prefix.hash));
        let (conv_hash, group) = key_hashes("pool", &turn1, 7);
        let group_hash = key_hash("pool", &prefix.hash.to_le_bytes(), 7);
        assert_eq!(group, Grouping::Group(group_hash));
        assert_eq!(conv_hash, xxh3_64_with_seed(&turn1.key, group_hash));
        // A short system part, or none: no group, spread over the pool.
        for body in [
            chat("Group A few-shot prefix.", &["q"]),
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ] {
            let f = facts(&body);
            assert_eq!(f.group, Grouping::Pool);
            assert_eq!(key_hashes("pool", &f, 7).1, Grouping::Pool);
        }
        // Other modes and a key header: the ring.
        let conv = extract(
            Api::Chat,
            &serde_json::to_vec(&chat(&long, &["q"])).unwrap(),
            None,
            CONV,
        );
        assert_eq!(conv.unwrap().group, Grouping::Ring);
        let header = extract(
            Api::Chat,
            &serde_json::to_vec(&chat(&long, &["q"])).unwrap(),
            Some(b"session-1"),
            spec,
        );
        assert_eq!(header.unwrap().group, Grouping::Ring);
    }

    /// Routes `bodies` through one table, in order; returns the facts of the last.
    fn learned(table: &PrefixTable, api: Api, bodies: &[serde_json::Value]) -> RequestFacts {
        let spec = KeySpec::new(KeyMode::Hybrid, 1024);
        let mut last = None;
        for b in bodies {
            let bytes = serde_json::to_vec(b).unwrap();
            let env = facts::read(api, &bytes).unwrap();
            last = Some(facts_of(
                api,
                &bytes,
                env.as_ref(),
                None,
                spec,
                Learned::Observe(table),
            ));
        }
        last.unwrap()
    }

    /// A multi-turn chat whose first user message starts with `preamble`.
    fn preamble_chat(preamble: &str, user: usize, turns: usize) -> serde_json::Value {
        let mut messages = Vec::new();
        for t in 0..turns {
            let opening = if t == 0 { preamble } else { "" };
            messages.push(json!({"role": "user", "content": format!("{opening}user {user} asks {t}: {}", "why? ".repeat(30))}));
            if t + 1 < turns {
                messages
                    .push(json!({"role": "assistant", "content": format!("answer {user}.{t}")}));
            }
        }
        json!({"model": "m", "messages": messages})
    }

    #[test]
    fn a_preamble_in_the_first_user_message_is_learned_and_keys_stay_put() {
        let table = PrefixTable::default();
        let preamble = "Read these instructions first. ".repeat(300); // ~9 KB
                                                                      // Warm up: many conversations' first turns.
        let warm: Vec<_> = (0..40).map(|u| preamble_chat(&preamble, u, 1)).collect();
        learned(&table, Api::Chat, &warm);
        let turn1 = learned(&table, Api::Chat, &[preamble_chat(&preamble, 99, 1)]);
        let prefix = turn1.prefix.unwrap();
        assert!(prefix.learned, "{prefix:?}");
        let chunks = preamble.len() / super::super::prefix::CHUNK;
        assert!(
            prefix.hot_chunks >= chunks,
            "the walk went through the preamble: {prefix:?}"
        );
        assert!(
            prefix.bytes + super::super::prefix::CHUNK > preamble.len(),
            "{prefix:?}"
        );
        assert!(matches!(turn1.group, Grouping::Group(_)));
        // Later turns of the same conversation: the same prefix and key, even after many
        // turns made its own text hot.
        for turns in 2..8 {
            let later = learned(&table, Api::Chat, &[preamble_chat(&preamble, 99, turns)]);
            assert_eq!(
                later.prefix.map(|p| p.hash),
                Some(prefix.hash),
                "turn {turns}"
            );
            assert_eq!(later.key, turn1.key, "turn {turns}");
        }
        // Another conversation: same group, different key.
        let other = learned(&table, Api::Chat, &[preamble_chat(&preamble, 7, 1)]);
        assert_eq!(other.prefix.map(|p| p.hash), Some(prefix.hash));
        assert_ne!(other.key, turn1.key);
        let text = String::from_utf8_lossy(&turn1.key);
        assert!(text.contains("user 99 asks 0"), "{text}");
    }

    #[test]
    fn a_templated_completions_prompt_keeps_its_key_across_turns() {
        let table = PrefixTable::default();
        let system = "You answer questions about GPUs. ".repeat(60);
        let prompt = |u: usize, turns: usize| {
            let mut p = format!("<|im_start|>system\n{system}<|im_end|>\n");
            for t in 0..turns {
                p.push_str(&format!(
                    "<|im_start|>user\nhi from {u}<|im_end|>\n<|im_start|>assistant\n"
                ));
                if t + 1 < turns {
                    p.push_str(&format!("answer {t}<|im_end|>\n"));
                }
            }
            json!({"model": "m", "prompt": p})
        };
        let warm: Vec<_> = (0..40).map(|u| prompt(u, 1)).collect();
        learned(&table, Api::Completions, &warm);
        let turn1 = learned(&table, Api::Completions, &[prompt(500, 1)]);
        assert!(turn1.prefix.unwrap().learned);
        for turns in 2..5 {
            let later = learned(&table, Api::Completions, &[prompt(500, turns)]);
            assert_eq!(later.key, turn1.key, "a short first turn: turn {turns}");
        }
        let other = learned(&table, Api::Completions, &[prompt(501, 1)]);
        assert_ne!(other.key, turn1.key);
    }

    #[test]
    fn content_arrays_use_text_and_urls() {
        let body = json!({"model": "m", "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "look at "},
                {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                {"type": "text", "text": " please"}
            ]}
        ]});
        assert_eq!(
            key(Api::Chat, &body, CONV),
            "user\nlook at image_url https://x/cat.png please\n"
        );
    }

    #[test]
    fn tools_are_compact_json_before_messages() {
        let body = r#"{"model":"m","tools":[ {"type" : "function", "name":"a b"} ],"messages":[{"role":"user","content":"q"}]}"#;
        let facts = extract(Api::Chat, body.as_bytes(), None, PREFIX).unwrap();
        assert_eq!(
            String::from_utf8(facts.key).unwrap(),
            r#"[{"type":"function","name":"a b"}]user
q
"#
        );
    }

    #[test]
    fn unicode_is_cut_on_char_boundaries() {
        let spec = KeySpec::new(KeyMode::Prefix, 10);
        let body =
            json!({"model": "m", "messages": [{"role": "user", "content": "héllo wörld 🎉🎉🎉"}]});
        let k = key(Api::Chat, &body, spec);
        assert_eq!(k.chars().count(), 10);
        assert_eq!(k, "user\nhéllo");
        // Escaped surrogate pairs decode to one char.
        let raw = br#"{"messages":[{"role":"user","content":"\ud83c\udf89\n\u00e9"}]}"#;
        let k = extract(Api::Chat, raw, None, spec).unwrap().key;
        assert_eq!(String::from_utf8(k).unwrap(), "user\n🎉\né\n");
    }

    #[test]
    fn other_apis_find_their_prompt() {
        let c = key(
            Api::Completions,
            &json!({"model": "m", "prompt": "Once upon"}),
            CONV,
        );
        assert_eq!(c, "Once upon");
        let c = key(
            Api::Completions,
            &json!({"model": "m", "prompt": ["first", "second"]}),
            CONV,
        );
        assert_eq!(c, "first");
        let c = key(
            Api::Completions,
            &json!({"model": "m", "prompt": [1, 2, 3]}),
            CONV,
        );
        assert_eq!(c, "[1,2,3]");
        let g = key(Api::Generate, &json!({"text": "abc"}), CONV);
        assert_eq!(g, "abc");
        let g = key(Api::Generate, &json!({"input_ids": [7, 8]}), CONV);
        assert_eq!(g, "[7,8]");
        let r = key(
            Api::Responses,
            &json!({"model": "m", "instructions": "be brief", "input": "hi"}),
            CONV,
        );
        assert_eq!(r, "be briefhi");
        let r = key(
            Api::Responses,
            &json!({"model": "m", "input": [{"role": "developer", "content": "d"}, {"role": "user", "content": [{"type": "input_text", "text": "u"}]}, {"role": "assistant", "content": "a"}]}),
            CONV,
        );
        assert_eq!(r, "developer\nd\nuser\nu\n");
        let e = key(
            Api::Embeddings,
            &json!({"model": "m", "input": "embed me"}),
            CONV,
        );
        assert_eq!(e, "embed me");
    }

    #[test]
    fn model_and_stream_are_read_wherever_they_are() {
        let body = br#"{"messages":[{"role":"user","content":"x"}],"temperature":0.2,"stream":true,"model":"llama-3"}"#;
        let f = extract(Api::Chat, body, None, CONV).unwrap();
        assert_eq!(f.model.as_deref(), Some("llama-3"));
        assert!(f.stream);
    }

    #[test]
    fn reasoning_requests_and_the_model_span_are_found() {
        let body = br#"{"model": "qwen", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": true}}"#;
        let f = extract(Api::Chat, body, None, CONV).unwrap();
        assert!(f.wants_reasoning);
        let span = f.spans.model.unwrap();
        assert_eq!(&body[span], br#""qwen""#);
        let f = extract(
            Api::Chat,
            br#"{"messages": [], "reasoning_effort": "high"}"#,
            None,
            CONV,
        )
        .unwrap();
        assert!(f.wants_reasoning);
        let f = extract(Api::Chat, br#"{"messages": [], "reasoning_effort": null, "chat_template_kwargs": {"enable_thinking": false}}"#, None, CONV).unwrap();
        assert!(!f.wants_reasoning);
    }

    #[test]
    fn header_key_wins() {
        let body = serde_json::to_vec(&chat("s", &["u"])).unwrap();
        let f = extract(Api::Chat, &body, Some(b"session-42"), CONV).unwrap();
        assert_eq!(f.key, b"session-42");
        assert_eq!(f.source, KeySource::Header);
    }

    #[test]
    fn raw_bodies_use_their_bytes() {
        let f = extract(Api::Other, b"plain text body", None, CONV).unwrap();
        assert_eq!(f.key, b"plain text body");
        assert_eq!(f.source, KeySource::Raw);
        let f = extract(Api::Other, &[0xff, 0xfe, 0x00], None, CONV).unwrap();
        assert_eq!(f.key, vec![0xff, 0xfe, 0x00]);
    }

    #[test]
    fn bad_bodies_are_errors_not_panics() {
        for body in [
            &b""[..],
            b"   ",
            b"{",
            b"[1,2]",
            b"null",
            b"{\"messages\": \"nope\"}",
            b"{\"model\": 5, \"messages\": []}",
            b"{\"messages\": [{\"role\": 1}]}",
            b"{\"messages\": [], \"stream\": \"yes\"}",
            &[0xff, 0xfe],
        ] {
            let r = extract(Api::Chat, body, None, CONV);
            assert!(
                r.is_err(),
                "{:?} was accepted",
                String::from_utf8_lossy(body)
            );
        }
        // A lone surrogate is valid JSON: it is routed, the key holds U+FFFD.
        let lone = extract(
            Api::Chat,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}",
            None,
            CONV,
        );
        assert_eq!(lone.unwrap().key, "user\n\u{fffd}\n".as_bytes());
        assert_eq!(extract(Api::Chat, b"", None, CONV), Err(KeyError::Empty));
        assert!(matches!(
            extract(Api::Chat, b"{", None, CONV),
            Err(KeyError::Json(_))
        ));
        assert_eq!(
            extract(Api::Chat, b"{\"model\":\"m\"}", None, CONV),
            Err(KeyError::Missing("messages"))
        );
        assert_eq!(
            extract(Api::Completions, b"{\"model\":\"m\"}", None, CONV),
            Err(KeyError::Missing("prompt"))
        );
    }

    #[test]
    fn hash_is_golden() {
        // Replicas and restarts agree on every key's home only if this never changes.
        assert_eq!(
            format!("{:016x}", key_hash("llama", b"user\nhi\n", 0)),
            GOLDEN_HASH
        );
        assert_ne!(key_hash("llama", b"k", 0), key_hash("mistral", b"k", 0));
        assert_ne!(key_hash("llama", b"k", 0), key_hash("llama", b"k", 1));
        // The pool/key separator keeps ("ab", "c") apart from ("a", "bc").
        assert_ne!(key_hash("ab", b"c", 0), key_hash("a", b"bc", 0));
    }
    const GOLDEN_HASH: &str = "ba26594ed5f3b7d7";

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = extract(Api::Chat, &body, None, CONV);
            let _ = extract(Api::Other, &body, None, PREFIX);
        }

        #[test]
        fn keys_are_valid_prefixes(s in "\\PC{0,300}", n in 1usize..50) {
            let spec = KeySpec::new(KeyMode::Prefix, n);
            let body = serde_json::to_vec(&json!({"prompt": s})).unwrap();
            let k = String::from_utf8(extract(Api::Completions, &body, None, spec).unwrap().key).unwrap();
            prop_assert!(s.starts_with(&k));
            prop_assert_eq!(k.chars().count(), s.chars().count().min(n));
        }
    }
}
