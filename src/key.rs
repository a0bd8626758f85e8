//! The routing key: which bytes of a request decide its home on the ring.
//!
//! One borrowing serde pass over the body reads `model`, `stream` and the raw spans of
//! the prompt fields; only the few strings the key needs are then decoded, and only up
//! to `prefix_chars` characters each, so the work per request is bounded whatever the
//! body's size. Pure: no I/O.

use std::borrow::Cow;
use std::ops::Range;

use xxhash_rust::xxh3::Xxh3;

use crate::config::KeyMode;
pub use crate::group::Grouping;
use crate::json_scan::{self, ScanError, Scanner};

/// The OpenAI-style API a request path belongs to; it decides where the prompt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    /// SGLang's native `/generate`.
    Generate,
    Responses,
    Embeddings,
    Other,
}

impl Api {
    pub fn from_path(path: &str) -> Api {
        match path {
            "/v1/chat/completions" => Api::Chat,
            "/v1/completions" => Api::Completions,
            "/generate" => Api::Generate,
            "/v1/responses" => Api::Responses,
            "/v1/embeddings" => Api::Embeddings,
            _ => Api::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Generate => "generate",
            Api::Responses => "responses",
            Api::Embeddings => "embeddings",
            Api::Other => "other",
        }
    }

    /// Whether the body must be a JSON object (else 400).
    pub fn requires_json(self) -> bool {
        self != Api::Other
    }
}

/// Where a key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// The `routing.key_header` header.
    Header,
    /// Text taken from the prompt fields.
    Prompt,
    /// The raw body bytes (non-JSON bodies, or JSON with no prompt field).
    Raw,
}

impl KeySource {
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::Header => "header",
            KeySource::Prompt => "prompt",
            KeySource::Raw => "raw",
        }
    }
}

/// What the balancer needs to know of a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFacts {
    /// The `model` field, if any.
    pub model: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// The request asks for reasoning (`reasoning_effort`, `reasoning`, or
    /// `chat_template_kwargs.enable_thinking = true`).
    pub wants_reasoning: bool,
    /// `stream_options.include_usage = true`: the client asked for the usage chunk.
    pub include_usage: bool,
    /// Where the body may be edited (model rewrite, `stream_options`).
    pub spans: BodySpans,
    /// The key bytes (before the pool name and seed are mixed in).
    pub key: Vec<u8>,
    /// How the key is placed; for a prefix group, how many leading bytes of the key
    /// (its system part) name the group.
    pub group: Grouping<usize>,
    pub source: KeySource,
}

impl RequestFacts {
    /// The group's key bytes, if the request has a group.
    pub fn group_key(&self) -> Option<&[u8]> {
        match self.group {
            Grouping::Group(n) => Some(&self.key[..n.min(self.key.len())]),
            Grouping::Ring | Grouping::Pool => None,
        }
    }
}

/// Byte offsets in a request body where the balancer may edit it (see
/// [`crate::proxy::edit`]): all relative to the original bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodySpans {
    /// The top-level object.
    pub object: Option<ObjectSpan>,
    /// The value of `model` (the last one, as engines read it).
    pub model: Option<Range<usize>>,
    /// The value of `stream_options`.
    pub stream_options: Option<StreamOptionsSpan>,
}

/// An object's opening: the offset just after its `{`, and whether it has members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectSpan {
    pub open: usize,
    pub empty: bool,
}

/// `stream_options`: its value, and when it is an object, where members go and where
/// `include_usage`'s value is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamOptionsSpan {
    pub value: Range<usize>,
    pub object: Option<ObjectSpan>,
    pub include_usage: Option<Range<usize>>,
}

/// Why a body cannot be routed: the client's fault, answered with 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("request body is empty; expected a JSON object")]
    Empty,
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    #[error("'{0}' is a required property")]
    Missing(&'static str),
}

