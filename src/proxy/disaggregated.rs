//! A disaggregated pool's request (`disaggregation = "vllm"`): two legs, each placed,
//! admitted, failed over and relayed as any request is in its own pool. The prefill
//! leg goes to the pool's prefill engines, placed by the request's key (they hold the
//! prefix cache), asking for one token whole; the decode leg then goes to the pool's
//! decode engines (`{pool}/decode`, placed by the same key) with the
//! `kv_transfer_params` the prefill engine answered, and its answer is the client's.
//! Each leg holds its node's slot for its own time: a prefill engine's while it
//! prefills, a decode engine's while it streams.

use bytes::BytesMut;
use std::hash::{BuildHasher, RandomState};

use http::{HeaderValue, Response};
use http_body_util::BodyExt;

use super::body::BoxBody;
use super::forward::{Exchange, Leg};
use super::headers;
use super::kv_transfer;
use super::ProxyError;
use crate::routing::facts::KeyError;
use crate::routing::table::PlaceError;
use crate::telemetry::series::NodeSeries;

/// The most of a prefill engine's answer read for its `kv_transfer_params` (an answer
/// of one token is a few hundred bytes, its params a block id per 16 tokens).
const MAX_PREFILL_ANSWER: usize = 4 << 20;

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
    if answers > 1 {
        // Each answer would pull the one prefill's cache, which the first to finish
        // frees: a decode engine serves it whole.
        tracing::debug!(
            answers,
            "several answers asked for: decoded whole, no prefill leg"
        );
        exchange.placement = decode;
        return exchange.run(asking).await;
    }
    // Both legs carry one request id, as vLLM asks (its KV connectors may match the
    // decode engine's pull to the prefill by it): the client's, else a new one.
    let map = &mut exchange.headers.map;
    if !map.contains_key(&headers::X_REQUEST_ID) {
        map.insert(headers::X_REQUEST_ID.clone(), request_id());
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
    exchange.placement = decode;
    exchange.leg = Leg::Decode(params);
    // No engine is asked until the decode leg's attempt is.
    *asking = None;
    let mut response = exchange.run(asking).await?;
    if let Some(node) = node {
        response
            .headers_mut()
            .insert(headers::PREFILL_NODE.clone(), node);
    }
    Ok(response)
}

/// A new request id: 128 random bits in hex (`RandomState` is seeded at random, and
/// each one made afresh is new).
fn request_id() -> HeaderValue {
    let half = || RandomState::new().hash_one(0u8);
    let id = format!("prefixlb-{:016x}{:016x}", half(), half());
    HeaderValue::from_str(&id).expect("hex digits are a header value")
}
