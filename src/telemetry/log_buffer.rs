//! The log's writer: stderr, with each serving thread's lines gathered in a buffer of
//! its own and written in one `write` when the thread runs out of work (its runtime
//! parks it), when the buffer fills, or with the first line a second after the oldest
//! one gathered (so a thread busy for long does not sit on its lines while it logs).
//! At tens of thousands of requests a second the request line (one per request at
//! `info`) otherwise costs a `write` each, with the threads taking turns on stderr's
//! lock; gathered, it costs one write per batch, and a thread that idles between
//! requests still writes each line as its request ends.
//!
//! Only threads that ask for it buffer ([`buffer_this_thread`], called as a runtime's
//! worker wakes); every other thread (the main thread, blocking-pool threads) writes
//! each line straight through. Order is kept within a thread; across threads a line
//! may reach stderr up to one batch after a line stamped later (each line carries its
//! own time). A thread's buffer is written out when the thread ends, unwinding
//! included.

use std::cell::RefCell;
use std::io::{self, Write};
use std::time::{Duration, Instant};

use tracing_subscriber::fmt::MakeWriter;

/// Bytes gathered before a busy thread writes them out (about 80 request lines).
const BATCH: usize = 16 * 1024;

/// The longest a gathered line waits for a busy thread's next line to take it out.
const HOLD: Duration = Duration::from_secs(1);

/// One thread's gathered lines and when the oldest was gathered; written out when
/// dropped (the thread ends).
struct Batch {
    lines: Vec<u8>,
    since: Option<Instant>,
}

impl Batch {
    /// Adds a line; writes the batch out when [`due`] says so.
    fn gather(&mut self, line: &[u8]) {
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        self.lines.extend_from_slice(line);
        if due(self.lines.len(), since, now) {
            self.write_out();
        }
    }

    fn write_out(&mut self) {
        write_out(&mut self.lines);
        self.since = None;
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.write_out();
    }
}

/// Whether a batch of `len` bytes, the oldest gathered at `since`, goes out `now`.
fn due(len: usize, since: Instant, now: Instant) -> bool {
    len >= BATCH || now.saturating_duration_since(since) >= HOLD
}

thread_local! {
    static BATCH_OF_THREAD: RefCell<Option<Batch>> = const { RefCell::new(None) };
}

fn write_out(lines: &mut Vec<u8>) {
    if !lines.is_empty() {
        // A log that cannot be written has nowhere to report it.
        let _ = io::stderr().lock().write_all(lines);
        lines.clear();
    }
}

/// From now on this thread's log lines are gathered until [`flush_this_thread`] (or
/// a full batch). Cheap to call again.
pub fn buffer_this_thread() {
    let _ = BATCH_OF_THREAD.try_with(|b| {
        let mut b = b.borrow_mut();
        if b.is_none() {
            *b = Some(Batch {
                lines: Vec::with_capacity(BATCH),
                since: None,
            });
        }
    });
}

/// Writes out this thread's gathered lines, if any.
pub fn flush_this_thread() {
    let _ = BATCH_OF_THREAD.try_with(|b| {
        if let Some(batch) = b.borrow_mut().as_mut() {
            batch.write_out();
        }
    });
}

/// The `tracing_subscriber` writer of the log: stderr, through this thread's batch if
/// it has one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stderr;

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line
    }
}

/// One log line on its way out (`tracing_subscriber` writes a line in one call).
#[derive(Debug)]
pub struct Line;

impl Write for Line {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let gathered = BATCH_OF_THREAD
            .try_with(|b| match b.borrow_mut().as_mut() {
                Some(batch) => {
                    batch.gather(data);
                    true
                }
                None => false,
            })
            .unwrap_or(false);
        if !gathered {
            io::stderr().lock().write_all(data)?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_goes_out_when_full_or_a_second_old() {
        let t0 = Instant::now();
        assert!(!due(100, t0, t0));
        assert!(!due(BATCH - 1, t0, t0 + Duration::from_millis(999)));
        assert!(due(BATCH, t0, t0));
        assert!(due(1, t0, t0 + HOLD));
        // A clock read before the batch's start (another core's) is not old.
        assert!(!due(1, t0 + HOLD, t0));
    }
}
