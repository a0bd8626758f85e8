//! One request's trip to the engines: admission on the key's successor walk (spill,
//! shunt, queue, reject or overcommit), the upstream exchange, the first-packet probe
//! for streams, and failover to the next untried successor (then to the pool's
//! fallbacks) on anything that fails before a byte has gone to the client.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use tokio::time::Instant;

use super::admission;
use super::body::BoxBody;
use super::edit::{self, Edits};
use super::outcome::{FailoverReason, RequestOutcome};
use super::probe::{self, Commit, ProbeFailure};
use super::relay::{Finish, Learn, RelayBody};
use super::upstream::{EngineBody, Outgoing, Upstream};
use super::{headers, ProxyError};
use crate::clip::clip;
use crate::config::RoutingConfig;
use crate::routing::breaker::{BreakerSettings, Outcome};
use crate::routing::cost::Stakes;
use crate::routing::facts::RequestFacts;
use crate::routing::key;
use crate::routing::node::{Node, NodeState, Prefilling};
use crate::routing::route::Route;
use crate::routing::table::{Plan, Pool, Table};
use crate::routing::walk::{self, Choice};
use crate::server::metrics::Metrics;

/// Why one attempt did not produce a response for the client.
struct Failure {
    reason: FailoverReason,
    text: String,
}

impl Failure {
    fn new(reason: FailoverReason, text: String) -> Self {
        Failure { reason, text }
    }
}

/// The health outcome of one attempt, recorded exactly once: by [`Attempt::finish`],
/// or as neutral when the attempt is dropped unfinished (the client left), so a
/// half-open probe slot is never leaked.
///
/// Until then its estimated uncached prompt counts in the node's prefill backlog, so
/// each stream's latency is judged knowing what the node prefilled besides it.
struct Attempt {
    node: Arc<NodeState>,
    probe: bool,
    settings: Arc<BreakerSettings>,
    done: bool,
    /// Its uncached prompt tokens as estimated.
    uncached_estimate: u32,
    prefilling: Prefilling,
}

impl Attempt {
    /// Starts an attempt on the chosen node.
    fn start(choice: &Choice, settings: &Arc<BreakerSettings>, uncached_estimate: u32) -> Self {
        let node = choice.reservation.node().clone();
        let prefilling = node.start_prefill(uncached_estimate);
        Attempt {
            node,
            probe: choice.probe,
            settings: settings.clone(),
            done: false,
            uncached_estimate,
            prefilling,
        }
    }

    fn finish(mut self, outcome: Outcome) {
        self.done = true;
        self.node.record(outcome, self.probe, &self.settings);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.done {
            self.node
                .record(Outcome::Neutral, self.probe, &self.settings);
        }
    }
}

/// One client request on its way to the engines: what every attempt needs.
pub(super) struct Exchange<'t> {
    pub upstream: &'t Arc<Upstream>,
    pub metrics: &'t Arc<Metrics>,
    pub table: &'t Arc<Table>,
    pub plan: Plan,
    pub method: Method,
    /// Path and query, as the client sent them.
    pub path: PathAndQuery,
    /// The headers for the engines (see [`headers::upstream_headers`]).
    pub headers: HeaderMap,
    /// The body as the client sent it; every target edits these bytes afresh.
    pub body: Bytes,
    pub started: Instant,
}

/// Where the request is going now: a pool, the body for it, and the key's walk there.
struct Target<'t> {
    pool: &'t Pool,
    body: Bytes,
    walk: walk::Target,
    /// What leaving its home would cost it, and what it should find there.
    stakes: Stakes,
    /// Set once the request left its own pool.
    fallback: bool,
}

/// An engine's answer that goes to the client.
enum Answer {
    /// A stream the probe committed.
    Stream {
        head: http::response::Parts,
        committed: probe::Committed,
    },
    /// Anything else that is not a failure: a 2xx, or a 4xx that is the client's.
    Plain(Response<EngineBody>),
}

