//! One request's trip to the engines: admission on the key's successor walk (spill,
//! shunt, queue, reject or overcommit), the upstream exchange, the first-packet probe
//! for streams, and failover to the next untried successor (then to the pool's
//! fallbacks) on anything that fails before a byte has gone to the client. An
//! engine's 500 is kept until a second engine says whether the request caused it.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::uri::PathAndQuery;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body_util::BodyExt;
use smallvec::SmallVec;
use tokio::time::Instant;

use super::admission;
use super::body::BoxBody;
use super::disaggregated::Bootstrap;
use super::edit::{self, Edits};
use super::kv_transfer;
use super::probe::{self, Commit, ProbeFailure};
use super::relay::{Beat, RelayBody, RequestLog};
use super::upstream::{EngineBody, Outgoing, Upstream, UpstreamError};
use super::{headers, now, ProxyError};
use crate::clip::clip;
use crate::config::RoutingConfig;
use crate::routing::breaker::Outcome;
use crate::routing::decision::{Placement, Suspect, Ticket};
use crate::routing::facts::Api;
use crate::routing::node::Node;
use crate::routing::route::Route;
use crate::routing::stored::{self, Holder};
use crate::routing::table::{Pool, Table};
use crate::telemetry::metrics::RequestMetrics;
use crate::telemetry::outcome::{FailoverReason, RequestOutcome, StoredLookup};
use crate::telemetry::series::NodeSeries;
use crate::telemetry::traces;

/// How much of a plain (not streamed) answer is read before it goes to the client: an
/// answer that breaks within it is failed over instead of cut. Answers are usually a
/// few kilobytes; a longer one is relayed as it comes past this.
const PLAIN_HOLD: usize = 1 << 20;

/// Why one attempt did not produce a response for the client.
struct Failure {
    reason: FailoverReason,
    text: String,
    /// An HTTP 500 whose answer may be the request's own error, read whole: it goes to
    /// the client if a second engine answers the request the same way. (Boxed, as
    /// `Kept`: a rare path that would otherwise enlarge every request's future.)
    answer: Option<Box<Answer>>,
    /// No connection could be made to the node's server: every node behind its URL
    /// (the other ranks of a data-parallel server) is down with it for this request.
    unreachable: bool,
}

impl Failure {
    fn new(reason: FailoverReason, text: String) -> Self {
        Failure {
            reason,
            text,
            answer: None,
            unreachable: false,
        }
    }
}

/// An engine's HTTP 500, kept until a second engine's answer to the same request says
/// whether the request caused it.
struct Kept {
    node: String,
    suspect: Suspect,
    answer: Box<Answer>,
    series: &'static NodeSeries,
    route: Route,
    span: tracing::Span,
}

/// The last engine's 404 to a request naming a stored response no table knows
/// ([`Holder::Search`]): not that engine's response. The client reads it if no engine
/// holds the response.
struct NotHere {
    ticket: Ticket,
    series: &'static NodeSeries,
    route: Route,
    answer: Answer,
    span: tracing::Span,
}

/// One client request on its way to the engines: what every attempt needs.
pub(super) struct Exchange<'t> {
    pub upstream: &'t Arc<Upstream>,
    pub metrics: &'t Arc<RequestMetrics>,
    pub table: &'t Table,
    /// Where it is placed now: its own pool, then each fallback in turn.
    pub placement: Placement,
    pub method: Method,
    /// Path and query, as the client sent them.
    pub path: PathAndQuery,
    /// The headers for the engines.
    pub headers: headers::UpstreamHeaders,
    /// The body as the client sent it; every pool edits these bytes afresh.
    pub body: Bytes,
    pub started: Instant,
    /// Who is asking, if it must wait in a queue.
    pub asker: admission::Asker<'t>,
    /// The request's trace span (disabled when traces are off).
    pub span: tracing::Span,
    /// Time spent in the queue so far, over all attempts.
    pub queue_wait: std::time::Duration,
    /// Which leg of a disaggregated request this is, if it is one.
    pub leg: Leg,
}

