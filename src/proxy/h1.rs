//! HTTP/1.1 on the engine side, as pure functions over bytes: the request head
//! written, the response head parsed (with `httparse`), the body's framing chosen
//! (RFC 9112 §6.3) and a chunked body decoded. The I/O around them is in
//! [`super::upstream`].
//!
//! The engines are the balancer's own fleet, yet a response is still checked the way
//! a proxy checks any server's: a head that does not parse, conflicting lengths, an
//! over-long chunk-size line or trailer end the exchange with an error, never a guess.

use std::fmt;
use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};
use smallvec::SmallVec;

use super::headers::{is_hop_by_hop, is_hop_by_hop_text, UpstreamHeaders};

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
    /// `Content-Length` not digits, or given twice with different values.
    BadLength,
    /// `Transfer-Encoding` that cannot frame a body (not text, empty, or in an
    /// HTTP/1.0 response).
    BadTransferEncoding(&'static str),
    /// A `101 Switching Protocols` nobody asked for (the balancer never asks).
    Upgrade,
    /// A chunk-size line that is not hex, overflows, or runs too long.
    BadChunk(&'static str),
    /// A trailer line that is not a header field.
    BadTrailer(&'static str),
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
            WireError::BadTransferEncoding(why) => write!(f, "invalid transfer-encoding: {why}"),
            WireError::Upgrade => write!(f, "an unrequested 101 switching protocols"),
            WireError::BadChunk(why) => write!(f, "malformed chunked body: {why}"),
            WireError::BadTrailer(why) => write!(f, "malformed chunked trailer: {why}"),
            WireError::TrailersTooLarge => {
                write!(f, "chunked trailers longer than {MAX_TRAILER_BYTES} bytes")
            }
        }
    }
}

impl std::error::Error for WireError {}