/// The fields of any OpenAI-style body that routing reads, as raw JSON text; everything
/// else is skipped without being decoded.
#[derive(Default)]
struct Envelope<'a> {
    model: Option<Cow<'a, str>>,
    spans: BodySpans,
    wants_reasoning: bool,
    include_usage: bool,
    stream: Option<bool>,
    messages: Option<Vec<Message<'a>>>,
    tools: Option<&'a str>,
    prompt: Option<&'a str>,
    text: Option<&'a str>,
    input_ids: Option<&'a str>,
    instructions: Option<&'a str>,
    input: Option<&'a str>,
}

/// A chat message, or a `/v1/responses` input item.
struct Message<'a> {
    role: Option<Cow<'a, str>>,
    content: Option<&'a str>,
}

fn read_envelope(text: &str) -> Result<Envelope<'_>, ScanError> {
    let mut sc = Scanner::new(text);
    let mut env = Envelope::default();
    if sc.peek() != Some(b'{') {
        return Err(sc.error("the body must be a JSON object"));
    }
    let mut members = 0;
    let open = sc.offset() + 1;
    sc.object(|sc, key| {
        members += 1;
        let raw = match &*key {
            "model" => {
                sc.peek();
                let start = sc.offset();
                env.model = sc.opt_string("'model' must be a string")?;
                env.spans.model = Some(start..sc.offset());
                return Ok(());
            }
            "reasoning_effort" | "reasoning" => {
                env.wants_reasoning |= sc.value()? != "null";
                return Ok(());
            }
            "stream_options" => {
                let (span, include) = read_stream_options(sc)?;
                env.spans.stream_options = Some(span);
                env.include_usage = include;
                return Ok(());
            }
            "chat_template_kwargs" if sc.peek() == Some(b'{') => {
                sc.object(|sc, k| {
                    let v = sc.value()?;
                    env.wants_reasoning |=
                        matches!(&*k, "enable_thinking" | "thinking") && v == "true";
                    Ok(())
                })?;
                return Ok(());
            }
            "stream" => {
                env.stream = sc.opt_bool("'stream' must be a boolean")?;
                return Ok(());
            }
            "messages" => {
                env.messages = read_messages(sc, "'messages' must be an array of message objects")?;
                return Ok(());
            }
            "tools" => &mut env.tools,
            "prompt" => &mut env.prompt,
            "text" => &mut env.text,
            "input_ids" => &mut env.input_ids,
            "instructions" => &mut env.instructions,
            "input" => &mut env.input,
            _ => {
                sc.value()?;
                return Ok(());
            }
        };
        *raw = Some(sc.value()?).filter(|v| *v != "null");
        Ok(())
    })?;
    sc.end()?;
    env.spans.object = Some(ObjectSpan {
        open,
        empty: members == 0,
    });
    Ok(env)
}

/// The `stream_options` value: its spans, and whether it asks for the usage chunk.
fn read_stream_options(sc: &mut Scanner<'_>) -> Result<(StreamOptionsSpan, bool), ScanError> {
    let start = match sc.peek() {
        Some(_) => sc.offset(),
        None => return Err(sc.error("expected a value")),
    };
    let mut span = StreamOptionsSpan {
        value: start..start,
        object: None,
        include_usage: None,
    };
    let mut include = false;
    if sc.peek() == Some(b'{') {
        let mut members = 0;
        sc.object(|sc, k| {
            members += 1;
            sc.peek();
            let from = sc.offset();
            let v = sc.value()?;
            if k == "include_usage" {
                include = v == "true";
                span.include_usage = Some(from..sc.offset());
            }
            Ok(())
        })?;
        span.object = Some(ObjectSpan {
            open: start + 1,
            empty: members == 0,
        });
    } else {
        sc.value()?;
    }
    span.value = start..sc.offset();
    Ok((span, include))
}

