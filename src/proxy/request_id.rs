//! The request's id, in `x-request-id`: the client's when it sent one that is 1 to 128
//! visible ASCII characters, else a new one (`prefixlb-` and 32 hex digits; one that
//! is not such is replaced). It goes to the engine with the request (vLLM makes it its
//! own request's id, so its log names it; both legs of a disaggregated request carry
//! it), comes back in the answer's `x-request-id` (the
//! OpenAI SDKs' `_request_id`; on Anthropic's API in its `request-id` too, which its
//! SDK reads), errors and early keep-alive heads included, and is in every log line of
//! the request (`request_id`). `server.request_ids = false`: none of this.

use std::cell::Cell;
use std::hash::BuildHasher;

use http::{HeaderMap, HeaderName, HeaderValue};

use super::headers::X_REQUEST_ID;
use crate::routing::facts::Api;

/// The longest client id taken as it is.
const MAX_CHARS: usize = 128;

/// A request's id, and whether the balancer made it (then it is written to the
/// engine apart from the client's fields: [`super::headers::UpstreamHeaders`]).
#[derive(Debug, Clone)]
pub struct RequestId {
    pub value: HeaderValue,
    pub made: bool,
}

/// The request's id: the client's if it is one, else a new one (a client's field that
/// is not an id is taken out of `headers`). One lookup of the field: a header name of
/// its own is hashed at each, and this runs for every request.
pub fn settle(headers: &mut HeaderMap) -> RequestId {
    match headers.get(&X_REQUEST_ID) {
        Some(id) if is_id(id.as_bytes()) => {
            return RequestId {
                value: id.clone(),
                made: false,
            }
        }
        Some(_) => drop(headers.remove(&X_REQUEST_ID)),
        None => {}
    }
    RequestId {
        value: new(),
        made: true,
    }
}

/// Anthropic's name for it, which its SDK reads (`_request_id`, `APIError.request_id`).
static ANTHROPIC: HeaderName = HeaderName::from_static("request-id");

/// The headers that tell the id in an answer: `x-request-id`, and on Anthropic's API
/// its `request-id` too.
pub fn headers(id: &HeaderValue, api: Api) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
    let anthropic = api.is_anthropic().then(|| (ANTHROPIC.clone(), id.clone()));
    std::iter::once((X_REQUEST_ID.clone(), id.clone())).chain(anthropic)
}

/// Tells the id in an answer's `headers` ([`headers`]).
pub fn tell(headers: &mut HeaderMap, id: &HeaderValue, api: Api) {
    for (name, value) in self::headers(id, api) {
        headers.insert(name, value);
    }
}

/// The id as log text.
pub fn text(id: &HeaderValue) -> &str {
    id.to_str().unwrap_or_default()
}

fn is_id(bytes: &[u8]) -> bool {
    (1..=MAX_CHARS).contains(&bytes.len()) && bytes.iter().all(|b| b.is_ascii_graphic())
}

thread_local! {
    /// This thread's 64 random bits and its count of ids made: each id is both.
    static MADE: Cell<(u64, u64)> = Cell::new((std::collections::hash_map::RandomState::new().hash_one(0u8), 0));
}

/// A new id: `prefixlb-` and 32 hex digits, a random half per thread and its count
/// (unique within a thread; across threads and processes as 64 random bits are).
fn new() -> HeaderValue {
    let (random, n) = MADE.with(|m| {
        let (random, n) = m.get();
        m.set((random, n.wrapping_add(1)));
        (random, n)
    });
    let mut id = *b"prefixlb-00000000000000000000000000000000";
    // The count spread over its 64 bits (an odd multiplier: still one id per count),
    // so that ids do not read as a run of zeros.
    let spread = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for (at, mut word) in [(9, random), (25, spread)] {
        for i in (at..at + 16).rev() {
            id[i] = b"0123456789abcdef"[(word & 0xf) as usize];
            word >>= 4;
        }
    }
    HeaderValue::from_bytes(&id).expect("hex digits are a header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_id_is_kept_and_a_missing_or_bad_one_made() {
        let mut h = HeaderMap::new();
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("req_abc-123"));
        let id = settle(&mut h);
        assert_eq!(
            (id.value.to_str().unwrap(), id.made),
            ("req_abc-123", false)
        );
        assert_eq!(h[&X_REQUEST_ID], "req_abc-123", "passed on as it came");
        for bad in ["", "has space", &"x".repeat(129)] {
            let mut h = HeaderMap::new();
            h.insert(&X_REQUEST_ID, HeaderValue::from_str(bad).unwrap());
            let id = settle(&mut h);
            assert!(
                id.made && text(&id.value).starts_with("prefixlb-"),
                "{bad:?} → {id:?}"
            );
            assert!(h.get(&X_REQUEST_ID).is_none(), "the client's taken out");
        }
        let mut h = HeaderMap::new();
        h.insert(
            &X_REQUEST_ID,
            HeaderValue::from_str(&"x".repeat(128)).unwrap(),
        );
        assert_eq!(text(&settle(&mut h).value).len(), 128);
    }

    #[test]
    fn made_ids_are_hex_and_differ() {
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| text(&settle(&mut HeaderMap::new()).value).to_string())
            .collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            let hex = id.strip_prefix("prefixlb-").unwrap();
            assert_eq!(hex.len(), 32);
            assert!(hex
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        }
        let other = std::thread::spawn(|| text(&new()).to_string())
            .join()
            .unwrap();
        assert_ne!(
            other[9..25],
            ids.iter().next().unwrap()[9..25],
            "another thread's half"
        );
    }
}
