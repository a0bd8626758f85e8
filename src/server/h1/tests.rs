//! The client-side request head under attack: a corpus of valid and hostile heads,
//! each parsed alone. The request-smuggling cases (a body framed two ways, lengths
//! that disagree or overflow, codings that hide the body's end, folded lines, bare
//! LF) are learned from llhttp's `test/request` and RFC 9112 §6.3 and §11.2; the
//! same bytes are sent through a real balancer in `tests/client_conformance.rs`.

use bytes::BytesMut;
use http::{Method, StatusCode, Version};

use super::request::{is_h2_preface, parse_request, BodyFraming, HeadError, HeadLimits};

const LIMITS: HeadLimits = HeadLimits {
    max_fields: 100,
    max_bytes: 64 * 1024,
};

/// What a head must parse to.
#[derive(Debug, PartialEq)]
enum Want {
    Body(BodyFraming),
    Refused(u16),
}
use Want::*;

fn parse(head: &str) -> Result<Option<super::request::RequestHead>, HeadError> {
    let mut buf = BytesMut::from(head.as_bytes());
    parse_request(&mut buf, LIMITS)
}

fn outcome(head: &str) -> Want {
    match parse(head) {
        Ok(Some(h)) => Body(h.body),
        Ok(None) => panic!("incomplete: {head:?}"),
        Err(e) => Refused(e.status().as_u16()),
    }
}

const POST: &str = "POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\n";

