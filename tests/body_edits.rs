//! Property test of request body edits (issue 9): for random valid request bodies
//! (members in any order, any whitespace, escapes and unicode, with and without every
//! shape of `stream_options`) and every combination of edits, the edited body parses
//! as JSON and equals the intended edit of the parsed input.

use bytes::Bytes;
use proptest::prelude::*;
use std::collections::HashSet;

use serde_json::{json, Value};

use prefixlb::config::KeyMode;
use prefixlb::proxy::edit::{apply, Edits};
use prefixlb::routing::facts::Api;
use prefixlb::routing::json_scan::Scanner;
use prefixlb::routing::key::{extract, KeySpec};

/// A JSON string literal for `s`, escaping some characters that need no escape (as
/// `\uXXXX`, surrogate pairs included, or `\/`) when `fancy` says so.
fn encode_str(s: &str, fancy: &[bool]) -> String {
    let mut out = String::from("\"");
    for (i, c) in s.chars().enumerate() {
        let fancy = fancy.get(i % fancy.len().max(1)).copied().unwrap_or(false);
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '/' if fancy => out.push_str("\\/"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if fancy && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Writes a value with the given whitespace between tokens, members in the order given.
fn encode(v: &Value, ws: &str, fancy: &[bool]) -> String {
    match v {
        Value::String(s) => encode_str(s, fancy),
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(|i| encode(i, ws, fancy)).collect();
            format!("[{ws}{}{ws}]", parts.join(&format!("{ws},{ws}")))
        }
        Value::Object(m) => {
            let parts: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}{ws}:{ws}{}", encode_str(k, fancy), encode(v, ws, fancy)))
                .collect();
            format!("{{{ws}{}{ws}}}", parts.join(&format!("{ws},{ws}")))
        }
        other => other.to_string(),
    }
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,12}",
        "\\PC{0,12}",
        Just("quote \" back\\slash / new\nline tab\t é 🎉 \u{1}".to_string()),
    ]
}

fn stream_options() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        Just(Some(json!({}))),
        Just(Some(Value::Null)),
        any::<bool>().prop_map(|b| Some(json!({"include_usage": b}))),
        any::<bool>()
            .prop_map(|b| Some(json!({"continuous_usage_stats": true, "include_usage": b}))),
        Just(Some(json!({"x": [1, {"include_usage": false}]}))),
    ]
}

/// A request body's members, in a random order.
fn members() -> impl Strategy<Value = Vec<(String, Value)>> {
    (
        prop_oneof![
            Just(None),
            Just(Some(Value::Null)),
            text().prop_map(|t| Some(Value::String(t)))
        ],
        proptest::collection::vec(
            (
                prop_oneof![Just("system"), Just("user"), Just("assistant")],
                text(),
            ),
            0..4,
        ),
        any::<Option<bool>>(),
        stream_options(),
        proptest::option::of(text()),
        any::<u64>(),
    )
        .prop_map(|(model, messages, stream, so, extra, seed)| {
            let mut m: Vec<(String, Value)> = Vec::new();
            if let Some(model) = model {
                m.push(("model".into(), model));
            }
            let messages: Vec<Value> = messages
                .into_iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect();
            m.push(("messages".into(), Value::Array(messages)));
            if let Some(stream) = stream {
                m.push(("stream".into(), Value::Bool(stream)));
            }
            if let Some(so) = so {
                m.push(("stream_options".into(), so));
            }
            if let Some(extra) = extra {
                m.push((
                    "ünïcode \"key\"".into(),
                    json!({"nested": [extra, 1.5e3, null]}),
                ));
            }
            m.push(("temperature".into(), json!(0.25)));
            // Shuffle by the seed.
            let mut x = seed | 1;
            for i in (1..m.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                m.swap(i, (x % (i as u64 + 1)) as usize);
            }
            m
        })
}

/// What the edits should do to the parsed input.
fn intended(input: &Value, model: Option<&str>, include_usage: bool) -> Value {
    let mut v = input.clone();
    let obj = v.as_object_mut().unwrap();
    if let Some(model) = model {
        obj.insert("model".into(), Value::String(model.into()));
    }
    if include_usage {
        match obj.get_mut("stream_options") {
            Some(Value::Object(so)) => {
                so.insert("include_usage".into(), Value::Bool(true));
            }
            _ => {
                obj.insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn every_edit_of_every_body_is_valid_and_exact(
        members in members(),
        ws in prop_oneof![Just(""), Just(" "), Just("\n  "), Just("\t")],
        fancy in proptest::collection::vec(any::<bool>(), 1..8),
        new_model in prop_oneof![Just("backup-model".to_string()), text()],
    ) {
        // The body text keeps the members in the generated order.
        let parts: Vec<String> = members
            .iter()
            .map(|(k, v)| format!("{}{ws}:{ws}{}", encode_str(k, &fancy), encode(v, ws, &fancy)))
            .collect();
        let body = format!("{ws}{{{ws}{}{ws}}}{ws}", parts.join(&format!("{ws},{ws}")));
        let input: Value = serde_json::from_str(&body).expect("the generated body is valid JSON");
        prop_assert_eq!(input.as_object().unwrap().len(), members.len());
        let spec = KeySpec::new(KeyMode::Hybrid, 1024);
        let facts = extract(Api::Chat, body.as_bytes(), None, spec).unwrap();
        let bytes = Bytes::from(body.clone());
        for model in [None, Some(new_model.as_str())] {
            for include_usage in [false, true] {
                let out = apply(&bytes, &facts.spans, Edits { model, include_usage });
                let parsed: Value = serde_json::from_slice(&out).map_err(|e| {
                    TestCaseError::fail(format!("{e}: {}", String::from_utf8_lossy(&out)))
                })?;
                prop_assert_eq!(&parsed, &intended(&input, model, include_usage), "body {}", body);
                // Exactly one of each member: no duplicate for an engine to guess about.
                let mut keys = Vec::new();
                let text = std::str::from_utf8(&out).unwrap();
                Scanner::new(text)
                    .object(|sc, key| {
                        keys.push(key.into_owned());
                        sc.value().map(|_| ())
                    })
                    .unwrap();
                let unique: HashSet<&String> = keys.iter().collect();
                prop_assert_eq!(unique.len(), keys.len(), "duplicate member in {}", text);
            }
        }
    }
}