impl Exchange<'_> {
    fn routing(&self) -> &RoutingConfig {
        &self.table.config.routing
    }

    /// Ask a stream for its usage chunk (to count cache hits) when the client did not,
    /// and hide that chunk from the client. Only the OpenAI APIs that define
    /// `stream_options` get it (SGLang's `/generate`, say, might reject the field).
    fn strip_usage(&self) -> bool {
        let facts = &self.plan.facts;
        facts.stream
            && matches!(self.plan.api, key::Api::Chat | key::Api::Completions)
            && self.routing().track_usage
            && !facts.include_usage
    }

    /// The pools to try, in order: the request's own, then its fallbacks; a request
    /// asking for reasoning skips pools that do not support it.
    fn pools(&self) -> Vec<&Pool> {
        let table = self.table;
        let own = &table.pools[self.plan.pool];
        std::iter::once(own)
            .chain(
                own.config
                    .fallbacks
                    .iter()
                    .filter_map(|name| table.pools.iter().find(|p| p.config.name == *name)),
            )
            .filter(|p| !self.plan.facts.wants_reasoning || p.config.supports_thinking)
            .collect()
    }

    /// Points the request at `pool`: the key's hash there, and the body with every
    /// edit applied in one step on the client's bytes (for a fallback pool, `model`
    /// rewritten to the pool's first model).
    fn target<'p>(&self, pool: &'p Pool) -> Target<'p> {
        let name = &pool.config.name;
        let facts = &self.plan.facts;
        let (hash, group) = key::key_hashes(name, facts, self.routing().hash_seed);
        let fallback = name != &self.table.pools[self.plan.pool].config.name;
        let b = &pool.balancer;
        let stakes = Stakes::of(facts, group, b.home_of(hash).is_some());
        let edits = Edits {
            model: fallback.then(|| pool.config.models.first().unwrap_or(name).as_str()),
            include_usage: self.strip_usage(),
        };
        Target {
            pool,
            body: edit::apply(&self.body, &facts.spans, edits),
            walk: b.place(hash, group, facts.turn_seen(), stakes.own_tokens),
            stakes,
            fallback,
        }
    }

    /// Admission, the exchange and failover, until an answer commits or nothing is
    /// left to try.
    pub async fn run(self) -> Result<Response<BoxBody>, ProxyError> {
        let pools = self.pools();
        let Some((first, mut rest)) = pools.split_first() else {
            let own = &self.table.pools[self.plan.pool].config.name;
            return Err(ProxyError::NoNode {
                pool: format!("{own} (no pool for a reasoning request)"),
            });
        };
        let mut target = self.target(first);
        let max_attempts = self.routing().max_attempts;
        let mut tried = Vec::with_capacity(max_attempts as usize);
        let mut failures: Vec<Failure> = Vec::new();
        let mut attempt = 0;
        while attempt < max_attempts {
            let (choice, queued) = match admission::admit(
                target.pool,
                self.routing(),
                target.walk,
                &target.stakes,
                &tried,
                self.metrics,
            )
            .await
            {
                Ok(admitted) => admitted,
                Err(ProxyError::NoNode { .. }) if !rest.is_empty() => {
                    let next = rest[0];
                    rest = &rest[1..];
                    tracing::debug!(from = %target.pool.config.name, to = %next.config.name, "no node available; trying the fallback pool");
                    target = self.target(next);
                    tried.clear();
                    continue;
                }
                Err(e) if failures.is_empty() => return Err(e),
                Err(_) => break, // nothing left to fail over to
            };
            let admitted_at = Instant::now();
            attempt += 1;
            tried.push(choice.index);
            let pool = target.pool;
            let node = pool.balancer.node(choice.index);
            let estimate = uncached_estimate(&self.plan.facts, &target.stakes, &choice);
            let health = Attempt::start(&choice, pool.balancer.settings(), estimate);
            let failure = match self.ask(pool, node, &target.body).await {
                Ok(answer) => {
                    let route = route_of(&target, queued, &choice);
                    let ctx = Decision {
                        pool,
                        node,
                        route,
                        attempts: attempt,
                        choice,
                        walk: target.walk,
                        stakes: target.stakes,
                        since: admitted_at,
                    };
                    return Ok(self.commit(ctx, answer, health));
                }
                Err(f) => f,
            };
            self.metrics
                .count_failover(&pool.config.name, failure.reason);
            if failure.reason == FailoverReason::Busy {
                health.finish(Outcome::Neutral);
            } else {
                tracing::info!(pool = %pool.config.name, reason = %failure.text, attempt, "attempt failed; failing over");
                health.finish(Outcome::Failure);
            }
            failures.push(failure);
        }
        Err(final_error(&failures))
    }

    /// One attempt: sends the request to `node` and classifies what comes back.
    async fn ask(&self, pool: &Pool, node: &Node, body: &Bytes) -> Result<Answer, Failure> {
        let bad_uri = |e: &dyn std::fmt::Display| {
            Failure::new(
                FailoverReason::Error,
                format!("{}: bad upstream URI: {e}", node.id()),
            )
        };
        let uri = node.origin_form(&self.path).map_err(|e| bad_uri(&e))?;
        let (authority, host) = node.authority().ok_or_else(|| bad_uri(&"no host"))?;
        let req = Outgoing {
            method: &self.method,
            target: uri.path_and_query().map_or("/", |p| p.as_str()),
            host,
            headers: &self.headers,
            body,
        };
        let stream = self.plan.facts.stream;
        let sent = Instant::now();
        // A stream has `first_token_timeout` for its head and first token together.
        let budget = if stream {
            pool.config.first_token_timeout
        } else {
            self.table.config.server.request_timeout
        };
        let resp = match tokio::time::timeout(budget, self.upstream.send(authority, req)).await {
            Err(_) => {
                let ms = budget.as_millis();
                return Err(Failure::new(
                    FailoverReason::Timeout,
                    format!("{}: no response within {ms} ms", node.id()),
                ));
            }
            Ok(Err(e)) => {
                return Err(Failure::new(
                    FailoverReason::Error,
                    format!("{}: {e}", node.id()),
                ))
            }
            Ok(Ok(resp)) => resp,
        };
        let status = resp.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Err(Failure::new(
                FailoverReason::Busy,
                format!("{}: HTTP 429", node.id()),
            ));
        }
        if status.is_server_error() {
            return Err(Failure::new(
                FailoverReason::Http5xx,
                format!("{}: HTTP {}", node.id(), status.as_u16()),
            ));
        }
        if !(stream && status.is_success() && is_event_stream(resp.headers())) {
            return Ok(Answer::Plain(resp));
        }
        let (head, body) = resp.into_parts();
        let deadline = sent + pool.config.first_token_timeout;
        match probe::first_packet(body, sent, deadline).await {
            Ok(committed) => Ok(Answer::Stream { head, committed }),
            Err(ProbeFailure::Timeout) => Err(Failure::new(
                FailoverReason::Timeout,
                format!(
                    "{}: no first token within {} ms",
                    node.id(),
                    pool.config.first_token_timeout.as_millis()
                ),
            )),
            Err(ProbeFailure::Error(msg)) => Err(Failure::new(
                FailoverReason::Error,
                format!(
                    "{}: stream error before the first token: {}",
                    node.id(),
                    clip(&msg)
                ),
            )),
            Err(ProbeFailure::NoContent) => Err(Failure::new(
                FailoverReason::NoContent,
                format!("{}: stream ended with no content", node.id()),
            )),
        }
    }

    /// Sends an answer to the client: the node's health recorded, the decision
    /// counted, the reservation handed to the relayed body.
    fn commit(&self, c: Decision<'_>, answer: Answer, health: Attempt) -> Response<BoxBody> {
        let idle = self.table.config.server.idle_stream_timeout;
        let settings = c.pool.balancer.settings().clone();
        self.metrics
            .count_decision(&c.pool.config.name, &c.route, c.choice.distance);
        c.pool
            .balancer
            .settle(c.walk, c.choice.index, c.choice.distance);
        let pool_index = self
            .table
            .pools
            .iter()
            .position(|p| std::ptr::eq(p, c.pool))
            .unwrap_or(0);
        let (uncached_estimate, ahead) = (health.uncached_estimate, health.prefilling.ahead());
        let learn = || Learn {
            table: self.table.clone(),
            pool: pool_index,
            target: c.walk,
            stakes: c.stakes,
            node: c.choice.index,
            since: c.since,
            uncached_estimate,
            ahead,
        };
        let finish = |status: StatusCode, ttft: Option<Duration>| Finish {
            metrics: self.metrics.clone(),
            route: c.route.clone(),
            attempts: c.attempts,
            status: status.as_u16(),
            outcome: RequestOutcome::of_status(status.as_u16()),
            started: self.started,
            ttft,
            learn: learn(),
        };
        let (head, body) = match answer {
            Answer::Stream {
                mut head,
                committed,
            } => {
                // A client error in an SSE event is the client's to read: the node is
                // fine, and its latency says nothing.
                let client_error = committed.by == Commit::ClientError;
                let ttft = (!client_error).then_some(committed.ttft);
                if let Some(t) = ttft {
                    self.metrics
                        .observe_ttft(&c.pool.config.name, c.node.id(), t);
                }
                let mut finish = finish(head.status, ttft);
                if client_error {
                    finish.outcome = RequestOutcome::ClientError;
                }
                head.headers.remove(header::CONTENT_LENGTH);
                health.finish(Outcome::Success);
                let body = RelayBody::stream(
                    committed.held,
                    committed.rest,
                    c.choice.reservation,
                    finish,
                    idle,
                    settings,
                    self.strip_usage(),
                );
                (head, body)
            }
            Answer::Plain(resp) => {
                health.finish(Outcome::Success);
                let (head, body) = resp.into_parts();
                let finish = finish(head.status, None);
                let body = RelayBody::plain(body, c.choice.reservation, finish, idle, settings);
                (head, body)
            }
        };
        respond(head, body, c.node, &c.route, c.attempts)
    }
}

