//! Request facts: what the balancer reads of a request body before any key is built.
//! One forward pass of the borrowing [`Scanner`] over the body checks its structure,
//! reads `model`, `stream`, `stream_options` and the reasoning switches, records where
//! the body may be edited ([`BodySpans`]), and keeps the raw text of the prompt fields
//! for the key; nothing else is decoded. Pure: no I/O.

use std::borrow::Cow;
use std::ops::Range;

use super::canonical::without_cache_control;
use super::group::Grouping;
use super::json_scan::{ScanError, Scanner, StringValue};

/// The API a request path belongs to; it decides where the prompt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
    /// `/v1/messages/count_tokens`: keyed like Messages, but it generates nothing, so
    /// it takes no queue place and teaches the pool nothing.
    CountTokens,
    Completions,
    /// SGLang's native `/generate`.
    Generate,
    Responses,
    /// One stored response's own endpoints (`GET`/`DELETE /v1/responses/{id}`,
    /// `POST /v1/responses/{id}/cancel`, …): served by the engine that holds it.
    StoredResponse,
    Embeddings,
    /// vLLM's pooling endpoints: `/v1/rerank` (also `/rerank`, `/v2/rerank`), `/score`
    /// (`/v1/score`), `/pooling` and `/classify`. Keyed as embeddings are.
    Pooling,
    /// vLLM's `/tokenize` and `/detokenize`: like `count_tokens`, no load.
    Tokenize,
    /// OpenAI's audio transcriptions and translations (`/v1/audio/transcriptions`,
    /// `/v1/audio/translations`): a `multipart/form-data` upload, read for its
    /// `model`, `stream` and `file` parts. No engine caches audio by prefix, so it is
    /// keyed by its file and teaches the pool nothing.
    Audio,
    Other,
}

impl Api {
    pub fn from_path(path: &str) -> Api {
        match path {
            "/v1/chat/completions" => Api::Chat,
            "/v1/messages" => Api::Messages,
            "/v1/messages/count_tokens" => Api::CountTokens,
            "/v1/completions" => Api::Completions,
            "/generate" => Api::Generate,
            "/v1/responses" => Api::Responses,
            "/v1/embeddings" => Api::Embeddings,
            "/v1/rerank" | "/rerank" | "/v2/rerank" | "/v1/score" | "/score" | "/pooling"
            | "/classify" => Api::Pooling,
            "/tokenize" | "/detokenize" => Api::Tokenize,
            "/v1/audio/transcriptions" | "/v1/audio/translations" => Api::Audio,
            p if super::stored::id_in_path(p).is_some() => Api::StoredResponse,
            _ => Api::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Messages => "messages",
            Api::CountTokens => "count_tokens",
            Api::Completions => "completions",
            Api::Generate => "generate",
            Api::Responses => "responses",
            Api::StoredResponse => "stored_response",
            Api::Embeddings => "embeddings",
            Api::Pooling => "pooling",
            Api::Tokenize => "tokenize",
            Api::Audio => "audio",
            Api::Other => "other",
        }
    }

    /// Whether the body must be a JSON object (else 400).
    pub fn requires_json(self) -> bool {
        !matches!(self, Api::Other | Api::StoredResponse | Api::Audio)
    }

    /// Whether the body must be a `multipart/form-data` form (another content type is
    /// 415; a form that is not whole, 400).
    pub fn takes_form(self) -> bool {
        self == Api::Audio
    }

    /// Whether the pool learns from it: its prefix is counted, its home remembered,
    /// and its prefill rate, latency and cached tokens learned when it ends. Not a
    /// request that is not load, nor an audio upload: no engine caches audio by
    /// prefix, and its time is the audio's length, which the body does not tell.
    pub fn teaches(self) -> bool {
        self.is_load() && self != Api::Audio
    }

    /// Anthropic's API: its errors, stream events and usage have Anthropic's shapes.
    pub fn is_anthropic(self) -> bool {
        matches!(self, Api::Messages | Api::CountTokens)
    }

    /// Whether `stream: true` asks it for an SSE stream of generated output.
    pub fn streams(self) -> bool {
        matches!(
            self,
            Api::Chat
                | Api::Messages
                | Api::Completions
                | Api::Generate
                | Api::Responses
                | Api::Audio
        )
    }

