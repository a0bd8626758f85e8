//! The routing key's tests: keys per API and mode, the learned prefix, golden hashes,
//! and bodies that must never panic.

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

/// An Anthropic Messages body: `system` as text blocks, tools, and turns whose
/// content is blocks; the cache marker on the last block of the last message, as
/// agent clients put it.
fn anthropic(system: &str, turns: &[&str]) -> serde_json::Value {
    let n = turns.len();
    let messages: Vec<_> = turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let mut block = json!({"type": "text", "text": t});
            if i + 1 == n {
                block["cache_control"] = json!({"type": "ephemeral"});
            }
            json!({"role": role, "content": [block]})
        })
        .collect();
    json!({
        "model": "m", "max_tokens": 64,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "grep", "input_schema": {"type": "object"}}],
        "messages": messages,
    })
}

#[test]
fn messages_keys_ignore_cache_markers_and_group_by_their_system_part() {
    let spec = KeySpec::new(KeyMode::Hybrid, 1024);
    let facts = |body: &serde_json::Value| {
        extract(
            Api::Messages,
            &serde_json::to_vec(body).unwrap(),
            None,
            spec,
        )
        .unwrap()
    };
    let long = format!("You are a coding agent. {}", "Rule. ".repeat(200));
    // The marker moves to the newest block every turn: the key stays.
    let turn1 = facts(&anthropic(&long, &["fix the bug"]));
    let turn3 = facts(&anthropic(&long, &["fix the bug", "done", "now test it"]));
    let other = facts(&anthropic(&long, &["write docs"]));
    assert_eq!(turn1.key, turn3.key);
    assert_eq!(
        turn1.key,
        br#"user
[{"text":"fix the bug","type":"text"}]
"#
    );
    assert_ne!(turn1.key, other.key);
    assert_eq!(turn1.prefix, other.prefix, "tools and system: one group");
    assert!(matches!(turn1.group, Grouping::Group(_)));
    assert_eq!((turn1.turn, turn3.turn), (Turn::First, Turn::Later));
    // The same conversation with no markers at all: the same key and group.
    let mut plain = anthropic(&long, &["fix the bug", "done", "now test it"]);
    plain["system"][0]
        .as_object_mut()
        .unwrap()
        .remove("cache_control");
    plain["messages"][2]["content"][0]
        .as_object_mut()
        .unwrap()
        .remove("cache_control");
    let plain = facts(&plain);
    assert_eq!((plain.key, plain.prefix), (turn3.key.clone(), turn3.prefix));
    // A string system part and string content key like chat's conversation mode.
    let body = json!({"model": "m", "max_tokens": 8, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(key(Api::Messages, &body, CONV), "Be brief.user\nhi\n");
    // Images by type and URL (or their inline data).
    let image = |url: &str| {
        let src = json!({"type": "url", "url": url});
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": src}, {"type": "text", "text": "what is this?"}]}]})
    };
    let a = key(Api::Messages, &image("https://x/a.png"), CONV);
    assert!(a.contains("image https://x/a.png"), "{a}");
    assert_ne!(a, key(Api::Messages, &image("https://x/b.png"), CONV));
    // count_tokens reads the same body the same way; `messages` is required.
    let bytes = serde_json::to_vec(&anthropic(&long, &["fix the bug"])).unwrap();
    assert_eq!(
        extract(Api::CountTokens, &bytes, None, spec).unwrap().key,
        turn1.key
    );
    assert_eq!(
        extract(Api::Messages, br#"{"model":"m","system":"x"}"#, None, spec),
        Err(KeyError::Missing("messages"))
    );
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
            Some((table, Mode::Route)),
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
            messages.push(json!({"role": "assistant", "content": format!("answer {user}.{t}")}));
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
fn token_id_prompts_are_chunked_by_tokens_whatever_their_spacing() {
    // A shared 600-token preamble, then each request's own 200 tokens; half the
    // clients write `[1,2]`, half `[1, 2]` (Python's json.dumps).
    let table = PrefixTable::default();
    let spec = KeySpec::new(KeyMode::Hybrid, 1024);
    let body = |user: u32, spaced: bool, api: Api| {
        let ids: Vec<String> = (0..600u32)
            .map(|t| (t * 7 + 100_000).to_string())
            .chain((0..200u32).map(|t| (user * 1000 + t).to_string()))
            .collect();
        let list = ids.join(if spaced { ", " } else { "," });
        let field = if api == Api::Generate {
            "input_ids"
        } else {
            "prompt"
        };
        format!(r#"{{"model": "m", "{field}": [{list}]}}"#)
    };
    let facts = |b: &str, api: Api| {
        let env = facts::read(api, b.as_bytes()).unwrap();
        facts_of(
            api,
            b.as_bytes(),
            env.as_ref(),
            None,
            spec,
            Some((&table, Mode::Route)),
        )
    };
    for u in 0..40 {
        facts(&body(u, u % 2 == 0, Api::Completions), Api::Completions);
    }
    let compact = facts(&body(500, false, Api::Completions), Api::Completions);
    let spaced = facts(&body(501, true, Api::Completions), Api::Completions);
    let generate = facts(&body(502, true, Api::Generate), Api::Generate);
    let p = compact.prefix.unwrap();
    assert!(p.learned, "{p:?}");
    assert_eq!(
        spaced.prefix.map(|p| p.hash),
        Some(p.hash),
        "spacing does not matter"
    );
    assert_eq!(
        generate.prefix.map(|p| p.hash),
        Some(p.hash),
        "/generate alike"
    );
    // The group ends on a chunk of whole tokens: 4 × 128 of the 600 shared.
    let shared_bytes = |spaced: bool| {
        // The bracket, 512 six-digit ids, each with its comma, and the spaces between.
        1 + 512 * 7 + if spaced { 511 } else { 0 }
    };
    assert_eq!(p.bytes, shared_bytes(false), "{p:?}");
    assert_eq!(spaced.prefix.unwrap().bytes, shared_bytes(true));
    // The estimate counts tokens, not bytes.
    assert_eq!(compact.tokens.prompt, 800);
    assert_eq!(generate.tokens.prompt, 800);
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
fn a_hybrid_key_counts_characters_too() {
    // `prefix_chars` counts characters in every mode: a conversation part of Japanese
    // text holds as many characters as one of English text, whatever its bytes.
    let spec = KeySpec::new(KeyMode::Hybrid, 12);
    for text in [
        "日本語の会話はここから始まります",
        "an english conversation",
    ] {
        let body = json!({"messages": [{"role": "user", "content": text}]});
        let k = key(Api::Chat, &body, spec);
        assert_eq!(k.chars().count(), 12, "{k:?}");
        assert!(format!("\"{text}").starts_with(&k), "{k:?}");
    }
    let templated = json!({"prompt": "<|im_start|>user\nこんにちは、世界<|im_end|>\n"});
    let k = key(Api::Completions, &templated, spec);
    assert_eq!(k.chars().count(), 12, "{k:?}");
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
    assert!(f.wants_thinking);
    let span = f.spans.model.unwrap();
    assert_eq!(&body[span], br#""qwen""#);
    let f = extract(
        Api::Chat,
        br#"{"messages": [], "reasoning_effort": "high"}"#,
        None,
        CONV,
    )
    .unwrap();
    assert!(f.wants_thinking);
    let f = extract(Api::Chat, br#"{"messages": [], "reasoning_effort": null, "chat_template_kwargs": {"enable_thinking": false}}"#, None, CONV).unwrap();
    assert!(!f.wants_thinking);
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
    // Bad syntax where a field's value should be is bad JSON; valid JSON of the wrong
    // type is an invalid field, said as such.
    for (body, syntax) in [
        (&b"{\"messages\": ["[..], true),
        (b"{\"model\": }", true),
        (b"{\"stream\": tru}", true),
        (b"{\"messages\": [1]", true),
        (b"{\"messages\": \"hi\"}", false),
        (b"{\"messages\": [1]}", false),
        (b"{\"model\": 7, \"messages\": []}", false),
        (b"{\"stream\": \"yes\"}", false),
    ] {
        let got = extract(Api::Chat, body, None, CONV);
        let shown = String::from_utf8_lossy(body);
        match syntax {
            true => assert!(matches!(got, Err(KeyError::Json(_))), "{shown}: {got:?}"),
            false => assert!(matches!(got, Err(KeyError::Invalid(_))), "{shown}: {got:?}"),
        }
    }
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