/// An array of `{role, content}` objects (other members skipped), or `null`.
fn read_messages<'a>(
    sc: &mut Scanner<'a>,
    msg: &'static str,
) -> Result<Option<Vec<Message<'a>>>, ScanError> {
    match sc.peek() {
        Some(b'n') => return sc.opt_bool(msg).map(|_| None),
        Some(b'[') => {}
        _ => return Err(sc.error(msg)),
    }
    let mut messages = Vec::new();
    sc.array(|sc| {
        if sc.peek() != Some(b'{') {
            return Err(sc.error(msg));
        }
        let mut m = Message {
            role: None,
            content: None,
        };
        sc.object(|sc, key| {
            match &*key {
                "role" => m.role = sc.opt_string("'role' must be a string")?,
                "content" => m.content = Some(sc.value()?).filter(|v| *v != "null"),
                _ => {
                    sc.value()?;
                }
            }
            Ok(())
        })?;
        messages.push(m);
        Ok(())
    })?;
    Ok(Some(messages))
}

/// Runs `f` over a raw JSON text known to be valid (it was scanned already).
fn rescan<'a, T>(
    raw: &'a str,
    f: impl FnOnce(&mut Scanner<'a>) -> Result<T, ScanError>,
) -> Option<T> {
    f(&mut Scanner::new(raw)).ok()
}

/// How to build keys: the `[routing]` settings that matter here.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    pub mode: KeyMode,
    pub prefix_chars: usize,
}

/// Reads a request body for routing. `header_key` is the value of the key header, if
/// the request has one; it wins over the prompt.
pub fn extract(
    api: Api,
    body: &[u8],
    header_key: Option<&[u8]>,
    spec: KeySpec,
) -> Result<RequestFacts, KeyError> {
    // SIMD validation (simdutf8) is ~3× std's on prompt-sized bodies; std's check
    // runs only on failure, for the error's position.
    let text = match simdutf8::basic::from_utf8(body) {
        Ok(text) => Ok(text),
        Err(_) => std::str::from_utf8(body),
    };
    let envelope = if api.requires_json() {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(KeyError::Empty);
        }
        let text =
            text.map_err(|e| KeyError::Json(format!("invalid UTF-8 at byte {}", e.valid_up_to())))?;
        Some(read_envelope(text).map_err(|e| KeyError::Json(e.to_string()))?)
    } else {
        // Anything else: use the JSON fields if it is a JSON object, else raw bytes.
        text.ok().and_then(|t| read_envelope(t).ok())
    };

    let (model, stream, wants_reasoning, spans, include_usage) = match &envelope {
        Some(env) => (
            env.model.as_deref().map(str::to_owned),
            env.stream == Some(true),
            env.wants_reasoning,
            env.spans.clone(),
            env.include_usage,
        ),
        None => (None, false, false, BodySpans::default(), false),
    };
    if let Some(env) = &envelope {
        match api {
            Api::Chat if env.messages.is_none() => return Err(KeyError::Missing("messages")),
            Api::Completions if env.prompt.is_none() => return Err(KeyError::Missing("prompt")),
            _ => {}
        }
    }

    let (key, source) = match (header_key, &envelope) {
        (Some(h), _) => ((h.to_vec(), Grouping::Ring), KeySource::Header),
        (None, Some(env)) => match prompt_key(api, env, spec) {
            Some((text, group)) => ((text.into_bytes(), group), KeySource::Prompt),
            None => (
                (raw_prefix(body, spec.prefix_chars), Grouping::Ring),
                KeySource::Raw,
            ),
        },
        (None, None) => (
            (raw_prefix(body, spec.prefix_chars), Grouping::Ring),
            KeySource::Raw,
        ),
    };
    let (key, group) = key;
    Ok(RequestFacts {
        model,
        stream,
        wants_reasoning,
        include_usage,
        spans,
        key,
        group,
        source,
    })
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

/// Key text, and how it is placed (for a prefix group: how many of its leading bytes
/// are the group, i.e. the system part).
type PromptKey = (String, Grouping<usize>);

/// The key's hash for `pool`, and its placement with, for a prefix group, the group's
/// hash. The group is a prefix of the key, so one streaming pass yields both hashes.
pub fn key_hashes(pool: &str, facts: &RequestFacts, seed: u64) -> (u64, Grouping<u64>) {
    let Some(group) = facts.group_key() else {
        let placement = match facts.group {
            Grouping::Pool => Grouping::Pool,
            Grouping::Ring | Grouping::Group(_) => Grouping::Ring,
        };
        return (key_hash(pool, &facts.key, seed), placement);
    };
    let mut h = Xxh3::with_seed(seed);
    h.update(pool.as_bytes());
    h.update(&[0]);
    h.update(group);
    let group_hash = h.digest();
    h.update(&facts.key[group.len()..]);
    (h.digest(), Grouping::Group(group_hash))
}