/// What a request is asked of the pool it is placed in.
#[derive(Debug, Default)]
pub(super) enum Leg {
    /// The whole request.
    #[default]
    Whole,
    /// A disaggregated request's prefill: one token, whole, the KV cache kept for a
    /// decode engine ([`kv_transfer::prefill_body`]).
    Prefill,
    /// A disaggregated request's decode, with the `kv_transfer_params` its prefill
    /// engine answered.
    Decode(Box<serde_json::value::RawValue>),
    /// An SGLang-disaggregated request's prefill: the request, with its engine's
    /// bootstrap address and the request's rooms, which it tells its decode leg. One
    /// attempt: its decode leg waits on that engine.
    PrefillFor(Arc<Bootstrap>),
    /// An SGLang-disaggregated request's decode: the request, with the bootstrap
    /// address and rooms of its prefill leg's engine, sent once that leg's is.
    DecodeFrom(Arc<Bootstrap>),
}

impl Leg {
    /// Whether it asks an engine for a prefill alone: one token, its time the node's
    /// time to first token.
    fn prefills(&self) -> bool {
        matches!(self, Leg::Prefill | Leg::PrefillFor(_))
    }
}

/// An engine's answer that goes to the client.
enum Answer {
    /// A stream the probe committed.
    Stream {
        head: http::response::Parts,
        committed: probe::Committed,
    },
    /// Anything else that is not a failure: a 2xx, or a 4xx that is the client's; its
    /// first bytes read already (`held`).
    Plain {
        head: http::response::Parts,
        held: Bytes,
        body: EngineBody,
        /// A prefill leg's: from the send until it was read whole (or `held` was
        /// full). None for any other answer, which reads no clock for it.
        took: Option<std::time::Duration>,
    },
}

impl Answer {
    fn status(&self) -> StatusCode {
        match self {
            Answer::Stream { head, .. } | Answer::Plain { head, .. } => head.status,
        }
    }

    /// The bytes read of it before it commits.
    fn held(&self) -> &Bytes {
        match self {
            Answer::Stream { committed, .. } => &committed.held,
            Answer::Plain { held, .. } => held,
        }
    }
}

impl<'t> Exchange<'t> {
    /// The same request, placed by `placement`, as `leg`: a disaggregated request's
    /// other leg, sent alongside this one.
    pub fn sibling(&self, placement: Placement, leg: Leg) -> Exchange<'t> {
        Exchange {
            upstream: self.upstream,
            metrics: self.metrics,
            table: self.table,
            placement,
            method: self.method.clone(),
            path: self.path.clone(),
            headers: self.headers.clone(),
            body: self.body.clone(),
            started: self.started,
            asker: self.asker.clone(),
            span: self.span.clone(),
            queue_wait: self.queue_wait,
            leg,
        }
    }
}

