//! A disaggregated pool's request: two legs, each placed, admitted and relayed as any
//! request is in its own pool. The prefill leg goes to the pool's prefill engines,
//! placed by the request's key (they hold the prefix cache); the decode leg to the
//! pool's decode engines (`{pool}/decode`, placed by the same key), and its answer is
//! the client's. Each leg holds its node's slot for its own time: a prefill engine's
//! while it prefills, a decode engine's while it streams.
//!
//! - `disaggregation = "vllm"`: one leg after the other. The prefill engine is asked
//!   for one token, whole; the decode engine gets the `kv_transfer_params` it answered.
//!   Each leg is failed over in its pool.
//! - `disaggregation = "sglang"`: both at once, both told the prefill engine's
//!   bootstrap address and one new room ([`Bootstrap`]), where the decode engine pulls
//!   the KV cache from. The decode leg is sent once the prefill leg's engine is chosen,
//!   and is failed over in its pool with the same room; a prefill leg that fails ends
//!   its decode leg, and the pair is sent again, on another prefill engine with a new
//!   room.

use bytes::{Bytes, BytesMut};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use http::{HeaderValue, Response};
use http_body_util::BodyExt;
use tokio::sync::watch;

use super::body::BoxBody;
use super::forward::{Exchange, Leg};
use super::headers;
use super::kv_transfer::{self, Answers};
use super::ProxyError;
use crate::config::Disaggregation;
use crate::routing::decision::Placement;
use crate::routing::facts::KeyError;
use crate::routing::node::Node;
use crate::routing::table::PlaceError;
use crate::telemetry::series::NodeSeries;

/// The most of a prefill engine's answer read for its `kv_transfer_params` (an answer
/// of one token is a few hundred bytes, its params a block id per 16 tokens).
const MAX_PREFILL_ANSWER: usize = 4 << 20;

/// The most requests one SGLang-disaggregated request may make of its engines (its
/// `n`, or its batch's prompts), each with a bootstrap room of its own.
const MAX_ROOMS: u64 = 4096;

/// Runs both legs; the client reads the decode leg's answer, or the prefill leg's
/// when that is not a success (a 400 for a prompt too long is the client's to read).
pub(super) async fn run(
    exchange: &mut Exchange<'_>,
    asking: &mut Option<&'static NodeSeries>,
) -> Result<Response<BoxBody>, ProxyError> {
    let Some(decode) = exchange.placement.decode(exchange.table) else {
        return exchange.run(asking).await;
    };
    let Some(answers) = kv_transfer::fan_out(&exchange.body) else {
        let e = KeyError::Json("the body is not a JSON object".into());
        return Err(ProxyError::Place(PlaceError::Key(e)));
    };
    let stream = exchange.placement.facts.stream;
    let split = match exchange.placement.pool().config.disaggregation {
        Some(Disaggregation::Sglang) => sglang(exchange, decode, answers, asking).await,
        _ => vllm(exchange, decode, answers, asking).await,
    };
    // No prefill or no decode engine to take it: the pool's fallbacks, whole.
    let Err(e @ ProxyError::NoNode { .. }) = split else {
        return split;
    };
    exchange.placement.facts.stream = stream;
    let Some(fallback) = exchange.placement.fallback(exchange.table) else {
        return Err(e);
    };
    tracing::debug!(from = %exchange.placement.pool().config.name, to = %fallback.pool().config.name, "no prefill or decode engine available; the fallback pool takes it whole");
    exchange.placement = fallback;
    exchange.leg = Leg::Whole;
    *asking = None;
    exchange.run(asking).await
}

