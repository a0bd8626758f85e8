//! Load for fault tests: clients that send streaming and plain chat requests without
//! pause, and a tally of how each request ended, judged against the contract: a
//! complete response or an explicit error, never a silent truncation or a hang.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::{chat, send, Proc};

/// A request's fate.
#[derive(Debug, Default)]
pub struct Tally {
    pub ok: AtomicU64,
    /// An HTTP error status with a JSON error body.
    pub http_error: AtomicU64,
    /// A stream that ended with an SSE error event.
    pub sse_error: AtomicU64,
    /// A plain body the balancer cut (an engine stalled after its head).
    pub cut: AtomicU64,
    /// The client walked away on purpose.
    pub left: AtomicU64,
    /// Failures of the contract: truncated streams, non-JSON errors, hangs, no answer.
    pub broken: Mutex<Vec<String>>,
}

impl Tally {
    /// One line: how many requests ended how.
    pub fn summary(&self) -> String {
        format!(
            "{} requests, {} ok, {} http errors, {} sse errors, {} cut, {} left by the client, {} broken",
            self.total(),
            self.ok.load(Ordering::Relaxed),
            self.http_error.load(Ordering::Relaxed),
            self.sse_error.load(Ordering::Relaxed),
            self.cut.load(Ordering::Relaxed),
            self.left.load(Ordering::Relaxed),
            self.broken.lock().len(),
        )
    }

    /// The contract held: nothing broken or hung, and at least `percent` % of the
    /// requests whole (the rest explicit errors or clients that left).
    pub fn assert_kept(&self, percent: u64) {
        let (ok, total) = (self.ok.load(Ordering::Relaxed), self.total());
        let broken = self.broken.lock();
        assert!(
            broken.is_empty(),
            "{} broken: {:?}",
            broken.len(),
            &broken[..broken.len().min(5)]
        );
        assert!(
            ok * 100 >= total * percent,
            "only {ok} of {total} succeeded with three healthy engines"
        );
    }

    pub fn total(&self) -> u64 {
        [
            &self.ok,
            &self.http_error,
            &self.sse_error,
            &self.cut,
            &self.left,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum::<u64>()
            + self.broken.lock().len() as u64
    }
}

/// xorshift: enough randomness for a schedule, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

pub fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// One client request, classified.
pub async fn one(lb: &Proc, rng: &mut Rng, tally: &Tally) {
    let session = format!("s{}", rng.below(60));
    let stream = rng.below(4) != 0;
    let leave = stream && rng.below(10) == 0;
    let body = serde_json::to_vec(&chat(
        &[("user", &format!("question for {session}"))],
        stream,
        8 + rng.below(32) as u32,
    ))
    .unwrap();
    let url = lb.url("/v1/chat/completions");
    let exchange = async {
        let resp = send(
            "POST",
            &url,
            &[
                ("content-type", "application/json"),
                ("x-session-id", &session),
            ],
            body,
        )
        .await;
        let status = resp.status();
        let mut body = resp.into_body();
        if leave && status == 200 {
            let _ = http_body_util::BodyExt::frame(&mut body).await;
            tally.left.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let bytes = http_body_util::BodyExt::collect(body)
            .await
            .map(|b| b.to_bytes());
        let text = bytes
            .as_ref()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default();
        let fate = match (status.as_u16(), stream, &bytes) {
            (200, true, Ok(_)) if text.ends_with("data: [DONE]\n\n") => &tally.ok,
            (200, true, Ok(_)) if text.contains("data: {\"error\"") => &tally.sse_error,
            (200, false, Ok(_)) if text.contains("\"choices\"") => &tally.ok,
            (200, false, Err(_)) => &tally.cut,
            (s, _, Ok(_)) if s >= 400 && text.contains("\"error\"") => &tally.http_error,
            (s, _, r) => {
                tally.broken.lock().push(format!(
                    "status {s}, stream {stream}, body {:?}: {}",
                    r.as_ref().err(),
                    text.chars().rev().take(120).collect::<String>()
                ));
                return;
            }
        };
        fate.fetch_add(1, Ordering::Relaxed);
    };
    // Longest legitimate wait: three attempts' first-token budgets plus the stream.
    if tokio::time::timeout(Duration::from_secs(15), exchange)
        .await
        .is_err()
    {
        tally
            .broken
            .lock()
            .push(format!("hung past 15 s (stream {stream})"));
    }
}
