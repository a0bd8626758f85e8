//! A serving thread (a lane, or a worker of the shared runtime) that has run for
//! `server.yield_after` without running out of work offers its CPU to any other
//! thread waiting for it (`sched_yield`) before its next request. A serving thread
//! under load never sleeps, and one pinned to its CPU cannot move: without this, a
//! thread woken on that CPU (the engine's, a sidecar's, the load generator's in a
//! benchmark) waits for the kernel's next tick, 4 ms on a kernel built with `HZ=250`,
//! and so do the requests behind it. With no other thread waiting, the call returns at
//! once. The stretch starts each time the thread's runtime wakes from waiting for work
//! (its unpark hook), so a thread with idle moments never yields. Evidence:
//! docs/performance.md, "A twelfth sitting".

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// When this thread last woke from waiting for work.
    static AWAKE_SINCE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// This thread's runtime woke from waiting for work: a new stretch starts (the
/// runtime's `on_thread_unpark` hook).
pub fn woke() {
    AWAKE_SINCE.with(|s| s.set(Some(Instant::now())));
}

/// Whether a stretch that started at `since` has run `limit` by `now` (a zero limit
/// never has).
pub fn due(since: Instant, now: Instant, limit: Duration) -> bool {
    !limit.is_zero() && now.saturating_duration_since(since) >= limit
}

/// Before a request: yields the CPU once if this thread's stretch has run `limit`, and
/// starts a new one. Returns whether it yielded. A thread whose runtime has no unpark
/// hook (no stretch ever started: an embedding's own runtime) never yields.
fn before_request(limit: Duration) -> bool {
    if limit.is_zero() {
        return false;
    }
    AWAKE_SINCE.with(|s| match s.get() {
        Some(since) if due(since, Instant::now(), limit) => {
            std::thread::yield_now();
            s.set(Some(Instant::now()));
            true
        }
        _ => false,
    })
}

/// [`before_request`], counting a yield in `yields` (`prefixlb_lane_yields_total`).
pub fn before_request_counted(limit: Duration, yields: &prometheus::IntCounter) {
    if before_request(limit) {
        yields.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stretch_is_due_once_it_has_run_the_limit() {
        let t = Instant::now();
        let limit = Duration::from_micros(500);
        assert!(!due(t, t, limit));
        assert!(!due(t, t + Duration::from_micros(499), limit));
        assert!(due(t, t + limit, limit));
        assert!(due(t, t + Duration::from_millis(4), limit));
        // A clock read before the stretch began is not a stretch run.
        assert!(!due(t + limit, t, limit));
        // Zero: never.
        assert!(!due(t, t + Duration::from_secs(1), Duration::ZERO));
    }

    #[test]
    fn a_busy_thread_yields_every_limit_and_a_woken_one_starts_again() {
        let limit = Duration::from_millis(100);
        std::thread::spawn(move || {
            // No stretch started (a runtime without the hook): never.
            assert!(!before_request(limit));
            std::thread::sleep(limit);
            assert!(!before_request(limit), "no hook, no stretch, no yield");
            woke();
            assert!(!before_request(limit), "a stretch just begun");
            std::thread::sleep(limit);
            assert!(before_request(limit), "the stretch ran the limit");
            assert!(!before_request(limit), "the yield started a new stretch");
            std::thread::sleep(limit);
            woke();
            assert!(!before_request(limit), "waking started a new stretch");
            assert!(!before_request(Duration::ZERO), "zero never yields");
        })
        .join()
        .unwrap();
    }
}
