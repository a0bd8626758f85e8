//! The SSE scanner on arbitrary bytes in arbitrary chunkings: never a panic, and the
//! events found do not depend on where the stream was cut.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prefixlb::proxy::sse::SseScanner;

fn events(stream: &[u8], cuts: &[u8]) -> Vec<(Option<String>, Vec<u8>)> {
    let mut scanner = SseScanner::default();
    let mut out = Vec::new();
    let mut at = 0;
    let mut cuts = cuts.iter().cycle();
    while at < stream.len() {
        let step = usize::from(*cuts.next().unwrap_or(&255)).max(1);
        let end = (at + step).min(stream.len());
        for block in scanner.push(&Bytes::copy_from_slice(&stream[at..end])) {
            out.push((block.event.map(|e| e.data.to_string()), block.raw.to_vec()));
        }
        at = end;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let split = data
        .first()
        .map_or(0, |&b| usize::from(b))
        .min(data.len().saturating_sub(1));
    let (cuts, stream) = data.split_at(split);
    let whole = events(stream, &[255]);
    let cut = events(stream, if cuts.is_empty() { &[1] } else { cuts });
    assert_eq!(whole, cut, "events depend on the chunking");
});
