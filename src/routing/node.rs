//! Runtime state of nodes and pools, and the node view of a routing table: per-node
//! atomic in-flight counters taken by compare-and-swap (so a cap is never exceeded
//! under any concurrency), the RAII [`Reservation`] that gives a slot back when
//! dropped, each pool's total load and FIFO of waiting requests, and [`Node`]: one
//! node's configured identity, cap and runtime state together. State is keyed by id
//! and carried into every new table. No I/O.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Notify;

use super::breaker::{Breaker, BreakerSettings, BreakerState, Outcome};
use super::cost::{PrefillRate, SlotTime};
use super::fair::{FairQueue, Waiting};
use super::group::GroupHeat;
use super::home::{HomeTable, RecentHomes};
use super::prefix::PrefixTable;
use crate::config::NodeConfig;

/// Where a node came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeSource {
    /// The config file's `[[pools.nodes]]`.
    Static,
    /// A heartbeat in Redis (`prefixlb agent`).
    Redis,
    /// An address of a `discover` entry's name.
    Dns,
}

impl NodeSource {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeSource::Static => "static",
            NodeSource::Redis => "redis",
            NodeSource::Dns => "dns",
        }
    }

    /// Whether the balancer reads this node's engine load itself (an agent relays a
    /// heartbeating node's).
    pub fn reads_engine_load(self) -> bool {
        self != NodeSource::Redis
    }
}

/// An engine's load as it reports it (vLLM, SGLang or llama.cpp metrics, relayed by its agent).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineLoad {
    /// Sequences running.
    pub running: Option<f64>,
    /// Requests waiting in the engine's own queue.
    pub waiting: Option<f64>,
    /// Share of the KV cache in use, 0–1.
    pub kv_cache_usage: Option<f64>,
}

/// One node of a pool, as a routing table holds it: its configured identity and
/// weight, its cap, and its runtime state (shared with every other table by id).
#[derive(Debug, Clone)]
pub struct Node {
    config: NodeConfig,
    source: NodeSource,
    cap: u32,
    state: Arc<NodeState>,
    /// The `Host` header for the engine, made once (none if the URL has no authority).
    host: Option<http::HeaderValue>,
    /// Its id as the `x-prefixlb-node` header, made once.
    id_header: Option<http::HeaderValue>,
    /// Its data-parallel rank as the `x-data-parallel-rank` header, if it is one.
    rank_header: Option<http::HeaderValue>,
}

impl Node {
    /// A node with absolute cap `cap` (`max_in_flight × weight`).
    pub fn new(config: NodeConfig, source: NodeSource, cap: u32, state: Arc<NodeState>) -> Node {
        // `host[:port]`, never userinfo (validation refuses it in a node URL already).
        let host = config.url.authority().and_then(|a| {
            let host = a.as_str().rsplit('@').next().unwrap_or_default();
            http::HeaderValue::from_str(host).ok()
        });
        let id_header = http::HeaderValue::from_str(&config.id).ok();
        let rank_header = config.data_parallel_rank.map(http::HeaderValue::from);
        Node {
            config,
            source,
            cap,
            state,
            host,
            id_header,
            rank_header,
        }
    }

    /// The `x-data-parallel-rank` value of a node that is one rank of its server.
    pub fn rank_header(&self) -> Option<&http::HeaderValue> {
        self.rank_header.as_ref()
    }

    pub fn id(&self) -> &str {
        &self.config.id
    }

    /// Its rank, if it is one rank of a data-parallel server.
    pub fn data_parallel_rank(&self) -> Option<u32> {
        self.config.data_parallel_rank
    }

    /// The engine's base URL.
    pub fn url(&self) -> &http::Uri {
        &self.config.url
    }

    pub fn weight(&self) -> u32 {
        self.config.weight
    }

    /// The absolute cap, `max_in_flight × weight` (see `Balancer::cap_of` for the cap
    /// in force, which `load_factor` may tighten).
    pub fn cap(&self) -> u32 {
        self.cap
    }

