//! One way to place a request. [`Table::place`] turns a request (path, key header,
//! body) into a [`Placement`] in the first pool that serves it: its facts, its key's
//! hash and grouping there, the walk's target (its home, or a new conversation's
//! placement) and what leaving its home would cost. Admission asks the placement for a
//! node; the node chosen becomes a [`Ticket`] that carries the decision to its end:
//! [`Ticket::settle`] when the answer commits (the breaker's outcome),
//! [`Ticket::finish`] when it ends (the stream's latency judged and what the request
//! teaches learned, in one call). A ticket dropped unsettled records a neutral
//! outcome, so a half-open trial is never leaked. The proxy, `prefixlb route` and
//! `/admin/explain`, the simulator and the benches all go through here.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::breaker::Outcome;
use super::cost::Stakes;
use super::facts::{self, Api, RequestFacts};
use super::group::Grouping;
use super::key;
use super::node::{Node, Prefilling, Reservation};
use super::place::Home;
use super::stored::{self, Holder};
use super::table::{PlaceError, Pool, PoolError, Table};
use super::walk::{Choice, Peek, Target, Walk};
use super::Mode;
use crate::config::{Disaggregation, WhenSaturated};

/// A request placed in one pool: everything admission and the explanation need.
#[derive(Debug)]
pub struct Placement {
    pub api: Api,
    pub facts: RequestFacts,
    /// The key's hash in this pool, and how it is grouped.
    pub hash: u64,
    pub grouping: Grouping<u64>,
    /// Where the walk starts.
    pub target: Target,
    /// What leaving its home would cost it, and what it should find there.
    pub stakes: Stakes,
    /// The conversation's home as this balancer remembers it, if it does.
    pub home: Option<Home>,
    pool: Arc<Pool>,
    /// The request's own pool, and this pool's place in its chain (0: the own pool,
    /// `k`: its `k`-th fallback).
    own: usize,
    at: usize,
    mode: Mode,
    /// Homes are remembered and learned (off for the simulator's plain bounded walk).
    homes: bool,
    /// Nodes whose engines do not serve the adapter it asks for, or (for a stored
    /// response whose engine is known) every node but that one.
    unserved: Vec<usize>,
    /// Where the stored response it names is.
    holder: Holder,
}

impl Table {
    /// Places a request: its pool (by `model`, then the first of the pool and its
    /// fallbacks that can serve it: a request asking for reasoning skips pools with
    /// `supports_thinking = false`), its key and hash there, and the walk's target.
    /// `mode` says whether the decision counts (see [`Mode`]).
    pub fn place(
        &self,
        path: &str,
        header_key: Option<&[u8]>,
        body: &[u8],
        mode: Mode,
    ) -> Result<Placement, PlaceError> {
        let api = Api::from_path(path);
        let envelope = facts::read(api, body)?;
        // A stored response's own endpoints name no model: the pool whose table knows
        // the response, else each pool in turn from the first.
        let named = stored::id_in_path(path).filter(|_| api == Api::StoredResponse);
        let own = match named {
            Some(id) => self.holding_pool(id).unwrap_or(0),
            None => self.pool_for(envelope.as_ref().and_then(|e| e.model()))?,
        };
        let prefixes = &self.pools[own].balancer.load().prefixes;
        // A request that teaches nothing is keyed as its API keys, but counts nothing.
        let learn = if api.teaches() { mode } else { Mode::Explain };
        let mut facts = key::facts_of(
            api,
            body,
            envelope.as_ref(),
            header_key,
            self.key_spec(),
            Some((prefixes, learn)),
        );
        if let Some(id) = named {
            facts.follows = Some(id.to_owned());
        }
        let Some((at, pool)) = self.serving_pool(own, 0, &facts) else {
            return Err(PlaceError::Pool(PoolError::NoThinking {
                pool: self.pools[own].config.name.clone(),
            }));
        };
        let placement = Placement::new(self, api, facts, own, at, pool, mode);
        Ok(placement.with_homes(api.teaches()))
    }

