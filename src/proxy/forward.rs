//! One request's trip to the engines: admission on the key's successor walk (spill,
//! queue, reject or overcommit when saturated), the upstream exchange, and failover to
//! the next untried successor on connect errors, transport errors, 5xx and 429 before
//! any byte has gone to the client.

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{request, HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::headers;
use super::relay::RelayBody;
use super::{ProxyError, UpstreamClient};
use crate::balance::{Balancer, Choice, Walk};
use crate::body::BoxBody;
use crate::config::{RoutingConfig, WhenSaturated};
use crate::table::{Plan, Pool, Table};

/// Why one attempt did not produce a response for the client.
enum Failure {
    /// Connect or transport error, or a 5xx.
    Broken(String),
    /// No response head within `request_timeout`.
    Timeout(String),
    /// The engine answered 429: busy, not broken.
    Busy(String),
}

impl Failure {
    fn text(&self) -> &str {
        match self {
            Failure::Broken(s) | Failure::Timeout(s) | Failure::Busy(s) => s,
        }
    }
}

pub(super) async fn forward(
    client: &UpstreamClient,
    table: &Arc<Table>,
    plan: Plan,
    parts: request::Parts,
    body: Bytes,
    peer: SocketAddr,
) -> Result<Response<BoxBody>, ProxyError> {
    let pool = &table.pools[plan.pool];
    let routing = &table.config.routing;
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let upstream_headers = headers::upstream_headers(&parts.headers, peer);
    let request_timeout = table.config.server.request_timeout;

    let mut tried = Vec::with_capacity(routing.max_attempts as usize);
    let mut failures: Vec<Failure> = Vec::new();
    for attempt in 1..=routing.max_attempts {
        let (choice, queued) = match admit(pool, routing, plan.hash, &tried).await {
            Ok(admitted) => admitted,
            Err(e) if failures.is_empty() => return Err(e),
            Err(_) => break, // nothing left to fail over to
        };
        tried.push(choice.index);
        let node = &pool.config.nodes[choice.index];
        let uri = node.upstream_uri(path).map_err(|e| ProxyError::Upstream {
            count: attempt,
            attempts: format!("{}: bad upstream URI: {e}", node.id),
        })?;
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = upstream_headers.clone();

        let failure = match tokio::time::timeout(request_timeout, client.request(req)).await {
            Err(_) => Failure::Timeout(format!(
                "{}: no response within {} ms",
                node.id,
                request_timeout.as_millis()
            )),
            Ok(Err(e)) => Failure::Broken(format!("{}: {}", node.id, error_chain(&e))),
            Ok(Ok(resp)) if resp.status() == StatusCode::TOO_MANY_REQUESTS => {
                Failure::Busy(format!("{}: HTTP 429", node.id))
            }
            Ok(Ok(resp)) if resp.status().is_server_error() => {
                Failure::Broken(format!("{}: HTTP {}", node.id, resp.status().as_u16()))
            }
            Ok(Ok(resp)) => {
                let route = route_label(queued, choice.distance);
                tracing::debug!(pool = %pool.config.name, node = %node.id, %route, attempt, "routed");
                return Ok(relay(resp, choice, &node.id, &route, attempt));
            }
        };
        tracing::debug!(pool = %pool.config.name, reason = failure.text(), attempt, "attempt failed; failing over");
        failures.push(failure);
    }
    Err(final_error(&failures, request_timeout.as_millis()))
}

/// Takes a slot on the first willing node of the key's walk; when every willing node
/// is at cap, applies `routing.when_saturated`. Returns whether the request queued.
async fn admit(
    pool: &Pool,
    routing: &RoutingConfig,
    hash: u64,
    tried: &[usize],
) -> Result<(Choice, bool), ProxyError> {
    let b = &pool.balancer;
    let name = || pool.config.name.clone();
    // FIFO: a new request does not overtake the ones already waiting.
    let queue_first =
        routing.when_saturated == WhenSaturated::Queue && tried.is_empty() && b.load.queued() > 0;
    let walk = if queue_first {
        Walk::Saturated
    } else {
        b.choose(hash, tried)
    };
    match walk {
        Walk::Chosen(c) => Ok((c, false)),
        Walk::Unavailable => Err(ProxyError::NoNode { pool: name() }),
        Walk::Saturated => match routing.when_saturated {
            WhenSaturated::Reject => Err(ProxyError::Saturated { pool: name() }),
            WhenSaturated::LeastLoaded => b
                .choose_least_loaded(hash, tried)
                .map(|c| (c, false))
                .ok_or_else(|| ProxyError::NoNode { pool: name() }),
            WhenSaturated::Queue => wait_for_slot(b, routing, hash, tried, &pool.config.name)
                .await
                .map(|c| (c, true)),
        },
    }
}

/// Waits in the pool's FIFO (bounded by `max_queue` and `queue_timeout`), re-running
/// the walk each time a slot frees, so the key still lands on its nearest free node.
async fn wait_for_slot(
    b: &Balancer,
    routing: &RoutingConfig,
    hash: u64,
    tried: &[usize],
    pool: &str,
) -> Result<Choice, ProxyError> {
    let _ticket = b
        .load
        .enqueue(routing.max_queue)
        .ok_or_else(|| ProxyError::QueueFull {
            pool: pool.to_string(),
            max: routing.max_queue,
        })?;
    let started = Instant::now();
    let deadline = started + routing.queue_timeout;
    loop {
        // Register for the wake-up before looking, so a slot freed in between is not missed.
        let mut freed = std::pin::pin!(b.load.freed().notified());
        freed.as_mut().enable();
        match b.choose(hash, tried) {
            Walk::Chosen(c) => return Ok(c),
            Walk::Unavailable => {
                return Err(ProxyError::NoNode {
                    pool: pool.to_string(),
                })
            }
            Walk::Saturated => {}
        }
        if tokio::time::timeout_at(deadline, freed).await.is_err() {
            return Err(ProxyError::QueueTimeout {
                pool: pool.to_string(),
                waited_ms: started.elapsed().as_millis(),
            });
        }
    }
}

fn route_label(queued: bool, distance: usize) -> String {
    match (queued, distance) {
        (true, _) => "queued".to_string(),
        (false, 0) => "primary".to_string(),
        (false, d) => format!("spill:{d}"),
    }
}

/// The engine's response, headers cleaned and labelled, body relayed with the
/// reservation attached.
fn relay(
    resp: Response<Incoming>,
    choice: Choice,
    node: &str,
    route: &str,
    attempts: u32,
) -> Response<BoxBody> {
    let (mut parts, body) = resp.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    let h = &mut parts.headers;
    if let Ok(v) = HeaderValue::from_str(node) {
        h.insert(headers::NODE.clone(), v);
    }
    if let Ok(v) = HeaderValue::from_str(route) {
        h.insert(headers::ROUTE.clone(), v);
    }
    h.insert(headers::ATTEMPTS.clone(), HeaderValue::from(attempts));
    Response::from_parts(
        parts,
        BoxBody::new(RelayBody::new(body, choice.reservation)),
    )
}

fn final_error(failures: &[Failure], timeout_ms: u128) -> ProxyError {
    let attempts = failures
        .iter()
        .map(Failure::text)
        .collect::<Vec<_>>()
        .join("; ");
    if failures.iter().all(|f| matches!(f, Failure::Busy(_))) {
        return ProxyError::Busy { attempts };
    }
    match failures.last() {
        Some(Failure::Timeout(_)) => ProxyError::UpstreamTimeout {
            timeout_ms,
            attempts,
        },
        _ => ProxyError::Upstream {
            count: failures.len() as u32,
            attempts,
        },
    }
}

/// An error and its causes, e.g. "client error (Connect): tcp connect error: Connection refused".
fn error_chain(e: &hyper_util::client::legacy::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