    pub fn source(&self) -> NodeSource {
        self.source
    }

    pub fn state(&self) -> &Arc<NodeState> {
        &self.state
    }

    /// The engine URL for a request path (and query) on the balancer.
    pub fn upstream_uri(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        self.config.upstream_uri(path_and_query)
    }

    /// The request target sent to the engine (origin form): the engine URL's base
    /// path, if any, then the client's path and query.
    pub fn origin_form(
        &self,
        path_and_query: &http::uri::PathAndQuery,
    ) -> Result<http::Uri, http::Error> {
        let base = self.config.base_path();
        if base.is_empty() {
            return Ok(http::Uri::from(path_and_query.clone()));
        }
        Ok(http::Uri::try_from(format!("{base}{path_and_query}"))?)
    }

    /// Its id as a header value (none if the id cannot be one).
    pub fn id_header(&self) -> Option<&http::HeaderValue> {
        self.id_header.as_ref()
    }

    /// The engine is behind TLS (`https://`).
    pub fn is_tls(&self) -> bool {
        self.config.url.scheme_str() == Some("https")
    }

    /// The name its TLS certificate is checked against, where it is not its URL's host
    /// (a node found in DNS: the entry's name).
    pub fn tls_name(&self) -> Option<&str> {
        self.config.tls_name.as_deref()
    }

    /// Its engine's SGLang bootstrap port, if the config names one.
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.config.bootstrap_port
    }

    /// The engine's address and its `Host` header.
    pub fn authority(&self) -> Option<(&http::uri::Authority, &http::HeaderValue)> {
        Some((self.config.url.authority()?, self.host.as_ref()?))
    }
}

/// The models an engine serves, from its `/v1/models`: each id, and for a LoRA adapter
/// the model it adapts (vLLM lists adapters with a `parent`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Served {
    pub models: Vec<(String, Option<String>)>,
}

impl Served {
    /// Reads a `/v1/models` answer (`{"data": [{"id", "parent"?}, …]}`).
    pub fn from_json(body: &[u8]) -> Option<Served> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let models = v["data"]
            .as_array()?
            .iter()
            .filter_map(|m| {
                let id = m["id"].as_str()?.to_string();
                Some((id, m["parent"].as_str().map(str::to_string)))
            })
            .collect();
        Some(Served { models })
    }

    pub fn lists(&self, model: &str) -> bool {
        self.models.iter().any(|(id, _)| id == model)
    }

    /// The model `adapter` adapts, if this engine lists it as an adapter.
    pub fn parent_of(&self, adapter: &str) -> Option<&str> {
        self.models
            .iter()
            .find(|(id, _)| id == adapter)
            .and_then(|(_, parent)| parent.as_deref())
    }
}

/// Runtime state of one node, keyed by node id and carried across config reloads and
/// ring rebuilds.
#[derive(Debug)]
pub struct NodeState {
    pub id: String,
    in_flight: AtomicU32,
    draining: AtomicBool,
    healthy: AtomicBool,
    /// Consecutive failed / passed active health checks.
    check_failures: AtomicU32,
    check_passes: AtomicU32,
    /// Why the last active health check failed (none after one passes).
    check_error: parking_lot::Mutex<Option<String>>,
    /// What the engine serves, from its `/v1/models` (none: not known).
    served: parking_lot::Mutex<Option<Arc<Served>>>,
    pub breaker: Breaker,
    /// Breaker transitions so far, by the state entered.
    transitions: [AtomicU64; 4],
    /// How long requests hold a slot here.
    pub slot_time: SlotTime,
    /// Requests waiting for a slot here (their home).
    waiting: AtomicU32,
    /// Wakes a request waiting for a slot here, one per freed slot.
    freed: Notify,
    /// The engine's own load figures, from its agent's last heartbeat or the health
    /// checks' last read of its metrics.
    engine_load: parking_lot::Mutex<Option<EngineLoad>>,
    /// What the operator should change, when the engine's metrics name another number
    /// of data-parallel ranks than this node's server has (a node of the config).
    engine_advice: parking_lot::Mutex<Option<String>>,
    /// See [`NodeState::start_prefill`]: estimated prompt tokens sent here and not yet
    /// past their first token, and all ever sent here.
    prefill_backlog: AtomicU32,
    prefill_arrived: AtomicU64,
    /// Requests other balancer replicas are known to have in flight here, counted
    /// against the cap. Only `simulate --share-load` sets it (the upper bound of a
    /// budget shared between replicas); `serve` has no feed for it yet, so it stays 0.
    others: AtomicU32,
    /// The body hash of the last request this node was blamed for answering with an
    /// HTTP 500 that no other engine was asked about (see [`NodeState::blamed_again`]).
    lone_500: AtomicU64,
}

