//! What the balancer tells operators, below the data plane and the control plane that
//! feed it: the Prometheus metrics ([`metrics`]: one registry, and the families each
//! component updates, handed to it at construction; [`series`]: a node's per-request
//! series, counted per serving thread with [`per_thread`] and added up at scrape), the
//! vocabulary of a request's end in logs and labels ([`outcome`]), the log's writer
//! ([`log_buffer`]: each serving thread's lines gathered and written when it idles;
//! [`log_fields`]: their fields written without `core::fmt` where it can;
//! [`log_json`]: JSON lines written directly; [`log_time`]: their timestamps, the
//! second kept per thread), and OpenTelemetry traces ([`traces`]).

pub mod log_buffer;
pub mod log_fields;
pub mod log_json;
#[cfg(test)]
mod log_samples;
pub mod log_time;
pub mod metrics;
pub mod outcome;
pub mod per_thread;
pub mod series;
pub mod traces;