#[test]
fn the_corpus_frames_each_head_one_way_or_refuses_it() {
    let cases: &[(&str, String, Want)] = &[
        (
            "no body",
            format!("{POST}\r\n"),
            Body(BodyFraming::Length(0)),
        ),
        (
            "a length",
            format!("{POST}content-length: 5\r\n\r\n"),
            Body(BodyFraming::Length(5)),
        ),
        (
            "chunked",
            format!("{POST}transfer-encoding: chunked\r\n\r\n"),
            Body(BodyFraming::Chunked),
        ),
        (
            "Chunked in capitals",
            format!("{POST}Transfer-Encoding: Chunked\r\n\r\n"),
            Body(BodyFraming::Chunked),
        ),
        // Smuggling: a body framed two ways.
        (
            "CL then TE",
            format!("{POST}content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"),
            Refused(400),
        ),
        (
            "TE then CL",
            format!("{POST}transfer-encoding: chunked\r\ncontent-length: 4\r\n\r\n"),
            Refused(400),
        ),
        (
            "CL beside TE: identity",
            format!("{POST}content-length: 4\r\ntransfer-encoding: identity\r\n\r\n"),
            Refused(400),
        ),
        // Lengths.
        (
            "two equal lengths",
            format!("{POST}content-length: 5\r\ncontent-length: 5\r\n\r\n"),
            Body(BodyFraming::Length(5)),
        ),
        (
            "a list of equal lengths",
            format!("{POST}content-length: 5, 5\r\n\r\n"),
            Body(BodyFraming::Length(5)),
        ),
        (
            "two different lengths",
            format!("{POST}content-length: 5\r\ncontent-length: 6\r\n\r\n"),
            Refused(400),
        ),
        (
            "a list of different lengths",
            format!("{POST}content-length: 5, 6\r\n\r\n"),
            Refused(400),
        ),
        (
            "a signed length",
            format!("{POST}content-length: +5\r\n\r\n"),
            Refused(400),
        ),
        (
            "a negative length",
            format!("{POST}content-length: -1\r\n\r\n"),
            Refused(400),
        ),
        (
            "a hex length",
            format!("{POST}content-length: 0x5\r\n\r\n"),
            Refused(400),
        ),
        (
            "two numbers",
            format!("{POST}content-length: 5 5\r\n\r\n"),
            Refused(400),
        ),
        (
            "an empty length",
            format!("{POST}content-length: \r\n\r\n"),
            Refused(400),
        ),
        (
            "a length past u64",
            format!("{POST}content-length: 99999999999999999999\r\n\r\n"),
            Refused(400),
        ),
        (
            "a length with spaces around",
            format!("{POST}content-length:  7 \r\n\r\n"),
            Body(BodyFraming::Length(7)),
        ),
        // Codings.
        (
            "gzip then chunked",
            format!("{POST}transfer-encoding: gzip, chunked\r\n\r\n"),
            Refused(501),
        ),
        (
            "chunked then gzip",
            format!("{POST}transfer-encoding: chunked, gzip\r\n\r\n"),
            Refused(400),
        ),
        (
            "chunked twice in a list",
            format!("{POST}transfer-encoding: chunked, chunked\r\n\r\n"),
            Refused(400),
        ),
        (
            "chunked on two lines",
            format!("{POST}transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n"),
            Refused(400),
        ),
        (
            "chunked, then identity on a second line",
            format!("{POST}transfer-encoding: chunked\r\ntransfer-encoding: identity\r\n\r\n"),
            Refused(400),
        ),
        (
            "identity alone",
            format!("{POST}transfer-encoding: identity\r\n\r\n"),
            Refused(400),
        ),
        (
            "an empty coding",
            format!("{POST}transfer-encoding: \r\n\r\n"),
            Refused(400),
        ),
        (
            "a coding with junk",
            format!("{POST}transfer-encoding: xchunked\r\n\r\n"),
            Refused(400),
        ),
        (
            "chunked in HTTP/1.0",
            "POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n".to_string(),
            Refused(400),
        ),
        // Lines.
        (
            "obs-fold",
            format!("{POST}x-a: one\r\n two\r\ncontent-length: 0\r\n\r\n"),
            Refused(400),
        ),
        (
            "obs-fold of a length",
            format!("{POST}content-length:\r\n 5\r\n\r\n"),
            Refused(400),
        ),
        (
            "a space before the colon",
            format!("{POST}content-length : 5\r\n\r\n"),
            Refused(400),
        ),
        (
            "a NUL in a value",
            format!("{POST}x-a: a\0b\r\n\r\n"),
            Refused(400),
        ),
        (
            "a CR alone in a value",
            format!("{POST}x-a: a\rb\r\n\r\n"),
            Refused(400),
        ),
        (
            "a name with a slash",
            format!("{POST}x/a: b\r\n\r\n"),
            Refused(400),
        ),
        (
            "bare LF line ends",
            "POST / HTTP/1.1\nhost: lb\ncontent-length: 2\n\n".to_string(),
            Body(BodyFraming::Length(2)),
        ),
        (
            "HTTP/1.2",
            "POST / HTTP/1.2\r\n\r\n".to_string(),
            Refused(400),
        ),
        (
            "HTTP/2.0 in a request line",
            "POST / HTTP/2.0\r\n\r\n".to_string(),
            Refused(400),
        ),
        (
            "a space in the target",
            "POST /a b HTTP/1.1\r\n\r\n".to_string(),
            Refused(400),
        ),
        (
            "a method with a slash",
            "PO/ST / HTTP/1.1\r\n\r\n".to_string(),
            Refused(400),
        ),
    ];
    let mut wrong = Vec::new();
    for (name, head, want) in cases {
        let got = outcome(head);
        if got != *want {
            wrong.push(format!("{name}: got {got:?}, want {want:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_head_is_read_once_whole_and_the_next_request_is_left_in_the_buffer() {
    let two = format!("{POST}content-length: 2\r\n\r\nhi{POST}\r\n");
    let mut buf = BytesMut::from(two.as_bytes());
    let head = parse_request(&mut buf, LIMITS).unwrap().unwrap();
    assert_eq!(head.parts.method, Method::POST);
    assert_eq!(head.parts.uri.path(), "/v1/chat/completions");
    assert_eq!(head.parts.headers["host"], "lb");
    assert_eq!(&buf[..2], b"hi", "the body is left for the connection");
    let rest = &buf[2..];
    assert!(rest.starts_with(b"POST "));

    // A part of a head is left alone until the rest comes.
    let part = &POST[..POST.len() - 3];
    let mut buf = BytesMut::from(part.as_bytes());
    assert!(parse_request(&mut buf, LIMITS).unwrap().is_none());
    assert_eq!(&buf[..], part.as_bytes());
}

#[test]
fn fields_and_bytes_past_the_limits_are_431() {
    let fields = |n: usize| -> String {
        let extra: String = (0..n).map(|i| format!("x-h{i}: v\r\n")).collect();
        format!("POST / HTTP/1.1\r\n{extra}\r\n")
    };
    assert!(parse(&fields(99)).unwrap().is_some());
    assert_eq!(parse(&fields(100)).unwrap_err(), HeadError::TooManyFields);
    assert_eq!(parse(&fields(500)).unwrap_err(), HeadError::TooManyFields);
    // Few fields, on a stack of 32: the same limit when it is lower.
    let mut buf = BytesMut::from(fields(20).as_bytes());
    let small = HeadLimits {
        max_fields: 20,
        ..LIMITS
    };
    assert_eq!(
        parse_request(&mut buf, small).unwrap_err(),
        HeadError::TooManyFields
    );

    let long = format!("POST / HTTP/1.1\r\nx-big: {}\r\n\r\n", "v".repeat(70_000));
    assert_eq!(parse(&long).unwrap_err(), HeadError::TooLarge);
    // Still coming, and already past the limit.
    let coming = format!("POST / HTTP/1.1\r\nx-big: {}", "v".repeat(70_000));
    assert_eq!(parse(&coming).unwrap_err(), HeadError::TooLarge);
    assert_eq!(
        HeadError::TooLarge.status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
}

#[test]
fn keep_alive_follows_the_version_and_connection_and_expect_is_read() {
    let keep = |head: &str| parse(head).unwrap().unwrap().keep_alive;
    assert!(keep("GET / HTTP/1.1\r\n\r\n"));
    assert!(!keep("GET / HTTP/1.1\r\nconnection: close\r\n\r\n"));
    assert!(!keep(
        "GET / HTTP/1.1\r\nconnection: upgrade, Close\r\n\r\n"
    ));
    assert!(!keep("GET / HTTP/1.0\r\n\r\n"));
    assert!(keep("GET / HTTP/1.0\r\nconnection: keep-alive\r\n\r\n"));
    let head = parse(&format!(
        "{POST}expect: 100-Continue\r\ncontent-length: 3\r\n\r\n"
    ))
    .unwrap()
    .unwrap();
    assert!(head.expect_continue);
    assert_eq!(head.parts.version, Version::HTTP_11);
    let head = parse("POST / HTTP/1.0\r\nexpect: 100-continue\r\n\r\n")
        .unwrap()
        .unwrap();
    assert!(!head.expect_continue, "HTTP/1.0 has no interim responses");
}

#[test]
fn an_absolute_target_is_read_and_the_http2_preface_is_told_early() {
    let head = parse("POST http://lb:8080/v1/completions?x=1 HTTP/1.1\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(head.parts.uri.path(), "/v1/completions");
    assert_eq!(head.parts.uri.query(), Some("x=1"));

    assert_eq!(
        is_h2_preface(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        Some(true)
    );
    assert_eq!(is_h2_preface(b"PRI * HT"), None);
    assert_eq!(is_h2_preface(b"POST / HTTP/1.1\r\n"), Some(false));
    assert_eq!(is_h2_preface(b"PRI * HTTP/1.1\r\n"), Some(false));
}
