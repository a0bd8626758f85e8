//! One request's trip to the engines: admission on the key's successor walk (spill,
//! shunt, queue, reject or overcommit), the upstream exchange, the first-packet probe
//! for streams, and failover to the next untried successor (then to the pool's
//! fallbacks) on anything that fails before a byte has gone to the client.

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, request, HeaderMap, HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::Full;
use tokio::time::Instant;

use super::headers;
use super::probe::{self, ProbeFailure};
use super::relay::{Finish, RelayBody};
use super::{ProxyError, UpstreamClient};
use crate::balance::{self, Balancer, Choice, NodeState, Walk};
use crate::body::BoxBody;
use crate::breaker::{BreakerSettings, Outcome};
use crate::config::{RoutingConfig, WhenSaturated};
use crate::key;
use crate::metrics::Metrics;
use crate::table::{Plan, Pool, Table};

/// Why one attempt did not produce a response for the client.
struct Failure {
    /// The `reason` label of `failovers_total`.
    reason: &'static str,
    text: String,
}

impl Failure {
    fn new(reason: &'static str, text: String) -> Self {
        Failure { reason, text }
    }
}

/// The health outcome of one attempt, recorded exactly once: by [`Attempt::finish`],
/// or as neutral when the attempt is dropped unfinished (the client left), so a
/// half-open probe slot is never leaked.
struct Attempt {
    node: Arc<NodeState>,
    probe: bool,
    settings: Arc<BreakerSettings>,
    done: bool,
}

impl Attempt {
    fn finish(mut self, outcome: Outcome, ttft: Option<Duration>) {
        self.done = true;
        self.node.record(outcome, ttft, self.probe, &self.settings);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.done {
            self.node
                .record(Outcome::Neutral, None, self.probe, &self.settings);
        }
    }
}

