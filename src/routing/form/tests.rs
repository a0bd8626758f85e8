//! The form reader on bodies as clients write them (httpx for the `openai` SDK, curl),
//! on hostile ones, and on any form proptest writes.

use proptest::prelude::*;

use super::*;

/// A body as httpx (the `openai` Python SDK's transport) writes it.
fn httpx_body(boundary: &str, fields: &[(&str, &[u8])], file: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, value) in fields {
        b.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n")
                .as_bytes(),
        );
        b.extend_from_slice(value);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"speech.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
    b.extend_from_slice(file);
    b.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    b
}

fn value<'b>(body: &'b [u8], parts: &[Part], name: &str) -> Option<&'b [u8]> {
    parts
        .iter()
        .find(|p| p.name == name)
        .map(|p| &body[p.value.clone()])
}

#[test]
fn a_content_type_names_its_boundary_only_for_a_form() {
    assert_eq!(
        boundary("multipart/form-data; boundary=abc123"),
        Some("abc123")
    );
    assert_eq!(
        boundary("Multipart/Form-Data ; charset=utf-8; Boundary=\"a b:c\""),
        Some("a b:c")
    );
    assert_eq!(boundary("multipart/form-data"), None);
    assert_eq!(boundary("multipart/form-data; boundary="), None);
    assert_eq!(boundary("multipart/mixed; boundary=abc"), None);
    assert_eq!(boundary("application/json"), None);
}

#[test]
fn the_fields_and_the_file_of_an_openai_sdk_body_are_found_in_place() {
    // Audio bytes that look like the form's own syntax: line ends, dashes, a
    // boundary-like line that is not this one's.
    let file = b"RIFF\x00\x01\r\n--\r\n--0f9e\r\n\r\n\xff\xfe data";
    let body = httpx_body(
        "0f9e8d7c6b5a",
        &[
            ("model", b"whisper-1"),
            ("stream", b"true"),
            ("language", b"en"),
        ],
        file,
    );
    let parts = parts(&body).unwrap();
    assert_eq!(parts.len(), 4);
    assert_eq!(value(&body, &parts, "model"), Some(&b"whisper-1"[..]));
    assert_eq!(value(&body, &parts, "stream"), Some(&b"true"[..]));
    assert_eq!(value(&body, &parts, "file"), Some(&file[..]));
    assert!(parts[3].file && !parts[0].file);
}

#[test]
fn curl_quoting_padding_and_an_epilogue_are_read() {
    // curl writes `Content-Disposition` the same way; other clients quote, escape,
    // put `filename*`, pad the boundary line, or write an epilogue.
    let body = b"--XyZ  \r\ncontent-disposition: form-data; name=model\r\n\r\nm1\r\n--XyZ\t\r\nContent-Disposition: form-data; foo; name=\"a\\\"b;c\"; filename*=UTF-8''x.mp3\r\n\r\nAUDIO\r\n--XyZ--\r\nthe epilogue\r\n--XyZ\r\n";
    let parts = parts(body).unwrap();
    assert_eq!(parts.len(), 2);
    assert_eq!(value(body, &parts, "model"), Some(&b"m1"[..]));
    assert_eq!(parts[1].name, "a\"b;c");
    assert!(parts[1].file);
    assert_eq!(&body[parts[1].value.clone()], b"AUDIO");
}

#[test]
fn a_part_without_a_disposition_or_a_value_is_kept_unnamed_or_empty() {
    let body = b"--b\r\n\r\nanonymous\r\n--b\r\nContent-Disposition: form-data; name=\"empty\"\r\n\r\n\r\n--b--";
    let parts = parts(body).unwrap();
    assert_eq!(parts[0].name, "");
    assert_eq!(&body[parts[0].value.clone()], b"anonymous");
    assert_eq!(parts[1].name, "empty");
    assert!(parts[1].value.is_empty());
}

