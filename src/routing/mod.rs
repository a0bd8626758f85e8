//! The routing core, pure and synchronous (no I/O; clocks are passed in): what a
//! request is ([`facts`]), its key and hashes ([`key`]), the ring ([`ring`]) and prefix
//! groups ([`group`]), each node's breaker ([`breaker`]) and what its latency means ([`latency`]) and runtime state ([`node`]),
//! the bounded-load walk ([`walk`]), the immutable routing snapshot ([`table`]), and
//! the explanation of one decision ([`explain`]).

pub mod breaker;
pub mod cost;
pub mod explain;
pub mod facts;
pub mod group;
pub mod home;
pub mod json_scan;
pub mod key;
mod key_text;
pub mod latency;
pub mod node;
pub mod prefix;
pub mod ring;
pub mod route;
pub mod table;
mod ttft_window;
pub mod walk;