    /// The first pool whose table knows where the stored response `id` is.
    fn holding_pool(&self, id: &str) -> Option<usize> {
        let hash = stored::id_hash(id);
        self.pools
            .iter()
            .position(|p| p.balancer.holder_of(hash).is_some())
    }

    /// The first pool of `own`'s chain, from position `from` on, that serves a request
    /// with these facts, with its position in the chain.
    fn serving_pool(
        &self,
        own: usize,
        from: usize,
        facts: &RequestFacts,
    ) -> Option<(usize, usize)> {
        let chain = std::iter::once(Some(own)).chain(
            self.pools[own]
                .config
                .fallbacks
                .iter()
                .map(|name| self.pools.iter().position(|p| p.config.name == *name)),
        );
        chain
            .enumerate()
            .skip(from)
            .filter_map(|(at, pool)| Some((at, pool?)))
            .find(|&(_, pool)| !facts.wants_thinking || self.pools[pool].config.supports_thinking)
    }
}

impl Placement {
    fn new(
        table: &Table,
        api: Api,
        facts: RequestFacts,
        own: usize,
        at: usize,
        index: usize,
        mode: Mode,
    ) -> Placement {
        let pool = table.pools[index].clone();
        // An adapter's requests are keyed apart: an engine caches prefixes per adapter.
        let adapter = facts.model.as_deref().and_then(|m| pool.adapter(m));
        // Engines known not to serve it are never chosen for it.
        let mut unserved = match adapter {
            Some(a) => unserved_by(&pool, a),
            None => Vec::new(),
        };
        // A stored response is served by its own engine or by none.
        let holder = match &facts.follows {
            None => Holder::Any,
            Some(id) => match pool.balancer.holder_of(stored::id_hash(id)) {
                Some(only) => Holder::Only(only),
                None => Holder::Search,
            },
        };
        if let Holder::Only(only) = holder {
            unserved = (0..pool.balancer.nodes().len())
                .filter(|&i| i != only)
                .collect();
        }
        let space = match adapter {
            Some(adapter) => Cow::Owned(format!("{}\0{adapter}", pool.config.name)),
            None => Cow::Borrowed(pool.config.name.as_str()),
        };
        let (hash, grouping) = key::key_hashes(&space, &facts, table.config.routing.hash_seed);
        let b = &pool.balancer;
        let home = b.home_of(hash);
        let stakes = Stakes::of(&facts, grouping, home.map(|h| h.tokens));
        let keyed = b.target(hash, grouping, mode);
        let mut target = b.place(keyed, home, facts.turn, stakes.own_tokens);
        if let Holder::Only(only) = holder {
            // Its walk starts where it must go: nothing else is its home.
            target.first = Some(only);
        }
        Placement {
            api,
            facts,
            hash,
            grouping,
            target,
            stakes,
            home,
            pool,
            own,
            at,
            mode,
            homes: true,
            unserved,
            holder,
        }
    }

    /// The same request placed in the next pool of its chain that serves it (its
    /// fallbacks, in order), if any: when this pool has no node to offer.
    pub fn fallback(&self, table: &Table) -> Option<Placement> {
        let (at, index) = match (self.holder, self.api) {
            // No other pool holds it.
            (Holder::Only(_), _) => return None,
            // A stored response not known anywhere: each pool in turn.
            (_, Api::StoredResponse) => {
                let at = self.at + 1;
                (at < table.pools.len()).then(|| (at, (self.own + at) % table.pools.len()))?
            }
            _ => table.serving_pool(self.own, self.at + 1, &self.facts)?,
        };
        let next = Placement::new(
            table,
            self.api,
            self.facts.clone(),
            self.own,
            at,
            index,
            self.mode,
        );
        Some(next.with_homes(self.homes))
    }

