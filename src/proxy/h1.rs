//! HTTP/1.1 on the engine side, as pure functions over bytes: the request head
//! written, the response head parsed (with `httparse`), the body's framing chosen
//! (RFC 9112 §6.3) and a chunked body decoded. The I/O around them is in
//! [`super::upstream`].
//!
//! The engines are the balancer's own fleet, yet a response is still checked the way
//! a proxy checks any server's: a head that does not parse, conflicting lengths, an
//! over-long chunk-size line or trailer end the exchange with an error, never a guess.

use std::fmt;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};

use super::headers::list_items;

/// The most header fields a response head may carry.
const MAX_HEADERS: usize = 128;
/// Header fields parsed into room on the stack; a head with more is parsed again
/// with room for [`MAX_HEADERS`].
const USUAL_HEADERS: usize = 24;
/// Room left in a parsed head's map for the balancer's own response headers.
const ADDED_HEADERS: usize = 4;
/// The longest response head, in bytes.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The longest chunk-size line (size, extensions and CRLF).
const MAX_CHUNK_LINE: usize = 4 * 1024;
/// The most trailer bytes after a chunked body (they are read and dropped).
const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// Why an engine's response cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// The head is not HTTP/1.x (`httparse`'s reason).
    Head(String),
    HeadTooLarge,
    /// `Content-Length` unparsable, or given twice with different values.
    BadLength,
    /// A chunk-size line that is not hex, overflows, or runs too long.
    BadChunk(&'static str),
    TrailersTooLarge,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Head(why) => write!(f, "malformed response head: {why}"),
            WireError::HeadTooLarge => {
                write!(f, "response head longer than {MAX_HEAD_BYTES} bytes")
            }
            WireError::BadLength => write!(f, "invalid or conflicting content-length"),
            WireError::BadChunk(why) => write!(f, "malformed chunked body: {why}"),
            WireError::TrailersTooLarge => {
                write!(f, "chunked trailers longer than {MAX_TRAILER_BYTES} bytes")
            }
        }
    }
}

impl std::error::Error for WireError {}

/// Appends a request head for `body_len` bytes of body to `out`. `headers` must hold
/// neither `host` nor `content-length` nor hop-by-hop fields (see
/// [`super::headers::upstream_headers`]); the values are valid by construction
/// (`HeaderValue` refuses CR and LF).
pub fn encode_request(
    method: &Method,
    target: &str,
    host: &HeaderValue,
    headers: &HeaderMap,
    body_len: usize,
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    // A request without a body says so only where one is expected.
    if body_len > 0 || !matches!(*method, Method::GET | Method::HEAD | Method::DELETE) {
        use std::io::Write as _;
        let _ = write!(out, "content-length: {body_len}\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// How the body after a response head is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body: a response to HEAD, or 204 / 304.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Everything until the engine closes the connection (HTTP/1.0 style).
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub struct ResponseHead {
    pub parts: http::response::Parts,
    pub framing: Framing,
    /// The connection may carry another request once this body is read.
    pub reusable: bool,
}

/// Parses one response head from the front of `buf`, which it consumes. `Ok(None)`:
/// more bytes are needed. Interim 1xx responses (`100 Continue`, `103 Early Hints`)
/// are consumed and skipped.
pub fn parse_response(
    buf: &mut BytesMut,
    method: &Method,
) -> Result<Option<ResponseHead>, WireError> {
    loop {
        let mut usual = [httparse::EMPTY_HEADER; USUAL_HEADERS];
        let mut many: Vec<httparse::Header<'_>>;
        let mut resp = httparse::Response::new(&mut usual);
        let mut parsed = resp.parse(buf);
        if parsed == Err(httparse::Error::TooManyHeaders) {
            many = vec![httparse::EMPTY_HEADER; MAX_HEADERS];
            resp = httparse::Response::new(&mut many);
            parsed = resp.parse(buf);
        }
        let len = match parsed {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge)
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(WireError::Head(e.to_string())),
        };
        let code = resp.code.unwrap_or(0);
        if (100..200).contains(&code) && code != 101 {
            buf.advance(len);
            continue;
        }
        let status =
            StatusCode::from_u16(code).map_err(|_| WireError::Head(format!("status {code}")))?;
        let version = match resp.version {
            Some(0) => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        // The header values are slices of the head, shared rather than copied.
        let offsets: Vec<(HeaderName, std::ops::Range<usize>)> = resp
            .headers
            .iter()
            .map(|h| {
                let name = HeaderName::from_bytes(h.name.as_bytes())
                    .map_err(|_| WireError::Head(format!("header name {:?}", h.name)))?;
                let start = h.value.as_ptr() as usize - buf.as_ptr() as usize;
                Ok((name, start..start + h.value.len()))
            })
            .collect::<Result<_, WireError>>()?;
        let head = buf.split_to(len).freeze();
        let mut headers = HeaderMap::with_capacity(offsets.len() + ADDED_HEADERS);
        for (name, range) in offsets {
            let value = HeaderValue::from_maybe_shared(head.slice(range))
                .map_err(|_| WireError::Head(format!("value of {name}")))?;
            headers.append(name, value);
        }
        let framing = framing(method, status, &headers)?;
        let reusable = version == Version::HTTP_11
            && framing != Framing::UntilClose
            && !list_items(&headers, &header::CONNECTION).any(|t| t.eq_ignore_ascii_case("close"));
        let mut parts = http::Response::new(()).into_parts().0;
        parts.status = status;
        parts.version = version;
        parts.headers = headers;
        return Ok(Some(ResponseHead {
            parts,
            framing,
            reusable,
        }));
    }
}

/// The body's framing (RFC 9112 §6.3).
fn framing(method: &Method, status: StatusCode, headers: &HeaderMap) -> Result<Framing, WireError> {
    if *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        // Chunked must be the last coding; anything else is read until close.
        let last = list_items(headers, &header::TRANSFER_ENCODING).next_back();
        return Ok(match last {
            Some(t) if t.eq_ignore_ascii_case("chunked") => Framing::Chunked,
            _ => Framing::UntilClose,
        });
    }
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for part in value.to_str().map_err(|_| WireError::BadLength)?.split(',') {
            let n: u64 = part.trim().parse().map_err(|_| WireError::BadLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(WireError::BadLength);
            }
            length = Some(n);
        }
    }
    Ok(length.map_or(Framing::UntilClose, Framing::Length))
}

/// What [`Chunked::decode`] made of the bytes it had.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// Body bytes.
    Data(Bytes),
    /// The input ran out mid-chunk or mid-line: read more.
    NeedMore,
    /// The last chunk and the trailers have been read.
    End,
}