impl Exchange<'_> {
    fn routing(&self) -> &RoutingConfig {
        &self.table.config.routing
    }

    /// Its tenant's rate limits, in the answer's head (its API's rate-limit headers).
    fn tell_rate_limits(&self, head: &mut http::response::Parts) {
        if let Some(standing) = &self.asker.standing {
            head.headers
                .extend(standing.headers_for(self.placement.api));
        }
    }

    /// Its charge to its tenant's tokens, for the relayed body to settle from the
    /// engine's usage. None for a prefill leg: a disaggregated request's tokens are
    /// settled once, by its decode leg. None for an answer of an error status either:
    /// the request gives its estimate back ([`super::tenant::Refund`], in `route`).
    fn charge_for(&self, status: StatusCode) -> Option<super::tenant::Charge> {
        let settles = status.is_success() && !self.leg.prefills();
        self.asker.charge.as_ref().filter(|_| settles).cloned()
    }

    /// A committed stream's keep-alives (`server.sse_keepalive`), if it has them.
    fn keepalive(&self) -> Option<Beat> {
        let every = self.table.config.server.sse_keepalive;
        (!every.is_zero()).then(|| Beat::new(every, self.metrics.sse_keepalives("streaming")))
    }

    /// Ask a stream for its usage chunk (to count cache hits) when the client did not,
    /// and hide that chunk from the client. Only the OpenAI APIs that define
    /// `stream_options` get it (SGLang's `/generate`, say, might reject the field).
    fn strip_usage(&self) -> bool {
        let facts = &self.placement.facts;
        facts.stream
            && matches!(self.placement.api, Api::Chat | Api::Completions)
            && self.routing().track_usage
            && !facts.include_usage
    }

    /// The body for the pool placed in, with every edit applied in one step on the
    /// client's bytes (for a fallback pool, `model` rewritten to the pool's first model;
    /// an alias, to the model it stands for).
    fn body_for(&self, placement: &Placement) -> Bytes {
        let pool = &placement.pool().config;
        let model = if placement.api == Api::StoredResponse {
            // It names a response, not a model.
            None
        } else if placement.is_fallback() {
            Some(pool.models.first().unwrap_or(&pool.name).as_str())
        } else {
            placement
                .facts
                .model
                .as_deref()
                .and_then(|m| pool.aliased(m))
        };
        let edits = Edits {
            model,
            include_usage: self.strip_usage(),
        };
        let body = edit::apply(&self.body, &placement.facts.spans, edits);
        match &self.leg {
            Leg::Whole | Leg::PrefillFor(_) | Leg::DecodeFrom(_) => body,
            // The client's body was read as JSON before its prefill leg began
            // (`disaggregated`), and the edits keep it JSON.
            Leg::Prefill => kv_transfer::prefill_body(&body).unwrap_or(body),
            Leg::Decode(params) => kv_transfer::decode_body(&body, params),
        }
    }

    /// Admission, the exchange and failover, until an answer commits or nothing is
    /// left to try. `asking` names the node of the attempt in progress (none while the
    /// request waits), for a client who leaves before the answer.
    pub async fn run(
        &mut self,
        asking: &mut Option<&'static NodeSeries>,
    ) -> Result<Response<BoxBody>, ProxyError> {
        let mut body = self.body_for(&self.placement);
        let max_attempts = match &self.leg {
            Leg::PrefillFor(_) => 1,
            _ => self.routing().max_attempts,
        };
        // Engines that do not serve the adapter asked for count as tried from the start.
        let mut tried: SmallVec<[usize; 4]> = SmallVec::new();
        tried.extend_from_slice(self.placement.unserved());
        if let Leg::PrefillFor(bootstrap) = &self.leg {
            tried.extend_from_slice(&bootstrap.avoid);
        }
        let mut failures: Vec<Failure> = Vec::new();
        // The last HTTP 500 answered, until another engine's answer says whose error
        // it was (its node blamed when dropped).
        let mut kept: Option<Box<Kept>> = None;
        // The last engine's 404 while looking for a stored response.
        let mut not_here: Option<Box<NotHere>> = None;
        let mut attempt = 0;
        while attempt < max_attempts {
            // One reading of the clock for the walk, the ticket and the send, unless
            // the request waited for its slot.
            let mut at = Instant::now();
            let admitted = admission::admit(
                &self.placement,
                self.routing(),
                &tried,
                self.metrics,
                &self.asker,
                at.into_std(),
            )
            .await;
            let (choice, queued, waited) = match admitted {
                Ok(admitted) => admitted,
                // The one engine that holds the response it names takes no requests.
                Err(ProxyError::NoNode { .. })
                    if failures.is_empty() && self.placement.holding_node().is_some() =>
                {
                    let node = self.placement.holding_node().map_or("", |n| n.id());
                    let id = self.placement.facts.follows.as_deref().unwrap_or_default();
                    self.count_stored_lookup(StoredLookup::Unavailable);
                    return Err(ProxyError::HolderUnavailable {
                        id: clip(id),
                        node: node.to_string(),
                    });
                }
                // A disaggregated request's leg is not sent elsewhere: the request
                // goes whole to the fallback pool (`disaggregated`).
                Err(e @ ProxyError::NoNode { .. }) => match self
                    .placement
                    .fallback(self.table)
                    .filter(|_| matches!(self.leg, Leg::Whole))
                {
                    Some(next) => {
                        tracing::debug!(from = %self.placement.pool().config.name, to = %next.pool().config.name, "no node available; trying the fallback pool");
                        self.placement = next;
                        body = self.body_for(&self.placement);
                        tried.clear();
                        tried.extend_from_slice(self.placement.unserved());
                        continue;
                    }
                    None if failures.is_empty() && not_here.is_none() => return Err(e),
                    None => break,
                },
                Err(e) if failures.is_empty() => return Err(e),
                Err(_) => break, // nothing left to fail over to
            };
            if queued || !waited.is_zero() {
                at = Instant::now();
            }
            if !waited.is_zero() {
                self.queue_wait += waited;
                self.span
                    .record("prefixlb.queue_wait_ms", traces::ms(self.queue_wait));
            }
            attempt += 1;
            tried.push(choice.index);
            let route = route_of(&self.placement, queued, choice.distance, choice.shunted);
            let mut ticket = self.placement.ticket(choice, at.into_std());
            let span = traces::attempt_span(&self.span, ticket.node().id(), attempt);
            if !span.is_disabled() {
                span.record("prefixlb.route", route.label().as_ref());
            }
            traces::inject(&span, &mut self.headers.map);
            if let Leg::PrefillFor(bootstrap) = &self.leg {
                bootstrap.open(ticket.index(), ticket.node());
            }
            let series = self
                .metrics
                .series(&ticket.pool().config.name, ticket.node().id());
            *asking = Some(series);
            let mut failure = match self
                .ask(ticket.pool(), ticket.node(), &body, at, &span)
                .await
            {
                Ok(answer)
                    if self.placement.holder() == Holder::Search
                        && answer.status() == StatusCode::NOT_FOUND =>
                {
                    // Not this engine's response: the next is asked (no attempt spent,
                    // no fault of the node), and this answer kept in case none has it.
                    tracing::debug!(node = %ticket.node().id(), "the stored response is not on this engine; asking the next");
                    attempt -= 1;
                    *asking = None;
                    not_here = Some(Box::new(NotHere {
                        ticket,
                        series,
                        route,
                        answer,
                        span,
                    }));
                    continue;
                }
                Ok(answer) => {
                    match self.placement.holder() {
                        Holder::Any => {}
                        Holder::Only(_) => self.count_stored_lookup(StoredLookup::Known),
                        Holder::Search => self.count_stored_lookup(StoredLookup::Found),
                    }
                    return Ok(self.commit(ticket, series, route, attempt, answer, span));
                }
                Err(f) => f,
            };
            *asking = None;
            traces::record_failed_attempt(&span, failure.reason.as_str(), &failure.text);
            if failure.unreachable {
                // Its server's other ranks would refuse the connection too: out of this
                // request's failover, and the failure counts on each rank's breaker, so
                // a server that went dark opens them all as soon as it opens one.
                let nodes = &ticket.pool().balancer;
                for i in nodes.same_server(ticket.index()) {
                    if i != ticket.index() {
                        tried.push(i);
                        let state = nodes.node(i).state();
                        state.record(Outcome::Failure, false, nodes.settings(), now());
                    }
                }
            }
            let pool = &ticket.pool().config.name;
            match (failure.answer.take(), kept.take()) {
                (Some(answer), Some(earlier)) => {
                    // A second engine answered the same 500: the request is the cause
                    // (an image sent to a text-only model, say). The client reads the
                    // engine's answer, and neither node is blamed, so a client's
                    // retries cannot open every breaker in the pool.
                    tracing::info!(pool = %pool, nodes = %format_args!("{}, {}", earlier.node, ticket.node().id()), "two engines answered HTTP 500: the request's own error, passed to the client");
                    earlier.suspect.excuse(now());
                    ticket.excuse(now());
                    return Ok(self.commit(ticket, series, route, attempt, *answer, span));
                }
                (answer, earlier) => {
                    kept = earlier;
                    self.metrics.count_failover(pool, failure.reason);
                    if failure.reason == FailoverReason::Busy {
                        ticket.fail(Outcome::Neutral, now());
                    } else {
                        tracing::info!(pool = %pool, reason = %failure.text, attempt, "attempt failed; failing over");
                        match answer {
                            // Blamed unless the next engine answers the same.
                            Some(answer) => {
                                kept = Some(Box::new(Kept {
                                    node: ticket.node().id().to_string(),
                                    suspect: ticket.suspect(),
                                    answer,
                                    series,
                                    route,
                                    span,
                                }))
                            }
                            None => ticket.fail(Outcome::Failure, now()),
                        }
                    }
                }
            }
            failures.push(failure);
        }
        // Every engine asked answered that it does not hold the response, and none
        // failed (the one that holds it might have): the client reads the last answer.
        if let (Some(n), true) = (not_here, failures.is_empty()) {
            let n = *n;
            self.count_stored_lookup(StoredLookup::Missing);
            return Ok(self.commit(
                n.ticket,
                n.series,
                n.route,
                attempt.max(1),
                n.answer,
                n.span,
            ));
        }
        // No other engine was left to ask: the client reads the engine's own 500 (it
        // says more than ours would), and the node is blamed.
        if let Some(k) = kept.map(|k| *k) {
            let request = xxhash_rust::xxh3::xxh3_64(&self.body);
            if let Some(ticket) = k.suspect.blame(request, now()) {
                return Ok(self.commit(ticket, k.series, k.route, attempt, *k.answer, k.span));
            }
        }
        Err(final_error(&failures))
    }

    /// One attempt: sends the request to `node` at `sent` and classifies what comes
    /// back.
    async fn ask(
        &self,
        pool: &Pool,
        node: &Node,
        body: &Bytes,
        sent: Instant,
        span: &tracing::Span,
    ) -> Result<Answer, Failure> {
        let bad_uri = |e: &dyn std::fmt::Display| {
            Failure::new(
                FailoverReason::Error,
                format!("{}: bad upstream URI: {e}", node.id()),
            )
        };
        let uri = node.origin_form(&self.path).map_err(|e| bad_uri(&e))?;
        let (authority, host) = node.authority().ok_or_else(|| bad_uri(&"no host"))?;
        let tls = match node.is_tls() {
            false => None,
            true => Some(self.table.config.tls.client().map_err(|e| {
                Failure::new(
                    FailoverReason::Error,
                    format!("{}: no TLS client: {e}", node.id()),
                )
            })?),
        };
        // SGLang's `/generate` reads its data-parallel rank from the body (as SGLang's
        // disaggregated legs do, whose bodies name it with the rest).
        let ranked;
        let bootstrapping = matches!(self.leg, Leg::PrefillFor(_) | Leg::DecodeFrom(_));
        let body = match node.rank_header() {
            Some(rank) if self.placement.api == Api::Generate && !bootstrapping => {
                ranked = edit::with_rank(body, &self.placement.facts.spans, rank.as_bytes());
                &ranked
            }
            _ => body,
        };
        // SGLang's disaggregation: both legs name the prefill engine's bootstrap.
        let bootstrapped;
        let body = match &self.leg {
            Leg::PrefillFor(bootstrap) => {
                bootstrapped = bootstrap.body(body, node, false).await;
                &bootstrapped
            }
            Leg::DecodeFrom(bootstrap) => {
                bootstrapped = bootstrap.body(body, node, true).await;
                &bootstrapped
            }
            _ => body,
        };
        let req = Outgoing {
            tls: tls.as_ref(),
            method: &self.method,
            target: uri.path_and_query().map_or("/", |p| p.as_str()),
            host,
            headers: &self.headers,
            rank: node.rank_header(),
            body,
            tls_name: node.tls_name(),
        };
        let stream = self.placement.facts.stream;
        // A stream has `first_token_timeout` for its head and first token together; so
        // has a prefill leg, whose one token is the first.
        let budget = if stream || self.leg.prefills() {
            pool.config.first_token_timeout
        } else {
            self.table.config.server.request_timeout
        };
        let resp = match self
            .upstream
            .send(authority, req, sent, Some(sent + budget))
            .await
        {
            Err(UpstreamError::Timeout) => {
                let ms = budget.as_millis();
                return Err(Failure::new(
                    FailoverReason::Timeout,
                    format!("{}: no response within {ms} ms", node.id()),
                ));
            }
            Err(e) => {
                let mut failure =
                    Failure::new(FailoverReason::Error, format!("{}: {e}", node.id()));
                failure.unreachable = matches!(
                    e,
                    UpstreamError::Connect(_) | UpstreamError::ConnectTimeout(_)
                );
                return Err(failure);
            }
            Ok(resp) => resp,
        };
        let status = resp.status();
        span.record("http.response.status_code", status.as_u16());
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Err(Failure::new(
                FailoverReason::Busy,
                format!("{}: HTTP 429", node.id()),
            ));
        }
        // 501 and 505 answer what the request asked for (an endpoint or a feature
        // this engine does not serve, as llama.cpp answers embeddings without
        // `--embeddings`): the client's to read, like a 4xx, and no fault of the node
        // (HAProxy's rule for its layer-7 health too).
        let requests_own = matches!(
            status,
            StatusCode::NOT_IMPLEMENTED | StatusCode::HTTP_VERSION_NOT_SUPPORTED
        );
        if status.is_server_error() && !requests_own {
            let mut failure = Failure::new(
                FailoverReason::Http5xx,
                format!("{}: HTTP {}", node.id(), status.as_u16()),
            );
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                // Kept for a second opinion: a 500 may be the request's own error.
                failure.answer = Some(Box::new(self.read_plain(node, resp, sent, budget).await?));
            }
            return Err(failure);
        }
        if self.placement.api == Api::StoredResponse && is_event_stream(resp.headers()) {
            // A stored response's stream, resumed (`?stream=true`): relayed as it comes.
            let (head, body) = resp.into_parts();
            let held = Bytes::new();
            let took = self.prefill_took(sent);
            return Ok(Answer::Plain {
                head,
                held,
                body,
                took,
            });
        }
        if !(stream && status.is_success() && is_event_stream(resp.headers())) {
            return self.read_plain(node, resp, sent, budget).await;
        }
        let (head, body) = resp.into_parts();
        let deadline = sent + pool.config.first_token_timeout;
        let probe_span = traces::probe_span(span);
        let probed = probe::first_packet(body, sent, deadline).await;
        if let Ok(c) = &probed {
            probe_span.record("prefixlb.ttft_ms", traces::ms(c.ttft));
            probe_span.record("prefixlb.committed_by", c.by.as_str());
        }
        drop(probe_span);
        match probed {
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

    /// A plain (not streamed) answer. Nothing has gone to the client yet: its body is
    /// read whole (up to `PLAIN_HOLD`) before it commits, so one that breaks, or stalls
    /// for `idle_stream_timeout`, is a failure like any other (failed over, or a 502),
    /// never a cut answer.
    async fn read_plain(
        &self,
        node: &Node,
        resp: Response<EngineBody>,
        sent: Instant,
        budget: std::time::Duration,
    ) -> Result<Answer, Failure> {
        let (head, mut body) = resp.into_parts();
        let idle = self.table.config.server.idle_stream_timeout;
        let mut held = BytesMut::new();
        while held.len() < PLAIN_HOLD && !http_body::Body::is_end_stream(&body) {
            let until = (sent + budget).min(Instant::now() + idle);
            let frame = match tokio::time::timeout_at(until, body.frame()).await {
                Err(_) => {
                    return Err(Failure::new(
                        FailoverReason::Timeout,
                        format!(
                        "{}: the body stalled (no whole body within {} ms, or {} ms of silence)",
                        node.id(),
                        budget.as_millis(),
                        idle.as_millis()
                    ),
                    ))
                }
                Ok(Some(Err(e))) => {
                    return Err(Failure::new(
                        FailoverReason::Error,
                        format!("{}: {e}", node.id()),
                    ))
                }
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => break,
            };
            if let Ok(data) = frame.into_data() {
                held.extend_from_slice(&data);
            }
        }
        let held = held.freeze();
        let took = self.prefill_took(sent);
        Ok(Answer::Plain {
            head,
            held,
            body,
            took,
        })
    }

    /// A prefill leg's time from `sent` to now; none (and no clock read) for any other.
    fn prefill_took(&self, sent: Instant) -> Option<std::time::Duration> {
        self.leg.prefills().then(|| sent.elapsed())
    }

    /// Counts a request naming a stored response by how its engine was found (in the
    /// pool it was placed in).
    fn count_stored_lookup(&self, lookup: StoredLookup) {
        let pool = &self.placement.pool().config.name;
        self.metrics.count_stored_lookup(pool, lookup);
    }

    /// Sends an answer to the client: the ticket settled (the node's health, the
    /// conversation's home), the decision counted, the ticket handed to the relayed
    /// body, which holds the slot to the end.
    fn commit(
        &self,
        mut ticket: Ticket,
        series: &'static NodeSeries,
        route: Route,
        attempts: u32,
        answer: Answer,
        attempt_span: tracing::Span,
    ) -> Response<BoxBody> {
        let idle = self.table.config.server.idle_stream_timeout;
        if !self.span.is_disabled() {
            self.span.record("prefixlb.route", route.label().as_ref());
            self.span.record("prefixlb.node", ticket.node().id());
            self.span.record("prefixlb.attempts", attempts);
        }
        series.count_decision(&route, ticket.distance());
        self.learn_stored(&ticket, &answer);
        let committed_at = Instant::now();
        ticket.settle(committed_at.into_std());
        let log = |status: StatusCode, ttft, ticket| RequestLog {
            series,
            route: route.clone(),
            attempts,
            status: status.as_u16(),
            outcome: RequestOutcome::of_status(status.as_u16()),
            started: self.started,
            ttft,
            ticket,
            teaches: self.placement.api.teaches(),
            charge: self.charge_for(status),
            tenant_tokens: (!self.leg.prefills() && self.table.config.tenancy.counts_usage)
                .then(|| self.metrics.tenant_tokens(self.asker.tenant_label())),
            spans: [self.span.clone(), attempt_span.clone()],
            id: self.headers.id.as_ref().map(|id| id.value.clone()),
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
                    series.observe_ttft(t);
                }
                head.headers.remove(header::CONTENT_LENGTH);
                label(&mut head, ticket.node(), &route, attempts);
                self.tell_rate_limits(&mut head);
                let mut log = log(head.status, ttft, ticket);
                if client_error {
                    log.outcome = RequestOutcome::ClientError;
                }
                let body = RelayBody::stream(
                    committed.held,
                    committed.rest,
                    log,
                    idle,
                    committed_at,
                    self.strip_usage(),
                    self.placement.api.is_anthropic(),
                )
                .keep_alive(self.keepalive());
                (head, body)
            }
            Answer::Plain {
                mut head,
                held,
                body,
                took,
            } => {
                label(&mut head, ticket.node(), &route, attempts);
                self.tell_rate_limits(&mut head);
                // A prefill leg's one token is its first: the time it took is the
                // prefill's, which the breaker and the pool's prefill rate learn from.
                let ttft = took.filter(|_| head.status.is_success());
                if let Some(t) = ttft {
                    series.observe_ttft(t);
                }
                let log = log(head.status, ttft, ticket);
                let anthropic = self.placement.api.is_anthropic();
                (
                    head,
                    RelayBody::plain(held, body, log, idle, committed_at, anthropic),
                )
            }
        };
        Response::from_parts(head, BoxBody::new(body))
    }
}

