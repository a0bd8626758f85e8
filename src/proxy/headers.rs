//! Header rules: hop-by-hop headers are stripped in both directions (RFC 9110 §7.6.1),
//! the client's address is appended to `x-forwarded-for`, and everything else (the
//! client's `Authorization` included, unless `auth.strip`) passes through unchanged.

use std::net::{IpAddr, SocketAddr};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Connection-specific headers that a proxy must not forward (RFC 9110 §7.6.1, plus
/// the legacy `proxy-connection` and `keep-alive`).
static HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Balancer response headers.
pub static NODE: HeaderName = HeaderName::from_static("x-prefixlb-node");
pub static ROUTE: HeaderName = HeaderName::from_static("x-prefixlb-route");
pub static ATTEMPTS: HeaderName = HeaderName::from_static("x-prefixlb-attempts");
/// The id both legs of a disaggregated request carry (the client's, if it sent one).
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// On a disaggregated request's answer: the node of its prefill leg (`x-prefixlb-node`
/// names its decode leg's).
pub static PREFILL_NODE: HeaderName = HeaderName::from_static("x-prefixlb-prefill-node");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// Anthropic's API key header.
pub static X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
/// The data-parallel rank a request is for (vLLM reads it): the balancer's
/// to set for a node that is one rank ([`crate::config::NodeConfig::ranks`]), never
/// the client's to pass on.
pub static X_DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");
/// SGLang's header for the same, which it reads over [`X_DATA_PARALLEL_RANK`] when
/// started with `SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`: never the client's to pass
/// on either.
static X_OVERRIDE_ROUTED_DP_RANK: HeaderName = HeaderName::from_static("x-override-routed-dp-rank");

/// A small count as a header value, without formatting (or allocating) the usual ones.
pub fn count_value(n: u32) -> HeaderValue {
    const SMALL: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match SMALL.get(n as usize) {
        Some(s) => HeaderValue::from_static(s),
        None => HeaderValue::from(n),
    }
}

/// The items of a comma-separated list header (`Connection`, `Transfer-Encoding`),
/// trimmed, empty ones skipped, over every line of it; values that are not text are
/// passed over.
pub fn list_items<'h>(
    headers: &'h HeaderMap,
    name: &HeaderName,
) -> impl DoubleEndedIterator<Item = &'h str> + 'h {
    headers
        .get_all(name)
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|item| !item.is_empty())
}

/// Whether a header is hop-by-hop (one of the nine; not those `Connection` names).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    hop_by_hop_index(name.as_str()).is_some()
}

/// Whether a name, in any case, is one of the nine hop-by-hop headers.
pub fn is_hop_by_hop_text(name: &str) -> bool {
    HOP_BY_HOP
        .iter()
        .any(|h| h.as_str().eq_ignore_ascii_case(name))
}

/// The index in [`HOP_BY_HOP`] of a lowercase header name (a `match` on the text:
/// its length, then a compare, instead of nine `HeaderName` comparisons).
fn hop_by_hop_index(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "proxy-authenticate" => 3,
        "proxy-authorization" => 4,
        "te" => 5,
        "trailer" => 6,
        "transfer-encoding" => 7,
        "upgrade" => 8,
        _ => return None,
    })
}

/// The headers sent to an engine: the client's, minus hop-by-hop ones (and any its
/// `Connection` names), `host` (set from the engine URL), `content-length` (set from
/// the body), `x-data-parallel-rank` (where a request runs is the balancer's choice)
/// and, with `strip_auth` (`auth.strip`), `authorization` and `x-api-key`;
/// plus the client's address in `x-forwarded-for`. The client's map is kept as it
/// came and the rules are applied as the head is written ([`UpstreamHeaders::write`]):
/// each removal from a `HeaderMap` would hash its name, on every request.
#[derive(Debug, Default, Clone)]
pub struct UpstreamHeaders {
    /// The client's fields, and any the balancer adds (`traceparent`).
    pub map: HeaderMap,
    strip_auth: bool,
    /// The client's address, for `x-forwarded-for` (none for the balancer's own
    /// requests).
    peer: Option<IpAddr>,
    /// The request's id (none for the balancer's own requests): written as
    /// `x-request-id` after the client's fields when the balancer made it (a client's
    /// own is one of them).
    pub id: Option<super::request_id::RequestId>,
}

impl UpstreamHeaders {
    pub fn new(mut map: HeaderMap, peer: SocketAddr, strip_auth: bool) -> UpstreamHeaders {
        // Names the client's `Connection` lists beyond the nine (rare) go at once, so
        // that nothing read or added later (`x-forwarded-for`, `traceparent`) sees them.
        if map.contains_key(header::CONNECTION) {
            let named: Vec<HeaderName> = list_items(&map, &header::CONNECTION)
                .filter(|item| !is_hop_by_hop_text(item))
                .filter_map(|item| HeaderName::from_bytes(item.as_bytes()).ok())
                .collect();
            for name in &named {
                map.remove(name);
            }
        }
        UpstreamHeaders {
            map,
            strip_auth,
            peer: Some(peer.ip()),
            id: None,
        }
    }