impl NodeState {
    pub fn new(id: impl Into<String>) -> Self {
        NodeState {
            id: id.into(),
            in_flight: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            check_failures: AtomicU32::new(0),
            check_passes: AtomicU32::new(0),
            check_error: parking_lot::Mutex::new(None),
            served: parking_lot::Mutex::new(None),
            breaker: Breaker::default(),
            transitions: Default::default(),
            slot_time: SlotTime::default(),
            waiting: AtomicU32::new(0),
            freed: Notify::new(),
            engine_load: parking_lot::Mutex::new(None),
            engine_advice: parking_lot::Mutex::new(None),
            prefill_backlog: AtomicU32::new(0),
            prefill_arrived: AtomicU64::new(0),
            others: AtomicU32::new(0),
            lone_500: AtomicU64::new(0),
        }
    }

    /// Requests other replicas have in flight here, as last estimated.
    pub fn others_in_flight(&self) -> u32 {
        self.others.load(Ordering::Relaxed)
    }

    /// Sets the estimate of [`NodeState::others_in_flight`].
    pub fn set_others_in_flight(&self, n: u32) {
        self.others.store(n, Ordering::Relaxed);
    }

    /// Requests waiting for a slot here now.
    pub fn waiting(&self) -> u32 {
        self.waiting.load(Ordering::Acquire)
    }

    /// Counts a request waiting for a slot here until the waiter is dropped; wait on
    /// [`NodeState::freed`].
    pub fn wait_here(self: &Arc<Self>) -> HomeWaiter {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        HomeWaiter { node: self.clone() }
    }

    /// Notified once per slot freed here, and all at once when the node turns requests
    /// away ([`NodeState::turned_away`]).
    pub fn freed(&self) -> &Notify {
        &self.freed
    }

    /// How many times the breaker entered `state`.
    pub fn transitions(&self, state: BreakerState) -> u64 {
        self.transitions[state as usize].load(Ordering::Relaxed)
    }

    /// Notes an HTTP 500 that no other engine was asked about, for the request whose
    /// body hashes to `hash`; true when the last such 500 was for the same body: a
    /// client retrying a request only this node could answer, blamed once, not on
    /// every retry (the openai clients retry a 500 twice).
    pub fn blamed_again(&self, hash: u64) -> bool {
        self.lone_500.swap(hash, Ordering::AcqRel) == hash
    }

    /// Records how an exchange with this node ended (see [`Breaker::record`]).
    pub fn record(&self, outcome: Outcome, trial: bool, s: &BreakerSettings, now: Instant) {
        let flip = self.breaker.record(outcome, trial, s, now);
        self.log_flip(flip);
    }

    /// Counts `tokens` (a request's estimated uncached prompt) as waiting to be
    /// prefilled here until the guard is dropped (at its first token, or its end).
    pub fn start_prefill(self: &Arc<Self>, tokens: u32) -> Prefilling {
        let backlog = self.prefill_backlog.fetch_add(tokens, Ordering::AcqRel);
        let arrived = self
            .prefill_arrived
            .fetch_add(u64::from(tokens), Ordering::AcqRel);
        Prefilling {
            node: self.clone(),
            tokens,
            backlog,
            arrived,
        }
    }

