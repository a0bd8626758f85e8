//! A client's HTTP/1.1 request head, read as a pure function over bytes: parsed with
//! `httparse`, the body's framing chosen by RFC 9112 §6.3, and every head that could
//! frame a body two ways refused. A proxy that guesses where a body ends lets one
//! request carry another past it (request smuggling), so:
//!
//! - `Transfer-Encoding` beside `Content-Length`: 400 (RFC 9112 §6.3 allows reading
//!   it as chunked and closing; refusing is safer and costs honest clients nothing);
//! - `Content-Length` given twice with different values, or not digits: 400;
//! - `Transfer-Encoding` whose last coding is not `chunked`, `chunked` twice, or any
//!   in an HTTP/1.0 request: 400; a coding other than `chunked` before it: 501;
//! - obs-fold (a header line continued on the next) and a space before the colon:
//!   400 (`httparse` refuses both in requests);
//! - a head with `max_headers` fields or more, or longer than `max_header_bytes`: 431.
//!
//! Bare LF line ends are read as CRLF, as `httparse` (and hyper, nginx, HAProxy) do:
//! the head is parsed once, here, and written again for the engine, so no reader
//! downstream sees them.

use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Uri, Version};
use smallvec::SmallVec;

use crate::clip::clip;

/// Header fields parsed into room on the stack; a head with more is parsed again
/// with room for the limit.
const USUAL_FIELDS: usize = 32;

/// How a request's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// Exactly this many bytes (0: no body).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// A parsed request head.
#[derive(Debug)]
pub struct RequestHead {
    pub parts: http::request::Parts,
    pub body: BodyFraming,
    /// The client lets the connection carry another request after this one.
    pub keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for a go-ahead before its body.
    pub expect_continue: bool,
}

/// Why a request head is refused; the status it is answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadError {
    /// Not an HTTP/1.x request head (`httparse`'s reason, or ours).
    Malformed(String),
    TooManyFields,
    TooLarge,
    /// `Content-Length` not digits, or given twice with different values.
    BadLength,
    /// `Transfer-Encoding` that cannot frame a body, or beside `Content-Length`.
    BadTransferEncoding(&'static str),
    /// A transfer coding other than `chunked`.
    UnknownCoding,
}

impl HeadError {
    pub fn status(&self) -> StatusCode {
        match self {
            HeadError::TooManyFields | HeadError::TooLarge => {
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
            }
            HeadError::UnknownCoding => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

impl std::fmt::Display for HeadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeadError::Malformed(why) => write!(f, "malformed request head: {why}"),
            HeadError::TooManyFields => write!(f, "too many header fields"),
            HeadError::TooLarge => write!(f, "request head too large"),
            HeadError::BadLength => write!(f, "invalid or conflicting content-length"),
            HeadError::BadTransferEncoding(why) => write!(f, "invalid transfer-encoding: {why}"),
            HeadError::UnknownCoding => {
                write!(f, "transfer codings other than chunked are not supported")
            }
        }
    }
}

/// The limits a head is read within.
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    /// A head with this many fields or more is refused.
    pub max_fields: usize,
    pub max_bytes: usize,
}

/// Whether `buf` begins the HTTP/2 connection preface, or may still (`None`: more
/// bytes are needed to tell).
pub fn is_h2_preface(buf: &[u8]) -> Option<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let n = buf.len().min(PREFACE.len());
    if buf[..n] != PREFACE[..n] {
        Some(false)
    } else if n == PREFACE.len() {
        Some(true)
    } else {
        None
    }
}

/// Parses one request head from the front of `buf`, which it consumes. `Ok(None)`:
/// more bytes are needed.
pub fn parse_request(
    buf: &mut BytesMut,
    limits: HeadLimits,
) -> Result<Option<RequestHead>, HeadError> {
    let mut usual = [const { MaybeUninit::uninit() }; USUAL_FIELDS];
    let mut req = httparse::Request::new(&mut []);
    let mut parsed = req.parse_with_uninit_headers(buf, &mut usual);
    let mut many: Vec<MaybeUninit<httparse::Header<'_>>>;
    if parsed == Err(httparse::Error::TooManyHeaders) && limits.max_fields > USUAL_FIELDS {
        many = Vec::with_capacity(limits.max_fields);
        many.resize_with(limits.max_fields, MaybeUninit::uninit);
        req = httparse::Request::new(&mut []);
        parsed = req.parse_with_uninit_headers(buf, &mut many);
    }
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) if len > limits.max_bytes => {
            return Err(HeadError::TooLarge)
        }
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= limits.max_bytes => {
            return Err(HeadError::TooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooManyFields),
        Err(e) => return Err(HeadError::Malformed(e.to_string())),
    };
    if req.headers.len() >= limits.max_fields {
        return Err(HeadError::TooManyFields);
    }
    let version = match req.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let method = req.method.unwrap_or_default();
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| HeadError::Malformed(format!("method {}", clip(method))))?;
    let base = buf.as_ptr() as usize;
    let offset = |s: &[u8]| s.as_ptr() as usize - base;
    let path = req.path.unwrap_or_default();
    let path_at = offset(path.as_bytes())..offset(path.as_bytes()) + path.len();
    let mut fields = FieldFacts::default();
    let mut offsets: SmallVec<[(HeaderName, Range<usize>); USUAL_FIELDS]> = SmallVec::new();
    for h in req.headers.iter() {
        let name = match usual_name(h.name) {
            Some(name) => name,
            None => HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| HeadError::Malformed(format!("header name {}", clip(h.name))))?,
        };
        fields.read(&name, h.value);
        let start = offset(h.value);
        offsets.push((name, start..start + h.value.len()));
    }
    let head: Bytes = buf.split_to(len).freeze();
    let uri = Uri::from_maybe_shared(head.slice(path_at))
        .map_err(|e| HeadError::Malformed(format!("request target: {e}")))?;
    let mut headers = HeaderMap::with_capacity(offsets.len());
    for (name, range) in offsets {
        let value = HeaderValue::from_maybe_shared(head.slice(range))
            .map_err(|_| HeadError::Malformed(format!("value of {name}")))?;
        headers.append(name, value);
    }
    let body = fields.framing(version)?;
    let keep_alive = match version {
        Version::HTTP_10 => fields.keep_alive && !fields.close,
        _ => !fields.close,
    };
    let mut parts = http::Request::new(()).into_parts().0;
    parts.method = method;
    parts.uri = uri;
    parts.version = version;
    parts.headers = headers;
    Ok(Some(RequestHead {
        parts,
        body,
        keep_alive,
        expect_continue: fields.expect_continue && version == Version::HTTP_11,
    }))
}

