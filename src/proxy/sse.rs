//! The one incremental Server-Sent Events scanner (WHATWG HTML §9.2.6), shared by the
//! first-packet probe, the relay (usage stripping, clean error events), `bench` and the
//! relay-latency example. Bytes go in as they arrive, cut anywhere; out come blocks:
//! the raw bytes of the stream up to and including each blank line that ends an event,
//! with the event parsed. The bytes of an unfinished event stay inside the scanner until
//! their blank line arrives, so a consumer that forwards blocks never sends half an
//! event. Lines end in LF, CRLF or CR; comments (`:`) and keep-alive blank lines pass
//! through as blocks without an event.

use bytes::{Bytes, BytesMut};

/// One dispatched event: its `event:` type (empty if none) and its `data:` lines
/// joined by `\n`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    pub kind: String,
    pub data: String,
}

/// A run of stream bytes ending at a blank line, and the event it dispatched (none for
/// a keep-alive or comment-only block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub raw: Bytes,
    pub event: Option<SseEvent>,
}

/// The incremental scanner.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// Bytes of the unfinished block, already scanned up to `scanned`.
    pending: BytesMut,
    /// Offset in `pending` where the current (unterminated) line starts.
    line_start: usize,
    /// The last byte scanned was a CR: a following LF belongs to that line end.
    after_cr: bool,
    /// The last byte pending is a CR ending a blank line, not scanned yet: whether an
    /// LF follows decides which block that LF belongs to, so the block waits for it.
    held_cr: bool,
    kind: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
}

impl SseScanner {
    /// Feeds bytes; returns the blocks they complete, in order.
    pub fn push(&mut self, chunk: &Bytes) -> Vec<Block> {
        let mut blocks = Vec::new();
        self.push_with(chunk, |b| blocks.push(b));
        blocks
    }