    /// Whether a request is load that matters: everything but `count_tokens` and
    /// `/tokenize` (`/detokenize`), which only tokenize, and a stored response's own
    /// endpoints (read, delete, cancel).
    /// Such a request takes the least loaded node at once (never a
    /// queue place or a home wait), adds nothing to a prefill backlog, and teaches the
    /// pool nothing (no prefix counted, no home, no latency sample).
    pub fn is_load(self) -> bool {
        !matches!(self, Api::CountTokens | Api::Tokenize | Api::StoredResponse)
    }

    /// Whether the prompt is a message list (`messages`), read the same for every API
    /// that has one.
    pub(super) fn has_messages(self) -> bool {
        matches!(
            self,
            Api::Chat | Api::Messages | Api::CountTokens | Api::Other
        )
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
    /// The digest of a form's uploaded `file`.
    File,
}

impl KeySource {
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::Header => "header",
            KeySource::Prompt => "prompt",
            KeySource::Raw => "raw",
            KeySource::File => "file",
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
    pub wants_thinking: bool,
    /// `stream_options.include_usage = true`: the client asked for the usage chunk.
    pub include_usage: bool,
    /// The most output tokens it asks for (`max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens`), if it says.
    pub max_tokens: Option<u32>,
    /// Where the body may be edited (model rewrite, `stream_options`).
    pub spans: BodySpans,
    /// The key bytes (before the pool name and seed are mixed in): for a `hybrid` key,
    /// the conversation part after its prefix.
    pub key: Vec<u8>,
    /// How the key is placed; for a prefix group, the chain hash of the group's text.
    pub group: Grouping<u64>,
    /// `hybrid` keys: the prefix before the key (a group, or a shared part too short
    /// to be one) and how it was found.
    pub prefix: Option<PrefixFound>,
    pub source: KeySource,
    /// Which turn of its conversation the request is, where the API shows it.
    pub turn: Turn,
    /// Estimated prompt tokens (≈ 4 bytes of text each) and how many of them come
    /// before the newest message (what a cache holding the earlier turns would hold).
    pub tokens: TokenEstimate,
    /// The stored response it names: a Responses API request's
    /// `previous_response_id`, or the id in a stored response's own path.
    pub follows: Option<String>,
    /// Its answer is stored by the engine (a Responses API request without
    /// `"store": false`): the balancer remembers where.
    pub stored: bool,
}

impl RequestFacts {
    /// Tokens of the key's own text: its prefix and conversation part.
    pub fn own_tokens(&self) -> u32 {
        let bytes = self.prefix.map_or(0, |p| p.bytes) + self.key.len();
        (bytes / TokenEstimate::BYTES_PER_TOKEN).min(u32::MAX as usize) as u32
    }
}

/// Which turn of a conversation a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Turn {
    /// A message list with no answer in it yet.
    First,
    /// A message list with an assistant or tool message: it continues a conversation.
    Later,
    /// A prompt string, or a key header: the body does not say, and nothing is
    /// guessed (a long prompt is as likely a new sequence as a continued one).
    #[default]
    Unknown,
}

/// A request's size as the balancer estimates it before an engine counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenEstimate {
    /// The whole prompt.
    pub prompt: u32,
    /// The part before the newest message (0 for a prompt string).
    pub history: u32,
}

impl TokenEstimate {
    /// Bytes of JSON text per token (text is ≈ 4 characters per token).
    pub const BYTES_PER_TOKEN: usize = 4;

    pub fn of_bytes(prompt: usize, history: usize) -> TokenEstimate {
        let t = |b: usize| (b / Self::BYTES_PER_TOKEN).min(u32::MAX as usize) as u32;
        TokenEstimate {
            prompt: t(prompt),
            history: t(history),
        }
    }
}

