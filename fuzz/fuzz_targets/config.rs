//! The config parser and validator on arbitrary text: an error with a position, never
//! a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prefixlb::config::Config;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = Config::parse(text, "fuzz.toml") {
            assert!(e.line >= 1 && e.col >= 1, "{e}");
        }
    }
});
