//! Engine-side HTTP/1.1 framing as pure functions: heads, lengths, chunked bodies,
//! split at every byte.

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
    headers.insert(header::HOST, HeaderValue::from_static("lb"));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
    headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    let headers = UpstreamHeaders::new(headers, "10.1.2.3:4000".parse().unwrap(), false);
    let mut out = Vec::new();
    let host = HeaderValue::from_static("10.0.0.7:8000");
    encode_request(
        &Method::POST,
        "/v1/chat/completions",
        &host,
        &headers,
        None,
        17,
        &mut out,
    );
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.7:8000\r\n\
         content-type: application/json\r\nx-forwarded-for: 10.1.2.3\r\n\
         content-length: 17\r\n\r\n"
    );
    let mut out = Vec::new();
    encode_request(
        &Method::GET,
        "/v1/models",
        &host,
        &UpstreamHeaders::default(),
        None,
        0,
        &mut out,
    );
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "GET /v1/models HTTP/1.1\r\nhost: 10.0.0.7:8000\r\n\r\n"
    );
    // A node that is one data-parallel rank names it, after the client's fields.
    let mut out = Vec::new();
    encode_request(
        &Method::POST,
        "/v1/chat/completions",
        &host,
        &headers,
        Some(&HeaderValue::from_static("5")),
        2,
        &mut out,
    );
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.7:8000\r\n\
         content-type: application/json\r\nx-forwarded-for: 10.1.2.3\r\n\
         x-data-parallel-rank: 5\r\ncontent-length: 2\r\n\r\n"
    );
}

proptest! {
    #[test]
    fn lengths_are_written_as_the_formatter_writes_them(n in any::<u64>()) {
        let mut out = b"x".to_vec();
        push_decimal(&mut out, n);
        prop_assert_eq!(out, format!("x{n}").into_bytes());
    }
}