/// The shared prefix in front of a `hybrid` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixFound {
    /// Chain hash of the prefix's text.
    pub hash: u64,
    /// Bytes of canonical text in it.
    pub bytes: usize,
    /// Chunks of it the pool's traffic shares (0 when only the system part's end was
    /// used, before anything was learned).
    pub hot_chunks: usize,
    /// Learned from the traffic (a hot branch point) or the structural end of the
    /// system part.
    pub learned: bool,
    /// Why the walk stopped.
    pub stop: super::prefix::Stop,
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
    /// The body is a multipart form: `model` is a part's raw value.
    pub form: bool,
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
    /// Valid JSON, but a field the balancer reads has the wrong type.
    #[error("invalid request body: {0}")]
    Invalid(String),
    #[error("'{0}' is a required property")]
    Missing(&'static str),
    #[error("request body is not a valid multipart/form-data form: {0}")]
    Form(#[from] super::form::FormError),
    #[error("'{0}' must be UTF-8 text")]
    NotText(&'static str),
}

/// The fields of any OpenAI-style body that routing reads, as raw JSON text; everything
/// else is skipped without being decoded.
#[derive(Default)]
pub struct Envelope<'a> {
    pub(super) model: Option<Cow<'a, str>>,
    pub(super) spans: BodySpans,
    pub(super) wants_thinking: bool,
    pub(super) include_usage: bool,
    pub(super) max_tokens: Option<u32>,
    pub(super) stream: Option<bool>,
    pub(super) messages: Option<Vec<Message<'a>>>,
    /// Anthropic's top-level `system` (a string or text blocks), without cache markers.
    pub(super) system: Option<Cow<'a, str>>,
    /// Without cache markers.
    pub(super) tools: Option<Cow<'a, str>>,
    pub(super) prompt: Option<&'a str>,
    pub(super) text: Option<&'a str>,
    pub(super) input_ids: Option<&'a str>,
    pub(super) instructions: Option<&'a str>,
    pub(super) input: Option<&'a str>,
    pub(super) previous_response_id: Option<Cow<'a, str>>,
    /// `"store": false`.
    pub(super) no_store: bool,
    /// A form's `file` part: the audio uploaded.
    pub(super) upload: Option<Range<usize>>,
}

/// A chat message, or a `/v1/responses` input item. Its content is the raw JSON
/// text, without cache markers (see [`without_cache_control`]).
pub(super) struct Message<'a> {
    pub(super) role: Option<Cow<'a, str>>,
    pub(super) content: Option<Cow<'a, str>>,
}

/// An audio upload's form: its `model` (and where it is, for a rewrite), `stream`,
/// and its `file` (required, as OpenAI's API has it).
fn read_form(body: &[u8]) -> Result<Envelope<'_>, KeyError> {
    let mut env = Envelope::default();
    env.spans.form = true;
    // Engines read the last of a repeated field, as they do a JSON member.
    for part in super::form::parts(body)? {
        let value = &body[part.value.clone()];
        match part.name.as_str() {
            "model" => {
                let model = std::str::from_utf8(value).map_err(|_| KeyError::NotText("model"))?;
                env.model = Some(Cow::Borrowed(model));
                env.spans.model = Some(part.value);
            }
            // What pydantic reads as true in a form field (vLLM's and SGLang's servers).
            "stream" => {
                let text = String::from_utf8_lossy(value);
                let text = text.trim().to_ascii_lowercase();
                env.stream = Some(matches!(
                    text.as_str(),
                    "true" | "1" | "t" | "yes" | "y" | "on"
                ));
            }
            "file" => env.upload = Some(part.value),
            _ => {}
        }
    }
    if env.upload.is_none() {
        return Err(KeyError::Missing("file"));
    }
    Ok(env)
}