    /// The engine's load as its agent last reported it.
    pub fn engine_load(&self) -> Option<EngineLoad> {
        *self.engine_load.lock()
    }

    pub fn set_engine_load(&self, load: Option<EngineLoad>) {
        *self.engine_load.lock() = load;
    }

    /// See the field: shown in `/admin/nodes` and on the status page.
    pub fn engine_advice(&self) -> Option<String> {
        self.engine_advice.lock().clone()
    }

    pub fn set_engine_advice(&self, advice: Option<String>) {
        *self.engine_advice.lock() = advice;
    }

    /// Estimated prompt tokens sent here and not yet past their first token.
    pub fn prefill_backlog(&self) -> u32 {
        self.prefill_backlog.load(Ordering::Acquire)
    }

    /// Records an active health check: `unhealthy_after` consecutive failures mark the
    /// node down, `healthy_after` passes mark it up. Returns whether `healthy` flipped.
    /// What the engine serves, as its `/v1/models` last said (none: not known).
    pub fn served(&self) -> Option<Arc<Served>> {
        self.served.lock().clone()
    }

    pub fn set_served(&self, served: Option<Served>) {
        *self.served.lock() = served.map(Arc::new);
    }

    /// Whether the engine's `/v1/models` was read and does not list `model`.
    pub fn lacks(&self, model: &str) -> bool {
        self.served.lock().as_ref().is_some_and(|s| !s.lists(model))
    }

    /// Why the last active health check failed, if it did (shown in `/admin/nodes`).
    pub fn check_error(&self) -> Option<String> {
        self.check_error.lock().clone()
    }

    /// Records an active health check's result: [`NodeState::record_check`], with why
    /// it failed kept for the operator.
    pub fn record_check_result(
        &self,
        result: Result<(), String>,
        unhealthy_after: u32,
        healthy_after: u32,
        s: &BreakerSettings,
        now: Instant,
    ) -> bool {
        let passed = result.is_ok();
        *self.check_error.lock() = result.err();
        self.record_check(passed, unhealthy_after, healthy_after, s, now)
    }

    pub fn record_check(
        &self,
        passed: bool,
        unhealthy_after: u32,
        healthy_after: u32,
        s: &BreakerSettings,
        now: Instant,
    ) -> bool {
        let flipped = if passed {
            self.check_failures.store(0, Ordering::Relaxed);
            let passes = self.check_passes.fetch_add(1, Ordering::Relaxed) + 1;
            passes >= healthy_after && self.set_healthy(true)
        } else {
            self.check_passes.store(0, Ordering::Relaxed);
            let failures = self.check_failures.fetch_add(1, Ordering::Relaxed) + 1;
            failures >= unhealthy_after && self.set_healthy(false)
        };
        if flipped {
            tracing::warn!(node = %self.id, healthy = passed, "health check state changed");
        }
        self.log_flip(self.breaker.on_health_check(passed, s, now));
        flipped
    }

    pub(super) fn log_flip(&self, flip: Option<BreakerState>) {
        if let Some(to) = flip {
            self.transitions[to as usize].fetch_add(1, Ordering::Relaxed);
            tracing::warn!(node = %self.id, to = to.as_str(), "breaker state changed");
            if to == BreakerState::Open {
                self.freed.notify_waiters();
            }
        }
    }

    /// Whether a request waiting for a slot here should stop: the node takes no new
    /// requests (drained, unhealthy) or its breaker is open. The flips that make it so
    /// wake the waiters ([`NodeState::freed`]).
    pub fn turned_away(&self) -> bool {
        !self.accepts_new() || self.breaker.state() == BreakerState::Open
    }