/// Where the request is going now: a pool, the body for it, and the key's walk target
/// there.
struct Target<'t> {
    pool: &'t Pool,
    body: Bytes,
    walk: balance::Target,
    /// `fallback:POOL` once the request left its own pool.
    fallback: Option<String>,
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn forward(
    client: &UpstreamClient,
    metrics: &Arc<Metrics>,
    table: &Arc<Table>,
    plan: Plan,
    parts: request::Parts,
    body: Bytes,
    peer: SocketAddr,
    started: Instant,
) -> Result<Response<BoxBody>, ProxyError> {
    let routing = &table.config.routing;
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let upstream_headers = headers::upstream_headers(&parts.headers, peer);
    let stream = plan.facts.stream;
    // Ask a stream for its usage chunk (to count cache hits) when the client did not,
    // and hide that chunk from the client. Only the OpenAI APIs that define
    // `stream_options` get it (SGLang's `/generate`, say, might reject the field).
    let openai_stream = matches!(plan.api, key::Api::Chat | key::Api::Completions);
    let strip_usage =
        stream && openai_stream && routing.track_usage && plan.facts.include_usage.is_none();
    let body = if strip_usage {
        add_include_usage(&body)
    } else {
        body
    };

    // The pools to try, in order: the request's own, then its fallbacks; a request
    // asking for reasoning skips pools that do not support it.
    let own = &table.pools[plan.pool];
    let mut pools: std::collections::VecDeque<&Pool> = std::iter::once(own)
        .chain(
            own.config
                .fallbacks
                .iter()
                .filter_map(|name| table.pools.iter().find(|p| p.config.name == *name)),
        )
        .filter(|p| !plan.facts.wants_reasoning || p.config.supports_thinking)
        .collect();
    let Some(first) = pools.pop_front() else {
        return Err(ProxyError::NoNode {
            pool: format!("{} (no pool for a reasoning request)", own.config.name),
        });
    };
    let mut target = retarget(
        table,
        &plan,
        &body,
        first,
        first.config.name != own.config.name,
    );

    let mut tried = Vec::with_capacity(routing.max_attempts as usize);
    let mut failures: Vec<Failure> = Vec::new();
    let mut attempt = 0;
    while attempt < routing.max_attempts {
        let (choice, queued) = match admit(target.pool, routing, target.walk, &tried, metrics).await
        {
            Ok(admitted) => admitted,
            Err(ProxyError::NoNode { .. }) if !pools.is_empty() => {
                let next = pools.pop_front().expect("not empty");
                tracing::debug!(from = %target.pool.config.name, to = %next.config.name, "no node available; trying the fallback pool");
                target = retarget(table, &plan, &body, next, true);
                tried.clear();
                continue;
            }
            Err(e) if failures.is_empty() => return Err(e),
            Err(_) => break, // nothing left to fail over to
        };
        attempt += 1;
        tried.push(choice.index);
        let pool = target.pool;
        let node = &pool.config.nodes[choice.index];
        let uri = node.upstream_uri(path).map_err(|e| ProxyError::Upstream {
            count: attempt,
            attempts: format!("{}: bad upstream URI: {e}", node.id),
        })?;
        let mut req = Request::new(Full::new(target.body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = upstream_headers.clone();

        let health = Attempt {
            node: choice.reservation.node().clone(),
            probe: choice.probe,
            settings: pool.balancer.breaker.clone(),
            done: false,
        };
        let sent = Instant::now();
        // A stream has `first_token_timeout` for its head and first token together.
        let head_budget = if stream {
            pool.config.first_token_timeout
        } else {
            table.config.server.request_timeout
        };
        let finish = |route: &str, status: StatusCode, ttft: Option<Duration>| Finish {
            metrics: metrics.clone(),
            pool: pool.config.name.clone(),
            node: node.id.clone(),
            route: route.to_string(),
            attempts: attempt,
            status: status.as_u16(),
            started,
            ttft,
        };
        let failure = match tokio::time::timeout(head_budget, client.request(req)).await {
            Err(_) => Failure::new(
                "timeout",
                format!(
                    "{}: no response within {} ms",
                    node.id,
                    head_budget.as_millis()
                ),
            ),
            Ok(Err(e)) => Failure::new("error", format!("{}: {}", node.id, error_chain(&e))),
            Ok(Ok(resp)) if resp.status() == StatusCode::TOO_MANY_REQUESTS => {
                health.finish(Outcome::Neutral, None);
                metrics
                    .failovers
                    .with_label_values(&[&pool.config.name, "busy"])
                    .inc();
                failures.push(Failure::new("busy", format!("{}: HTTP 429", node.id)));
                continue;
            }
            Ok(Ok(resp)) if resp.status().is_server_error() => Failure::new(
                "http_5xx",
                format!("{}: HTTP {}", node.id, resp.status().as_u16()),
            ),
            Ok(Ok(resp))
                if stream && resp.status().is_success() && is_event_stream(resp.headers()) =>
            {
                let (mut head, body) = resp.into_parts();
                let deadline = sent + pool.config.first_token_timeout;
                match probe::first_packet(body, sent, deadline).await {
                    Ok(committed) => {
                        health.finish(Outcome::Success, Some(committed.ttft));
                        let route = route_label(&target, queued, &choice);
                        count_decision(metrics, pool, &route, choice.distance);
                        metrics
                            .ttft
                            .with_label_values(&[&pool.config.name, &node.id])
                            .observe(committed.ttft.as_secs_f64());
                        let body = RelayBody::stream(
                            committed.held,
                            committed.rest,
                            choice.reservation,
                            finish(&route, head.status, Some(committed.ttft)),
                            table.config.server.idle_stream_timeout,
                            pool.balancer.breaker.clone(),
                            strip_usage,
                        );
                        head.headers.remove(header::CONTENT_LENGTH);
                        return Ok(respond(head, body, &node.id, &route, attempt));
                    }
                    Err(ProbeFailure::Timeout) => Failure::new(
                        "timeout",
                        format!(
                            "{}: no first token within {} ms",
                            node.id,
                            pool.config.first_token_timeout.as_millis()
                        ),
                    ),
                    Err(ProbeFailure::Error(msg)) => Failure::new(
                        "error",
                        format!("{}: stream error before the first token: {msg}", node.id),
                    ),
                    Err(ProbeFailure::NoContent) => Failure::new(
                        "no_content",
                        format!("{}: stream ended with no content", node.id),
                    ),
                }
            }
            Ok(Ok(resp)) => {
                // A 2xx, or a 4xx that is the client's to read: the node is fine.
                health.finish(Outcome::Success, None);
                let route = route_label(&target, queued, &choice);
                count_decision(metrics, pool, &route, choice.distance);
                let (head, body) = resp.into_parts();
                let body =
                    RelayBody::plain(body, choice.reservation, finish(&route, head.status, None));
                return Ok(respond(head, body, &node.id, &route, attempt));
            }
        };
        tracing::info!(pool = %pool.config.name, reason = %failure.text, attempt, "attempt failed; failing over");
        metrics
            .failovers
            .with_label_values(&[&pool.config.name, failure.reason])
            .inc();
        health.finish(Outcome::Failure, None);
        failures.push(failure);
    }
    Err(final_error(&failures))
}

/// Points the request at `pool`: the key's hash there, and for a fallback pool the
/// body with `model` rewritten to the pool's first model.
fn retarget<'t>(
    table: &Table,
    plan: &Plan,
    body: &Bytes,
    pool: &'t Pool,
    fallback: bool,
) -> Target<'t> {
    let name = &pool.config.name;
    let (hash, group) = key::key_hashes(name, &plan.facts, table.config.routing.hash_seed);
    let walk = pool.balancer.target(hash, group);
    if !fallback {
        return Target {
            pool,
            body: body.clone(),
            walk,
            fallback: None,
        };
    }
    let model = pool.config.models.first().unwrap_or(name);
    Target {
        pool,
        body: rewrite_model(body, plan.facts.model_span, model),
        walk,
        fallback: Some(format!("fallback:{name}")),
    }
}

