//! OpenAI's audio APIs as vLLM serves them for Whisper: `POST
//! /v1/audio/transcriptions` and `/v1/audio/translations` take a multipart form
//! (`file`, `model`, `stream`, …). The "transcript" says what arrived, so a test can
//! check that the balancer passed the upload on whole: the model, the file's length
//! and its xxh3 (`model=M bytes=N xxh3=H`). A stream sends it a word a chunk in vLLM's
//! `transcription.chunk` shape. The form is split here by plain string search, apart
//! from the balancer's reader (`routing::form`).

use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;

use super::wire::{error, json_response, ChannelBody};
use crate::proxy::body::BoxBody;
use crate::proxy::request_body::RequestBody;

/// The fields of an upload this engine reads.
struct Upload {
    model: Option<String>,
    stream: bool,
    file: Option<Vec<u8>>,
}

/// Answers one upload for `model` (the engine's own), each word `per_word` apart.
pub(super) async fn serve(
    req: Request<RequestBody>,
    model: &str,
    per_word: Duration,
) -> Response<BoxBody> {
    let boundary = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|ct| ct.split_once("boundary="))
        .map(|(_, b)| b.trim_matches('"').to_string());
    let Some(boundary) = boundary else {
        return error(StatusCode::BAD_REQUEST, "expected multipart/form-data");
    };
    let Ok(body) = req.into_body().collect().await else {
        return error(StatusCode::BAD_REQUEST, "could not read body");
    };
    let upload = read(&body.to_bytes(), &boundary);
    let Some(file) = upload.file else {
        return error(StatusCode::BAD_REQUEST, "'file' is required");
    };
    let asked = upload.model.unwrap_or_else(|| model.to_string());
    if asked != model {
        // vLLM's answer for a model it does not serve.
        return error(
            StatusCode::NOT_FOUND,
            &format!("The model `{asked}` does not exist."),
        );
    }
    let digest = xxhash_rust::xxh3::xxh3_64(&file);
    let words = [
        format!("model={asked}"),
        format!("bytes={}", file.len()),
        format!("xxh3={digest:016x}"),
    ];
    // What 16 kHz 16-bit mono audio of this size lasts.
    let seconds = (file.len() as f64 / 32_000.0).ceil();
    if !upload.stream {
        tokio::time::sleep(per_word * words.len() as u32).await;
        return json_response(
            StatusCode::OK,
            &json!({"text": words.join(" "), "usage": {"type": "duration", "seconds": seconds}}),
        );
    }
    let (tx, body) = ChannelBody::new(4);
    let model = model.to_string();
    tokio::spawn(async move {
        let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
            let v = json!({"id": "trsc-mock", "object": "transcription.chunk", "created": 0, "model": model,
                           "choices": [{"delta": delta, "finish_reason": finish, "stop_reason": null}]});
            Bytes::from(format!("data: {v}\n\n"))
        };
        for (i, word) in words.iter().enumerate() {
            tokio::time::sleep(per_word).await;
            let text = if i == 0 {
                word.clone()
            } else {
                format!(" {word}")
            };
            if tx
                .send(chunk(json!({"content": text}), json!(null)))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = tx.send(chunk(json!({}), json!("stop"))).await;
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let mut resp = Response::new(BoxBody::new(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    resp
}

/// The form's `model`, `stream` and `file` (the last of each, as FastAPI reads them).
fn read(body: &[u8], boundary: &str) -> Upload {
    let mut upload = Upload {
        model: None,
        stream: false,
        file: None,
    };
    let delimiter = format!("--{boundary}");
    for piece in split(body, delimiter.as_bytes()).into_iter().skip(1) {
        if piece.starts_with(b"--") {
            break;
        }
        let piece = piece.strip_prefix(b"\r\n").unwrap_or(piece);
        let Some(head_end) = find(piece, b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&piece[..head_end]);
        let value = &piece[head_end + 4..];
        let value = value.strip_suffix(b"\r\n").unwrap_or(value);
        let name = head
            .split_once("name=\"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(name, _)| name);
        match name {
            Some("model") => upload.model = Some(String::from_utf8_lossy(value).into_owned()),
            Some("stream") => upload.stream = value.eq_ignore_ascii_case(b"true"),
            Some("file") => upload.file = Some(value.to_vec()),
            _ => {}
        }
    }
    upload
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

/// `body` cut at every `delimiter`.
fn split<'b>(body: &'b [u8], delimiter: &[u8]) -> Vec<&'b [u8]> {
    let mut pieces = Vec::new();
    let mut rest = body;
    while let Some(i) = find(rest, delimiter) {
        pieces.push(&rest[..i]);
        rest = &rest[i + delimiter.len()..];
    }
    pieces.push(rest);
    pieces
}