impl Exchange<'_> {
    /// What an answer says of stored responses: the node that answers a response it
    /// stores holds it from now on; one found by asking holds the response it was
    /// asked for; a deleted response is held nowhere.
    fn learn_stored(&self, ticket: &Ticket, answer: &Answer) {
        let p = &self.placement;
        if !answer.status().is_success() {
            return;
        }
        let balancer = &ticket.pool().balancer;
        if p.facts.stored {
            let stream = matches!(answer, Answer::Stream { .. });
            if let Some(id) = stored::created_id(answer.held(), stream) {
                balancer.hold(stored::id_hash(id), ticket.index());
            }
        }
        let Some(named) = &p.facts.follows else {
            return;
        };
        let named = stored::id_hash(named);
        if p.api == Api::StoredResponse && self.method == Method::DELETE {
            balancer.forget(named);
        } else if p.holder() == Holder::Search {
            balancer.hold(named, ticket.index());
        }
    }
}

fn route_of(placement: &Placement, queued: bool, distance: usize, shunted: bool) -> Route {
    if placement.is_fallback() {
        return Route::Fallback(placement.pool().config.name.clone());
    }
    if queued {
        return Route::Queued;
    }
    Route::walked(distance, shunted)
}

pub(super) fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

/// The engine's response head (its hop-by-hop fields already left out by
/// [`super::h1::parse_response`]), labelled with where it went.
fn label(head: &mut http::response::Parts, node: &Node, route: &Route, attempts: u32) {
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
