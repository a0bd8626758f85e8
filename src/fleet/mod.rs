//! Dynamic fleets: membership from heartbeats in Redis, and only heartbeats, or from
//! the addresses of DNS names ([`dns`]).
//! Engines heartbeat through `prefixlb agent` ([`agent`]); each `serve` replica reads
//! membership and heartbeats itself ([`watcher`]), in a task of its own: no routing
//! decision ever waits on Redis or reads routing state from it, and a Redis outage
//! freezes membership as last known ("fail static"). What is stored and how it
//! becomes nodes is pure ([`record`]); the Redis calls are in [`store`]. The watcher
//! feeds the control plane through a trait ([`watcher::Members`]): nothing here
//! depends on the data plane or on how the balancer is served.

pub mod agent;
pub mod dns;
pub mod record;
pub mod store;
pub mod watcher;