/// vLLM's: the prefill leg, read whole for its `kv_transfer_params`, then the decode
/// leg with them.
async fn vllm(
    exchange: &mut Exchange<'_>,
    decode: Placement,
    answers: Answers,
    asking: &mut Option<&'static NodeSeries>,
) -> Result<Response<BoxBody>, ProxyError> {
    if answers.total() > 1 {
        // Each answer would pull the one prefill's cache, which the first to finish
        // frees: a decode engine serves it whole.
        tracing::debug!(
            answers = answers.total(),
            "several answers asked for: decoded whole, no prefill leg"
        );
        return exchange.sibling(decode, Leg::Whole).run(asking).await;
    }
    // Both legs carry the request's id (`x-request-id`: the client's, else one the
    // balancer made), as vLLM asks: its KV connectors may match the decode engine's
    // pull to the prefill by it. It has one even with `server.request_ids` off.
    let upstream = &mut exchange.headers;
    if upstream.id.is_none() {
        upstream.id = Some(super::request_id::settle(&mut upstream.map));
    }
    exchange.placement.facts.stream = false;
    exchange.leg = Leg::Prefill;
    let prefill = exchange.run(asking).await?;
    if !prefill.status().is_success() {
        return Ok(prefill);
    }
    let node = prefill.headers().get(&headers::NODE).cloned();
    let node_id = || {
        let id = node.as_ref().and_then(|n| n.to_str().ok());
        id.unwrap_or_default().to_string()
    };
    // Read whole, which ends the prefill leg: its node's slot is free again.
    let broke = |e: &dyn std::fmt::Display| ProxyError::Upstream {
        count: 1,
        attempts: format!("{}: the prefill answer: {e}", node_id()),
    };
    let mut body = prefill.into_body();
    let mut answer = BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.map_err(|e| broke(&e))?.into_data() {
            if answer.len() + data.len() > MAX_PREFILL_ANSWER {
                return Err(broke(&format_args!("over {MAX_PREFILL_ANSWER} bytes")));
            }
            answer.extend_from_slice(&data);
        }
    }
    drop(body);
    let Some(params) = kv_transfer::answered_params(&answer) else {
        return Err(ProxyError::NoKvTransfer { node: node_id() });
    };
    let mut decode_leg = exchange.sibling(decode, Leg::Decode(params));
    // No engine is asked until the decode leg's attempt is.
    *asking = None;
    let mut response = decode_leg.run(asking).await?;
    if let Some(node) = node {
        response
            .headers_mut()
            .insert(headers::PREFILL_NODE.clone(), node);
    }
    Ok(response)
}

/// SGLang's: both legs at once, the decode leg sent once the prefill leg's engine is
/// chosen; a failed prefill leg ends its decode leg, and the pair is sent again.
async fn sglang(
    exchange: &mut Exchange<'_>,
    decode: Placement,
    answers: Answers,
    asking: &mut Option<&'static NodeSeries>,
) -> Result<Response<BoxBody>, ProxyError> {
    let batch = answers.batch();
    if batch.is_some_and(|b| b > MAX_ROOMS) {
        let e = format!("it asks for more than {MAX_ROOMS} answers, the most a disaggregated pool takes in one request");
        return Err(ProxyError::Place(PlaceError::Key(KeyError::Invalid(e))));
    }
    // The prefill leg asks what the client asked, as SGLang's router sends it: a
    // stream (usage asked for, to count its prompt tokens) is probed for its first
    // token; a whole answer is read in the time a first token has.
    let mut decode = Some(decode);
    let mut avoid = Vec::new();
    let mut failed = Vec::new();
    let tries = exchange.table.config.routing.max_attempts;
    for pair in 1..=tries {
        let bootstrap = Arc::new(Bootstrap::new(batch, avoid.clone()));
        let placement =
            match decode.take() {
                Some(p) => p,
                None => exchange.placement.decode(exchange.table).ok_or_else(|| {
                    ProxyError::Upstream {
                        count: 0,
                        attempts: "the decode engines' pool is gone".into(),
                    }
                })?,
            };
        let mut decode_leg = exchange.sibling(placement, Leg::DecodeFrom(bootstrap.clone()));
        exchange.leg = Leg::PrefillFor(bootstrap.clone());
        let mut prefill_asking = None;
        let prefill = exchange.run(&mut prefill_asking);
        tokio::pin!(prefill);
        // Until the prefill leg's engine is chosen (it may wait in the queue), the
        // decode leg holds no slot.
        tokio::select! {
            biased;
            _ = bootstrap.chosen() => {}
            // Ended before it was sent: no engine for it (all full or down, or
            // each failed in an earlier try of the pair), or the request refused in
            // the queue.
            answer = &mut prefill => match answer {
                Err(_) if !failed.is_empty() => break,
                answer => return answer,
            },
        }
        let decoded = decode_leg.run(asking);
        tokio::pin!(decoded);
        let mut prefilled = false;
        let mut prefill_node = None;
        loop {
            tokio::select! {
                answer = &mut prefill, if !prefilled => match answer {
                    Ok(answer) if answer.status().is_success() => {
                        prefill_node = drain(answer);
                        prefilled = true;
                    }
                    // An engine's error: the pair goes again, on another engine.
                    Ok(answer) if answer.status().is_server_error() && pair < tries => {
                        let status = answer.status().as_u16();
                        tracing::info!(status, "the prefill leg failed: its decode leg ended, the pair sent again");
                        avoid.extend(bootstrap.node());
                        failed.push(format!("a prefill engine answered HTTP {status}"));
                        break;
                    }
                    // The client's to read (a 400 for a prompt too long; the last
                    // engine's error): the decode engine never gets the cache, and its
                    // leg ends here.
                    Ok(answer) => return Ok(answer),
                    Err(e) => {
                        tracing::info!(reason = %e, "the prefill leg failed: its decode leg ended, the pair sent again");
                        avoid.extend(bootstrap.node());
                        failed.push(e.to_string());
                        break;
                    }
                },
                answer = &mut decoded => {
                    let mut answer = answer?;
                    if !answer.status().is_success() {
                        return Ok(answer);
                    }
                    if !prefilled {
                        // Its engine has answered the decode engine: its own answer
                        // is on the way.
                        match (&mut prefill).await {
                            Ok(p) => prefill_node = drain(p),
                            Err(e) => tracing::info!(reason = %e, "the prefill leg failed after its decode leg answered"),
                        }
                    }
                    if let Some(node) = prefill_node {
                        answer.headers_mut().insert(headers::PREFILL_NODE.clone(), node);
                    }
                    return Ok(answer);
                }
            }
        }
    }
    Err(ProxyError::Upstream {
        count: failed.len() as u32,
        attempts: failed.join("; "),
    })
}