#[test]
fn length_edges_are_written_as_the_formatter_writes_them() {
    for n in [0, 9, 10, 99, 100, u64::MAX] {
        let mut out = Vec::new();
        push_decimal(&mut out, n);
        assert_eq!(out, n.to_string().into_bytes());
    }
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
        framing("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 4\r\n\r\n"),
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

#[test]
fn lengths_and_codings_are_mended_or_refused() {
    // Both: the coding frames the body (RFC 9112 §6.3), the length is dropped, and the
    // connection is not trusted with another request.
    let h = head("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(h.framing, Framing::Chunked);
    assert!(!h.parts.headers.contains_key(header::CONTENT_LENGTH));
    assert!(!h.reusable);
    // Digits only; equal values are one value.
    for bad in ["+5", "-5", "0x5", "5.0", "5 5", "", "99999999999999999999"] {
        let text = format!("HTTP/1.1 200 OK\r\nContent-Length: {bad}\r\n\r\n");
        assert_eq!(head(&text).err(), Some(WireError::BadLength), "{bad:?}");
    }
    let h = head("HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nContent-Length: 5\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(h.framing, Framing::Length(5));
    let lengths: Vec<_> = h
        .parts
        .headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .collect();
    assert_eq!(lengths, ["5"]);
    // A coding that cannot be read, an empty one, or one in HTTP/1.0: faulty framing.
    let mut garbled =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: ".to_vec();
    garbled.extend_from_slice(b"\xffgzip\r\n\r\n");
    assert_eq!(
        parse_response(&mut BytesMut::from(&garbled[..]), &Method::POST).err(),
        Some(WireError::BadTransferEncoding("not visible ASCII"))
    );
    assert_eq!(
        head("HTTP/1.1 200 OK\r\nTransfer-Encoding:\r\nContent-Length: 5\r\n\r\n").err(),
        Some(WireError::BadTransferEncoding("empty"))
    );
    assert_eq!(
        head("HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").err(),
        Some(WireError::BadTransferEncoding("in an HTTP/1.0 response"))
    );
    // Nothing asked to switch protocols.
    for extra in [
        "",
        "Upgrade: websocket\r\nConnection: upgrade\r\n",
        "Content-Length: 0\r\n",
    ] {
        let text = format!("HTTP/1.1 101 Switching Protocols\r\n{extra}\r\n");
        assert_eq!(head(&text).err(), Some(WireError::Upgrade), "{extra:?}");
    }
    // The head limit holds for a head that arrived whole, too.
    let big = format!(
        "HTTP/1.1 200 OK\r\nx: {}\r\ncontent-length: 0\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    assert_eq!(head(&big).err(), Some(WireError::HeadTooLarge));
}

#[test]
fn chunk_lines_and_trailers_are_read_strictly() {
    let err = |w: &str| decode_in_pieces(w.as_bytes(), &[]).err();
    let not_hex = Some(WireError::BadChunk("chunk size is not hex"));
    let bad_ext = Some(WireError::BadChunk("invalid chunk extension"));
    assert_eq!(err(" 5\r\nhello\r\n0\r\n\r\n"), not_hex, "leading space");
    assert_eq!(err("5 \r\nhello\r\n0\r\n\r\n"), not_hex, "trailing space");
    assert_eq!(err("2 erfrferferf\r\naa\r\n0\r\n\r\n"), not_hex);
    assert_eq!(
        err("5;\r\nhello\r\n0\r\n\r\n"),
        bad_ext,
        "no extension after ;"
    );
    assert_eq!(err("5;a=\rb\r\nhello\r\n0\r\n\r\n"), bad_ext, "bare CR");
    assert_eq!(
        err("5;a=\"def; ghi\r\nhello\r\n0\r\n\r\n"),
        bad_ext,
        "unbalanced quote"
    );
    let ok = decode_in_pieces(
        b"5;ilovew3=\"I love; \\\"extensions\\\"\";somuchlove=more;blah\r\nhello\r\n6;x\r\n world\r\n0\r\n\r\n",
        &[],
    )
    .unwrap();
    assert_eq!(ok, (b"hello world".to_vec(), true));
    assert_eq!(
        err("0\r\n folded: value\r\n\r\n"),
        Some(WireError::BadTrailer("obsolete line folding"))
    );
    assert_eq!(
        err("0\r\nno colon here\r\n\r\n"),
        Some(WireError::BadTrailer("not a header field"))
    );
    assert_eq!(
        err("0\r\nx-checksum: 1\n\r\n"),
        Some(WireError::BadTrailer("line not ended by CRLF"))
    );
    assert_eq!(
        err("0\r\nx-checksum: a\u{1}b\r\n\r\n"),
        Some(WireError::BadTrailer("control character in a value"))
    );
    assert_eq!(
        decode_in_pieces(b"0\r\nx-checksum: 1\r\n\r\n", &[]).unwrap(),
        (Vec::new(), true)
    );
}

#[test]
fn usual_names_are_the_names_from_bytes_gives() {
    for name in [
        "content-type",
        "Content-Type",
        "content-length",
        "Content-Length",
        "date",
        "Date",
        "server",
        "Server",
        "connection",
        "Connection",
        "transfer-encoding",
        "Transfer-Encoding",
        "cache-control",
        "Cache-Control",
        "keep-alive",
        "Keep-Alive",
    ] {
        assert_eq!(
            usual_name(name),
            Some(HeaderName::from_bytes(name.as_bytes()).unwrap()),
            "{name}"
        );
    }
    assert_eq!(
        usual_name("CONTENT-TYPE"),
        None,
        "other spellings go the long way"
    );
    // Either way the map is the same.
    let mut buf = BytesMut::from(
        &b"HTTP/1.1 200 OK\r\nCONTENT-LENGTH: 2\r\nContent-Type: a/b\r\nx-Other: 1\r\n\r\nhi"[..],
    );
    let head = parse_response(&mut buf, &Method::POST).unwrap().unwrap();
    assert_eq!(head.parts.headers[header::CONTENT_LENGTH], "2");
    assert_eq!(head.parts.headers[header::CONTENT_TYPE], "a/b");
    assert_eq!(head.parts.headers["x-other"], "1");
    assert_eq!(head.framing, Framing::Length(2));
}

#[test]
fn hop_by_hop_fields_frame_the_body_and_are_not_kept() {
    let mut buf = BytesMut::from(
        "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Private\r\nKeep-Alive: timeout=5\r\n\
         Transfer-Encoding: chunked\r\nX-Private: 1\r\nContent-Type: a/b\r\n\r\n",
    );
    let head = parse_response(&mut buf, &Method::POST).unwrap().unwrap();
    assert_eq!(head.framing, Framing::Chunked);
    assert!(head.reusable);
    let names: Vec<&str> = head.parts.headers.keys().map(|n| n.as_str()).collect();
    assert_eq!(names, ["content-type"], "only end-to-end fields are kept");
    // `close` among other items still closes; a line that is not text is passed over.
    let mut buf = BytesMut::from(
        &b"HTTP/1.1 200 OK\r\nconnection: \xff\r\nConnection: x, Close\r\ncontent-length: 0\r\n\r\n"[..],
    );
    let head = parse_response(&mut buf, &Method::POST).unwrap().unwrap();
    assert!(!head.reusable);
    assert_eq!(head.framing, Framing::Length(0));
    assert_eq!(head.parts.headers[header::CONTENT_LENGTH], "0");
    // No `Connection`: a lone `te` and `upgrade` still go.
    let mut buf = BytesMut::from(
        "HTTP/1.1 200 OK\r\nTE: trailers\r\nUpgrade: websocket\r\n\
         Content-Type: text/plain\r\ncontent-length: 0\r\n\r\n",
    );
    let head = parse_response(&mut buf, &Method::POST).unwrap().unwrap();
    let mut names: Vec<&str> = head.parts.headers.keys().map(|n| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["content-length", "content-type"]);
    // `Connection` naming one of the nine and a header of its own, on two lines.
    let mut buf = BytesMut::from(
        "HTTP/1.1 200 OK\r\nConnection: Keep-Alive\r\nConnection:  x-hop ,\r\n\
         Keep-Alive: timeout=5\r\nx-hop: 1\r\nx-stay: 1\r\ncontent-length: 0\r\n\r\n",
    );
    let head = parse_response(&mut buf, &Method::POST).unwrap().unwrap();
    assert!(head.reusable);
    let mut names: Vec<&str> = head.parts.headers.keys().map(|n| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["content-length", "x-stay"]);
}