    /// Whether it is split between its pool's prefill and decode engines: a chat or
    /// completions request in a disaggregated pool (and a `/generate` one in SGLang's).
    /// Any other API goes whole to the pool's prefill engines (vLLM serves a request
    /// with no `kv_transfer_params` whole on any engine).
    pub fn splits(&self) -> bool {
        let config = &self.pool.config;
        config.decode_pool.is_some()
            && match self.api {
                Api::Chat | Api::Completions => true,
                // SGLang's native API, which its disaggregation serves too.
                Api::Generate => config.disaggregation == Some(Disaggregation::Sglang),
                _ => false,
            }
    }

    /// The same request placed in the pool of its pool's decode engines, if it
    /// [`splits`](Placement::splits).
    pub fn decode(&self, table: &Table) -> Option<Placement> {
        if !self.splits() {
            return None;
        }
        let name = self.pool.config.decode_pool.as_deref()?;
        let index = table.pools.iter().position(|p| p.config.name == name)?;
        let facts = self.facts.clone();
        let next = Placement::new(table, self.api, facts, index, 0, index, self.mode);
        Some(next.with_homes(self.homes))
    }

    /// The plain bounded walk: the key's own order, no homes remembered or learned
    /// (the simulator's `chwbl` and `consistent_hash`).
    pub fn without_homes(self) -> Placement {
        self.with_homes(false)
    }

    fn with_homes(mut self, homes: bool) -> Placement {
        if !homes {
            self.target.first = None;
            self.stakes.guessed = false;
            self.homes = false;
        }
        self
    }

    /// Nodes never to be chosen for it: their engines list what they serve, and the
    /// adapter it asks for is not among it. Admission treats them as tried.
    pub fn unserved(&self) -> &[usize] {
        &self.unserved
    }

    /// Where the stored response it names is (see [`stored`]).
    pub fn holder(&self) -> Holder {
        self.holder
    }

    /// The node that holds the stored response it names, when that is known.
    pub fn holding_node(&self) -> Option<&Node> {
        match self.holder {
            Holder::Only(i) => self.pool.balancer.nodes().get(i),
            _ => None,
        }
    }

    /// The pool it is placed in.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The index of the request's own pool (the one its `model` names).
    pub fn own_pool(&self) -> usize {
        self.own
    }

    /// It left its own pool for a fallback.
    pub fn is_fallback(&self) -> bool {
        self.at > 0
    }

    /// Whether it joins the pool's queue before walking (see [`Balancer::joins_queue`]).
    ///
    /// [`Balancer::joins_queue`]: super::walk::Balancer::joins_queue
    pub fn joins_queue(&self, when_saturated: WhenSaturated, tried: &[usize]) -> bool {
        self.pool.balancer.joins_queue(when_saturated, tried)
    }

    /// Reserves the first willing node of its walk, skipping `tried`.
    pub fn choose(&self, tried: &[usize], now: Instant) -> Walk {
        debug_assert!(self.mode.counts(), "an explanation reserves nothing");
        self.pool.balancer.choose(self.target, tried, now)
    }

    /// The node [`Placement::choose`] would take now, changing nothing.
    pub fn peek(&self, tried: &[usize], now: Instant) -> Peek {
        self.pool.balancer.peek(self.target, tried, now)
    }

    /// Overcommits the least loaded willing node (`when_saturated = "least_loaded"`).
    pub fn choose_least_loaded(&self, tried: &[usize]) -> Option<Choice> {
        self.pool.balancer.choose_least_loaded(self.target, tried)
    }

    /// Whether to wait for its full home instead of taking `spill`, and for how long
    /// at most: `(home, budget)` (see [`super::cost::wait_budget`]).
    pub fn home_wait(&self, spill: usize) -> Option<(usize, Duration)> {
        let (home, budget) = self
            .pool
            .balancer
            .home_wait(self.target, &self.stakes, spill)?;
        // A home that may not serve it is never waited for.
        (!self.unserved.contains(&home)).then_some((home, budget))
    }