/// A chunked body's decoder state (RFC 9112 §7.1).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Chunked {
    /// Expecting a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk: this many data bytes to go.
    Data(u64),
    /// After a chunk's data: expecting its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines up to an empty one; bytes read so far.
    Trailers(usize),
    Done,
}

impl Chunked {
    /// Decodes from the front of `buf`, consuming what it uses.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        loop {
            match *self {
                Chunked::Size => {
                    let Some(line) = take_line(buf, MAX_CHUNK_LINE, "chunk-size line too long")?
                    else {
                        return Ok(Decoded::NeedMore);
                    };
                    let size = chunk_size(&line)?;
                    *self = if size == 0 {
                        Chunked::Trailers(0)
                    } else {
                        Chunked::Data(size)
                    };
                }
                Chunked::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Decoded::NeedMore);
                    }
                    let n = (buf.len() as u64).min(left) as usize;
                    let left = left - n as u64;
                    *self = if left == 0 {
                        Chunked::DataEnd
                    } else {
                        Chunked::Data(left)
                    };
                    return Ok(Decoded::Data(buf.split_to(n).freeze()));
                }
                Chunked::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::NeedMore);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::BadChunk("no CRLF after chunk data"));
                    }
                    buf.advance(2);
                    *self = Chunked::Size;
                }
                Chunked::Trailers(read) => {
                    let room = MAX_TRAILER_BYTES.saturating_sub(read);
                    let line = match take_line(buf, room, "") {
                        Ok(Some(line)) => line,
                        Ok(None) => return Ok(Decoded::NeedMore),
                        Err(_) => return Err(WireError::TrailersTooLarge),
                    };
                    *self = if line.is_empty() {
                        Chunked::Done
                    } else {
                        Chunked::Trailers(read + line.len() + 2)
                    };
                }
                Chunked::Done => return Ok(Decoded::End),
            }
        }
    }
}

/// Takes one CRLF-terminated line (without the CRLF) off the front of `buf`;
/// `Ok(None)` if it is not all there yet; an error if it runs past `max` bytes.
fn take_line(
    buf: &mut BytesMut,
    max: usize,
    too_long: &'static str,
) -> Result<Option<BytesMut>, WireError> {
    match memchr::memchr(b'\n', buf) {
        Some(i) if i > max => Err(WireError::BadChunk(too_long)),
        Some(i) => {
            if i == 0 || buf[i - 1] != b'\r' {
                return Err(WireError::BadChunk("line not ended by CRLF"));
            }
            let mut line = buf.split_to(i + 1);
            line.truncate(i - 1);
            Ok(Some(line))
        }
        None if buf.len() > max => Err(WireError::BadChunk(too_long)),
        None => Ok(None),
    }
}

/// The hex size at the start of a chunk-size line (extensions after `;` ignored).
fn chunk_size(line: &[u8]) -> Result<u64, WireError> {
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() {
        return Err(WireError::BadChunk("empty chunk size"));
    }
    digits.iter().try_fold(0u64, |size, &b| {
        let digit = (b as char)
            .to_digit(16)
            .ok_or(WireError::BadChunk("chunk size is not hex"))?;
        size.checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(digit)))
            .ok_or(WireError::BadChunk("chunk size overflows"))
    })
}

#[cfg(test)]
mod tests;
