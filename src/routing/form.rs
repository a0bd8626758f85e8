//! `multipart/form-data` bodies (RFC 7578), the way OpenAI's audio APIs take a
//! request: the boundary a content type names, and a body's parts as byte ranges of
//! it (each part's name, whether it is a file, and where its value is). Part heads are
//! parsed with `httparse`; a value is found, never copied or decoded. The body must
//! open with its boundary (no preamble: no client sends one) and close with it. Pure:
//! no I/O.

use std::ops::Range;

/// Most header lines in one part's head (clients send one to three).
const MAX_PART_HEADERS: usize = 16;
/// RFC 2046: a boundary is 1 to 70 characters.
const MAX_BOUNDARY: usize = 70;
/// Most parts in one form (an upload has a file and a dozen fields at most): a body of
/// empty parts is not read into a list many times its size.
pub const MAX_PARTS: usize = 256;

/// Why a body is not a form this module can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormError {
    #[error("the body does not begin with a boundary line (--boundary)")]
    NoOpening,
    #[error("the boundary must be 1 to 70 characters")]
    BoundaryLength,
    #[error("the body's boundary is not the one its content-type names")]
    OtherBoundary,
    #[error("the form has more than {MAX_PARTS} parts")]
    TooManyParts,
    #[error("part {0}'s head is malformed or does not end")]
    PartHead(usize),
    #[error("part {0} is not closed by a boundary")]
    Unclosed(usize),
    #[error("the boundary after part {0} is followed by neither a line end nor --")]
    AfterBoundary(usize),
}

/// One part of a form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Its `Content-Disposition` name (empty when it has none).
    pub name: String,
    /// It is a file (its disposition has a `filename`).
    pub file: bool,
    /// Its value, as a range of the body.
    pub value: Range<usize>,
}

/// The boundary of a `multipart/form-data` content type (`None` for any other type,
/// or one that names no boundary).
pub fn boundary(content_type: &str) -> Option<&str> {
    let mut fields = content_type.split(';');
    let essence = fields.next()?.trim();
    if !essence.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    fields.find_map(|param| {
        let (name, value) = param.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let value = value.trim();
        let value = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or(value);
        (!value.is_empty()).then_some(value)
    })
}

/// The boundary a body opens with: its first line, `--` and the boundary (transport
/// padding after it ignored).
pub fn opening(body: &[u8]) -> Result<&[u8], FormError> {
    opening_line(body).map(|(boundary, _)| boundary)
}

/// The opening boundary, and where the line after it begins.
fn opening_line(body: &[u8]) -> Result<(&[u8], usize), FormError> {
    let line_end = memchr::memmem::find(body, b"\r\n").ok_or(FormError::NoOpening)?;
    let line = body[..line_end]
        .strip_prefix(b"--")
        .ok_or(FormError::NoOpening)?;
    let boundary = line.trim_ascii_end();
    if boundary.is_empty() || boundary.len() > MAX_BOUNDARY {
        return Err(FormError::BoundaryLength);
    }
    Ok((boundary, line_end + 2))
}

/// The parts of a form body, in order. Whatever follows the closing boundary (the
/// epilogue) is ignored.
pub fn parts(body: &[u8]) -> Result<Vec<Part>, FormError> {
    let (boundary, mut at) = opening_line(body)?;
    // Every boundary after the opening one is on a line of its own.
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let finder = memchr::memmem::Finder::new(&delimiter);
    let mut parts = Vec::new();
    loop {
        let n = parts.len();
        if n == MAX_PARTS {
            return Err(FormError::TooManyParts);
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_PART_HEADERS];
        let (head_len, name, file) = match httparse::parse_headers(&body[at..], &mut headers) {
            Ok(httparse::Status::Complete((len, headers))) => {
                let disposition = headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-disposition"))
                    .map(|h| disposition(h.value));
                let (name, file) = disposition.unwrap_or_default();
                (len, name, file)
            }
            _ => return Err(FormError::PartHead(n)),
        };
        let start = at + head_len;
        let end = start + finder.find(&body[start..]).ok_or(FormError::Unclosed(n))?;
        parts.push(Part {
            name,
            file,
            value: start..end,
        });
        let after = &body[end + delimiter.len()..];
        if after.starts_with(b"--") {
            return Ok(parts);
        }
        let padding = after
            .iter()
            .take_while(|b| matches!(b, b' ' | b'\t'))
            .count();
        if !after[padding..].starts_with(b"\r\n") {
            return Err(FormError::AfterBoundary(n));
        }
        at = end + delimiter.len() + padding + 2;
    }
}

/// A `Content-Disposition` value's `name` parameter and whether it has a `filename`
/// (or `filename*`) one. Parameters are tokens or quoted strings (a backslash escapes
/// the character after it, as some clients write quotes).
fn disposition(value: &[u8]) -> (String, bool) {
    let text = String::from_utf8_lossy(value);
    // The disposition type (`form-data`) comes first.
    let mut rest = text.split_once(';').map_or("", |(_, r)| r);
    let (mut name, mut file) = (String::new(), false);
    while let Some((key, after)) = rest.split_once('=') {
        // A parameter with no value before this one is skipped.
        let key = key.rsplit(';').next().unwrap_or(key).trim();
        let after = after.trim_start();
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => {
                let (value, tail) = unquote(quoted);
                (value, tail.split_once(';').map_or("", |(_, r)| r))
            }
            None => match after.split_once(';') {
                Some((v, next)) => (v.trim().to_string(), next),
                None => (after.trim().to_string(), ""),
            },
        };
        if key.eq_ignore_ascii_case("name") {
            name = value;
        } else if key.eq_ignore_ascii_case("filename") || key.eq_ignore_ascii_case("filename*") {
            file = true;
        }
        rest = next;
    }
    (name, file)
}

/// A quoted string's text (after its opening quote), and what follows its closing
/// quote. An unclosed string runs to the end.
fn unquote(s: &str) -> (String, &str) {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (out, &s[i + 1..]),
            '\\' => {
                if let Some((_, escaped)) = chars.next() {
                    out.push(escaped);
                }
            }
            c => out.push(c),
        }
    }
    (out, "")
}

#[cfg(test)]
mod tests;
