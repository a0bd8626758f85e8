//! Text a client or an engine controls (a model name, a path, an engine's error
//! message), made safe to echo in an error or a log line: bounded and escaped.

/// Most characters of such text echoed.
pub const CLIP_CHARS: usize = 256;

/// At most [`CLIP_CHARS`] characters of `text` (then `…`), with control characters,
/// quotes and backslashes escaped.
pub fn clip(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(CLIP_CHARS + 8));
    let mut chars = text.chars();
    for c in chars.by_ref().take(CLIP_CHARS) {
        out.extend(c.escape_debug());
    }
    if chars.next().is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipped_text_is_short_and_escaped() {
        assert_eq!(clip("gpt-5"), "gpt-5");
        assert_eq!(clip("a\nb\"c\u{7}"), "a\\nb\\\"c\\u{7}");
        let long = "x".repeat(1000);
        assert_eq!(clip(&long).chars().count(), CLIP_CHARS + 1);
    }
}
