//! Prompt text as the key sees it: JSON values with every `cache_control` member
//! taken out, at any depth. Anthropic's clients (and OpenAI-style clients of some
//! gateways) mark cache breakpoints on content blocks, tools and the system part, and
//! move the marker forward every turn; the text the engine caches is the same with or
//! without it, so the key must be too. The member is cut out of the client's own bytes
//! with the comma that joined it, so the rest keeps the client's spacing and a marked
//! block reads exactly as the same block unmarked. Pure: no I/O.

use std::borrow::Cow;
use std::ops::Range;

use memchr::memmem;

use super::facts::rescan;
use super::json_scan::{ScanError, Scanner};

const MARKER: &[u8] = b"\"cache_control\"";

/// `raw` (valid JSON text) without its `cache_control` members; borrowed when it has
/// none. The envelope's scan calls it only for a value in which it passed such a key
/// ([`super::json_scan::Scanner::take_cache_marks`]).
pub fn without_cache_control(raw: &str) -> Cow<'_, str> {
    if memmem::find(raw.as_bytes(), MARKER).is_none() {
        return Cow::Borrowed(raw);
    }
    let mut cuts = Vec::new();
    if rescan(raw, |sc| collect(sc, raw.as_bytes(), &mut cuts)).is_none() || cuts.is_empty() {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut at = 0;
    for cut in cuts {
        out.push_str(&raw[at..cut.start]);
        at = cut.end;
    }
    out.push_str(&raw[at..]);
    Cow::Owned(out)
}

/// Walks one value, recording the byte ranges to cut (in order, never overlapping).
fn collect(
    sc: &mut Scanner<'_>,
    bytes: &[u8],
    cuts: &mut Vec<Range<usize>>,
) -> Result<(), ScanError> {
    match sc.peek() {
        Some(b'{') => {
            let open = sc.offset() + 1;
            // Where the previous member's value ended (or just inside the brace).
            let mut prev_end = open;
            let mut first = true;
            sc.object(|sc, key| {
                if key != "cache_control" {
                    collect(sc, bytes, cuts)?;
                } else {
                    sc.value()?;
                    let end = sc.offset();
                    if first {
                        // `{ "cache_control": …, "next": …}`: the member, its comma and
                        // the space after it.
                        let key_start = skip_space(bytes, prev_end);
                        let mut to = skip_space(bytes, end);
                        if bytes.get(to) == Some(&b',') {
                            to = skip_space(bytes, to + 1);
                        }
                        cuts.push(key_start..to);
                        prev_end = to;
                        return Ok(());
                    }
                    // `…, "cache_control": …`: from the end of the previous value.
                    cuts.push(prev_end..end);
                    prev_end = end;
                    return Ok(());
                }
                first = false;
                prev_end = sc.offset();
                Ok(())
            })
        }
        Some(b'[') => sc.array(|sc| collect(sc, bytes, cuts)),
        _ => sc.value().map(|_| ()),
    }
}

fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(raw: &str) -> String {
        without_cache_control(raw).into_owned()
    }

    #[test]
    fn a_marked_block_reads_as_the_same_block_unmarked() {
        let plain = r#"[{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]"#;
        let marked = r#"[{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "there"}]"#;
        assert_eq!(strip(marked), plain);
        assert!(matches!(without_cache_control(plain), Cow::Borrowed(_)));
        // First member, compact, nested in a tool result, and alone.
        assert_eq!(
            strip(r#"{"cache_control":{"type":"ephemeral"},"type":"text","text":"a"}"#),
            r#"{"type":"text","text":"a"}"#
        );
        assert_eq!(
            strip(
                r#"[{"type":"tool_result","content":[{"type":"text","text":"x","cache_control":{"type":"ephemeral","ttl":"1h"}}]}]"#
            ),
            r#"[{"type":"tool_result","content":[{"type":"text","text":"x"}]}]"#
        );
        assert_eq!(strip(r#"{ "cache_control" : {} }"#), "{ }");
        assert_eq!(
            strip(r#"{"cache_control": 1, "cache_control": 2, "a": 3}"#),
            r#"{"a": 3}"#
        );
        // Only a member named so: a text that mentions it stays.
        let text = r#"[{"type":"text","text":"the \"cache_control\" field"}]"#;
        assert_eq!(strip(text), text);
    }

    #[test]
    fn every_member_is_cut_and_the_rest_stays_valid_json() {
        let raw = r#"{"cache_control": 1, "a": [{"cache_control": 2}, {"b": 3, "cache_control": {"x": [4]}, "c": 5}], "cache_control": 6}"#;
        let out = strip(raw);
        assert!(!out.contains("cache_control"), "{out}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, serde_json::json!({"a": [{}, {"b": 3, "c": 5}]}));
    }
}