/// Appends a request head for `body_len` bytes of body to `out`: `host`, the fields
/// [`UpstreamHeaders`] lets through, `x-forwarded-for`, the data-parallel `rank` if
/// the node is one, the length. The values are valid by construction (`HeaderValue`
/// refuses CR and LF).
pub fn encode_request(
    method: &Method,
    target: &str,
    host: &HeaderValue,
    headers: &UpstreamHeaders,
    rank: Option<&HeaderValue>,
    body_len: usize,
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    headers.write(out);
    if let Some(rank) = rank {
        out.extend_from_slice(b"x-data-parallel-rank: ");
        out.extend_from_slice(rank.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    // A request without a body says so only where one is expected.
    if body_len > 0 || !matches!(*method, Method::GET | Method::HEAD | Method::DELETE) {
        out.extend_from_slice(b"content-length: ");
        push_decimal(out, body_len as u64);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes `n` in decimal, on every request (a request head to an engine, a response
/// head to a client).
pub(crate) fn push_decimal(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(crate::decimal::digits(n, &mut [0; 20]).as_bytes());
}

/// How the body after a response head is delimited: an engine's response read here,
/// a client's response written by `server::h1::response`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body: a response to HEAD, or 1xx / 204 / 304.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Everything until the connection closes (HTTP/1.0 style).
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
/// are consumed and skipped; a `101` is an error (nothing asked to switch). The head
/// handed on carries the framing it was read with: with `Transfer-Encoding`, no
/// `Content-Length` (RFC 9112 §6.3: the proxy removes it); a valid list of equal
/// lengths, one value.
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
            Ok(httparse::Status::Complete(len)) if len > MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge)
            }
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge)
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(WireError::Head(e.to_string())),
        };
        let code = resp.code.unwrap_or(0);
        if code == 101 {
            return Err(WireError::Upgrade);
        }
        if (100..200).contains(&code) {
            buf.advance(len);
            continue;
        }
        let status =
            StatusCode::from_u16(code).map_err(|_| WireError::Head(format!("status {code}")))?;
        let version = match resp.version {
            Some(0) => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        // The header values are slices of the head, shared rather than copied. The
        // hop-by-hop fields are read for framing and reuse, and not kept: they are
        // this connection's, and the client's has its own.
        let mut hop = HopFields::default();
        let mut offsets: SmallVec<[(HeaderName, Range<usize>); USUAL_HEADERS]> = SmallVec::new();
        for h in resp.headers.iter() {
            let name = match usual_name(h.name) {
                Some(name) => name,
                None => HeaderName::from_bytes(h.name.as_bytes())
                    .map_err(|_| WireError::Head(format!("header name {:?}", h.name)))?,
            };
            if hop.read(&name, h.value) {
                continue;
            }
            let start = h.value.as_ptr() as usize - buf.as_ptr() as usize;
            offsets.push((name, start..start + h.value.len()));
        }
        let head = buf.split_to(len).freeze();
        let mut headers = HeaderMap::with_capacity(offsets.len() + ADDED_HEADERS);
        for (name, range) in offsets {
            let value = HeaderValue::from_maybe_shared(head.slice(range))
                .map_err(|_| WireError::Head(format!("value of {name}")))?;
            headers.append(name, value);
        }
        for name in &hop.nominated {
            headers.remove(name);
        }
        let (framing, clean) = hop.framing(method, status, version, &mut headers)?;
        let reusable =
            clean && version == Version::HTTP_11 && framing != Framing::UntilClose && !hop.close;
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

/// The names engines answer with, as they spell them (uvicorn in lowercase, nginx
/// and most others capitalized): matched as text, they skip `HeaderName::from_bytes`'s
/// byte-by-byte lowercasing and lookup, about 250 instructions a name. Any other
/// spelling takes that path and gets the same name.
fn usual_name(name: &str) -> Option<HeaderName> {
    Some(match name {
        "content-type" | "Content-Type" => header::CONTENT_TYPE,
        "content-length" | "Content-Length" => header::CONTENT_LENGTH,
        "date" | "Date" => header::DATE,
        "server" | "Server" => header::SERVER,
        "connection" | "Connection" => header::CONNECTION,
        "transfer-encoding" | "Transfer-Encoding" => header::TRANSFER_ENCODING,
        "cache-control" | "Cache-Control" => header::CACHE_CONTROL,
        "keep-alive" | "Keep-Alive" => HeaderName::from_static("keep-alive"),
        _ => return None,
    })
}

/// What a response head's framing and connection fields say, read as its map is
/// built: `Content-Length` (kept in the map), and the hop-by-hop fields
/// (`Transfer-Encoding`, `Connection` and the rest, left out: they are this
/// connection's, and the client's has its own). Reading them here saves the map
/// lookups and removals a second pass would make.
#[derive(Default)]
struct HopFields {
    /// `Transfer-Encoding` lines.
    codings: usize,
    /// Whether the last coding named is `chunked`.
    chunked: Option<bool>,
    /// Why a `Transfer-Encoding` line cannot be read, the first one.
    bad_coding: Option<&'static str>,
    /// `Content-Length` lines, the values they give, and the value they agree on.
    length_lines: usize,
    lengths: usize,
    length: Option<u64>,
    /// A `Content-Length` value that is not digits, or differs from another.
    bad_length: bool,
    /// `Connection: close`.
    close: bool,
    /// Other names `Connection` lists (hop-by-hop too: removed from the map).
    nominated: Vec<HeaderName>,
}

impl HopFields {
    /// Reads one field; `true` for a hop-by-hop one, which the map does not keep.
    fn read(&mut self, name: &HeaderName, value: &[u8]) -> bool {
        if *name == header::CONTENT_LENGTH {
            self.content_length(value);
            return false;
        }
        if !is_hop_by_hop(name) {
            return false;
        }
        if *name == header::TRANSFER_ENCODING {
            self.transfer_encoding(value);
        } else if *name == header::CONNECTION {
            self.connection(value);
        }
        true
    }

    fn transfer_encoding(&mut self, value: &[u8]) {
        self.codings += 1;
        if self.bad_coding.is_some() {
            return;
        }
        // Every line must be text: a coding that cannot be read cannot be skipped.
        let Some(text) = visible_text(value) else {
            self.bad_coding = Some("not visible ASCII");
            return;
        };
        if text.trim().is_empty() {
            self.bad_coding = Some("empty");
            return;
        }
        let coding = text.split(',').map(str::trim).rfind(|t| !t.is_empty());
        self.chunked = coding
            .map(|c| c.eq_ignore_ascii_case("chunked"))
            .or(self.chunked);
    }

    fn content_length(&mut self, value: &[u8]) {
        self.length_lines += 1;
        if self.bad_length {
            return;
        }
        for part in value.split(|&b| b == b',') {
            let digits = part.trim_ascii();
            let n = (!digits.is_empty() && digits.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(digits).ok()?.parse::<u64>().ok())
                .flatten();
            match n {
                Some(n) if self.length.is_none_or(|l| l == n) => {
                    self.length = Some(n);
                    self.lengths += 1;
                }
                _ => {
                    self.bad_length = true;
                    return;
                }
            }
        }
    }

    /// `Connection`'s items (a line that is not text is passed over).
    fn connection(&mut self, value: &[u8]) {
        let Some(text) = visible_text(value) else {
            return;
        };
        for item in text.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if item.eq_ignore_ascii_case("close") {
                self.close = true;
            } else if !is_hop_by_hop_text(item) {
                if let Ok(name) = HeaderName::from_bytes(item.as_bytes()) {
                    self.nominated.push(name);
                }
            }
        }
    }

    /// The body's framing (RFC 9112 §6.3), and whether the head framed it cleanly (one
    /// that had to be mended, `Content-Length` beside `Transfer-Encoding`, may be a
    /// smuggling attempt: its connection is not reused). `headers` are mended to say
    /// what the framing is.
    fn framing(
        &self,
        method: &Method,
        status: StatusCode,
        version: Version,
        headers: &mut HeaderMap,
    ) -> Result<(Framing, bool), WireError> {
        if *method == Method::HEAD {
            return Ok((Framing::Empty, true));
        }
        if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            // No body follows, so none may be announced to the client: a length here
            // would have it wait for bytes that never come (a 204 may not carry one at
            // all; a 304's is the size of a body not sent). Bytes sent anyway are left
            // over, and the connection is not reused.
            if self.length_lines > 0 {
                headers.remove(header::CONTENT_LENGTH);
            }
            return Ok((Framing::Empty, self.length_lines == 0 && self.codings == 0));
        }
        if self.codings > 0 {
            if version == Version::HTTP_10 {
                return Err(WireError::BadTransferEncoding("in an HTTP/1.0 response"));
            }
            if let Some(why) = self.bad_coding {
                return Err(WireError::BadTransferEncoding(why));
            }
            // A length beside a coding is dropped (RFC 9112 §6.3), and the head was
            // not clean.
            if self.length_lines > 0 {
                headers.remove(header::CONTENT_LENGTH);
            }
            // Chunked must be the last coding; anything else is read until close.
            let framing = match self.chunked {
                Some(true) => Framing::Chunked,
                _ => Framing::UntilClose,
            };
            return Ok((framing, self.length_lines == 0));
        }
        if self.bad_length {
            return Err(WireError::BadLength);
        }
        let Some(n) = self.length else {
            return Ok((Framing::UntilClose, true));
        };
        if self.lengths > 1 {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        Ok((Framing::Length(n), true))
    }
}

/// A value as text, if every byte is visible ASCII or a tab (as `HeaderValue::to_str`
/// requires).
fn visible_text(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (32..127).contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
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
                        Err(WireError::BadChunk("")) => return Err(WireError::TrailersTooLarge),
                        Err(_) => return Err(WireError::BadTrailer("line not ended by CRLF")),
                    };
                    if line.is_empty() {
                        *self = Chunked::Done;
                    } else {
                        trailer_field(&line)?;
                        *self = Chunked::Trailers(read + line.len() + 2);
                    }
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

/// The hex size at the start of a chunk-size line: `1*HEXDIG *( ";" chunk-ext )`, as
/// strict parsers read it (llhttp's strict mode): no whitespace around the size, and
/// each extension a token name with an optional token or quoted value. Extensions are
/// checked and ignored.
fn chunk_size(line: &[u8]) -> Result<u64, WireError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(WireError::BadChunk(if line.is_empty() {
            "empty chunk size"
        } else {
            "chunk size is not hex"
        }));
    }
    let size = line[..digits].iter().try_fold(0u64, |size, &b| {
        let digit = (b as char).to_digit(16).unwrap_or(0);
        size.checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(digit)))
            .ok_or(WireError::BadChunk("chunk size overflows"))
    })?;
    match line.get(digits) {
        None => Ok(size),
        Some(b';') => chunk_extensions(&line[digits..]).map(|()| size),
        Some(_) => Err(WireError::BadChunk("chunk size is not hex")),
    }
}

