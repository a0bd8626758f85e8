//! Stored responses: which engine holds each response of the Responses API. vLLM keeps
//! a response it answers (`store`, on by default) in the engine's own memory, so
//! a request that names one (`previous_response_id`, or `GET`/`DELETE`
//! `/v1/responses/{id}` and its `/cancel`) is served only by the engine that answered
//! it: any other answers 404. The balancer reads each new response's id from the first
//! bytes of its answer and remembers its node, per pool, in a bounded table (a
//! [`HomeTable`](super::home::HomeTable): an id overwritten by a collision, or answered
//! before a restart or by another replica, is simply not known). A request naming a
//! known id goes to that node and no other ([`Holder::Only`]); one naming an id not
//! known asks the nodes in turn until one does not answer 404 ([`Holder::Search`]).
//! Pure: the proxy brings the bytes.

use xxhash_rust::xxh3::xxh3_64;

use super::home::Entry;
use super::json_scan::Scanner;
use super::walk::Balancer;

/// Where a request may go, as the response it names says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Holder {
    /// It names no stored response: anywhere its key leads.
    #[default]
    Any,
    /// The node (its index in the pool) that holds the response it names: only there.
    Only(usize),
    /// It names a response no table here knows: every node is asked in turn, and an
    /// engine's 404 means "not here".
    Search,
}

/// The path prefix of one stored response's own endpoints.
const RESPONSE_PATH: &str = "/v1/responses/";

/// The actions on a stored response a path may name after its id (OpenAI's and
/// vLLM's): nothing else after `/v1/responses/` reaches an engine.
const ACTIONS: [&str; 2] = ["cancel", "input_items"];

/// The longest response id taken.
const MAX_ID_BYTES: usize = 256;

/// The response id a path names: `/v1/responses/{id}`, or an action on it
/// (`/v1/responses/{id}/cancel`, `/v1/responses/{id}/input_items`). An id is letters,
/// digits, `_` and `-` (vLLM's `resp_…`, OpenAI's): a path with anything else (`..`,
/// percent-escapes, more segments) names none.
pub fn id_in_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix(RESPONSE_PATH)?;
    let (id, action) = match rest.split_once('/') {
        Some((id, action)) => (id, Some(action)),
        None => (rest, None),
    };
    let id_ok = !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let action_ok = action.is_none_or(|a| ACTIONS.contains(&a));
    (id_ok && action_ok).then_some(id)
}

/// What a stored response is known by in the tables.
pub fn id_hash(id: &str) -> u64 {
    xxh3_64(id.as_bytes())
}

/// The id of the response an answer creates, read from its first bytes: a `response`
/// object's top-level `id`, or in a stream the `response.id` of its first event that
/// carries one (`response.created`). Bytes cut short (a long answer held in part) are
/// read as far as they go.
pub fn created_id(held: &[u8], stream: bool) -> Option<&str> {
    let text = std::str::from_utf8(held).unwrap_or_else(|e| {
        // A multi-byte character cut at the end of what is held.
        std::str::from_utf8(&held[..e.valid_up_to()]).unwrap_or_default()
    });
    if !stream {
        return top_level_id(text, false);
    }
    text.lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .find_map(|data| top_level_id(data.trim_start(), true))
}

/// `id` of the object `text` opens with (`nested`: of its `response` member).
fn top_level_id(text: &str, nested: bool) -> Option<&str> {
    let mut sc = Scanner::new(text);
    if sc.peek() != Some(b'{') {
        return None;
    }
    let mut found = None;
    // An error past the id (a body cut short) leaves what was found.
    let _ = sc.object(|sc, key| {
        match (&*key, nested) {
            ("id", false) => {
                if let Some(id) = sc.opt_string("")? {
                    found = Some(id);
                }
            }
            ("response", true) if sc.peek() == Some(b'{') => {
                sc.object(|sc, key| {
                    match &*key {
                        "id" => {
                            if let Some(id) = sc.opt_string("")? {
                                found = Some(id);
                            }
                        }
                        _ => {
                            sc.value()?;
                        }
                    }
                    Ok(())
                })?;
            }
            _ => {
                sc.value()?;
            }
        }
        if found.is_some() {
            // Nothing after it is needed.
            return Err(sc.error("found"));
        }
        Ok(())
    });
    let id = found?;
    match id {
        std::borrow::Cow::Borrowed(id) if id.starts_with("resp") => Some(id),
        _ => None,
    }
}

impl Balancer {
    /// The node of this pool that holds the response with `id_hash`, if known.
    pub fn holder_of(&self, id_hash: u64) -> Option<usize> {
        let entry = self.load.stored.get(id_hash)?;
        self.tags.iter().position(|&t| t == entry.node)
    }

    /// Remembers that node `index` holds the response with `id_hash`.
    pub fn hold(&self, id_hash: u64, index: usize) {
        let node = self.tags[index];
        self.load.stored.set(id_hash, Entry { node, tokens: 0 });
    }

    /// Forgets where the response with `id_hash` is (it was deleted).
    pub fn forget(&self, id_hash: u64) {
        self.load.stored.forget(id_hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_names_the_response_of_its_endpoint() {
        assert_eq!(id_in_path("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(id_in_path("/v1/responses/resp_1/cancel"), Some("resp_1"));
        assert_eq!(
            id_in_path("/v1/responses/resp_1/input_items"),
            Some("resp_1")
        );
        assert_eq!(id_in_path("/v1/responses/"), None);
        assert_eq!(id_in_path("/v1/responses"), None);
        assert_eq!(id_in_path("/v1/chat/completions"), None);
        // Nothing but an id and a known action reaches an engine.
        for path in [
            "/v1/responses/resp_1/",
            "/v1/responses/resp_1/delete",
            "/v1/responses/resp_1/cancel/x",
            "/v1/responses/../metrics",
            "/v1/responses/resp_1/../../metrics",
            "/v1/responses/%2e%2e",
            "/v1/responses/resp 1",
        ] {
            assert_eq!(id_in_path(path), None, "{path}");
        }
        assert_eq!(
            id_in_path(&format!("/v1/responses/{}", "r".repeat(257))),
            None
        );
    }

    #[test]
    fn the_created_id_is_read_from_an_object_or_a_stream_s_first_event() {
        let plain = br#"{"id":"resp_abc","object":"response","output":[{"id":"msg_1"}]}"#;
        assert_eq!(created_id(plain, false), Some("resp_abc"));
        // `id` after other members, and a body cut short after it.
        let late =
            br#"{"object":"response","created_at":1,"id":"resp_late","output":[{"content":"cut"#;
        assert_eq!(created_id(late, false), Some("resp_late"));
        let stream = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_s\",\"output\":[]},\"sequence_number\":0}\n\nevent: response.output_text.delta\ndata: {\"item_id\":\"msg_s\",\"delta\":\"x\"}\n\n";
        assert_eq!(created_id(stream, true), Some("resp_s"));
        // Not a response: an error, another object's id, no id at all.
        assert_eq!(created_id(br#"{"error":{"message":"x"}}"#, false), None);
        assert_eq!(created_id(br#"{"id":"chatcmpl-1"}"#, false), None);
        assert_eq!(created_id(b"data: {\"delta\":\"x\"}\n\n", true), None);
        assert_eq!(created_id(b"not json", false), None);
    }
}