#[test]
fn malformed_forms_are_errors_that_say_where() {
    let cases: &[(&[u8], FormError)] = &[
        (b"", FormError::NoOpening),
        (b"{\"model\": \"m\"}", FormError::NoOpening),
        (b"preamble\r\n--b\r\n\r\nx\r\n--b--", FormError::NoOpening),
        (b"--\r\n\r\nx\r\n----", FormError::BoundaryLength),
        (
            format!("--{}\r\n", "b".repeat(71))
                .as_bytes()
                .to_vec()
                .leak(),
            FormError::BoundaryLength,
        ),
        (
            b"--b\r\nContent-Disposition: form-data",
            FormError::PartHead(0),
        ),
        (
            b"--b\r\nno colon here\r\n\r\nx\r\n--b--",
            FormError::PartHead(0),
        ),
        (b"--b\r\n\r\nnever closed", FormError::Unclosed(0)),
        (b"--b\r\n\r\nx\r\n--b\r\n\r\ny", FormError::Unclosed(1)),
        (b"--b\r\n\r\nx\r\n--bogus\r\n", FormError::AfterBoundary(0)),
        (b"--b\r\n\r\nx\r\n--b", FormError::AfterBoundary(0)),
    ];
    for (body, want) in cases {
        assert_eq!(
            parts(body).as_ref().err(),
            Some(want),
            "{:?}",
            String::from_utf8_lossy(body)
        );
    }
    // More header lines in one part than a client writes.
    let mut body = b"--b\r\n".to_vec();
    for i in 0..=MAX_PART_HEADERS {
        body.extend_from_slice(format!("x-{i}: y\r\n").as_bytes());
    }
    body.extend_from_slice(b"\r\nv\r\n--b--");
    assert_eq!(parts(&body), Err(FormError::PartHead(0)));
    // More parts than a form has: refused before they are listed.
    let many = b"--b\r\n\r\n\r\n".repeat(MAX_PARTS + 1);
    assert_eq!(
        parts(&[many.as_slice(), b"--b--"].concat()),
        Err(FormError::TooManyParts)
    );
    let enough = b"--b\r\n\r\n\r\n".repeat(MAX_PARTS);
    assert_eq!(
        parts(&[enough.as_slice(), b"--b--"].concat()).map(|p| p.len()),
        Ok(MAX_PARTS)
    );
}

proptest! {
    /// Any form written as a client writes it (values free of the delimiter) reads
    /// back whole: every name, every value, in order.
    #[test]
    fn a_written_form_reads_back(
        boundary in "[0-9A-Za-z'()+_,./:=?-]{1,70}",
        fields in prop::collection::vec(("[a-z_\\[\\]]{1,12}", prop::collection::vec(any::<u8>(), 0..64), any::<bool>()), 1..6),
    ) {
        let delimiter = format!("\r\n--{boundary}");
        prop_assume!(fields.iter().all(|(_, v, _)| {
            let mut padded = b"\r\n".to_vec();
            padded.extend_from_slice(v);
            padded.extend_from_slice(b"\r\n");
            memchr::memmem::find(&padded, delimiter.as_bytes()).is_none()
        }));
        let mut body = Vec::new();
        for (name, value, file) in &fields {
            let filename = if *file { "; filename=\"f.bin\"" } else { "" };
            body.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"{filename}\r\n\r\n").as_bytes());
            body.extend_from_slice(value);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        let parts = parts(&body).unwrap();
        prop_assert_eq!(parts.len(), fields.len());
        for (part, (name, value, file)) in parts.iter().zip(&fields) {
            prop_assert_eq!(&part.name, name);
            prop_assert_eq!(part.file, *file);
            prop_assert_eq!(&body[part.value.clone()], &value[..]);
        }
    }

    /// Any bytes at all: an answer, never a panic, and every range inside the body.
    #[test]
    fn any_bytes_are_read_or_refused(body in prop::collection::vec(any::<u8>(), 0..256), opening in any::<bool>()) {
        let body = if opening { [b"--b\r\n".as_slice(), &body].concat() } else { body };
        if let Ok(parts) = parts(&body) {
            for p in parts {
                prop_assert!(p.value.start <= p.value.end && p.value.end <= body.len());
            }
        }
    }
}
