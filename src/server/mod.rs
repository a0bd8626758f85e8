//! The process and control plane: the HTTP listener and its limits ([`listener`]),
//! `prefixlb serve` ([`serve`]) with its reload triggers ([`reload`]), the admin API
//! ([`admin`]), active health checks ([`health`]) and the Prometheus metrics
//! ([`metrics`]).

pub mod admin;
pub mod health;
pub mod listener;
pub mod metrics;
pub mod reload;
pub mod serve;