    /// Feeds bytes, handing each completed block to `out` (no allocation per call).
    pub fn push_with(&mut self, chunk: &Bytes, mut out: impl FnMut(Block)) {
        if chunk.is_empty() {
            return;
        }
        // Work on one contiguous buffer: the chunk itself when nothing is pending (no
        // copy), else the pending bytes with the chunk appended.
        let (buf, mut pos) = if self.pending.is_empty() {
            (chunk.clone(), 0)
        } else {
            let scanned = self.pending.len() - usize::from(std::mem::take(&mut self.held_cr));
            self.pending.extend_from_slice(chunk);
            (std::mem::take(&mut self.pending).freeze(), scanned)
        };
        let mut block_start = 0;
        let bytes = &buf[..];
        while pos < bytes.len() {
            if std::mem::take(&mut self.after_cr) && bytes[pos] == b'\n' {
                // The LF of a CRLF whose CR ended the previous scan.
                pos += 1;
                self.line_start = pos;
                continue;
            }
            let Some(end) = memchr::memchr2(b'\n', b'\r', &bytes[pos..]).map(|i| pos + i) else {
                break;
            };
            let line = &bytes[self.line_start..end];
            let mut next = end + 1;
            if bytes[end] == b'\r' {
                match bytes.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    // A blank line whose CR may be half of a CRLF: wait for the next
                    // byte before ending the block, so the LF is not left behind.
                    None if line.is_empty() => {
                        self.held_cr = true;
                        break;
                    }
                    None => self.after_cr = true,
                }
            }
            let dispatched = self.line(line);
            pos = next;
            self.line_start = next;
            if let Some(event) = dispatched {
                out(Block {
                    raw: buf.slice(block_start..next),
                    event,
                });
                block_start = next;
            }
        }
        // Keep the unfinished block (rebased to offset 0).
        self.line_start -= block_start;
        self.pending = BytesMut::from(&buf[block_start..]);
    }

    /// Whether every byte pushed so far belongs to a completed block.
    pub fn at_boundary(&self) -> bool {
        self.pending.is_empty()
    }

    /// Takes the bytes of the unfinished block (for a stream that ended without its
    /// final blank line), resetting the scanner.
    pub fn take_pending(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.pending).freeze();
        *self = SseScanner::default();
        rest
    }

    /// One complete line. A blank line ends the block: `Some(event or none)`.
    fn line(&mut self, line: &[u8]) -> Option<Option<SseEvent>> {
        if line.is_empty() {
            let kind = std::mem::take(&mut self.kind);
            let data = std::mem::take(&mut self.data);
            if !std::mem::take(&mut self.has_data) {
                return Some(None);
            }
            return Some(Some(SseEvent {
                kind: String::from_utf8_lossy(&kind).into_owned(),
                data: String::from_utf8(data)
                    .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
            }));
        }
        if line[0] == b':' {
            return None;
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            b"event" => {
                self.kind.clear();
                self.kind.extend_from_slice(value);
            }
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(blocks: &[Block]) -> Vec<&str> {
        blocks
            .iter()
            .filter_map(|b| b.event.as_ref())
            .map(|e| e.data.as_str())
            .collect()
    }

    fn push(s: &mut SseScanner, bytes: &'static [u8]) -> Vec<Block> {
        s.push(&Bytes::from_static(bytes))
    }

    #[test]
    fn events_split_across_chunks_and_sharing_chunks() {
        let mut s = SseScanner::default();
        assert!(push(&mut s, b"data: {\"a\"").is_empty());
        assert!(!s.at_boundary());
        let out = push(&mut s, b":1}\n\ndata: 2\n\ndata: 3\n");
        assert_eq!(data(&out), vec!["{\"a\":1}", "2"]);
        assert_eq!(&out[0].raw[..], b"data: {\"a\":1}\n\n");
        assert_eq!(&out[1].raw[..], b"data: 2\n\n");
        assert_eq!(data(&push(&mut s, b"\n")), vec!["3"]);
        assert!(s.at_boundary());
    }

    #[test]
    fn crlf_cr_comments_keepalives_and_multiline_data() {
        let mut s = SseScanner::default();
        let out = push(
            &mut s,
            b": ping\r\n\r\ndata: a\r\ndata: b\r\n\r\n\r\nevent: error\rdata: x\r",
        );
        assert_eq!(out.len(), 3, "comment block, event, keep-alive");
        assert_eq!(out[0].event, None);
        assert_eq!(data(&out), vec!["a\nb"]);
        let out = push(&mut s, b"\n\r\n");
        assert_eq!(
            out.iter().map(|b| b.event.clone()).collect::<Vec<_>>(),
            vec![Some(SseEvent {
                kind: "error".into(),
                data: "x".into()
            })]
        );
    }

    #[test]
    fn a_multibyte_character_split_across_chunks_survives() {
        let text = "data: {\"c\":\"héllo 🎉\"}\n\n".as_bytes();
        for cut in 0..text.len() {
            let mut s = SseScanner::default();
            let mut out = s.push(&Bytes::copy_from_slice(&text[..cut]));
            out.extend(s.push(&Bytes::copy_from_slice(&text[cut..])));
            assert_eq!(data(&out), vec!["{\"c\":\"héllo 🎉\"}"], "cut at {cut}");
        }
    }

    #[test]
    fn a_whole_chunk_block_is_not_copied() {
        let mut s = SseScanner::default();
        let chunk = Bytes::from_static(b"data: x\n\n");
        let out = s.push(&chunk);
        assert_eq!(out[0].raw.as_ptr(), chunk.as_ptr());
    }

    const STREAM: &[u8] = b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n: keep-alive\n\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"h\xc3\xa9\"}}]}\r\n\r\nevent: error\r\ndata: {\"error\":1}\r\rdata: [DONE]\n\n";

    proptest! {
        #[test]
        fn any_chunking_gives_the_same_blocks(cuts in proptest::collection::vec(0usize..STREAM.len(), 0..12)) {
            let mut cuts = cuts;
            cuts.sort();
            let whole: Vec<Block> = SseScanner::default().push(&Bytes::from_static(STREAM));
            let mut s = SseScanner::default();
            let mut got = Vec::new();
            let mut from = 0;
            for c in cuts.into_iter().chain([STREAM.len()]) {
                got.extend(s.push(&Bytes::copy_from_slice(&STREAM[from..c])));
                from = c;
            }
            let events = |b: &[Block]| b.iter().filter_map(|b| b.event.clone()).collect::<Vec<_>>();
            prop_assert_eq!(events(&got), events(&whole));
            // Every byte comes out once, in order.
            let joined: Vec<u8> = got.iter().flat_map(|b| b.raw.to_vec()).collect();
            prop_assert_eq!(&joined[..], STREAM);
            prop_assert!(s.at_boundary());
        }
    }
}
