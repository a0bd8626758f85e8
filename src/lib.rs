//! prefixlb: a prefix-affinity load balancer for self-hosted LLM inference fleets.
//!
//! Each request's key (the conversation after the prompt prefix its pool's traffic
//! shares, learned from the traffic) is hashed onto its pool's nodes, so the engine
//! that already holds its prefix in its KV cache serves it: a conversation lives on
//! one engine, and a shared prefix gathers on a few. Bounded loads cap each engine's
//! in-flight requests; the overflow spills to the key's next node, or waits for its
//! home when that is cheaper than a cold prefill elsewhere. A breaker per engine judges
//! its time to first token against the work and its peers.
//!
//! The layers, top down (an arrow only points down): [`server`] (the process and
//! control plane) and [`fleet`] (membership from Redis heartbeats), [`proxy`] (the data
//! plane), [`telemetry`] (metrics and outcome labels), [`routing`] (the core: no I/O),
//! [`config`] (the TOML file, validated); with the `tools` feature, [`tools`]
//! (simulator, load generator, demo, engine emulator) above them all. [`clip`],
//! [`decimal`] and [`name_hash`] are leaves any layer may use.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod clip;
pub mod config;
pub mod decimal;
pub mod engine_load;
pub mod fleet;
pub mod name_hash;
pub mod proxy;
pub mod routing;
pub mod server;
pub mod telemetry;
#[cfg(feature = "tools")]
pub mod tools;
