//! The routing key: which bytes of a request decide its home on the ring, and its
//! hashes. The key comes from a key header, the prompt fields the facts scan kept, or
//! the raw body. `conversation` and `prefix` keys cut each part to `prefix_chars`
//! characters; a `hybrid` key is the conversation part that follows the request's
//! shared prefix (found from the pool's traffic by [`super::prefix`]), which also
//! names its prefix group. The work per request is bounded whatever the body's size.
//! Pure but for the prefix table's counters.

use smallvec::SmallVec;
use xxhash_rust::xxh3::Xxh3;

use super::facts::{
    self, Api, BodySpans, Envelope, KeyError, KeySource, Message, PrefixFound, RequestFacts,
    TokenEstimate, Turn,
};
use super::group::Grouping;
use super::key_text::KeyText;
use super::prefix::{seeded_xxh3, Chunks, Pos, PrefixTable, Segment, Stop};
use super::Mode;
use crate::config::KeyMode;

/// How to build keys: the `[routing]` settings that matter here.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub mode: KeyMode,
    /// Characters per part of the key (`hybrid`: of the conversation part after the
    /// shared prefix, as raw JSON text).
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

/// Where a `hybrid` key's shared prefix is learned: a pool's table, walked as `Mode`
/// says (counted for a request being routed, only read for an explanation); with none,
/// the structural end of the system part is used.
pub type Prefixes<'t> = Option<(&'t PrefixTable, Mode)>;

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
        None,
    ))
}

