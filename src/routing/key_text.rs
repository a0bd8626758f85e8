//! Key text under construction: at most `prefix_chars` characters, cut on character
//! boundaries, with JSON strings decoded only as far as the key needs them and other
//! values copied as compact JSON. Pure: no I/O.

use super::facts::rescan;
use super::json_scan::{self, ScanError, Scanner};

/// A key under construction that holds at most `left` more characters.
pub(super) struct KeyText {
    pub(super) out: String,
    left: usize,
}

impl KeyText {
    pub(super) fn new(limit: usize) -> Self {
        KeyText {
            out: String::with_capacity(limit.min(4096)),
            left: limit,
        }
    }

    pub(super) fn full(&self) -> bool {
        self.left == 0
    }

    pub(super) fn push_char(&mut self, c: char) -> bool {
        if self.left == 0 {
            return false;
        }
        self.out.push(c);
        self.left -= 1;
        true
    }

    pub(super) fn push_str(&mut self, s: &str) {
        // Cut on a char boundary, never inside a code point.
        let (taken, n) = json_scan::take_chars(s, self.left);
        self.out.push_str(taken);
        self.left -= n;
    }

    /// A JSON value as key text: strings decoded, anything else as compact JSON.
    pub(super) fn push_value(&mut self, raw: &str) {
        if raw.starts_with('"') {
            self.left -= json_scan::decode_prefix(raw, self.left, &mut self.out);
        } else {
            self.push_compact_json(raw);
        }
    }

    /// Message content: a string, or an array of parts (text parts contribute their
    /// text; other parts their type and URL).
    pub(super) fn push_content(&mut self, raw: &str) {
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
                        "image_url" | "video_url" | "audio_url" | "source" => media_url(sc)?,
                        _ => sc.value()?,
                    };
                    match &*key {
                        "type" => kind = Some(v),
                        "text" => text = Some(v),
                        // Anthropic's images and documents: `source`'s URL or data.
                        "image_url" | "video_url" | "audio_url" | "source" => url = Some(v),
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
    pub(super) fn push_compact_json(&mut self, json: &str) {
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

/// A media part's URL: the `url` of `{"url": ...}` (else its inline `data`, as
/// Anthropic's base64 `source` carries it), or a bare string.
fn media_url<'a>(sc: &mut Scanner<'a>) -> Result<&'a str, ScanError> {
    if sc.peek() != Some(b'{') {
        return sc.value();
    }
    let (mut url, mut data) = ("", "");
    sc.object(|sc, key| {
        let v = sc.value()?;
        match &*key {
            "url" => url = v,
            "data" => data = v,
            _ => {}
        }
        Ok(())
    })?;
    Ok(if url.is_empty() { data } else { url })
}