fn count_decision(metrics: &Metrics, pool: &Pool, route: &str, distance: usize) {
    let kind = route.split(':').next().unwrap_or(route);
    metrics
        .routing_decisions
        .with_label_values(&[&pool.config.name, kind])
        .inc();
    metrics.spill_distance.observe(distance as f64);
}

/// The body with `"stream_options": {"include_usage": true}` added (it had none).
fn add_include_usage(body: &Bytes) -> Bytes {
    insert_member(body, r#""stream_options":{"include_usage":true}"#)
}

/// The body with `member` (`"key":value`) added as the object's first member.
fn insert_member(body: &Bytes, member: &str) -> Bytes {
    let Some(brace) = body.iter().position(|&b| b == b'{') else {
        return body.clone();
    };
    let mut out = BytesMut::with_capacity(body.len() + member.len() + 1);
    out.extend_from_slice(&body[..=brace]);
    out.extend_from_slice(member.as_bytes());
    let rest = &body[brace + 1..];
    // `{}` must not become `{"k":v,}`.
    if rest.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'}') {
        out.extend_from_slice(b",");
    }
    out.extend_from_slice(rest);
    out.freeze()
}

/// The body with its `model` value replaced (or added, if it had none).
fn rewrite_model(body: &Bytes, span: Option<(usize, usize)>, model: &str) -> Bytes {
    let quoted = serde_json::Value::from(model).to_string();
    let Some((start, end)) = span else {
        return insert_member(body, &format!("\"model\":{quoted}"));
    };
    let mut out = BytesMut::with_capacity(body.len() + quoted.len());
    out.extend_from_slice(&body[..start]);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(&body[end..]);
    out.freeze()
}

