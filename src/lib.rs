//! prefixlb: a prefix-affinity load balancer for self-hosted LLM inference fleets.
//!
//! Requests are placed on a consistent-hash ring by an xxh3 hash of their prompt
//! prefix, so the engine that already holds a prefix in its KV cache serves it;
//! bounded loads cap each engine's in-flight requests and spill clockwise.
//!
//! The layers: [`config`] (the TOML file, validated), [`routing`] (the pure core),
//! [`proxy`] (the data plane), [`server`] (the process and control plane), and, with
//! the `tools` feature, [`tools`] (simulator, load generator, demo, engine emulator).

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod clip;
pub mod config;
pub mod fleet;
pub mod proxy;
pub mod routing;
pub mod server;
#[cfg(feature = "tools")]
pub mod tools;
