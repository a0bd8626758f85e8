//! The request's id, in `x-request-id`: the client's when it sent one that is 1 to 128
//! visible ASCII characters, else a new one (`prefixlb-` and 32 hex digits; one that
//! is not such is replaced). It goes to the engine with the request (vLLM and SGLang
//! make it their own request's id, so their logs name it; both legs of a
//! disaggregated request carry it), comes back in the answer's `x-request-id` (the
//! OpenAI SDKs' `_request_id`), errors and early keep-alive heads included, and is in
//! every log line of the request (`request_id`).

use std::cell::Cell;
use std::hash::BuildHasher;

use http::{HeaderMap, HeaderValue};

use super::headers::X_REQUEST_ID;

/// The longest client id taken as it is.
const MAX_CHARS: usize = 128;

/// The request's id: the client's if it is one, else a new one written into
/// `headers` (so the engine gets it).
pub fn settle(headers: &mut HeaderMap) -> HeaderValue {
    if let Some(id) = headers.get(&X_REQUEST_ID).filter(|v| is_id(v.as_bytes())) {
        return id.clone();
    }
    let id = new();
    headers.insert(X_REQUEST_ID.clone(), id.clone());
    id
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
    for (at, mut word) in [(9, random), (25, n)] {
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
        assert_eq!(settle(&mut h), "req_abc-123");
        for bad in ["", "has space", &"x".repeat(129)] {
            let mut h = HeaderMap::new();
            h.insert(&X_REQUEST_ID, HeaderValue::from_str(bad).unwrap());
            let id = settle(&mut h);
            assert!(text(&id).starts_with("prefixlb-"), "{bad:?} → {id:?}");
            assert_eq!(h.get_all(&X_REQUEST_ID).iter().collect::<Vec<_>>(), [&id]);
        }
        let mut h = HeaderMap::new();
        h.insert(
            &X_REQUEST_ID,
            HeaderValue::from_str(&"x".repeat(128)).unwrap(),
        );
        assert_eq!(text(&settle(&mut h)).len(), 128);
    }

    #[test]
    fn made_ids_are_hex_and_differ() {
        let ids: std::collections::HashSet<String> = (0..1000)
            .map(|_| text(&settle(&mut HeaderMap::new())).to_string())
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
