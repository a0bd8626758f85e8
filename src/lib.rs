//! prefixlb: a prefix-affinity load balancer for self-hosted LLM inference fleets.
//!
//! Requests are placed on a consistent-hash ring by an xxh3 hash of their prompt
//! prefix, so the engine that already holds a prefix in its KV cache serves it;
//! bounded loads cap each engine's in-flight requests and spill clockwise.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod admin;
pub mod balance;
pub mod bench;
pub mod body;
pub mod breaker;
pub mod config;
pub mod demo;
pub mod engine_model;
pub mod explain;
pub mod group;
pub mod health;
pub mod json_scan;
pub mod key;
pub mod metrics;
pub mod mock_engine;
pub mod proxy;
pub mod ring;
pub mod serve;
pub mod server;
pub mod sim;
pub mod table;
