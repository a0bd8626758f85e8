//! A response to a client, written for HTTP/1.1 as pure functions over bytes: the
//! head (status line, the handler's fields, a `date`, and the framing and connection
//! fields this connection decides), and a chunked body's framing.
//!
//! The framing follows the body: one of known size (`SizeHint::exact`, as every
//! whole answer is) gets its `content-length`; one that streams is chunked, or to an
//! HTTP/1.0 client read until the connection closes. A response to HEAD, a 1xx, 204
//! or 304 carries no body. The handler's own `content-length`, `transfer-encoding`
//! and `connection` fields are not written as given: the connection writes what it
//! will actually do.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

use http::header::{self, HeaderMap};
use http::{Method, StatusCode, Version};
use http_body::SizeHint;

use crate::proxy::h1::push_decimal;
pub use crate::proxy::h1::Framing;

/// What the response answers.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    pub method: &'a Method,
    pub version: Version,
    /// The connection may carry another request (the client allows it, and this
    /// server is not closing).
    pub keep_alive: bool,
}

/// Appends the head of a response to `out`; returns its framing and whether the
/// connection stays open after it.
pub fn encode_head(
    status: StatusCode,
    headers: &HeaderMap,
    body: &SizeHint,
    asked: Asked<'_>,
    out: &mut Vec<u8>,
) -> (Framing, bool) {
    let mut keep_alive = asked.keep_alive
        && !headers
            .get_all(header::CONNECTION)
            .iter()
            .any(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    let framing = if *asked.method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Empty
    } else if let Some(n) = body.exact() {
        Framing::Length(n)
    } else if let Some(n) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok())
    {
        Framing::Length(n)
    } else if asked.version == Version::HTTP_11 {
        Framing::Chunked
    } else {
        Framing::UntilClose
    };
    if framing == Framing::UntilClose {
        keep_alive = false;
    }
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut dated = false;
    for (name, value) in headers {
        if *name == header::CONTENT_LENGTH
            || *name == header::TRANSFER_ENCODING
            || *name == header::CONNECTION
        {
            // A HEAD or 304 answer keeps the length its GET would have had.
            let keep = *name == header::CONTENT_LENGTH
                && framing == Framing::Empty
                && status != StatusCode::NO_CONTENT;
            if !keep {
                continue;
            }
        }
        dated |= *name == header::DATE;
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        push_date(out);
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        Framing::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            push_decimal(out, n);
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        Framing::Empty | Framing::UntilClose => {}
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if asked.version == Version::HTTP_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    (framing, keep_alive)
}

/// Appends one chunk of a chunked body (an empty one is skipped: it would end it).
pub fn push_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    push_hex(out, data.len());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The end of a chunked body: the last chunk, no trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// The interim response `Expect: 100-continue` waits for.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

fn push_hex(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

thread_local! {
    /// This thread's `date` value and the second it was made for: formatted once a
    /// second, not once a response.
    static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
}

/// Appends the IMF-fixdate of now (RFC 9110 §5.6.7).
fn push_date(out: &mut Vec<u8>) {
    let now = SystemTime::now();
    let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with_borrow_mut(|(at, text)| {
        if *at != second {
            *at = second;
            *text = httpdate::fmt_http_date(now);
        }
        out.extend_from_slice(text.as_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn head(
        status: u16,
        headers: &[(&'static str, &'static str)],
        hint: SizeHint,
        method: Method,
        version: Version,
    ) -> (String, Framing, bool) {
        let mut map = HeaderMap::new();
        for (n, v) in headers {
            map.append(*n, HeaderValue::from_static(v));
        }
        let mut out = Vec::new();
        let asked = Asked {
            method: &method,
            version,
            keep_alive: true,
        };
        let status = StatusCode::from_u16(status).unwrap();
        let (framing, keep) = encode_head(status, &map, &hint, asked, &mut out);
        (String::from_utf8(out).unwrap(), framing, keep)
    }

    #[test]
    fn a_whole_body_gets_its_length_and_a_stream_is_chunked_or_read_to_the_close() {
        let (text, framing, keep) = head(
            200,
            &[
                ("content-type", "application/json"),
                ("content-length", "999"),
            ],
            SizeHint::with_exact(12),
            Method::POST,
            Version::HTTP_11,
        );
        assert_eq!(framing, Framing::Length(12));
        assert!(keep);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ndate: "));
        assert!(
            text.ends_with("GMT\r\ncontent-length: 12\r\n\r\n"),
            "{text}"
        );
        assert!(!text.contains("999"));

        let streamed = || SizeHint::default();
        let (text, framing, keep) = head(
            200,
            &[("transfer-encoding", "gzip"), ("connection", "upgrade")],
            streamed(),
            Method::POST,
            Version::HTTP_11,
        );
        assert_eq!((framing, keep), (Framing::Chunked, true));
        assert!(
            text.ends_with("transfer-encoding: chunked\r\n\r\n"),
            "{text}"
        );
        assert!(!text.contains("gzip") && !text.contains("upgrade"));

        let (text, framing, keep) = head(200, &[], streamed(), Method::POST, Version::HTTP_10);
        assert_eq!((framing, keep), (Framing::UntilClose, false));
        assert!(text.ends_with("connection: close\r\n\r\n"));

        let (text, framing, keep) = head(
            200,
            &[],
            SizeHint::with_exact(2),
            Method::GET,
            Version::HTTP_10,
        );
        assert_eq!((framing, keep), (Framing::Length(2), true));
        assert!(text.ends_with("connection: keep-alive\r\n\r\n"));
    }

    #[test]
    fn head_204_and_304_answers_carry_no_body() {
        let (text, framing, _) = head(
            200,
            &[("content-length", "40")],
            SizeHint::with_exact(0),
            Method::HEAD,
            Version::HTTP_11,
        );
        assert_eq!(framing, Framing::Empty);
        assert!(text.contains("content-length: 40\r\n"));
        let (text, framing, _) = head(
            204,
            &[("content-length", "40")],
            SizeHint::default(),
            Method::POST,
            Version::HTTP_11,
        );
        assert_eq!(framing, Framing::Empty);
        assert!(!text.contains("content-length") && !text.contains("transfer-encoding"));
    }

    #[test]
    fn a_handlers_connection_close_is_kept_and_its_date_is_not_doubled() {
        let (text, _, keep) = head(
            503,
            &[
                ("connection", "close"),
                ("date", "Tue, 01 Dec 2026 00:00:00 GMT"),
            ],
            SizeHint::with_exact(0),
            Method::POST,
            Version::HTTP_11,
        );
        assert!(!keep);
        assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert_eq!(text.matches("date: ").count(), 1);
        assert_eq!(text.matches("connection: close").count(), 1);
    }

    #[test]
    fn chunks_are_framed_in_hex_and_empty_ones_skipped() {
        let mut out = Vec::new();
        push_chunk(&mut out, &[b'x'; 300]);
        push_chunk(&mut out, b"");
        assert!(out.starts_with(b"12c\r\nxxx"));
        assert!(out.ends_with(b"xx\r\n"));
        assert_eq!(out.len(), 5 + 300 + 2);
    }
}