    /// Requests currently reserved on this node.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Sets the drain flag; returns whether it flipped.
    pub fn set_draining(&self, draining: bool) -> bool {
        let flipped = self.draining.swap(draining, Ordering::Relaxed) != draining;
        if flipped && draining {
            self.freed.notify_waiters();
        }
        flipped
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Sets the health flag; returns whether it flipped.
    pub fn set_healthy(&self, healthy: bool) -> bool {
        let flipped = self.healthy.swap(healthy, Ordering::Relaxed) != healthy;
        if flipped && !healthy {
            self.freed.notify_waiters();
        }
        flipped
    }

    /// Whether the walk may consider this node at all (before its load is looked at).
    pub fn accepts_new(&self) -> bool {
        self.is_healthy() && !self.is_draining()
    }

    /// Takes a slot if fewer than `cap` are taken. Compare-and-swap: concurrent callers
    /// can never push the count past `cap`.
    fn try_take(&self, cap: u32) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .is_ok()
    }
}

/// Runtime state of one pool: its total load and the queue of requests waiting for a
/// slot. Keyed by pool name and carried across reloads like [`NodeState`].
#[derive(Debug, Default)]
pub struct PoolLoad {
    in_flight: AtomicU32,
    queued: AtomicUsize,
    /// The waiters, in the order they go (see [`FairQueue`]).
    queue: FairQueue,
    /// Recent traffic per prefix group (`key = "hybrid"`).
    pub groups: GroupHeat,
    /// Recent traffic per chunk of prompt text: where shared prefixes end (`hybrid`).
    pub prefixes: PrefixTable,
    /// Where each conversation lives (`hybrid`).
    pub homes: HomeTable,
    /// How many conversations each node became home to lately.
    pub recent_homes: RecentHomes,
    /// Which node holds each stored response of the Responses API (see
    /// [`super::stored`]).
    pub stored: HomeTable,
    /// The pool's prefill time per uncached token.
    pub prefill: PrefillRate,
    /// Balancer replicas serving the pool (this one included), as known: they place
    /// new conversations more conservatively so that they agree.
    replicas: AtomicU32,
}

impl PoolLoad {
    /// Balancer replicas known (at least 1).
    pub fn replicas(&self) -> u32 {
        self.replicas.load(Ordering::Relaxed).max(1)
    }

    pub fn set_replicas(&self, n: u32) {
        self.replicas.store(n, Ordering::Relaxed);
    }

    /// Requests in flight on all of the pool's nodes.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// How many waiters would go before a request of `who` that joined now.
    pub fn queue_ahead(&self, who: &Waiting) -> usize {
        self.queue.ahead(who)
    }

    /// Requests of priority class `class` waiting for a slot.
    pub fn queued_in(&self, class: usize) -> usize {
        self.queue.depth_of(class)
    }

    /// Joins the queue if fewer than `max` wait (and fewer than `class_max` of its
    /// class); the place leaves it on drop.
    pub fn enqueue(
        self: &Arc<Self>,
        who: Waiting,
        max: usize,
        class_max: usize,
    ) -> Option<QueuePlace> {
        let (id, wake) = self.queue.join(who, max, class_max)?;
        self.queued.fetch_add(1, Ordering::AcqRel);
        Some(QueuePlace {
            pool: self.clone(),
            id,
            wake,
            admitted: false,
        })
    }
}

/// A place in a pool's queue; dropping it leaves the queue.
#[derive(Debug)]
pub struct QueuePlace {
    pool: Arc<PoolLoad>,
    id: u64,
    wake: Arc<Notify>,
    admitted: bool,
}