fn prompt_key(api: Api, env: &Envelope<'_>, spec: KeySpec) -> Option<PromptKey> {
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
                    rescan(raw, |sc| read_messages(sc, "input items")).flatten()
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
                    let system_len = env.instructions.map_or(0, str::len);
                    Some(join_parts(spec.mode, text, system_len, user, n))
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

/// A system part shorter than this (in bytes of its JSON text, ≈ 256 tokens) forms no
/// prefix group, and its conversations spread over the whole pool: it prefills in
/// milliseconds, so gathering them would buy nothing and coarsen the balance (many
/// tenants with one-line prompts lost 3–6 points of hit rate in the simulator when
/// grouped).
pub const MIN_GROUP_BYTES: usize = 1024;

/// In `conversation` and `hybrid` mode, system and user parts are cut separately (each
/// to `prefix_chars`) so the user part survives a long shared system prompt, and
/// `hybrid` makes the system part a group when the whole of it (`system_len` bytes,
/// before the cut) is at least [`MIN_GROUP_BYTES`], else spreads over the pool; in
/// `prefix` mode the whole text is cut once.
fn join_parts(
    mode: KeyMode,
    mut system: KeyText,
    system_len: usize,
    user: KeyText,
    n: usize,
) -> PromptKey {
    match mode {
        KeyMode::Conversation | KeyMode::Hybrid => {
            let group = match mode {
                KeyMode::Hybrid if system_len >= MIN_GROUP_BYTES => {
                    Grouping::Group(system.out.len())
                }
                KeyMode::Hybrid => Grouping::Pool,
                _ => Grouping::Ring,
            };
            system.out.push_str(&user.out);
            (system.out, group)
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
) -> PromptKey {
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
            let system_len = tools.map_or(0, str::len)
                + instructions.map_or(0, str::len)
                + messages
                    .iter()
                    .filter(|m| is_system(m))
                    .map(|m| m.content.map_or(0, str::len))
                    .sum::<usize>();
            join_parts(spec.mode, head, system_len, user, n)
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
        let first = rescan(raw, |sc| {
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

/// A key under construction that holds at most `left` more characters.
struct KeyText {
    out: String,
    left: usize,
}

impl KeyText {
    fn new(limit: usize) -> Self {
        KeyText {
            out: String::with_capacity(limit.min(4096)),
            left: limit,
        }
    }

    fn full(&self) -> bool {
        self.left == 0
    }

    fn push_char(&mut self, c: char) -> bool {
        if self.left == 0 {
            return false;
        }
        self.out.push(c);
        self.left -= 1;
        true
    }

    fn push_str(&mut self, s: &str) {
        // Cut on a char boundary, never inside a code point.
        let (taken, n) = json_scan::take_chars(s, self.left);
        self.out.push_str(taken);
        self.left -= n;
    }

    /// A JSON value as key text: strings decoded, anything else as compact JSON.
    fn push_value(&mut self, raw: &str) {
        if raw.starts_with('"') {
            self.left -= json_scan::decode_prefix(raw, self.left, &mut self.out);
        } else {
            self.push_compact_json(raw);
        }
    }

    /// Message content: a string, or an array of parts (text parts contribute their
    /// text; other parts their type and URL).
    fn push_content(&mut self, raw: &str) {
        if !raw.starts_with('[') {
            return self.push_value(raw);
        }
        // The text was scanned already, so this walk cannot fail.
        let _ = rescan(raw, |sc| {
            sc.array(|sc| {
                if sc.peek() != Some(b'{') {
                    let part = sc.value()?;
                    self.push_value(part);
                    return Ok(());
                }
                let (mut kind, mut text, mut url) = (None, None, None);
                sc.object(|sc, key| {
                    let v = match &*key {
                        "image_url" | "video_url" | "audio_url" => media_url(sc)?,
                        _ => sc.value()?,
                    };
                    match &*key {
                        "type" => kind = Some(v),
                        "text" => text = Some(v),
                        "image_url" | "video_url" | "audio_url" => url = Some(v),
                        _ => {}
                    }
                    Ok(())
                })?;
                match (text, kind) {
                    (Some(text), _) => self.push_value(text),
                    (None, kind) => {
                        self.push_value(kind.unwrap_or("\"\""));
                        if let Some(url) = url {
                            self.push_str(" ");
                            self.push_value(url);
                        }
                    }
                }
                Ok(())
            })
        });
    }

    /// Copies JSON text without the whitespace outside strings, up to the limit.
    fn push_compact_json(&mut self, json: &str) {
        let mut in_string = false;
        let mut escaped = false;
        for c in json.chars() {
            if in_string {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '"' {
                    in_string = false;
                }
            } else if c == '"' {
                in_string = true;
            } else if c.is_whitespace() {
                continue;
            }
            if !self.push_char(c) {
                return;
            }
        }
    }
}

/// A media part's URL: the `url` of `{"url": ...}`, or a bare string.
fn media_url<'a>(sc: &mut Scanner<'a>) -> Result<&'a str, ScanError> {
    if sc.peek() != Some(b'{') {
        return sc.value();
    }
    let mut url = "";
    sc.object(|sc, key| {
        let v = sc.value()?;
        if key == "url" {
            url = v;
        }
        Ok(())
    })?;
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CONV: KeySpec = KeySpec {
        mode: KeyMode::Conversation,
        prefix_chars: 1024,
    };
    const PREFIX: KeySpec = KeySpec {
        mode: KeyMode::Prefix,
        prefix_chars: 1024,
    };

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
        let spec = KeySpec {
            mode: KeyMode::Hybrid,
            prefix_chars: 1024,
        };
        let facts = |body: &serde_json::Value| {
            extract(Api::Chat, &serde_json::to_vec(body).unwrap(), None, spec).unwrap()
        };
        // A long system part (≥ MIN_GROUP_BYTES) is a group; the key is cut as usual.
        let long = format!("Group A few-shot prefix. {}", "Example. ".repeat(120));
        let turn1 = facts(&chat(&long, &["question one"]));
        let turn3 = facts(&chat(&long, &["question one", "answer", "more"]));
        let other = facts(&chat(&long, &["question two"]));
        assert_eq!(
            turn1.key, turn3.key,
            "every turn of a conversation: one key"
        );
        assert_eq!(
            String::from_utf8(turn1.key.clone()).unwrap(),
            key(Api::Chat, &chat(&long, &["question one"]), CONV),
            "the key is the conversation key"
        );
        assert_ne!(turn1.key, other.key);
        // The system part, cut to `prefix_chars` (role line included).
        let system_part = format!("system\n{long}")[..1024].to_string();
        assert_eq!(turn1.group_key(), Some(system_part.as_bytes()));
        assert_eq!(turn1.group_key(), other.group_key(), "one group");
        let (conv_hash, group) = key_hashes("pool", &turn1, 7);
        assert_eq!(conv_hash, key_hash("pool", &turn1.key, 7));
        assert_eq!(
            group,
            Grouping::Group(key_hash("pool", system_part.as_bytes(), 7))
        );
        // A short system part, or none: no group, spread over the pool.
        for body in [
            chat("Group A few-shot prefix.", &["q"]),
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ] {
            let f = facts(&body);
            assert_eq!((f.group, f.group_key()), (Grouping::Pool, None));
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
        let spec = KeySpec {
            mode: KeyMode::Prefix,
            prefix_chars: 10,
        };
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
            let spec = KeySpec { mode: KeyMode::Prefix, prefix_chars: n };
            let body = serde_json::to_vec(&json!({"prompt": s})).unwrap();
            let k = String::from_utf8(extract(Api::Completions, &body, None, spec).unwrap().key).unwrap();
            prop_assert!(s.starts_with(&k));
            prop_assert_eq!(k.chars().count(), s.chars().count().min(n));
        }
    }
}
