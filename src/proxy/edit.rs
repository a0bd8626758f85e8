//! Request body edits: the `model` rewrite of a fallback pool and the
//! `stream_options.include_usage` the balancer asks for on the client's behalf. Every
//! edit is a splice at an offset the routing scan found in the *original* bytes
//! ([`BodySpans`]), and all of a request's splices are applied in one pass over those
//! bytes, so no edit can shift another's offsets. Apart, per attempt: the
//! data-parallel rank written into an SGLang `/generate` body ([`with_rank`]). Pure:
//! no I/O.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

use crate::routing::facts::{BodySpans, ObjectSpan};

/// What to change in a body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Edits<'a> {
    /// Set `model` to this (added if the body has none).
    pub model: Option<&'a str>,
    /// Set `stream_options.include_usage` to true (adding what is missing).
    pub include_usage: bool,
}

impl Edits<'_> {
    pub fn is_empty(&self) -> bool {
        self.model.is_none() && !self.include_usage
    }
}

/// One replacement of a byte range of the original (empty range: an insertion).
#[derive(Debug)]
struct Splice {
    at: Range<usize>,
    text: String,
}

/// The body with `edits` applied. `spans` must come from scanning this very `body`.
pub fn apply(body: &Bytes, spans: &BodySpans, edits: Edits<'_>) -> Bytes {
    if spans.form {
        return in_form(body, spans, edits.model);
    }
    let Some(object) = spans.object.filter(|_| !edits.is_empty()) else {
        return body.clone();
    };
    let mut splices: Vec<Splice> = Vec::with_capacity(3);
    // Members added to the top-level object, as its first members.
    let mut new_members: Vec<String> = Vec::new();
    if let Some(model) = edits.model {
        let quoted = serde_json::Value::from(model).to_string();
        match &spans.model {
            Some(span) => splices.push(Splice {
                at: span.clone(),
                text: quoted,
            }),
            None => new_members.push(format!("\"model\":{quoted}")),
        }
    }
    if edits.include_usage {
        match &spans.stream_options {
            None => new_members.push(r#""stream_options":{"include_usage":true}"#.to_string()),
            Some(so) => match (so.object, &so.include_usage) {
                (_, Some(value)) => splices.push(Splice {
                    at: value.clone(),
                    text: "true".into(),
                }),
                (Some(obj), None) => {
                    splices.push(insertion(obj, vec![r#""include_usage":true"#.to_string()]))
                }
                // `null` or another non-object: replaced whole.
                (None, None) => splices.push(Splice {
                    at: so.value.clone(),
                    text: r#"{"include_usage":true}"#.into(),
                }),
            },
        }
    }
    if !new_members.is_empty() {
        splices.push(insertion(object, new_members));
    }
    splices.sort_by_key(|s| (s.at.start, s.at.end));
    let grown: usize = splices.iter().map(|s| s.text.len()).sum();
    let mut out = BytesMut::with_capacity(body.len() + grown);
    let mut from = 0;
    for s in &splices {
        out.extend_from_slice(&body[from..s.at.start]);
        out.extend_from_slice(s.text.as_bytes());
        from = s.at.end;
    }
    out.extend_from_slice(&body[from..]);
    out.freeze()
}

/// A multipart form with its `model` part's value replaced by `model` (a form that has
/// no `model` part is left as it is: OpenAI's audio APIs require one). A form has no
/// `stream_options`; its usage is asked for by other fields.
fn in_form(body: &Bytes, spans: &BodySpans, model: Option<&str>) -> Bytes {
    // A model name is one line of text (a line end would end the part).
    let model = model.filter(|m| !m.contains(['\r', '\n']));
    let (Some(model), Some(at)) = (model, &spans.model) else {
        return body.clone();
    };
    let mut out = BytesMut::with_capacity(body.len() + model.len());
    out.extend_from_slice(&body[..at.start]);
    out.extend_from_slice(model.as_bytes());
    out.extend_from_slice(&body[at.end..]);
    out.freeze()
}

/// `body` (an SGLang `/generate` request, already edited) with `"routed_dp_rank":
/// rank` as its top-level object's last member: SGLang reads the rank of `/generate`
/// from its body, not from the `x-data-parallel-rank` header, and its JSON parser keeps
/// the last of a repeated member, so a rank the client wrote is overridden as its
/// header would be. `spans` are the original body's: only whether it is an object is
/// read. A body that does not end with its object's `}` is left as it is.
pub fn with_rank(body: &Bytes, spans: &BodySpans, rank: &[u8]) -> Bytes {
    if spans.object.is_none() {
        return body.clone();
    }
    append_members(body, &[b"\"routed_dp_rank\":", rank])
}

/// `body` (a JSON object) with `members` (the pieces of `"name":value` members,
/// comma-separated, written one after the other) as its last, and the comma before
/// them that its other members need. A body whose last byte (but whitespace) is not
/// its object's `}` is left as it is.
pub fn append_members(body: &[u8], members: &[&[u8]]) -> Bytes {
    let Some(close) = body.iter().rposition(|b| !b.is_ascii_whitespace()) else {
        return Bytes::copy_from_slice(body);
    };
    if body[close] != b'}' {
        return Bytes::copy_from_slice(body);
    }
    // Empty when its `{` is the last thing before its `}` (after the other edits).
    let before = body[..close].iter().rposition(|b| !b.is_ascii_whitespace());
    let has_members = before.is_some_and(|i| body[i] != b'{');
    let added: usize = members.iter().map(|m| m.len()).sum();
    let mut out = BytesMut::with_capacity(body.len() + added + 1);
    out.extend_from_slice(&body[..close]);
    if has_members {
        out.extend_from_slice(b",");
    }
    for m in members {
        out.extend_from_slice(m);
    }
    out.extend_from_slice(&body[close..]);
    out.freeze()
}

/// Members inserted right after an object's `{`, with the comma its other members need.
fn insertion(object: ObjectSpan, members: Vec<String>) -> Splice {
    let mut text = members.join(",");
    if !object.empty {
        text.push(',');
    }
    Splice {
        at: object.open..object.open,
        text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KeyMode;
    use crate::routing::facts::Api;
    use crate::routing::key::{extract, KeySpec};

    fn edit(body: &str, model: Option<&str>, include_usage: bool) -> String {
        let spec = KeySpec::new(KeyMode::Hybrid, 64);
        let facts = extract(Api::Embeddings, body.as_bytes(), None, spec).unwrap();
        let out = apply(
            &Bytes::copy_from_slice(body.as_bytes()),
            &facts.spans,
            Edits {
                model,
                include_usage,
            },
        );
        String::from_utf8(out.to_vec()).unwrap()
    }

    fn ranked(body: &str, rank: &str) -> String {
        let spec = KeySpec::new(KeyMode::Hybrid, 64);
        let facts = extract(Api::Generate, body.as_bytes(), None, spec).unwrap();
        let body = Bytes::copy_from_slice(body.as_bytes());
        let out = with_rank(&body, &facts.spans, rank.as_bytes());
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[test]
    fn a_form_s_model_part_is_rewritten_and_nothing_else() {
        let form = |model: &str| {
            format!("--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\x00model\r\n--b--\r\n")
        };
        let spec = KeySpec::new(KeyMode::Hybrid, 64);
        let body = form("whisper-1");
        let facts = extract(Api::Audio, body.as_bytes(), None, spec).unwrap();
        let edited = |model, include_usage| {
            let body = Bytes::copy_from_slice(body.as_bytes());
            apply(
                &body,
                &facts.spans,
                Edits {
                    model,
                    include_usage,
                },
            )
        };
        let rewritten = edited(Some("openai/whisper-large-v3"), true);
        assert_eq!(rewritten, form("openai/whisper-large-v3").as_bytes());
        assert_eq!(edited(None, true), body.as_bytes());
        // A name that would end the part is not written.
        assert_eq!(edited(Some("a\r\n--b--"), false), body.as_bytes());
    }

    #[test]
    fn the_rank_is_the_last_member_so_it_overrides_the_client_s() {
        assert_eq!(
            ranked(r#"{"text":"hi","stream":true}"#, "3"),
            r#"{"text":"hi","stream":true,"routed_dp_rank":3}"#
        );
        let v: serde_json::Value =
            serde_json::from_str(&ranked("{\"routed_dp_rank\": 0, \"text\": \"x\"}\n", "5"))
                .unwrap();
        assert_eq!(v["routed_dp_rank"], 5, "the last member is the one read");
        assert_eq!(ranked("{ }", "2"), r#"{ "routed_dp_rank":2}"#);
        assert_eq!(ranked("{}", "2"), r#"{"routed_dp_rank":2}"#);
    }

    #[test]
    fn the_fallback_stream_bug_is_gone() {
        // Both edits at once on a body without `stream_options` (a fallback pool's stream).
        let body = r#"{"model":"test-model","messages":[],"stream":true,"max_tokens":8}"#;
        assert_eq!(
            edit(body, Some("backup-model"), true),
            r#"{"stream_options":{"include_usage":true},"model":"backup-model","messages":[],"stream":true,"max_tokens":8}"#
        );
    }

    #[test]
    fn each_shape_of_stream_options() {
        assert_eq!(
            edit(r#"{"stream_options": {}}"#, None, true),
            r#"{"stream_options": {"include_usage":true}}"#
        );
        assert_eq!(
            edit(r#"{"stream_options": {"x": 1}}"#, None, true),
            r#"{"stream_options": {"include_usage":true,"x": 1}}"#
        );
        assert_eq!(
            edit(
                r#"{"stream_options": {"include_usage": false}}"#,
                None,
                true
            ),
            r#"{"stream_options": {"include_usage": true}}"#
        );
        assert_eq!(
            edit(r#"{"stream_options": null, "a": 1}"#, None, true),
            r#"{"stream_options": {"include_usage":true}, "a": 1}"#
        );
        assert_eq!(
            edit(" { } ", Some("m"), true),
            r#" {"model":"m","stream_options":{"include_usage":true} } "#
        );
    }

    #[test]
    fn no_edits_no_copy() {
        let body = Bytes::from_static(b"{\"a\":1}");
        let spans = BodySpans::default();
        assert_eq!(
            apply(&body, &spans, Edits::default()).as_ptr(),
            body.as_ptr()
        );
    }
}