/// Reads a prefill leg's answer to its end, away from the request (its node's slot
/// is freed, and its request logged, when it ends); returns the node it names.
fn drain(answer: Response<BoxBody>) -> Option<HeaderValue> {
    let (head, mut body) = answer.into_parts();
    tokio::spawn(async move { while let Some(Ok(_)) = body.frame().await {} });
    head.headers.get(&headers::NODE).cloned()
}

/// An SGLang-disaggregated request's bootstrap: its rooms, and the prefill engine its
/// prefill leg was sent to, which both legs name.
#[derive(Debug)]
pub(super) struct Bootstrap {
    /// One per request its engines make of it (a batch makes several).
    rooms: Vec<u64>,
    batch: bool,
    /// Prefill engines of earlier tries of the pair, not tried again.
    pub(super) avoid: Vec<usize>,
    /// The prefill leg's engine, once chosen.
    prefill: watch::Sender<Option<BootstrapAt>>,
}

/// Where a prefill leg went: its node (its index in its pool), and its engine's
/// bootstrap host and port.
#[derive(Debug, Clone)]
struct BootstrapAt {
    node: usize,
    host: Arc<str>,
    port: Option<u16>,
    /// Its data-parallel rank, if the node is one rank of its server.
    rank: Option<u32>,
}

impl Bootstrap {
    fn new(batch: Option<u64>, avoid: Vec<usize>) -> Bootstrap {
        // SGLang's router draws each room at random, below 2^63.
        let room = || RandomState::new().hash_one(0u8) & (u64::MAX >> 1);
        Bootstrap {
            rooms: (0..batch.unwrap_or(1)).map(|_| room()).collect(),
            batch: batch.is_some(),
            avoid,
            prefill: watch::Sender::new(None),
        }
    }

    /// The prefill leg is sent to `node` (`index` in its pool).
    pub(super) fn open(&self, index: usize, node: &Node) {
        self.prefill.send_replace(Some(BootstrapAt {
            node: index,
            host: node.url().host().unwrap_or_default().into(),
            port: node.bootstrap_port(),
            rank: node.data_parallel_rank(),
        }));
    }

    /// The prefill leg's engine, once chosen (the sender lives as long as `self`, so
    /// it is always chosen in the end).
    async fn chosen(&self) -> Option<BootstrapAt> {
        let mut chosen = self.prefill.subscribe();
        let at = chosen.wait_for(Option::is_some).await.ok()?.clone();
        at
    }

    fn node(&self) -> Option<usize> {
        self.prefill.borrow().as_ref().map(|at| at.node)
    }

    /// A leg's body for `node`: `body` naming the prefill engine's bootstrap and the
    /// rooms (once that engine is chosen), and the data-parallel ranks: the node's
    /// own, and a decode leg's prefill engine's.
    pub(super) async fn body(&self, body: &Bytes, node: &Node, decode: bool) -> Bytes {
        let Some(at) = self.chosen().await else {
            return body.clone();
        };
        let to = kv_transfer::Bootstrapped {
            host: &at.host,
            port: at.port,
            rooms: &self.rooms,
            batch: self.batch,
            rank: node.data_parallel_rank(),
            prefill_rank: at.rank.filter(|_| decode),
        };
        kv_transfer::bootstrap_body(body, &to)
    }
}