    /// With the request's id, if it has one.
    pub fn with_id(self, id: Option<super::request_id::RequestId>) -> UpstreamHeaders {
        UpstreamHeaders { id, ..self }
    }

    /// Writes the fields that go, as head lines: the client's, in its order, then
    /// `x-forwarded-for`, then `x-request-id` if the balancer made it.
    pub fn write(&self, out: &mut Vec<u8>) {
        for (name, value) in self.map.iter().filter(|(name, _)| self.forwards(name)) {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        self.write_forwarded_for(out);
        if let Some(id) = self.id.as_ref().filter(|id| id.made) {
            out.extend_from_slice(b"x-request-id: ");
            out.extend_from_slice(id.value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
    }

    fn forwards(&self, name: &HeaderName) -> bool {
        let left_out = is_hop_by_hop(name)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == X_FORWARDED_FOR
            || name == X_DATA_PARALLEL_RANK
            || name == X_OVERRIDE_ROUTED_DP_RANK
            || self.strip_auth && (name == header::AUTHORIZATION || name == X_API_KEY);
        !left_out
    }

    /// Writes the `x-forwarded-for` field: the client's list (its first line, when it
    /// is text and not empty), then the client's address.
    fn write_forwarded_for(&self, out: &mut Vec<u8>) {
        let Some(peer) = self.peer else {
            return;
        };
        out.extend_from_slice(b"x-forwarded-for: ");
        let prior = self
            .map
            .get(&X_FORWARDED_FOR)
            .filter(|v| v.to_str().is_ok_and(|v| !v.is_empty()));
        if let Some(prior) = prior {
            out.extend_from_slice(prior.as_bytes());
            out.extend_from_slice(b", ");
        }
        push_ip(out, peer);
        out.extend_from_slice(b"\r\n");
    }

    /// About how many bytes the fields take written.
    pub fn written_len(&self) -> usize {
        let fields: usize = self
            .map
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 4)
            .sum();
        // `x-forwarded-for` and a made `x-request-id`.
        fields + 64 + 64
    }
}

/// Writes an address as `Display` does; an IPv4 one digit by digit, which costs a
/// tenth of going through the formatter (it is written on every request).
fn push_ip(out: &mut Vec<u8>, ip: IpAddr) {
    use std::io::Write as _;
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if octet >= 100 {
                    out.push(b'0' + octet / 100);
                }
                if octet >= 10 {
                    out.push(b'0' + octet / 10 % 10);
                }
                out.push(b'0' + octet % 10);
            }
        }
        IpAddr::V6(_) => {
            let _ = write!(out, "{ip}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_the_same_static_or_formatted() {
        for n in [0, 1, 9, 10, 123] {
            assert_eq!(count_value(n), HeaderValue::from(n));
        }
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert("x-api-key", HeaderValue::from_static("k"));
        h.insert(header::HOST, HeaderValue::from_static("lb"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.insert("x-data-parallel-rank", HeaderValue::from_static("3"));
        let peer = "127.0.0.1:5000".parse().unwrap();
        let out = sent(&UpstreamHeaders::new(h.clone(), peer, false));
        let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["authorization", "x-api-key", "x-forwarded-for"]);
        assert_eq!(out[0].1, "Bearer k");
        assert_eq!(out[2].1, "10.0.0.1, 127.0.0.1");
        let stripped = sent(&UpstreamHeaders::new(h, peer, true));
        assert_eq!(
            stripped,
            [("x-forwarded-for".into(), "10.0.0.1, 127.0.0.1".into())]
        );
        // Without a prior list (or with an empty one), the address alone.
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static(""));
        let peer = "[2001:db8::1]:5000".parse().unwrap();
        let out = sent(&UpstreamHeaders::new(h, peer, false));
        assert_eq!(out, [("x-forwarded-for".into(), "2001:db8::1".into())]);
        // A list the client's `Connection` names is its hop's: the address alone.
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("X-Forwarded-For"),
        );
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        let peer = "127.0.0.1:5000".parse().unwrap();
        let out = sent(&UpstreamHeaders::new(h, peer, false));
        assert_eq!(out, [("x-forwarded-for".into(), "127.0.0.1".into())]);
        // The balancer's own requests carry nothing.
        assert_eq!(sent(&UpstreamHeaders::default()), []);
    }

    /// The fields an engine is sent, as (name, value) text.
    fn sent(h: &UpstreamHeaders) -> Vec<(String, String)> {
        let mut out = Vec::new();
        h.write(&mut out);
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|line| {
                let (n, v) = line.split_once(": ").unwrap();
                (n.to_string(), v.to_string())
            })
            .collect()
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        let octets = (0..=255u8).map(|o| IpAddr::from([o, 255 - o, o / 7, 10]));
        let named = ["127.0.0.1", "::1", "2001:db8::ff00:42:8329"].map(|ip| ip.parse().unwrap());
        for ip in octets.chain(named) {
            let mut out = Vec::new();
            push_ip(&mut out, ip);
            assert_eq!(out, ip.to_string().into_bytes());
        }
    }

    #[test]
    fn the_index_names_the_same_header() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_str()), Some(i));
        }
        assert_eq!(hop_by_hop_index("x-connection"), None);
    }
}
