//! The routing key: which bytes of a request decide its home on the ring, and its
//! hashes. The key text comes from the prompt fields the facts scan kept (or a key
//! header, or the raw body), each part cut to `prefix_chars` characters, so the work
//! per request is bounded whatever the body's size; for `key = "hybrid"` the key's
//! leading system part also names its prefix group. Pure: no I/O.

use xxhash_rust::xxh3::Xxh3;

use super::facts::{self, Envelope, Message};
pub use super::facts::{
    Api, BodySpans, KeyError, KeySource, ObjectSpan, RequestFacts, StreamOptionsSpan,
};
pub use super::group::Grouping;
use super::key_text::KeyText;
use crate::config::KeyMode;

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
    let envelope = facts::read(api, body)?;
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
