//! The one response body type of every listener (the balancer, the admin API,
//! `mock-engine`): [`BoxBody`], and [`full`] for a complete body.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

/// The error type every response body may end with.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The one response body type.
pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BodyError>;

/// A complete body.
pub fn full(bytes: impl Into<Bytes>) -> BoxBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}
