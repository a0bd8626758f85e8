//! The multipart form reader and the form's `model` rewrite on arbitrary bytes: never
//! a panic; every part inside the body, in order; and a form read for an upload,
//! with its model rewritten, reads back with the same parts, the new model, and the
//! same file.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prefixlb::config::KeyMode;
use prefixlb::proxy::edit::{apply, Edits};
use prefixlb::routing::facts::Api;
use prefixlb::routing::form::parts;
use prefixlb::routing::key::{extract, KeySpec};

fuzz_target!(|data: &[u8]| {
    let Ok(before) = parts(data) else {
        return;
    };
    let mut end = 0;
    for p in &before {
        assert!(end <= p.value.start && p.value.start <= p.value.end && p.value.end <= data.len());
        end = p.value.end;
    }
    let Ok(facts) = extract(Api::Audio, data, None, KeySpec::new(KeyMode::Hybrid, 1024)) else {
        return;
    };
    let body = Bytes::copy_from_slice(data);
    let out = apply(&body, &facts.spans, Edits { model: Some("whisper-x"), include_usage: true });
    let after = parts(&out).expect("an edited form reads back");
    assert_eq!(after.len(), before.len());
    let value = |body: &[u8], ps: &[prefixlb::routing::form::Part], name: &str| {
        ps.iter().rev().find(|p| p.name == name).map(|p| body[p.value.clone()].to_vec())
    };
    if value(data, &before, "model").is_some() {
        assert_eq!(value(&out, &after, "model").as_deref(), Some(&b"whisper-x"[..]));
    }
    assert_eq!(value(&out, &after, "file"), value(data, &before, "file"));
});