impl QueuePlace {
    /// Notified when a freed slot is this waiter's turn.
    pub fn woken(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// It took a slot: its tenant is charged, and it leaves the queue.
    pub fn admitted(mut self) {
        self.admitted = true;
    }

    /// It was woken but found no slot it may take: the next waiter is woken.
    pub fn pass(&self) {
        self.pool.queue.pass(self.id);
    }

    /// It was woken but its slot was taken: it waits on, first in line.
    pub fn rest(&self) {
        self.pool.queue.rest(self.id);
    }

    /// Whether it goes first of all waiters.
    pub fn is_first(&self) -> bool {
        self.pool.queue.is_first(self.id)
    }

    /// Capacity came back while it waits: the waiter whose turn it is is woken.
    pub fn capacity_returned(&self) {
        self.pool.queue.wake_if_idle();
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        self.pool.queue.leave(self.id, self.admitted);
        self.pool.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One taken in-flight slot. It lives exactly as long as the upstream exchange
/// (attached to the response body), and gives the slot back on drop, waking the
/// oldest waiter of the pool.
#[derive(Debug)]
pub struct Reservation {
    node: Arc<NodeState>,
    pool: Arc<PoolLoad>,
}

impl Reservation {
    /// Takes a slot on `node` if it holds fewer than `cap`, counted in its `pool` too.
    pub fn take(node: &Arc<NodeState>, pool: &Arc<PoolLoad>, cap: u32) -> Option<Reservation> {
        if !node.try_take(cap) {
            return None;
        }
        pool.in_flight.fetch_add(1, Ordering::AcqRel);
        Some(Reservation {
            node: node.clone(),
            pool: pool.clone(),
        })
    }

    pub fn node(&self) -> &Arc<NodeState> {
        &self.node
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.node.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.pool.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.node.freed.notify_one();
        if self.pool.queued() > 0 {
            self.pool.queue.wake_next();
        }
    }
}

/// A request waiting for its home node; dropping it stops counting it there.
#[derive(Debug)]
pub struct HomeWaiter {
    node: Arc<NodeState>,
}

impl Drop for HomeWaiter {
    fn drop(&mut self) {
        self.node.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A request's prompt counted in its node's prefill backlog; dropping it stops
/// counting it.
#[derive(Debug)]
pub struct Prefilling {
    node: Arc<NodeState>,
    tokens: u32,
    /// The node's backlog and all tokens sent to it, when this request was sent.
    backlog: u32,
    arrived: u64,
}

impl Prefilling {
    /// Other prompts' tokens the node had to prefill while this one waited for its
    /// first token: the backlog when it was sent, and every prompt sent there since
    /// (an engine batches them with it). Read at the first token.
    pub fn ahead(&self) -> u32 {
        let since = self
            .node
            .prefill_arrived
            .load(Ordering::Acquire)
            .saturating_sub(self.arrived + u64::from(self.tokens));
        self.backlog
            .saturating_add(since.min(u64::from(u32::MAX)) as u32)
    }
}

impl Drop for Prefilling {
    fn drop(&mut self) {
        self.node
            .prefill_backlog
            .fetch_sub(self.tokens, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(url: &str) -> Node {
        let config = NodeConfig {
            id: "a".into(),
            url: url.parse().unwrap(),
            weight: 1,
            data_parallel_rank: None,
            tls_name: None,
            bootstrap_port: None,
        };
        Node::new(config, NodeSource::Static, 4, Arc::new(NodeState::new("a")))
    }

    #[test]
    fn the_engine_request_target_keeps_its_base_path_and_host() {
        let pq: http::uri::PathAndQuery = "/v1/chat/completions?x=1".parse().unwrap();
        for (url, want) in [
            ("http://h:8000", "/v1/chat/completions?x=1"),
            ("http://h:8000/", "/v1/chat/completions?x=1"),
            ("http://h:8000/engine/", "/engine/v1/chat/completions?x=1"),
        ] {
            let n = node(url);
            assert_eq!(n.origin_form(&pq).unwrap().to_string(), want, "{url}");
            let (authority, host) = n.authority().unwrap();
            assert_eq!(
                (authority.as_str(), host.to_str().unwrap()),
                ("h:8000", "h:8000")
            );
        }
        assert_eq!(node("http://h:8000").id_header().unwrap(), "a");
        // Credentials in a URL (refused by validation) never reach the Host header.
        let with_credentials = node("http://user:secret@h:8000");
        assert_eq!(with_credentials.authority().unwrap().1, "h:8000");
    }
}