/// Why a body could not be read (`e`, where the envelope's reading stopped): its
/// syntax, as a scan of the whole text finds it first, else the type of a field the
/// balancer reads (`'messages' must be an array of message objects`).
#[cold]
fn why_unread(text: &str, e: ScanError) -> KeyError {
    let mut whole = Scanner::new(text);
    match whole.value().and_then(|_| whole.end()) {
        Err(syntax) => KeyError::Json(syntax.to_string()),
        Ok(()) => KeyError::Invalid(e.to_string()),
    }
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
                env.wants_thinking |= sc.value()? != "null";
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
                    env.wants_thinking |=
                        matches!(&*k, "enable_thinking" | "thinking") && v == "true";
                    Ok(())
                })?;
                return Ok(());
            }
            "stream" => {
                env.stream = sc.opt_bool("'stream' must be a boolean")?;
                return Ok(());
            }
            "previous_response_id" => {
                env.previous_response_id =
                    sc.opt_string("'previous_response_id' must be a string")?;
                return Ok(());
            }
            "store" => {
                env.no_store = sc.value()? == "false";
                return Ok(());
            }
            "max_tokens" | "max_completion_tokens" | "max_output_tokens" => {
                let v = sc.value()?;
                if let Ok(n) = v.parse::<u64>() {
                    env.max_tokens = Some(n.min(u64::from(u32::MAX)) as u32);
                }
                return Ok(());
            }
            "messages" => {
                env.messages = read_messages(sc, "'messages' must be an array of message objects")?;
                return Ok(());
            }
            "tools" | "system" => {
                sc.take_cache_marks();
                let v = Some(sc.value()?).filter(|v| *v != "null");
                let marked = sc.take_cache_marks();
                let v = v.map(|v| {
                    if marked {
                        without_cache_control(v)
                    } else {
                        v.into()
                    }
                });
                match &*key {
                    "tools" => env.tools = v,
                    _ => env.system = v,
                }
                return Ok(());
            }
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
pub(super) fn read_messages<'a>(
    sc: &mut Scanner<'a>,
    msg: &'static str,
) -> Result<Option<Vec<Message<'a>>>, ScanError> {
    match sc.peek() {
        Some(b'n') => return sc.opt_bool(msg).map(|_| None),
        Some(b'[') => {}
        _ => return Err(sc.error(msg)),
    }
    // Room for a usual conversation at once: grown from empty, a 31-message list was
    // allocated four times over, each time copied.
    let mut messages = Vec::with_capacity(16);
    sc.array(|sc| {
        // The usual message (a role and a string content) first; anything else, in full.
        if let Some([role, content]) = sc.string_members(["role", "content"]) {
            messages.push(Message {
                role: role.map(StringValue::decoded),
                content: content.map(|c| Cow::Borrowed(c.literal())),
            });
            return Ok(());
        }
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
                "content" => {
                    sc.take_cache_marks();
                    let v = Some(sc.value()?).filter(|v| *v != "null");
                    let marked = sc.take_cache_marks();
                    m.content = v.map(|v| {
                        if marked {
                            without_cache_control(v)
                        } else {
                            v.into()
                        }
                    });
                }
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
pub(super) fn rescan<'a, T>(
    raw: &'a str,
    f: impl FnOnce(&mut Scanner<'a>) -> Result<T, ScanError>,
) -> Option<T> {
    f(&mut Scanner::new(raw)).ok()
}

impl Envelope<'_> {
    /// The `model` field, if any.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// A body's envelope, checked as its API requires: `None` for a body that is not a
/// JSON object where any body is allowed (`Api::Other`).
pub fn read(api: Api, body: &[u8]) -> Result<Option<Envelope<'_>>, KeyError> {
    if api.takes_form() {
        // Binary: no text to validate but its fields'.
        return read_form(body).map(Some);
    }
    // SIMD validation (simdutf8) is ~3× std's on prompt-sized bodies; std's check
    // runs only on failure, for the error's position.
    let text = match simdutf8::basic::from_utf8(body) {
        Ok(text) => Ok(text),
        Err(_) => std::str::from_utf8(body),
    };
    if !api.requires_json() {
        // Anything else: use the JSON fields if it is a JSON object, else raw bytes.
        return Ok(text.ok().and_then(|t| read_envelope(t).ok()));
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(KeyError::Empty);
    }
    let text =
        text.map_err(|e| KeyError::Json(format!("invalid UTF-8 at byte {}", e.valid_up_to())))?;
    let env = read_envelope(text).map_err(|e| why_unread(text, e))?;
    match api {
        Api::Chat | Api::Messages | Api::CountTokens if env.messages.is_none() => {
            Err(KeyError::Missing("messages"))
        }
        Api::Completions if env.prompt.is_none() => Err(KeyError::Missing("prompt")),
        _ => Ok(Some(env)),
    }
}
