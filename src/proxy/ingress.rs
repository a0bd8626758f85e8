//! Reading a client's request safely: the content type a JSON API needs, a body read
//! bounded in size (`max_body_bytes`), in time (`body_read_timeout`) and, across all
//! connections at once, by a byte budget (`max_buffered_bytes`), so a crowd of large or
//! slow bodies gets 503s instead of exhausting memory. No buffer is sized by what the
//! client merely declares.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::request_body::RequestBody;
use bytes::{Bytes, BytesMut};
use http::header;
use http_body_util::BodyExt;

use super::ProxyError;
use crate::clip::clip;
use crate::routing::facts::KeyError;
use crate::routing::form;
use crate::routing::table::PlaceError;

/// The largest buffer allocated before the body's bytes have arrived.
const INITIAL_BUFFER: usize = 64 * 1024;

/// Request bytes buffered across all connections.
#[derive(Debug, Default)]
pub struct ByteBudget {
    used: AtomicUsize,
}

impl ByteBudget {
    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// An empty claim on the budget.
    pub fn claim(self: &Arc<Self>) -> BudgetClaim {
        BudgetClaim {
            budget: self.clone(),
            held: 0,
        }
    }
}

/// Bytes of one request counted against the [`ByteBudget`], given back when dropped
/// (when the request is done with its body: answered, failed, or its client left).
#[derive(Debug)]
pub struct BudgetClaim {
    budget: Arc<ByteBudget>,
    held: usize,
}

impl BudgetClaim {
    /// Grows the claim to `total` bytes if the budget (`limit`) allows it.
    pub fn grow_to(&mut self, total: usize, limit: usize) -> bool {
        let more = total.saturating_sub(self.held);
        if more == 0 {
            return true;
        }
        let took = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|&u| u <= limit)
            })
            .is_ok();
        if took {
            self.held += more;
        }
        took
    }
}

impl Drop for BudgetClaim {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
    }
}

/// Limits of one body read.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// `max_body_bytes`.
    pub max_bytes: usize,
    /// `body_read_timeout`.
    pub timeout: Duration,
    /// `max_buffered_bytes`.
    pub budget: usize,
}

/// JSON APIs take `application/json` (or a `+json` type); a missing content-type is
/// accepted, as engines do.
pub fn check_json_content_type(headers: &http::HeaderMap) -> Result<(), ProxyError> {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let ct = ct.to_str().unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    let tail = essence.len().saturating_sub(5);
    let json = essence.eq_ignore_ascii_case("application/json")
        || essence.as_bytes()[tail..].eq_ignore_ascii_case(b"+json");
    if json {
        Ok(())
    } else {
        Err(ProxyError::UnsupportedMediaType {
            got: clip(essence),
            want: "application/json",
        })
    }
}

/// An upload (OpenAI's audio APIs) takes `multipart/form-data` with its boundary.
pub fn check_form_content_type(headers: &http::HeaderMap) -> Result<(), ProxyError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?"));
    match ct.and_then(form::boundary) {
        Some(_) => Ok(()),
        None => Err(ProxyError::UnsupportedMediaType {
            got: clip(ct.unwrap_or("(none)")),
            want: "multipart/form-data with a boundary",
        }),
    }
}

/// A form's body opens with the boundary its content type names (else the engine
/// would read other parts than the ones it was routed by).
pub fn check_form_boundary(headers: &http::HeaderMap, body: &[u8]) -> Result<(), ProxyError> {
    let named = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(form::boundary);
    let refused = |e| ProxyError::Place(PlaceError::Key(KeyError::Form(e)));
    let opened = form::opening(body).map_err(refused)?;
    if named.map(str::as_bytes) != Some(opened) {
        return Err(refused(form::FormError::OtherBoundary));
    }
    Ok(())
}

/// The body must come as it is meant to be read: a compressed body (`Content-Encoding`
/// other than `identity`) cannot be routed by its prompt, and engines read plain JSON.
pub fn check_identity_encoding(headers: &http::HeaderMap) -> Result<(), ProxyError> {
    match headers.get(header::CONTENT_ENCODING) {
        None => Ok(()),
        Some(v) => {
            let v = v.to_str().unwrap_or("?").trim();
            if v.is_empty() || v.eq_ignore_ascii_case("identity") {
                Ok(())
            } else {
                Err(ProxyError::UnsupportedEncoding(clip(v)))
            }
        }
    }
}

/// Reads a whole request body within `limits` (its time counted from `started`, when
/// the request's head came), counting it in `claim`.
pub async fn read_body(
    body: RequestBody,
    headers: &http::HeaderMap,
    limits: BodyLimits,
    started: tokio::time::Instant,
    claim: &mut BudgetClaim,
) -> Result<Bytes, ProxyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_bytes as u64) {
        discard_body(body, limits.max_bytes).await;
        return Err(ProxyError::BodyTooLarge {
            limit: limits.max_bytes,
        });
    }
    let declared = declared.unwrap_or(0) as usize;
    // Claim the declared size at once, so a crowd of large uploads meets the budget
    // before their bytes arrive.
    if !claim.grow_to(declared, limits.budget) {
        return Err(ProxyError::BufferFull);
    }
    let read = read_within(body, declared, limits, claim);
    match tokio::time::timeout_at(started + limits.timeout, read).await {
        Ok(result) => result,
        Err(_) => Err(ProxyError::BodyTimeout {
            after_ms: limits.timeout.as_millis(),
        }),
    }
}

async fn read_within(
    mut body: RequestBody,
    declared: usize,
    limits: BodyLimits,
    claim: &mut BudgetClaim,
) -> Result<Bytes, ProxyError> {
    // A body that arrives in one frame (most do) is kept as it came, not copied.
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ProxyError::BodyRead(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let held = first.as_ref().map_or(0, Bytes::len) + buf.len();
        let total = held + data.len();
        if total > limits.max_bytes {
            discard_body(body, limits.max_bytes).await;
            return Err(ProxyError::BodyTooLarge {
                limit: limits.max_bytes,
            });
        }
        if !claim.grow_to(total, limits.budget) {
            return Err(ProxyError::BufferFull);
        }
        if held == 0 {
            first = Some(data);
            continue;
        }
        if let Some(f) = first.take() {
            buf.reserve(declared.clamp(total, INITIAL_BUFFER.max(total)));
            buf.extend_from_slice(&f);
        }
        buf.extend_from_slice(&data);
    }
    Ok(match first {
        Some(only) => only,
        None => buf.freeze(),
    })
}

/// Reads and drops the rest of an oversized body (up to 4 × the limit, for at most
/// 10 s) so that the client, still sending, can read our 413 instead of a broken pipe.
pub async fn discard_body(mut body: RequestBody, limit: usize) {
    let cap = limit.saturating_mul(4);
    let drain = async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > cap {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(10), drain).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_share_the_budget_and_give_it_back() {
        let budget = Arc::new(ByteBudget::default());
        let mut a = budget.claim();
        let mut b = budget.claim();
        assert!(a.grow_to(600, 1000));
        assert!(!b.grow_to(500, 1000), "600 + 500 > 1000");
        assert!(b.grow_to(400, 1000));
        assert!(a.grow_to(600, 1000), "no growth, no new claim");
        assert_eq!(budget.used(), 1000);
        drop(a);
        assert_eq!(budget.used(), 400);
        drop(b);
        assert_eq!(budget.used(), 0);
    }
}
