//! Inputs the fuzzers (`scripts/fuzz.sh`, targets in `fuzz/`) found, replayed as
//! tests: each failed before its fix.

use bytes::Bytes;
use prefixlb::proxy::sse::SseScanner;

/// One block: its raw bytes and its event's data.
type Block = (Vec<u8>, Option<String>);

/// Blocks and the unfinished rest, pushing `stream` in chunks of `step` bytes.
fn scan(stream: &[u8], step: usize) -> (Vec<Block>, Bytes) {
    let mut s = SseScanner::default();
    let mut blocks = Vec::new();
    for chunk in stream.chunks(step) {
        for b in s.push(&Bytes::copy_from_slice(chunk)) {
            blocks.push((b.raw.to_vec(), b.event.map(|e| e.data)));
        }
    }
    (blocks, s.take_pending())
}

/// `sse_scanner`, crash-7e7e6ebf: a blank line ended by a CR that came last in its
/// chunk was dispatched at once, so the LF of its CRLF, arriving next, was left
/// behind as the start of the following block: the same stream gave other blocks
/// when cut elsewhere.
#[test]
fn a_crlf_split_after_its_cr_ends_the_same_block() {
    for stream in [
        &b"\0F\n\r\n"[..],
        b"data: 1\n\r\ndata: 2\r\n\r\n",
        b"data: a\r\r\ndata: b\r\r",
    ] {
        let whole = scan(stream, stream.len());
        for step in 1..stream.len() {
            assert_eq!(scan(stream, step), whole, "{stream:?} in chunks of {step}");
        }
    }
}
