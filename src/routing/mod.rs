//! The routing core, synchronous and free of I/O: what a request is ([`facts`]), its
//! key and hashes ([`key`]), the ring ([`ring`]) and prefix groups ([`group`]), each
//! node's breaker ([`breaker`]), what its latency means ([`latency`]) and its runtime
//! state ([`node`]), the bounded-load walk ([`walk`]) and the placement of a
//! conversation ([`place`]), which engine holds each stored response ([`stored`]), the immutable routing snapshot ([`table`]), the one entry
//! point of a decision and the ticket that carries it to its end ([`decision`]), and the
//! explanation of one decision ([`explain`]).
//!
//! Time comes in as an argument (`now`); nothing here reads a clock. The only
//! runtime pieces are atomics and locks, `tokio::sync::Notify` to wake requests waiting
//! for a slot, and `tracing` for the breaker's flips.

pub mod breaker;
mod canonical;
pub mod cost;
pub mod decision;
pub mod explain;
pub mod facts;
pub mod fair;
pub mod form;
pub mod group;
pub mod home;
pub mod json_scan;
pub mod key;
mod key_text;
pub mod latency;
pub mod node;
pub mod place;
pub mod prefix;
pub mod ring;
pub mod route;
pub mod stored;
pub mod table;
mod ttft_window;
pub mod walk;

/// Whether a decision counts. A request being routed (`Route`) is counted in its
/// pool's prefix and group tables, reserves a slot and teaches the pool what it finds;
/// `Replay` does the same on the simulator's virtual clock, where latency is not judged
/// (its engines never slow down alone); an explanation (`Explain`) reads everything
/// and changes nothing, so it names the node the next request would get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Route,
    Replay,
    Explain,
}

impl Mode {
    /// Whether the decision is counted in the pool's tables.
    pub fn counts(self) -> bool {
        self != Mode::Explain
    }
}
