//! The JSON scanner on trial: `facts::read` (the borrowing scanner of
//! `routing/json_scan.rs`) against the fair baseline, a borrowed typed serde derive
//! that reads the same fields (`&RawValue` for every raw value the key needs, the
//! edit spans found from the raw values' positions), on the bodies the routing decision
//! sees. Both must reject what the other rejects; the check below runs first.

use std::borrow::Cow;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use prefixlb::routing::facts::{self, Api};
use serde::Deserialize;
use serde_json::value::RawValue;

const PROSE: &str = "Prefix caching lets an engine skip prefill for tokens it has already seen. \
When a conversation returns to the same instance, its cached blocks are reused and the time \
to first token drops from seconds to milliseconds.\n\nA \"hot\" prefix, such as a shared \
system prompt, must not pin every request to one GPU; bounded loads spill the overflow.\n";
const DENSE: &str = "The quick brown fox jumps over the lazy dog; \"quoted\" text.\n";

fn text(sentence: &str, n: usize) -> String {
    sentence.repeat(n / sentence.len() + 1)[..n].to_string()
}

/// A chat body: a system prompt, `turns` turns, `model` and `stream` last.
fn chat(sentence: &str, system: usize, turns: usize, turn_chars: usize) -> Vec<u8> {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": text(sentence, system)})];
    for i in 0..turns {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": format!("turn {i}: {}", text(sentence, turn_chars))}));
    }
    serde_json::to_vec(&serde_json::json!({
        "messages": messages, "temperature": 0.7, "stream_options": {"include_usage": true},
        "model": "llama", "stream": true
    }))
    .unwrap()
}

/// What `facts::read` reads, through serde: every field the scanner keeps, raw.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    stream: Option<bool>,
    #[serde(borrow)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning_effort: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning: Option<&'a RawValue>,
    chat_template_kwargs: Option<Kwargs>,
    #[serde(borrow)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    input_ids: Option<&'a RawValue>,
    #[serde(borrow)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Kwargs {
    enable_thinking: Option<bool>,
    thinking: Option<bool>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// What the routing core takes from an envelope, found the serde way: the model as a
/// string with its span, the edit spans, the switches, and the raw prompt fields.
#[allow(dead_code)]
struct Facts<'a> {
    model: Option<Cow<'a, str>>,
    model_span: Option<(usize, usize)>,
    object_open: usize,
    stream: bool,
    include_usage: bool,
    stream_options_span: Option<(usize, usize)>,
    wants_thinking: bool,
    messages: Vec<(Option<Cow<'a, str>>, Option<&'a str>)>,
    prompt_fields: [Option<&'a str>; 6],
}

fn span(body: &str, raw: &RawValue) -> (usize, usize) {
    let at = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    (at, at + raw.get().len())
}

fn serde_facts(body: &[u8]) -> Result<Facts<'_>, serde_json::Error> {
    let text = simdutf8::basic::from_utf8(body).map_err(serde::de::Error::custom)?;
    let env: Envelope<'_> = serde_json::from_str(text)?;
    let model = match env.model {
        Some(raw) if raw.get() != "null" => Some(serde_json::from_str::<Cow<'_, str>>(raw.get())?),
        _ => None,
    };
    let include_usage = match env.stream_options {
        Some(raw) if raw.get().starts_with('{') => {
            serde_json::from_str::<StreamOptions>(raw.get())?
                .include_usage
                .unwrap_or(false)
        }
        _ => false,
    };
    fn raw(r: Option<&RawValue>) -> Option<&str> {
        r.map(RawValue::get).filter(|v| *v != "null")
    }
    let kw = env.chat_template_kwargs.as_ref();
    Ok(Facts {
        model_span: env.model.map(|m| span(text, m)),
        model,
        object_open: text.len() - text.trim_start().len() + 1,
        stream: env.stream == Some(true),
        include_usage,
        stream_options_span: env.stream_options.map(|s| span(text, s)),
        wants_thinking: raw(env.reasoning_effort).is_some()
            || raw(env.reasoning).is_some()
            || kw.is_some_and(|k| k.enable_thinking == Some(true) || k.thinking == Some(true)),
        messages: env
            .messages
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.role, raw(m.content)))
            .collect(),
        prompt_fields: [
            raw(env.tools),
            raw(env.prompt),
            raw(env.text),
            raw(env.input_ids),
            raw(env.instructions),
            raw(env.input),
        ],
    })
}

fn scanner_trial(c: &mut Criterion) {
    let bodies = [
        ("18KB_31_messages", chat(PROSE, 2000, 30, 520)),
        ("18KB_31_messages_escape_dense", chat(DENSE, 2000, 30, 520)),
        ("32KB_preamble", chat(PROSE, 32 * 1024, 1, 520)),
    ];
    for (name, body) in &bodies {
        // The same verdict and the same model from both, before anything is timed.
        let ours = facts::read(Api::Chat, body).unwrap().unwrap();
        let theirs = serde_facts(body).unwrap();
        assert_eq!(ours.model(), theirs.model.as_deref());
        assert_eq!(
            theirs.messages.len() as i64,
            if name.starts_with("32KB") { 2 } else { 31 }
        );
        let mut group = c.benchmark_group(format!("scanner_trial/{name}"));
        group.bench_function("json_scan", |b| {
            b.iter(|| facts::read(Api::Chat, black_box(body)).unwrap())
        });
        group.bench_function("serde_borrowed_rawvalue", |b| {
            b.iter(|| serde_facts(black_box(body)).unwrap())
        });
        group.finish();
    }
}

criterion_group!(benches, scanner_trial);
criterion_main!(benches);