/// Takes a slot on the first willing node of the key's walk; when every willing node
/// is at cap, applies `routing.when_saturated`. Returns whether the request queued.
async fn admit(
    pool: &Pool,
    routing: &RoutingConfig,
    target: balance::Target,
    tried: &[usize],
    metrics: &Metrics,
) -> Result<(Choice, bool), ProxyError> {
    let b = &pool.balancer;
    let name = || pool.config.name.clone();
    // FIFO: a new request does not overtake the ones already waiting.
    let queue_first =
        routing.when_saturated == WhenSaturated::Queue && tried.is_empty() && b.load.queued() > 0;
    let walk = if queue_first {
        Walk::Saturated
    } else {
        b.choose(target, tried, std::time::Instant::now())
    };
    match walk {
        Walk::Chosen(c) => Ok((c, false)),
        Walk::Unavailable => Err(ProxyError::NoNode { pool: name() }),
        Walk::Saturated => match routing.when_saturated {
            WhenSaturated::Reject => Err(ProxyError::Saturated { pool: name() }),
            WhenSaturated::LeastLoaded => b
                .choose_least_loaded(target, tried)
                .map(|c| (c, false))
                .ok_or_else(|| ProxyError::NoNode { pool: name() }),
            WhenSaturated::Queue => {
                let waited = Instant::now();
                let admitted = wait_for_slot(b, routing, target, tried, &pool.config.name).await;
                metrics
                    .queue_wait
                    .with_label_values(&[&pool.config.name])
                    .observe(waited.elapsed().as_secs_f64());
                admitted.map(|c| (c, true))
            }
        },
    }
}

/// Waits in the pool's FIFO (bounded by `max_queue` and `queue_timeout`), re-running
/// the walk each time a slot frees, so the key still lands on its nearest free node.
async fn wait_for_slot(
    b: &Balancer,
    routing: &RoutingConfig,
    target: balance::Target,
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
        match b.choose(target, tried, std::time::Instant::now()) {
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

fn route_label(target: &Target<'_>, queued: bool, choice: &Choice) -> String {
    if let Some(f) = &target.fallback {
        return f.clone();
    }
    match (queued, choice.shunted, choice.distance) {
        (true, _, _) => "queued".to_string(),
        (false, true, _) => "shunt".to_string(),
        (false, false, 0) => "primary".to_string(),
        (false, false, d) => format!("spill:{d}"),
    }
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

/// The engine's response head, cleaned and labelled, with the relayed body.
fn respond(
    mut head: http::response::Parts,
    body: RelayBody,
    node: &str,
    route: &str,
    attempts: u32,
) -> Response<BoxBody> {
    headers::strip_hop_by_hop(&mut head.headers);
    let h = &mut head.headers;
    if let Ok(v) = HeaderValue::from_str(node) {
        h.insert(headers::NODE.clone(), v);
    }
    if let Ok(v) = HeaderValue::from_str(route) {
        h.insert(headers::ROUTE.clone(), v);
    }
    h.insert(headers::ATTEMPTS.clone(), HeaderValue::from(attempts));
    Response::from_parts(head, BoxBody::new(body))
}

fn final_error(failures: &[Failure]) -> ProxyError {
    let attempts = failures
        .iter()
        .map(|f| f.text.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    if failures.iter().all(|f| f.reason == "busy") {
        return ProxyError::Busy { attempts };
    }
    match failures.last() {
        Some(f) if f.reason == "timeout" => ProxyError::UpstreamTimeout { attempts },
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_is_rewritten_or_added() {
        let body = Bytes::from_static(br#"{"model": "a", "messages": []}"#);
        let span = Some((10, 13));
        assert_eq!(
            &rewrite_model(&body, span, "big/model")[..],
            br#"{"model": "big/model", "messages": []}"#
        );
        let body = Bytes::from_static(br#"{"messages": []}"#);
        assert_eq!(
            &rewrite_model(&body, None, "m")[..],
            br#"{"model":"m","messages": []}"#
        );
        assert_eq!(
            &rewrite_model(&Bytes::from_static(b"{ }"), None, "m")[..],
            br#"{"model":"m" }"#
        );
    }
}
