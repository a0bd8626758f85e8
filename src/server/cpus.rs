//! Serving threads pinned to CPUs (`server.pin_threads`): each serving lane, or each
//! worker of the shared runtime when there are no lanes, runs on one CPU of its own,
//! the n-th of the CPUs the process may run on (as `taskset` or a cpuset left them),
//! round again past the last. By default (`"auto"`) only when the serving threads
//! cover those CPUs: with CPUs to spare (a container with a CPU quota on a large
//! host) the scheduler has somewhere else to put a thread, and two threads pinned to
//! the host's first CPUs would share them with whatever else the kernel puts there.
//!
//! Unpinned, the kernel at times stacked two busy serving threads of a 2-core host on
//! one core, where they took turns a scheduler tick (4 ms) at a time while the other
//! core ran the engines and the client; every request of the waiting thread waited
//! with it. The 1 KB p99 at 32 connections fell from 2-4 ms to HAProxy's 1-2 ms once
//! pinned (docs/performance.md, "A tenth sitting").

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::config::PinThreads;

/// The CPUs this thread may run on (the process's, unless something pinned the
/// thread); empty where they cannot be read.
pub fn allowed() -> Vec<usize> {
    core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|core| core.id)
        .collect()
}

/// The CPUs `threads` serving threads are pinned over (none: not pinned), given the
/// CPUs the process may run on.
pub fn chosen(pin: PinThreads, threads: usize, allowed: Vec<usize>) -> Vec<usize> {
    match pin {
        PinThreads::Always => allowed,
        PinThreads::Auto if threads >= allowed.len() => allowed,
        PinThreads::Auto | PinThreads::Never => Vec::new(),
    }
}

/// How many workers the shared runtime starts: tokio's choice (`TOKIO_WORKER_THREADS`,
/// else the CPUs available, quotas counted).
pub fn shared_workers() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1)
}

/// The CPU of the `n`-th serving thread: the n-th allowed one, round again past the
/// last; none when none are known.
pub fn nth(n: usize, allowed: &[usize]) -> Option<usize> {
    match allowed.len() {
        0 => None,
        len => Some(allowed[n % len]),
    }
}

/// Pins the calling thread to `cpu`; says so in the log when the kernel refuses (the
/// thread then runs where the scheduler puts it).
pub fn pin_this_thread(cpu: usize, thread: &str) {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        tracing::warn!(
            thread,
            cpu,
            "cannot pin a serving thread to its CPU; it runs unpinned"
        );
    }
}

/// Pins a runtime's worker threads, each to the next CPU, on each worker's first park
/// (the runtime has no hook that runs on its workers alone at start; its blocking
/// threads never park, so they are left unpinned).
#[derive(Debug)]
pub struct Workers {
    cpus: Vec<usize>,
    next: AtomicUsize,
}

thread_local! {
    static PINNED: Cell<bool> = const { Cell::new(false) };
}

impl Workers {
    pub fn new(cpus: Vec<usize>) -> Workers {
        Workers {
            cpus,
            next: AtomicUsize::new(0),
        }
    }

    /// Pins the calling worker, the first time it is called on that thread.
    pub fn pin_once(&self) {
        if PINNED.replace(true) {
            return;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        if let Some(cpu) = nth(n, &self.cpus) {
            pin_this_thread(cpu, "worker");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{chosen, nth};
    use crate::config::PinThreads;

    #[test]
    fn each_thread_takes_the_next_allowed_cpu_round_again_past_the_last() {
        let of = |allowed: &[usize], n| (0..n).map(|i| nth(i, allowed)).collect::<Vec<_>>();
        assert_eq!(of(&[4, 6], 2), [Some(4), Some(6)]);
        assert_eq!(of(&[0, 1], 3), [Some(0), Some(1), Some(0)]);
        // The CPUs could not be read: the threads run unpinned.
        assert_eq!(of(&[], 2), [None, None]);
    }

    #[test]
    fn auto_pins_only_threads_that_cover_the_cpus() {
        let two = || vec![0, 1];
        assert_eq!(chosen(PinThreads::Auto, 2, two()), [0, 1]);
        assert_eq!(chosen(PinThreads::Auto, 3, two()), [0, 1]);
        // CPUs to spare: left to the scheduler, unless asked.
        assert_eq!(chosen(PinThreads::Auto, 1, two()), [0usize; 0]);
        assert_eq!(chosen(PinThreads::Always, 1, two()), [0, 1]);
        assert_eq!(chosen(PinThreads::Never, 2, two()), [0usize; 0]);
    }
}
