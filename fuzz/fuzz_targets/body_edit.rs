//! The body editor (fallback `model` rewrite, `stream_options` insertion) on arbitrary
//! bodies: never a panic; on a body that parses as a JSON object, the edited body
//! parses too and carries the edits.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prefixlb::config::KeyMode;
use prefixlb::proxy::edit::{apply, Edits};
use prefixlb::routing::facts::Api;
use prefixlb::routing::key::{extract, KeySpec};

fuzz_target!(|data: &[u8]| {
    let Ok(facts) = extract(Api::Chat, data, None, KeySpec::new(KeyMode::Hybrid, 1024)) else {
        return;
    };
    let body = Bytes::copy_from_slice(data);
    for (model, include_usage) in [
        (Some("fallback-model"), false),
        (None, true),
        (Some("m\"x"), true),
    ] {
        let out = apply(
            &body,
            &facts.spans,
            Edits {
                model,
                include_usage,
            },
        );
        let Ok(before) = serde_json::from_slice::<serde_json::Value>(data) else {
            continue;
        };
        if !before.is_object() {
            continue;
        }
        let after: serde_json::Value = serde_json::from_slice(&out).unwrap_or_else(|e| {
            panic!(
                "edited body is not JSON ({e}): {}",
                String::from_utf8_lossy(&out)
            )
        });
        if let Some(m) = model {
            assert_eq!(after["model"], m);
        }
        if include_usage && before.get("stream_options").is_none() {
            assert_eq!(after["stream_options"]["include_usage"], true);
        }
    }
});