/// The facts of a body whose envelope was read already, with a `hybrid` key's prefix
/// learned where `prefixes` says.
pub fn facts_of(
    api: Api,
    body: &[u8],
    envelope: Option<&Envelope<'_>>,
    header_key: Option<&[u8]>,
    spec: KeySpec,
    prefixes: Prefixes<'_>,
) -> RequestFacts {
    let (model, stream, wants_thinking, spans, include_usage) = match envelope {
        Some(env) => (
            env.model.as_deref().map(str::to_owned),
            env.stream == Some(true),
            env.wants_thinking,
            env.spans.clone(),
            env.include_usage,
        ),
        None => (None, false, false, BodySpans::default(), false),
    };
    let max_tokens = envelope.and_then(|env| env.max_tokens);

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
        // An upload: its file's digest (no engine caches audio by prefix, and the
        // bytes before the file are a random boundary and the same few fields).
        (
            None,
            Some(Envelope {
                upload: Some(file), ..
            }),
        ) => {
            let digest = xxhash_rust::xxh3::xxh3_128(&body[file.clone()]);
            (
                PromptKey {
                    key: digest.to_le_bytes().to_vec(),
                    group: Grouping::Ring,
                    prefix: None,
                    turn: None,
                },
                KeySource::File,
            )
        }
        (None, Some(env)) if spec.mode == KeyMode::Hybrid => {
            match hybrid_key(api, env, spec, prefixes) {
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
        wants_thinking,
        include_usage,
        max_tokens,
        spans,
        key: k.key,
        group: k.group,
        prefix: k.prefix,
        source,
        turn,
        tokens,
        follows: envelope
            .and_then(|env| env.previous_response_id.as_deref())
            .filter(|_| api == Api::Responses)
            .map(str::to_owned),
        stored: api == Api::Responses && envelope.is_some_and(|env| !env.no_store),
    }
}

/// Which turn a request is, and its size: a message list with an assistant or tool
/// message continues a conversation, whose history is everything before its last
/// message.
fn shape(api: Api, env: &Envelope<'_>, body_len: usize) -> (Turn, TokenEstimate) {
    if api == Api::Audio {
        // Audio: its size in tokens is not its size in bytes, and is not known.
        return (Turn::Unknown, TokenEstimate::default());
    }
    let messages = match api {
        api if api.has_messages() => env.messages.as_deref(),
        _ => None,
    };
    let Some(messages) = messages else {
        // A token-id prompt says how many tokens it is.
        let ids = match api {
            Api::Completions => env.prompt.map(first_raw),
            Api::Generate if env.text.is_none() => env.input_ids.map(first_raw),
            _ => None,
        };
        if let Some(ids) = ids.filter(|ids| super::prefix::is_token_ids(ids.as_bytes())) {
            let n = memchr::memchr_iter(b',', ids.as_bytes()).count() + 1;
            let prompt = n.min(u32::MAX as usize) as u32;
            return (Turn::Unknown, TokenEstimate { prompt, history: 0 });
        }
        return (Turn::Unknown, TokenEstimate::of_bytes(body_len, 0));
    };
    let size = |m: &Message<'_>| m.content.as_deref().map_or(0, str::len) + 8;
    let lead = [&env.tools, &env.system]
        .iter()
        .map(|p| p.as_deref().map_or(0, str::len))
        .sum::<usize>();
    let total: usize = messages.iter().map(size).sum::<usize>() + lead;
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
    let hash = seeded_xxh3(&facts.key, group_hash);
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
        api if api.has_messages() && env.messages.is_some() => Some(messages_key(
            env.tools.as_deref(),
            env.system.as_deref(),
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
                Some(items) => Some(messages_key(
                    env.tools.as_deref(),
                    env.instructions,
                    &items,
                    spec,
                )),
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
    prefixes: Prefixes<'_>,
) -> Option<PromptKey> {
    let items = match (api, env.input) {
        (Api::Responses, Some(raw)) if raw.starts_with('[') => {
            facts::rescan(raw, |sc| facts::read_messages(sc, "input items")).flatten()
        }
        _ => None,
    };
    let (segments, chat) = segments(api, env, items.as_deref())?;
    let lead = segments
        .iter()
        .take_while(|s| matches!(s.tag, "tools" | "instructions" | "system" | "developer"))
        .count();
    // One pass of chunks: the walk's, then on to the system part's end if it stopped
    // before it.
    let mut chunks = Chunks::new(&segments, spec.seed, spec.max_scan_bytes, !chat).marking(lead);
    let depth = prefixes.map(|(t, mode)| t.walk(&mut chunks, mode));
    let (hot_chunks, stop) = depth.map_or((0, Stop::End), |d| (d.hot_chunks, d.stop));
    let structural = structural_end(&segments, lead, &mut chunks);
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

/// A body's segments: a usual conversation's fit on the stack.
type Segments<'a> = SmallVec<[Segment<'a>; 8]>;

/// The canonical text of a body as segments, and whether it is a message list (else
/// one prompt string). Tools and instructions come first, then the messages in order.
fn segments<'a>(
    api: Api,
    env: &'a Envelope<'a>,
    items: Option<&'a [Message<'a>]>,
) -> Option<(Segments<'a>, bool)> {
    let seg = |tag: &'a str, raw: &'a str| Segment {
        tag,
        body: raw.as_bytes(),
    };
    let mut out = Segments::new();
    let messages = match api {
        api if api.has_messages() && env.messages.is_some() => env.messages.as_deref(),
        Api::Responses => items,
        _ => None,
    };
    if let Some(messages) = messages {
        // Anthropic's order: tools, then the system part, then the messages.
        out.extend(env.tools.as_deref().map(|t| seg("tools", t)));
        out.extend(env.instructions.map(|i| seg("instructions", i)));
        out.extend(env.system.as_deref().map(|s| seg("system", s)));
        out.extend(messages.iter().map(|m| Segment {
            tag: m.role.as_deref().unwrap_or(""),
            body: m.content.as_deref().unwrap_or("").as_bytes(),
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
fn structural_end(
    segments: &[Segment<'_>],
    lead: usize,
    chunks: &mut Chunks<'_, '_>,
) -> Option<(Pos, u64)> {
    if lead == 0 || lead == segments.len() {
        return None;
    }
    let end = chunks
        .lead_end()
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
    let mut left = limit;
    let mut push = |out: &mut Vec<u8>, bytes: &[u8]| {
        let (len, chars) = take_chars(bytes, left);
        out.extend_from_slice(&bytes[..len]);
        left -= chars;
        left == 0
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

/// The first `n` characters of UTF-8 text (or all of it): their length in bytes, and
/// how many characters that is. A cut chunk may start inside a character; its
/// continuation bytes count as nothing.
fn take_chars(text: &[u8], n: usize) -> (usize, usize) {
    let head = &text[..text.len().min(n)];
    if head.is_ascii() {
        return (head.len(), head.len());
    }
    let mut chars = 0;
    for (i, &b) in text.iter().enumerate() {
        if b & 0xC0 != 0x80 {
            if chars == n {
                return (i, chars);
            }
            chars += 1;
        }
    }
    (text.len(), chars)
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
/// `window` characters), at most `window` characters; the whole window when it has no
/// markers.
fn first_user_turn(text: &[u8], window: usize) -> &[u8] {
    let text = &text[..take_chars(text, window).0];
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
/// of many documents, which grouping spreads over several nodes (docs/evidence.md,
/// "The constants behind the rules").
pub const PREAMBLE_SHARE: f64 = 0.5;

/// A shared prefix shorter than this (bytes of JSON text, ≈ 256 tokens) forms no
/// prefix group, and its conversations spread over the whole pool: it prefills in
/// milliseconds, so gathering them would buy nothing and coarsen the balance
/// (docs/evidence.md, "The constants behind the rules").
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
        // A string, or (Anthropic's `system`) text blocks.
        head.push_content(i);
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
    if let Some(content) = m.content.as_deref() {
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
mod tests;