/// `*( ";" token [ "=" ( token / quoted-string ) ] )`.
fn chunk_extensions(mut rest: &[u8]) -> Result<(), WireError> {
    const BAD: WireError = WireError::BadChunk("invalid chunk extension");
    while let Some(after) = rest.strip_prefix(b";") {
        let name = after.iter().take_while(|&&b| is_tchar(b)).count();
        if name == 0 {
            return Err(BAD);
        }
        rest = &after[name..];
        if let Some(value) = rest.strip_prefix(b"=") {
            let len = if value.first() == Some(&b'"') {
                quoted_len(value).ok_or(BAD)?
            } else {
                value.iter().take_while(|&&b| is_tchar(b)).count()
            };
            if len == 0 {
                return Err(BAD);
            }
            rest = &value[len..];
        }
    }
    if rest.is_empty() {
        Ok(())
    } else {
        Err(BAD)
    }
}

/// The length of the quoted string at the start of `s` (quotes included), if it is one:
/// `DQUOTE *( qdtext / "\" VCHAR ) DQUOTE`, no control characters.
fn quoted_len(s: &[u8]) -> Option<usize> {
    let mut i = 1;
    while i < s.len() {
        match s[i] {
            b'"' => return Some(i + 1),
            b'\\' => {
                let next = *s.get(i + 1)?;
                if next != b'\t' && !(0x20..0x7f).contains(&next) && next < 0x80 {
                    return None;
                }
                i += 2;
            }
            b'\t' | b' '..=b'~' | 0x80.. => i += 1,
            _ => return None,
        }
    }
    None
}

/// A token character (RFC 9110 §5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A trailer line must be a header field: `token ":" value`, no obsolete line folding
/// (RFC 9112 §5.2: a leading space or tab), no control characters but tab.
fn trailer_field(line: &[u8]) -> Result<(), WireError> {
    if matches!(line.first(), Some(b' ' | b'\t')) {
        return Err(WireError::BadTrailer("obsolete line folding"));
    }
    let name = line.iter().take_while(|&&b| is_tchar(b)).count();
    if name == 0 || line.get(name) != Some(&b':') {
        return Err(WireError::BadTrailer("not a header field"));
    }
    if line[name + 1..]
        .iter()
        .any(|&b| b != b'\t' && (b < 0x20 || b == 0x7f))
    {
        return Err(WireError::BadTrailer("control character in a value"));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