/// The decision being committed.
struct Decision<'t> {
    pool: &'t Pool,
    node: &'t Node,
    route: Route,
    attempts: u32,
    choice: Choice,
    walk: walk::Target,
    stakes: Stakes,
    /// When the slot was taken.
    since: Instant,
}

/// A request's uncached prompt tokens on the node chosen, as estimated before it goes:
/// at its home (the walk's first node) what it should find cached there (its history,
/// or its group's prefix) is left out; anywhere else all of it.
fn uncached_estimate(facts: &RequestFacts, stakes: &Stakes, choice: &Choice) -> u32 {
    let prompt = facts.tokens.prompt;
    if choice.distance > 0 {
        return prompt;
    }
    let cached = (stakes.expect * f64::from(prompt)) as u32;
    prompt.saturating_sub(cached.max(stakes.group_tokens))
}

fn route_of(target: &Target<'_>, queued: bool, choice: &Choice) -> Route {
    if target.fallback {
        return Route::Fallback(target.pool.config.name.clone());
    }
    if queued {
        return Route::Queued;
    }
    Route::walked(choice.distance, choice.shunted)
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
    node: &Node,
    route: &Route,
    attempts: u32,
) -> Response<BoxBody> {
    headers::strip_hop_by_hop(&mut head.headers);
    let h = &mut head.headers;
    h.reserve(3);
    if let Some(v) = node.id_header() {
        h.insert(headers::NODE.clone(), v.clone());
    }
    let label = match route.label() {
        Cow::Borrowed(kind) => Ok(HeaderValue::from_static(kind)),
        Cow::Owned(detailed) => HeaderValue::try_from(detailed),
    };
    if let Ok(v) = label {
        h.insert(headers::ROUTE.clone(), v);
    }
    h.insert(headers::ATTEMPTS.clone(), headers::count_value(attempts));
    Response::from_parts(head, BoxBody::new(body))
}

fn final_error(failures: &[Failure]) -> ProxyError {
    let attempts = failures
        .iter()
        .map(|f| f.text.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    if failures.iter().all(|f| f.reason == FailoverReason::Busy) {
        return ProxyError::Busy { attempts };
    }
    match failures.last() {
        Some(f) if f.reason == FailoverReason::Timeout => ProxyError::UpstreamTimeout { attempts },
        _ => ProxyError::Upstream {
            count: failures.len() as u32,
            attempts,
        },
    }
}