    /// The ticket of an admitted node: the conversation is at home there (see
    /// [`Balancer::admitted`](super::walk::Balancer)), and its estimated uncached
    /// prompt counts in the node's prefill backlog from `now` until the answer commits.
    pub fn ticket(&self, choice: Choice, now: Instant) -> Ticket {
        if self.homes {
            self.pool.balancer.admitted(
                self.target,
                choice.index,
                choice.distance,
                self.facts.tokens.prompt,
            );
        }
        let node = choice.reservation.node().clone();
        let uncached_estimate = match self.api.is_load() {
            true => uncached_estimate(&self.facts, &self.stakes, choice.distance),
            false => 0,
        };
        let prefilling = node.start_prefill(uncached_estimate);
        Ticket {
            pool: self.pool.clone(),
            index: choice.index,
            distance: choice.distance,
            shunted: choice.shunted,
            trial: choice.trial,
            reservation: Some(choice.reservation),
            target: self.target,
            stakes: self.stakes,
            since: now,
            uncached_estimate,
            prefilling: Some(prefilling),
            ahead: 0,
            settled: false,
            mode: self.mode,
        }
    }
}

/// A request's uncached prompt tokens on the node chosen, as estimated before it goes:
/// at its home (the walk's first node) what it should find cached there (its history,
/// or its group's prefix) is left out; anywhere else all of it.
/// The nodes of `pool` whose engines are known not to serve `adapter`: their
/// `/v1/models` does not list it while another engine's does. When no engine lists it
/// (engines that load adapters on demand, or do not list them), none is ruled out.
fn unserved_by(pool: &Pool, adapter: &str) -> Vec<usize> {
    let nodes = pool.balancer.nodes();
    let listed =
        |n: &crate::routing::node::Node| n.state().served().is_some_and(|s| s.lists(adapter));
    if !nodes.iter().any(listed) {
        return Vec::new();
    }
    let lacking = nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.state().lacks(adapter));
    lacking.map(|(i, _)| i).collect()
}

fn uncached_estimate(facts: &RequestFacts, stakes: &Stakes, distance: usize) -> u32 {
    let prompt = facts.tokens.prompt;
    if distance > 0 {
        return prompt;
    }
    let cached = (stakes.expect * f64::from(prompt)) as u32;
    prompt.saturating_sub(cached.max(stakes.group_tokens))
}

/// What an engine reported of a request's prompt (`usage`; zeros when it did not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
}

/// One admitted node, from its slot taken to the request's end: the slot, the health
/// outcome owed to its breaker, and what the pool learns when the request finishes.
#[derive(Debug)]
pub struct Ticket {
    pool: Arc<Pool>,
    pub(super) index: usize,
    distance: usize,
    shunted: bool,
    /// It is the node's half-open trial: its outcome must be recorded.
    trial: bool,
    reservation: Option<Reservation>,
    pub(super) target: Target,
    pub(super) stakes: Stakes,
    /// When its slot was taken.
    pub(super) since: Instant,
    /// Its uncached prompt tokens as estimated when sent.
    uncached_estimate: u32,
    /// Its place in the node's prefill backlog, until it commits.
    prefilling: Option<Prefilling>,
    /// Estimated prompt tokens other streams had to prefill on its node before it
    /// (read when it commits).
    pub(super) ahead: u32,
    /// The breaker's outcome was recorded.
    settled: bool,
    mode: Mode,
}

impl Ticket {
    /// The pool it was admitted in.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The node, and its index in the pool.
    pub fn node(&self) -> &Node {
        self.pool.balancer.node(self.index)
    }

    pub fn index(&self) -> usize {
        self.index
    }

    /// Its position in the key's walk (0 = primary), and whether an earlier node
    /// shunted the key here.
    pub fn distance(&self) -> usize {
        self.distance
    }

    pub fn shunted(&self) -> bool {
        self.shunted
    }

    /// The attempt ended before anything went to the client: `Failure` counts against
    /// the node, `Neutral` (the engine was busy) does not. The slot goes back.
    pub fn fail(mut self, outcome: Outcome, now: Instant) {
        self.record(outcome, now);
    }

    /// The engine answered with an error that may be the request's rather than its own
    /// (an HTTP 500): the slot goes back now, and the breaker's verdict waits for
    /// another engine's answer to the same request ([`Suspect`]).
    pub fn suspect(mut self) -> Suspect {
        self.reservation = None;
        self.prefilling = None;
        Suspect(Some(self))
    }

