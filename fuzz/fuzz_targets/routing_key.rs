//! The routing-key extractor on whole request bodies of every API and key mode: it
//! must never panic, and a key it returns is bounded by its spec.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefixlb::config::KeyMode;
use prefixlb::routing::facts::Api;
use prefixlb::routing::key::{extract, key_hashes, KeySpec};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let apis = [
        Api::Chat,
        Api::Completions,
        Api::Generate,
        Api::Responses,
        Api::Embeddings,
        Api::Other,
    ];
    let api = apis[usize::from(selector) % apis.len()];
    let mode =
        [KeyMode::Hybrid, KeyMode::Conversation, KeyMode::Prefix][usize::from(selector / 6 % 3)];
    let spec = KeySpec::new(mode, 64 + usize::from(selector) * 8);
    let header = (selector & 0x80 != 0).then_some(&b"session-1"[..]);
    if let Ok(facts) = extract(api, body, header, spec) {
        let _ = key_hashes("pool", &facts, 0);
        let _ = facts.turn_seen();
    }
});
