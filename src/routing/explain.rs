//! The explanation of one request's routing, as `prefixlb route` prints it and
//! `POST /admin/explain` returns it: pool, key (shortened), hash, the key's successor
//! walk with each node's load and state (for a grouped key: the group and its width),
//! and the node the next request would get. It is placed by the one entry point
//! requests are placed by, [`Table::place`], in [`Mode::Explain`], and walked by the
//! side-effect free [`Placement::peek`](super::decision::Placement::peek), so it is the
//! truth and changes nothing.

use std::borrow::Cow;
use std::time::Instant;

use serde::Serialize;

use super::decision::Placement;
use super::facts::{KeySource, Turn};
use super::group::Grouping;
use super::route::Route;
use super::table::{PlaceError, Table};
use super::walk::Peek;
use super::Mode;
use crate::config::WhenSaturated;

/// Characters of key text shown; the rest is summarised by `key_chars`.
const SHOWN_KEY_CHARS: usize = 160;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    pub pool: String,
    pub model: Option<String>,
    pub api: &'static str,
    pub stream: bool,
    /// `header`, `prompt`, `raw` or `file`.
    pub key_source: &'static str,
    /// The key text, shortened (`file`: the upload's digest, in hex).
    pub key: String,
    pub key_chars: usize,
    /// `xxh3_64(pool ‖ 0x00 ‖ key, hash_seed)` in hex.
    pub hash: String,
    /// `key = "hybrid"`: the request's prefix group, or the whole pool for a short
    /// shared prefix.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupInfo>,
    /// `key = "hybrid"`: the shared prefix in front of the key, and how it was found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<PrefixInfo>,
    /// `first`, `later` or `unknown`: which turn of its conversation the request is.
    pub turn: &'static str,
    /// The node this balancer remembers as the conversation's home, if any.
    pub home: Option<String>,
    /// A new conversation (`key = "hybrid"`, no home yet): how it is placed among its
    /// first two nodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementInfo>,
    /// A request naming a stored response (Responses API): the response, and the node
    /// that holds it (`null`: not known here; every node would be asked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stored_response: Option<StoredInfo>,
    /// The key's successor walk, primary first.
    pub successors: Vec<Step>,
    /// The node the next request would get now.
    pub choice: Option<String>,
    /// How it would get there: `primary`, `spill:N`, `shunt`, or, with no node,
    /// `queued` (it would wait for a slot), `saturated` (every willing node is at its
    /// cap) or `unavailable` (no node accepts requests).
    pub route: String,
    /// A disaggregated pool's chat or completions request: how its decode leg would
    /// be placed, in the pool of the decode engines (the above is its prefill leg).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decode: Option<Box<Explanation>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupInfo {
    /// `xxh3_64(pool ‖ 0x00 ‖ system part, hash_seed)` in hex; `null` when the system
    /// part is too short to form a group and the key spreads over the whole pool.
    pub hash: Option<String>,
    /// Nodes the group's conversations spread over now.
    pub width: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlacementInfo {
    /// Estimated tokens of the prompt above its group's prefix: its own text.
    pub own_tokens: u32,
    /// `recent homes, then load` (a short opening: where fewer conversations made
    /// their home lately) or `load` (requests in flight over cap).
    pub by: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoredInfo {
    pub id: String,
    pub held_by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixInfo {
    /// Bytes of prompt text in the prefix.
    pub bytes: usize,
    /// Chunks of it the pool's recent traffic shares.
    pub hot_chunks: usize,
    /// `learned` (a chunk the traffic shares and where conversations part) or
    /// `system part` (before anything is learned: the end of the system messages).
    pub found_by: &'static str,
    /// Why the walk over the chunks stopped: `cold chunk`, `max_scan_bytes` or `end
    /// of prompt`.
    pub stopped_at: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Step {
    pub node: String,
    pub in_flight: u32,
    pub cap: u32,
    /// Healthy and not draining.
    pub accepts_new: bool,
    /// The node's breaker state.
    pub breaker: &'static str,
    /// Its latency shunting diverts this key to a later node.
    pub shunts_key: bool,
}

/// Explains how `table` would route a request with this path, key header and body at
/// `now`.
pub fn explain(
    table: &Table,
    path: &str,
    header_key: Option<&[u8]>,
    body: &[u8],
    now: Instant,
) -> Result<Explanation, PlaceError> {
    let p = table.place(path, header_key, body, Mode::Explain)?;
    let decode = p.decode(table).map(|d| Box::new(explained(table, &d, now)));
    Ok(Explanation {
        decode,
        ..explained(table, &p, now)
    })
}

/// How a request placed as `p` would be routed at `now`.
fn explained(table: &Table, p: &Placement, now: Instant) -> Explanation {
    let pool = p.pool();
    let b = &pool.balancer;
    let successors: Vec<Step> = b
        .order(p.target)
        .map(|i| {
            let n = b.node(i);
            let state = n.state();
            Step {
                node: n.id().to_string(),
                in_flight: state.in_flight(),
                cap: b.cap_of(n),
                accepts_new: state.accepts_new(),
                breaker: state.breaker.state().as_str(),
                shunts_key: state.breaker.shunts(p.hash),
            }
        })
        .collect();
    let when_saturated = table.config.routing.when_saturated;
    // Nodes it may never go to (an adapter they lack, a stored response another holds)
    // are skipped as admission skips them.
    let (choice, route) = match p.peek(p.unserved(), now) {
        _ if p.joins_queue(when_saturated, &[]) => (None, "queued".to_string()),
        Peek::Node {
            index,
            distance,
            shunted,
        } => {
            let route = if p.is_fallback() {
                Route::Fallback(pool.config.name.clone())
            } else {
                Route::walked(distance, shunted)
            };
            (
                Some(b.node(index).id().to_string()),
                route.label().into_owned(),
            )
        }
        Peek::Saturated if when_saturated == WhenSaturated::Queue => (None, "queued".to_string()),
        Peek::Saturated => (None, "saturated".to_string()),
        Peek::Unavailable => (None, "unavailable".to_string()),
    };
    let facts = &p.facts;
    let text = match facts.source {
        // A digest: shown as hex.
        KeySource::File => Cow::Owned(facts.key.iter().map(|b| format!("{b:02x}")).collect()),
        _ => String::from_utf8_lossy(&facts.key),
    };
    let key_chars = text.chars().count();
    let mut key: String = text.chars().take(SHOWN_KEY_CHARS).collect();
    if key_chars > SHOWN_KEY_CHARS {
        key.push('…');
    }
    let turn = facts.turn;
    Explanation {
        pool: pool.config.name.clone(),
        model: facts.model.clone(),
        api: p.api.as_str(),
        stream: facts.stream,
        key_source: facts.source.as_str(),
        key,
        key_chars,
        hash: format!("{:016x}", p.hash),
        group: p.target.group.map(|(g, width)| GroupInfo {
            hash: matches!(p.grouping, Grouping::Group(_)).then(|| format!("{g:016x}")),
            width,
        }),
        prefix: facts.prefix.map(|f| PrefixInfo {
            bytes: f.bytes,
            hot_chunks: f.hot_chunks,
            found_by: if f.learned { "learned" } else { "system part" },
            stopped_at: f.stop.as_str(),
        }),
        turn: match turn {
            Turn::First => "first",
            Turn::Later => "later",
            Turn::Unknown => "unknown",
        },
        home: p.home.map(|h| b.node(h.index).id().to_string()),
        placement: (p.home.is_none() && turn == Turn::First && p.grouping != Grouping::Ring).then(
            || PlacementInfo {
                own_tokens: p.stakes.own_tokens,
                by: if b.places_by_homes(p.stakes.own_tokens) {
                    "recent homes, then load"
                } else {
                    "load"
                },
            },
        ),
        stored_response: facts.follows.as_ref().map(|id| StoredInfo {
            id: id.clone(),
            held_by: p.holding_node().map(|n| n.id().to_string()),
        }),
        successors,
        choice,
        route,
        decode: None,
    }
}