    /// The engine's answer is the request's own error, not the node's fault: it goes
    /// to the client and moves no breaker state (not even a success's reset).
    pub fn excuse(&mut self, now: Instant) {
        self.record(Outcome::Neutral, now);
    }

    /// The answer commits: the node served (a trial's success starts its canary), and
    /// the request's place in the prefill backlog is read and left.
    pub fn settle(&mut self, now: Instant) {
        self.record(Outcome::Success, now);
        if let Some(p) = self.prefilling.take() {
            self.ahead = p.ahead();
        }
    }

    /// The engine failed after commit (a broken or silent body): blamed, as a stream
    /// like any other (its trial outcome was recorded when it committed).
    pub fn broke(&self, now: Instant) {
        let settings = self.pool.balancer.settings();
        self.node()
            .state()
            .record(Outcome::Failure, false, settings, now);
    }

    /// Its uncached prompt tokens: as the engine reported them, else as estimated.
    pub fn uncached(&self, usage: Usage) -> u32 {
        if usage.prompt_tokens > 0 {
            usage.prompt_tokens.saturating_sub(usage.cached_tokens)
        } else {
            self.uncached_estimate
        }
    }

    /// The request ended well: its slot goes back, its stream's time to first token is
    /// judged against its work and the node's peers (not on the simulator's virtual
    /// clock), and the pool learns from it (prefill rate, slot time, its home).
    pub fn finish(mut self, usage: Usage, ttft: Option<Duration>, now: Instant) {
        self.reservation = None;
        let b = &self.pool.balancer;
        if let (Some(ttft), Mode::Route) = (ttft, self.mode) {
            b.judge_latency(self.index, ttft, self.ahead, self.uncached(usage), now);
        }
        b.learn(&self, usage, ttft, now);
    }

    fn record(&mut self, outcome: Outcome, now: Instant) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let settings = self.pool.balancer.settings();
        self.node()
            .state()
            .record(outcome, self.trial, settings, now);
    }
}

/// A node that answered a request with an error the request itself may have caused
/// (llama.cpp's 500 for an image sent to a text-only model, say), its slot already
/// given back. If another engine fails the same request the same way, the request is
/// the cause and neither node is blamed ([`Suspect::excuse`]). If none is left to ask,
/// the node is blamed and its answer goes to the client ([`Suspect::blame`]).
/// Otherwise (another engine served it, or failed it some other way) the failure
/// counts against the node when the suspect is dropped.
#[derive(Debug)]
pub struct Suspect(Option<Ticket>);

impl Suspect {
    pub fn excuse(mut self, now: Instant) {
        if let Some(mut ticket) = self.0.take() {
            ticket.excuse(now);
        }
    }

    /// No other engine's answer came: the failure counts against the node (once for
    /// the same request, its body hashed to `request`, retried: see
    /// [`NodeState::blamed_again`]), and the ticket is back (settled) to carry the
    /// node's answer to the client.
    ///
    /// [`NodeState::blamed_again`]: super::node::NodeState::blamed_again
    pub fn blame(mut self, request: u64, now: Instant) -> Option<Ticket> {
        let mut ticket = self.0.take()?;
        let again = ticket.node().state().blamed_again(request);
        let outcome = if again {
            Outcome::Neutral
        } else {
            Outcome::Failure
        };
        ticket.record(outcome, now);
        Some(ticket)
    }
}

impl Drop for Suspect {
    fn drop(&mut self) {
        if let Some(mut ticket) = self.0.take() {
            ticket.record(Outcome::Failure, Instant::now());
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // The client left before an answer committed: says nothing of the node, and a
        // trial slot is given back (a neutral outcome moves no state: its time is moot).
        if !self.settled {
            let settings = self.pool.balancer.settings();
            self.node()
                .state()
                .record(Outcome::Neutral, self.trial, settings, self.since);
        }
    }
}

#[cfg(test)]
mod tests;
