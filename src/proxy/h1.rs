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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn head(text: &str) -> Result<Option<ResponseHead>, WireError> {
        parse_response(&mut BytesMut::from(text), &Method::POST)
    }

    #[test]
    fn a_request_head_carries_host_headers_and_length() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let mut out = Vec::new();
        let host = HeaderValue::from_static("10.0.0.7:8000");
        encode_request(
            &Method::POST,
            "/v1/chat/completions",
            &host,
            &headers,
            17,
            &mut out,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.7:8000\r\n\
             content-type: application/json\r\ncontent-length: 17\r\n\r\n"
        );
        let mut out = Vec::new();
        encode_request(
            &Method::GET,
            "/v1/models",
            &host,
            &HeaderMap::new(),
            0,
            &mut out,
        );
        assert!(!String::from_utf8(out).unwrap().contains("content-length"));
    }

    #[test]
    fn a_head_is_parsed_with_its_framing_and_the_rest_left() {
        let mut buf = BytesMut::from(
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello",
        );
        let h = parse_response(&mut buf, &Method::POST).unwrap().unwrap();
        assert_eq!(h.parts.status, StatusCode::OK);
        assert_eq!(h.parts.headers[header::CONTENT_TYPE], "text/event-stream");
        assert_eq!(h.framing, Framing::Chunked);
        assert!(h.reusable);
        assert_eq!(&buf[..], b"5\r\nhello");
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let framing = |t: &str| head(t).unwrap().unwrap().framing;
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n"),
            Framing::Length(12)
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\n"),
            Framing::Length(3)
        );
        assert_eq!(
            framing("HTTP/1.1 204 No Content\r\ncontent-length: 9\r\n\r\n"),
            Framing::Empty
        );
        assert_eq!(framing("HTTP/1.1 200 OK\r\n\r\n"), Framing::UntilClose);
        assert_eq!(
            framing(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 4\r\n\r\n"
            ),
            Framing::Chunked
        );
        assert_eq!(
            framing("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n"),
            Framing::UntilClose
        );
        let mut buf = BytesMut::from("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n");
        let h = parse_response(&mut buf, &Method::HEAD).unwrap().unwrap();
        assert_eq!(h.framing, Framing::Empty);
    }

    #[test]
    fn close_and_http_1_0_are_not_reused() {
        let reusable = |t: &str| head(t).unwrap().unwrap().reusable;
        assert!(!reusable(
            "HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!reusable("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(!reusable("HTTP/1.1 200 OK\r\n\r\n"));
        assert!(reusable("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
    }

    #[test]
    fn a_head_with_many_fields_parses_and_one_with_too_many_is_an_error() {
        let fields = |n: usize| {
            (0..n)
                .map(|i| format!("x-f{i}: {i}\r\n"))
                .collect::<String>()
        };
        let h = head(&format!(
            "HTTP/1.1 200 OK\r\n{}content-length: 0\r\n\r\n",
            fields(100)
        ))
        .unwrap()
        .unwrap();
        assert_eq!(h.parts.headers.len(), 101);
        assert_eq!(h.parts.headers["x-f99"], "99");
        let err = head(&format!(
            "HTTP/1.1 200 OK\r\n{}\r\n",
            fields(MAX_HEADERS + 1)
        ))
        .unwrap_err();
        assert_eq!(err, WireError::Head("too many headers".into()));
    }

    #[test]
    fn interim_responses_are_skipped() {
        let h = head("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.parts.status, StatusCode::CREATED);
    }

    #[test]
    fn bad_heads_are_errors_and_partial_ones_wait() {
        assert!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
        assert!(matches!(
            head("SSH-2.0-OpenSSH\r\n\r\n"),
            Err(WireError::Head(_))
        ));
        assert_eq!(
            head("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n").err(),
            Some(WireError::BadLength)
        );
        assert_eq!(
            head("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n").err(),
            Some(WireError::BadLength)
        );
        let long = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD_BYTES));
        assert_eq!(head(&long).err(), Some(WireError::HeadTooLarge));
    }

    /// Decodes `wire` fed in pieces cut at `cuts`: the body, or the first error.
    fn decode_in_pieces(wire: &[u8], cuts: &[usize]) -> Result<(Vec<u8>, bool), WireError> {
        let mut dec = Chunked::default();
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        bounds.push(wire.len());
        bounds.sort_unstable();
        let mut fed = 0;
        for b in bounds {
            buf.extend_from_slice(&wire[fed..b]);
            fed = b;
            loop {
                match dec.decode(&mut buf)? {
                    Decoded::Data(d) => body.extend_from_slice(&d),
                    Decoded::NeedMore => break,
                    Decoded::End => return Ok((body, buf.is_empty())),
                }
            }
        }
        Ok((body, false))
    }

    fn chunked(pieces: &[Vec<u8>]) -> Vec<u8> {
        let mut wire = Vec::new();
        for p in pieces.iter().filter(|p| !p.is_empty()) {
            wire.extend_from_slice(format!("{:x};ext=1\r\n", p.len()).as_bytes());
            wire.extend_from_slice(p);
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\nx-trailer: 1\r\n\r\n");
        wire
    }

    proptest! {
        #[test]
        fn a_chunked_body_decodes_the_same_however_it_arrives(
            pieces in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..8),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let wire = chunked(&pieces);
            let (body, all_used) = decode_in_pieces(&wire, &cuts).unwrap();
            prop_assert_eq!(body, pieces.concat());
            prop_assert!(all_used);
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(
            wire in prop::collection::vec(any::<u8>(), 0..400),
            cuts in prop::collection::vec(any::<usize>(), 0..6),
        ) {
            let _ = decode_in_pieces(&wire, &cuts);
            let _ = parse_response(&mut BytesMut::from(&wire[..]), &Method::POST);
        }
    }

    #[test]
    fn bad_chunks_are_errors() {
        let err = |w: &str| decode_in_pieces(w.as_bytes(), &[]).err();
        assert_eq!(
            err("zz\r\n"),
            Some(WireError::BadChunk("chunk size is not hex"))
        );
        assert_eq!(
            err("3\r\nabcX\r\n"),
            Some(WireError::BadChunk("no CRLF after chunk data"))
        );
        assert_eq!(
            err("11111111111111111\r\n"),
            Some(WireError::BadChunk("chunk size overflows"))
        );
        assert_eq!(
            err("3\nabc"),
            Some(WireError::BadChunk("line not ended by CRLF"))
        );
        let long = format!("1{}", " ".repeat(MAX_CHUNK_LINE + 1));
        assert_eq!(
            err(&long),
            Some(WireError::BadChunk("chunk-size line too long"))
        );
        let trailers = format!("0\r\n{}", "x: y\r\n".repeat(MAX_TRAILER_BYTES / 6 + 1));
        assert_eq!(err(&trailers), Some(WireError::TrailersTooLarge));
        // A body cut short is not an error here: the reader sees the connection end.
        assert_eq!(
            decode_in_pieces(b"5\r\nab", &[]).unwrap(),
            (b"ab".to_vec(), false)
        );
    }
}