/// The names clients send most, as they spell them: matched as text, they skip
/// `HeaderName::from_bytes`'s byte-by-byte lowercasing and lookup.
fn usual_name(name: &str) -> Option<HeaderName> {
    Some(match name {
        "host" | "Host" => header::HOST,
        "content-type" | "Content-Type" => header::CONTENT_TYPE,
        "content-length" | "Content-Length" => header::CONTENT_LENGTH,
        "accept" | "Accept" => header::ACCEPT,
        "user-agent" | "User-Agent" => header::USER_AGENT,
        "authorization" | "Authorization" => header::AUTHORIZATION,
        "connection" | "Connection" => header::CONNECTION,
        "accept-encoding" | "Accept-Encoding" => header::ACCEPT_ENCODING,
        _ => return None,
    })
}

/// What a head's framing and connection fields say, read as its map is built.
#[derive(Debug, Default)]
struct FieldFacts {
    /// `Transfer-Encoding` lines seen, and why one cannot frame a body.
    codings: usize,
    bad_coding: Option<&'static str>,
    /// How often `chunked` is named, and whether it is the last coding named.
    chunked_seen: usize,
    chunked_last: bool,
    /// A coding other than `chunked`.
    other_coding: bool,
    /// `Content-Length` lines, the value they agree on, and whether they disagree.
    length_lines: usize,
    length: Option<u64>,
    bad_length: bool,
    close: bool,
    keep_alive: bool,
    expect_continue: bool,
}

impl FieldFacts {
    fn read(&mut self, name: &HeaderName, value: &[u8]) {
        if *name == header::CONTENT_LENGTH {
            self.content_length(value);
        } else if *name == header::TRANSFER_ENCODING {
            self.transfer_encoding(value);
        } else if *name == header::CONNECTION {
            for item in items(value) {
                if item.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if item.eq_ignore_ascii_case(b"keep-alive") {
                    self.keep_alive = true;
                }
            }
        } else if *name == header::EXPECT {
            self.expect_continue |= value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        }
    }

    fn content_length(&mut self, value: &[u8]) {
        self.length_lines += 1;
        for part in value.split(|&b| b == b',') {
            match decimal(part.trim_ascii()) {
                Some(n) if self.length.is_none_or(|l| l == n) => self.length = Some(n),
                _ => self.bad_length = true,
            }
        }
    }

    fn transfer_encoding(&mut self, value: &[u8]) {
        self.codings += 1;
        let mut any = false;
        for item in items(value) {
            any = true;
            self.chunked_last = item.eq_ignore_ascii_case(b"chunked");
            if self.chunked_last {
                self.chunked_seen += 1;
            } else {
                self.other_coding = true;
            }
        }
        if !any {
            self.bad_coding.get_or_insert("empty");
        }
    }

    /// The body's framing (RFC 9112 §6.3), or why the head cannot frame one.
    fn framing(&self, version: Version) -> Result<BodyFraming, HeadError> {
        if self.codings > 0 {
            if version == Version::HTTP_10 {
                return Err(HeadError::BadTransferEncoding("in an HTTP/1.0 request"));
            }
            if self.length_lines > 0 {
                return Err(HeadError::BadTransferEncoding("beside content-length"));
            }
            if let Some(why) = self.bad_coding {
                return Err(HeadError::BadTransferEncoding(why));
            }
            if !self.chunked_last {
                return Err(HeadError::BadTransferEncoding(
                    "chunked is not the last coding",
                ));
            }
            if self.chunked_seen > 1 {
                return Err(HeadError::BadTransferEncoding("chunked twice"));
            }
            if self.other_coding {
                return Err(HeadError::UnknownCoding);
            }
            return Ok(BodyFraming::Chunked);
        }
        if self.bad_length {
            return Err(HeadError::BadLength);
        }
        Ok(BodyFraming::Length(self.length.unwrap_or(0)))
    }
}

/// A list field's items, trimmed, empty ones skipped.
fn items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|i| !i.is_empty())
}

/// Digits only (no sign, no spaces inside), within `u64`.
fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    digits.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}
