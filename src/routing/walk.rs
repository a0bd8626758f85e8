//! The walk: which node of a pool serves a key. A key's order over the nodes (its ring
//! walk, or for a prefix group the group's first `width` nodes ranked by rendezvous with
//! the key, then the rest of the group's walk), and the bounded-load admission along it:
//! the first node that accepts new requests, was not tried, is under its cap, does not
//! shunt the key and whose breaker admits it. [`Balancer::choose`] reserves that node;
//! [`Balancer::peek`] names it and changes nothing (both run the same checks). The
//! clock is passed in; no I/O.

use std::sync::Arc;
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_64;

use super::breaker::{Admission, BreakerSettings, BreakerState, Outcome};
use super::cost::{self, Stakes};
use super::facts::Turn;
use super::group::{rendezvous, weighted_rendezvous, Grouping};
use super::home::node_tag;
use super::latency::{self, Peers};
use super::node::{Node, NodeSource, NodeState, PoolLoad, Reservation};
use super::ring::{Ring, RingMember, Successors};
use crate::config::NodeConfig;

/// A node chosen for a request, with its slot already taken.
#[derive(Debug)]
pub struct Choice {
    /// Index of the node in the pool (and ring).
    pub index: usize,
    /// Position in the key's successor walk: 0 = primary.
    pub distance: usize,
    pub reservation: Reservation,
    /// This request is the node's half-open probe: its outcome must be recorded.
    pub probe: bool,
    /// An earlier node of the walk shunted this key here.
    pub shunted: bool,
}

/// Where a request's walk starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// The key's hash: its ring position when it has no group, and the bits the
    /// breaker's canary and shunting read.
    pub hash: u64,
    /// `key = "hybrid"`: the group's hash and width; the walk starts at the node of
    /// the group's first `width` that ranks highest for `hash`.
    pub group: Option<(u64, usize)>,
    /// A node that goes first, before the key's order: its conversation's home, or the
    /// less loaded of a new conversation's first two.
    pub first: Option<usize>,
}

impl From<u64> for Target {
    fn from(hash: u64) -> Self {
        Target {
            hash,
            group: None,
            first: None,
        }
    }
}

/// How many of a new conversation's first nodes are compared by load (more spreads
/// better and makes replicas disagree more often).
const NEW_CONVERSATION_CHOICES: usize = 2;

/// The least share of a prompt above its group's prefix that a miss is judged on.
const MIN_HISTORY_SHARE: f64 = 0.1;

/// With balancer replicas, a key's first node that became home to this many more
/// conversations lately than the pool's mean loses its replica margin: new
/// conversations go by load alone (measured: 1 costs `doc-qa`, 2 does not).
const PILED_UP_HOMES: f64 = 2.0;

/// A new conversation whose own text (above its group's prefix) is at most this many
/// tokens is placed by the conversations each node became home to lately before load:
/// moving it costs a balancer replica that did not see it placed at most this text to
/// find it, and a short opening says nothing of how long the conversation grows (an
/// agent opens with 200 tokens of its own and ends ten thousand long), so the count of
/// homes, not the requests in flight at the moment, is what keeps long sessions from
/// piling up on one engine. Larger openings (a document, a long first message) would
/// cost that replica their whole text: they go by load alone (measured: every opening
/// placed this way costs `doc-qa` 3.6 points with two replicas, `multi-turn` 2; see
/// docs/evidence.md).
pub const SMALL_OPENING_TOKENS: u32 = 256;

/// Ranks a node at its cap after every node under it, whatever their recent homes.
const FULL: f64 = 1e6;

/// The nodes of a walk in order, each once: the key's ring walk, or for a grouped key
/// the first `width` nodes of the group's walk ranked by rendezvous score with the key
/// (so each conversation has its own order among them and spills scatter), then the
/// rest of the group's walk.
pub struct WalkOrder<'a> {
    /// The target's first node, yielded before the rest and skipped in it.
    first: Option<usize>,
    skip: Option<usize>,
    /// Scored head nodes not yet yielded.
    head: Vec<(u64, usize)>,
    /// The walk after the head (none when the head is the whole pool).
    rest: Option<Successors<'a>>,
}

impl Iterator for WalkOrder<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if let Some(first) = self.first.take() {
            return Some(first);
        }
        loop {
            let best = (0..self.head.len()).max_by_key(|&k| self.head[k].0);
            let next = match best {
                Some(k) => self.head.swap_remove(k).1,
                None => self.rest.as_mut()?.next()?,
            };
            if Some(next) != self.skip {
                return Some(next);
            }
        }
    }
}

/// Outcome of a walk.
#[derive(Debug)]
pub enum Walk {
    Chosen(Choice),
    /// Some node could serve but every such node is at its cap.
    Saturated,
    /// No node accepts new requests (all down, draining or already tried).
    Unavailable,
}

/// A finished request, as its balancer learns from it.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    pub target: Target,
    pub stakes: Stakes,
    /// The node that served it.
    pub node: usize,
    /// From its slot taken to its end.
    pub held: Duration,
    /// Its time to first token (streams).
    pub ttft: Option<Duration>,
    /// As the engine reported them (`usage`; 0 when it did not).
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// Its uncached prompt tokens as estimated when it was sent (used when the engine
    /// reports no usage).
    pub uncached_estimate: u32,
    /// Estimated prompt tokens other streams had to prefill on its node before it.
    pub ahead: u32,
}

impl Finished {
    /// Its uncached prompt tokens: as the engine reported, else as estimated.
    pub fn uncached(&self) -> u32 {
        if self.prompt_tokens > 0 {
            self.prompt_tokens.saturating_sub(self.cached_tokens)
        } else {
            self.uncached_estimate
        }
    }
}

/// What [`Balancer::peek`] finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peek {
    /// The node a request would get, at this position of the walk; `shunted`: an
    /// earlier node shunted the key here.
    Node {
        index: usize,
        distance: usize,
        shunted: bool,
    },
    Saturated,
    Unavailable,
}

/// One node as the walk sees it before asking its breaker.
enum Screen {
    /// Tried already, unhealthy or draining.
    Skip,
    /// At its cap; `open`: its breaker is not open (it could serve once a slot frees).
    Full { open: bool },
    /// Its shunting diverts this key.
    Shunted,
    /// Under this cap.
    Open(u32),
}

/// What the walk's `try_node` made of a node.
enum Try<X> {
    /// Its breaker refuses the key.
    Refused,
    /// Its last slot went to another request meanwhile.
    Lost,
    Taken(X),
}

/// How a walk ended.
enum Walked<X> {
    Taken {
        index: usize,
        distance: usize,
        shunted: bool,
        x: X,
    },
    Saturated,
    Unavailable,
}

/// The admission view of one pool: its nodes, their ring, and the bounds.
#[derive(Debug)]
pub struct Balancer {
    ring: Ring,
    nodes: Vec<Node>,
    load: Arc<PoolLoad>,
    /// CHWBL relative bound `c`, if configured.
    load_factor: Option<f64>,
    settings: Arc<BreakerSettings>,
    total_weight: u32,
    /// `xxh3_64(node id)` per node: rendezvous scores stay put across rebuilds.
    id_hashes: Vec<u64>,
    /// Nodes differ in weight: rank group nodes by weighted rendezvous.
    weighted: bool,
    /// Each node's tag in the pool's home table.
    tags: Vec<u32>,
    /// `routing.split_cap_across_replicas`.
    split_cap: bool,
}

impl Balancer {
    /// A pool's balancer: `vnodes × weight` ring points per node.
    pub fn new(
        nodes: Vec<Node>,
        vnodes: u32,
        load: Arc<PoolLoad>,
        load_factor: Option<f64>,
        settings: Arc<BreakerSettings>,
    ) -> Self {
        let ring_members: Vec<RingMember> = nodes
            .iter()
            .map(|n| RingMember {
                id: n.id().to_string(),
                weight: n.weight(),
            })
            .collect();
        let total_weight = nodes.iter().map(Node::weight).sum();
        let id_hashes: Vec<u64> = nodes.iter().map(|n| xxh3_64(n.id().as_bytes())).collect();
        let tags = id_hashes.iter().map(|&h| node_tag(h)).collect();
        let weighted = nodes.windows(2).any(|w| w[0].weight() != w[1].weight());
        Balancer {
            ring: Ring::build(&ring_members, vnodes),
            nodes,
            load,
            load_factor,
            settings,
            total_weight,
            id_hashes,
            weighted,
            tags,
            split_cap: false,
        }
    }

    /// Divides each node's cap by the balancer replicas known (rounded up, at least 1).
    pub fn with_split_cap(mut self, split: bool) -> Self {
        self.split_cap = split;
        self
    }

    /// `nodes` identical nodes (`n0`, `n1`, …, weight 1, cap `cap`) with fresh state:
    /// the fleet of tests, benches and experiments.
    pub fn uniform(nodes: usize, vnodes: u32, cap: u32, load_factor: Option<f64>) -> Balancer {
        let nodes = (0..nodes)
            .map(|i| {
                let id = format!("n{i}");
                let config = NodeConfig {
                    id: id.clone(),
                    url: http::Uri::from_static("http://127.0.0.1:1"),
                    weight: 1,
                };
                Node::new(
                    config,
                    NodeSource::Static,
                    cap,
                    Arc::new(NodeState::new(id)),
                )
            })
            .collect();
        Balancer::new(nodes, vnodes, Arc::default(), load_factor, Arc::default())
    }

    /// The pool's nodes, in config order (a walk's indexes point here).
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, index: usize) -> &Node {
        &self.nodes[index]
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    /// The pool's total load and queue.
    pub fn load(&self) -> &Arc<PoolLoad> {
        &self.load
    }

    /// The breaker settings its nodes are judged by.
    pub fn settings(&self) -> &Arc<BreakerSettings> {
        &self.settings
    }

    /// The walk target of a key placed by `grouping`, counting the request toward its
    /// group's share of the traffic.
    pub fn target(&self, hash: u64, grouping: Grouping<u64>) -> Target {
        self.target_with(hash, grouping, |g, nodes| {
            self.load.groups.observe(g, nodes)
        })
    }

    /// [`Balancer::target`] without counting the request (for explanations).
    pub fn peek_target(&self, hash: u64, grouping: Grouping<u64>) -> Target {
        self.target_with(hash, grouping, |g, nodes| self.load.groups.width(g, nodes))
    }

    fn target_with(
        &self,
        hash: u64,
        grouping: Grouping<u64>,
        width: impl FnOnce(u64, usize) -> usize,
    ) -> Target {
        let nodes = self.nodes.len();
        let group = match grouping {
            Grouping::Ring => None,
            // The whole pool: the group hash is never walked.
            Grouping::Pool => Some((0, nodes)),
            Grouping::Group(g) => Some((g, width(g, nodes))),
        };
        Target {
            hash,
            group,
            first: None,
        }
    }

    /// The walk target of a `hybrid` key (`Pool` or `Group` placement), counted toward
    /// its group, with a node first: the conversation's remembered home, or, for a new
    /// conversation (and a prompt string seen nowhere yet), the less loaded of its first
    /// two nodes (within its group's nodes; for an opening of at most
    /// [`SMALL_OPENING_TOKENS`] of its own, `own_tokens`, the one fewer conversations
    /// made their home lately), so new work spreads by load while every later turn
    /// finds its home. A later turn this balancer has no home for starts at the key's
    /// own first node. Other keys: [`Balancer::target`].
    pub fn place(&self, hash: u64, grouping: Grouping<u64>, turn: Turn, own_tokens: u32) -> Target {
        let mut target = self.target(hash, grouping);
        if grouping != Grouping::Ring {
            target.first = self.first_of(target, turn, own_tokens);
        }
        target
    }

    /// [`Balancer::place`] counting nothing (for explanations).
    pub fn peek_place(
        &self,
        hash: u64,
        grouping: Grouping<u64>,
        turn: Turn,
        own_tokens: u32,
    ) -> Target {
        let mut target = self.peek_target(hash, grouping);
        if grouping != Grouping::Ring {
            target.first = self.first_of(target, turn, own_tokens);
        }
        target
    }

    fn first_of(&self, target: Target, turn: Turn, own_tokens: u32) -> Option<usize> {
        if let Some(home) = self.home_of(target.hash) {
            return Some(home);
        }
        if turn == Turn::Later {
            return None;
        }
        let choices = match target.group {
            Some((_, width)) => width.clamp(1, NEW_CONVERSATION_CHOICES),
            None => NEW_CONVERSATION_CHOICES,
        };
        // A small opening: by recent homes (one home weighs a full node of requests)
        // and load, but never to a node at its cap (the walk would spill it).
        let by_homes = self.places_by_homes(own_tokens);
        let load = |i: usize| {
            let n = &self.nodes[i];
            let s = n.state();
            let in_flight =
                f64::from(s.in_flight() + s.others_in_flight()) / f64::from(self.own_cap(n).max(1));
            if !by_homes {
                in_flight
            } else if in_flight >= 1.0 {
                in_flight + FULL
            } else {
                in_flight + self.load.recent_homes.above_mean(self.tags[i], &self.tags)
            }
        };
        // With other balancer replicas, any node but the key's own first must be clearly
        // less loaded (by two requests at equal caps, not one): a new conversation placed
        // away from its key's first node costs a replica that did not see it placed one
        // miss to find it. Alone, the less loaded node takes it; so it does with
        // replicas when the key's first node has piled up homes: the margin keeps new
        // conversations on their keys' first nodes, and hashing alone piles them up
        // until the engine's cache thrashes (measured on `agentic`, docs/evidence.md).
        let mut order = self.key_order(target).take(choices);
        let key_first = order.next()?;
        let margin = if self.load.replicas() > 1 && !self.piled_up(key_first) {
            1.0 / f64::from(self.cap_of(&self.nodes[key_first]).max(1))
        } else {
            0.0
        };
        std::iter::once((load(key_first), 0, key_first))
            .chain(order.enumerate().map(|(k, i)| (load(i) + margin, k + 1, i)))
            .filter(|&(_, _, i)| self.nodes[i].state().accepts_new())
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, _, i)| i)
    }

    /// Whether a new conversation with `own_tokens` of its own text (above its group's
    /// prefix) is placed by recent homes before load ([`SMALL_OPENING_TOKENS`]). Not
    /// with `load_factor`, which asks for balance by requests in flight (measured:
    /// homes there cost `multi-tenant` 2 points).
    pub fn places_by_homes(&self, own_tokens: u32) -> bool {
        own_tokens <= SMALL_OPENING_TOKENS && self.load_factor.is_none()
    }

    /// Whether node `index` became home to more conversations lately than the pool's
    /// nodes on average, by more than [`PILED_UP_HOMES`].
    fn piled_up(&self, index: usize) -> bool {
        self.load
            .recent_homes
            .above_mean(self.tags[index], &self.tags)
            > PILED_UP_HOMES
    }

    /// Whether node `index` is one of the target's group's nodes (where the group's
    /// prefix is cached); every node is, for a key with no group or a group as wide
    /// as the pool.
    pub fn in_group(&self, target: Target, index: usize) -> bool {
        match target.group {
            Some((group, width)) if width < self.nodes.len() => self
                .ring
                .successors(group)
                .take(width.max(1))
                .any(|i| i == index),
            _ => true,
        }
    }

    /// The node remembered as `hash`'s home, if it is in this pool.
    pub fn home_of(&self, hash: u64) -> Option<usize> {
        let tag = self.load.homes.get(hash)?;
        self.tags.iter().position(|&t| t == tag)
    }

    /// What a finished request that was routed with no remembered home says of its
    /// conversation's home. It was served by `served` and was expected to find
    /// `expected` of its prompt cached there, `floor` of it (its group's prefix) on any
    /// node of its group; when it found less than half of what lies above the floor, its
    /// conversation's cache was elsewhere: on the other of its first two nodes, where a
    /// new conversation is placed (another replica placed it there, or its home was
    /// forgotten). That node becomes its home, so replicas that never share a word
    /// agree again after one miss. (A miss at a remembered home is an eviction: no
    /// other node holds more, and the caller does not ask.)
    pub fn learn(&self, target: Target, served: usize, expected: f64, floor: f64, found: f64) {
        // Ring keys (key headers, `conversation`/`prefix` modes) have no homes.
        let ringed = target.group.is_none() && target.first.is_none();
        // A group's prefix is found on all its nodes: only the history above it tells
        // the home (when there is enough of it to tell, past estimation error).
        // Alone, a guessed home was forgotten, not placed by another replica: no floor
        // (measured: with one replica the floor only cost long preambles up to a point).
        let floor = if self.load.replicas() > 1 {
            floor.clamp(0.0, expected)
        } else {
            0.0
        };
        let above = expected - floor;
        let too_little = floor > 0.0 && above < MIN_HISTORY_SHARE;
        if ringed || too_little || found >= floor + above / 2.0 {
            return;
        }
        let keyed = Target {
            first: None,
            ..target
        };
        let pair: Vec<usize> = self
            .key_order(keyed)
            .take(NEW_CONVERSATION_CHOICES)
            .collect();
        if let [a, b] = pair[..] {
            if served == a {
                self.remember(target.hash, b);
            } else if served == b {
                self.remember(target.hash, a);
            }
        }
    }

    /// Records where a request settled: a conversation placed with no home yet, or
    /// served at its home, is at home there from now on. A spill is a visit: the home
    /// stays where the conversation was placed, where every replica looks for it.
    pub fn settle(&self, target: Target, index: usize, distance: usize) {
        if distance == 0 || target.first.is_none() {
            self.remember(target.hash, index);
        }
    }

    /// Whether a request whose walk offered `spill` instead of its full home should
    /// wait for the home, and for how long at most (see [`cost::wait_budget`]): only
    /// when the home is full (not down, draining or open) and frees slots soon enough.
    pub fn home_wait(
        &self,
        target: Target,
        stakes: &Stakes,
        spill: usize,
    ) -> Option<(usize, Duration)> {
        let home = self.order(target).next()?;
        let node = &self.nodes[home];
        let state = node.state();
        // Only a home at its absolute cap is worth a wait. One held back by the relative
        // bound alone is busier than its share, which is what `load_factor` asks to
        // spill; and requests waiting there would shrink the pool's in-flight total and
        // with it the bound, until the rest of the pool idled while they queued.
        let cap = self.absolute_cap_of(node);
        if home == spill || !state.accepts_new() || state.in_flight() < cap {
            return None;
        }
        let budget = cost::wait_budget(
            stakes.saved(self.in_group(target, spill)),
            self.load.prefill.per_token(),
            state.slot_time.get(),
            cap,
            state.waiting(),
        )?;
        Some((home, budget))
    }

    /// Learns from a finished request: the pool's prefill rate (from a stream's time
    /// to first token), the node's slot time, and, for a request routed with no
    /// remembered home, where its conversation lives ([`Balancer::learn`]).
    pub fn finished(&self, f: &Finished) {
        if let (Some(ttft), true) = (f.ttft, f.prompt_tokens > 0) {
            self.load
                .prefill
                .observe(ttft, f.ahead.saturating_add(f.uncached()));
        }
        let node = &self.nodes[f.node];
        node.state().slot_time.observe(f.held);
        if f.stakes.guessed && f.prompt_tokens > 0 {
            let found = f64::from(f.cached_tokens) / f64::from(f.prompt_tokens);
            let s = &f.stakes;
            self.learn(f.target, f.node, s.expect, s.group_share, found);
        }
    }

    /// Judges a finished stream's latency against its work and the node's peers (see
    /// [`latency`]): may shunt, open, or mark the node degraded. Call before
    /// [`Balancer::finished`], so the sample is judged by what the pool knew before it.
    pub fn judge_latency(&self, f: &Finished, now: Instant) {
        let Some(ttft) = f.ttft else {
            return;
        };
        let s = &self.settings;
        let expectation = self.load.prefill.expectation();
        let Some(norm) = expectation.normalize(ttft, f.ahead, f.uncached(), s.slow_ttft) else {
            return;
        };
        let mut out = 0;
        let mut peers = Vec::with_capacity(self.nodes.len());
        for (i, n) in self.nodes.iter().enumerate() {
            let b = &n.state().breaker;
            if matches!(b.state(), BreakerState::Open | BreakerState::HalfOpen) {
                out += 1;
            }
            if i != f.node {
                peers.extend(b.summary(s.min_samples).map(|(_, p90)| p90));
            }
        }
        let may_eject = latency::may_eject(out, self.nodes.len(), s.max_ejected_share);
        let peers = Peers::of(&mut peers, may_eject);
        let state = self.nodes[f.node].state();
        state.log_flip(state.breaker.observe_latency(ttft, norm, &peers, s, now));
    }

    /// Remembers the node that served `hash`: its conversation's home from now on.
    pub fn remember(&self, hash: u64, index: usize) {
        let tag = self.tags[index];
        let before = self.load.homes.get(hash);
        if before == Some(tag) {
            return;
        }
        self.load.homes.set(hash, tag);
        self.load.recent_homes.moved(before, tag);
    }

    /// The nodes a target's walk visits, in order.
    pub fn order(&self, target: Target) -> WalkOrder<'_> {
        let first = target.first.filter(|&i| i < self.nodes.len());
        let mut order = self.key_order(target);
        order.first = first;
        order.skip = first;
        order
    }

    /// The key's own order (the target's `first` aside).
    fn key_order(&self, target: Target) -> WalkOrder<'_> {
        let order = |head, rest| WalkOrder {
            first: None,
            skip: None,
            head,
            rest,
        };
        match target.group {
            None => order(Vec::new(), Some(self.ring.successors(target.hash))),
            Some((group, width)) => {
                let score = |i: usize| {
                    let id = self.id_hashes[i];
                    let s = if self.weighted {
                        weighted_rendezvous(target.hash, id, self.nodes[i].weight())
                    } else {
                        rendezvous(target.hash, id)
                    };
                    (s, i)
                };
                if width >= self.nodes.len() {
                    // The whole pool: no need to walk the group's ring to list it.
                    return order((0..self.nodes.len()).map(score).collect(), None);
                }
                let mut rest = self.ring.successors(group);
                let head = rest.by_ref().take(width.max(1)).map(score).collect();
                order(head, Some(rest))
            }
        }
    }

    /// The cap in force for a member now: the absolute cap, tightened by the relative
    /// bound `ceil(c × (total_in_flight + 1) × weight / total_weight)` when configured.
    pub fn cap_of(&self, m: &Node) -> u32 {
        // What other replicas are known to hold there counts against it (never below one).
        self.own_cap(m)
            .saturating_sub(m.state().others_in_flight())
            .max(1)
    }

    /// The absolute cap alone, as [`Balancer::cap_of`] counts it but without
    /// `load_factor`'s relative bound: what the engine is meant to run, whatever the
    /// rest of the pool holds.
    fn absolute_cap_of(&self, m: &Node) -> u32 {
        self.split_cap_of(m)
            .saturating_sub(m.state().others_in_flight())
            .max(1)
    }

    /// The cap in force on this replica's own view (before others' known load).
    fn own_cap(&self, m: &Node) -> u32 {
        let cap = self.split_cap_of(m);
        match self.load_factor {
            None => cap,
            Some(c) => {
                let total = self.load.in_flight() as f64 + 1.0;
                let rel = (c * total * m.weight() as f64 / self.total_weight.max(1) as f64).ceil();
                cap.min(rel as u32).max(1)
            }
        }
    }

    /// `max_in_flight × weight`, split between the replicas when `split_cap` is on.
    fn split_cap_of(&self, m: &Node) -> u32 {
        if self.split_cap {
            m.cap().div_ceil(self.load.replicas()).max(1)
        } else {
            m.cap()
        }
    }

    /// What the walk sees at one node before its breaker is asked: the per-node check
    /// shared by [`Balancer::choose`] and [`Balancer::peek`].
    fn screen(&self, index: usize, hash: u64, tried: &[usize]) -> Screen {
        let m = &self.nodes[index];
        if tried.contains(&index) || !m.state().accepts_new() {
            return Screen::Skip;
        }
        let cap = self.cap_of(m);
        if m.state().in_flight() >= cap {
            return Screen::Full {
                open: m.state().breaker.state() != BreakerState::Open,
            };
        }
        if m.state().breaker.shunts(hash) {
            return Screen::Shunted;
        }
        Screen::Open(cap)
    }

    /// The walk itself: the first node of the target's order that passes
    /// [`Balancer::screen`] and that `try_node` takes (`try_node(member, cap, ask)`:
    /// `ask` says whether its breaker still has to admit the key). Shunting is a
    /// preference: a shunted node is taken when no later node is.
    fn walk<X>(
        &self,
        target: Target,
        tried: &[usize],
        mut try_node: impl FnMut(&Node, u32, bool) -> Try<X>,
    ) -> Walked<X> {
        let mut any_open = false;
        let mut shunted: Option<(usize, usize)> = None;
        for (distance, index) in self.order(target).enumerate() {
            let m = &self.nodes[index];
            match self.screen(index, target.hash, tried) {
                Screen::Skip => {}
                Screen::Full { open } => any_open |= open,
                Screen::Shunted => {
                    any_open = true;
                    shunted.get_or_insert((distance, index));
                }
                Screen::Open(cap) => match try_node(m, cap, true) {
                    Try::Refused => {}
                    Try::Lost => any_open = true,
                    Try::Taken(x) => {
                        return Walked::Taken {
                            index,
                            distance,
                            shunted: shunted.is_some(),
                            x,
                        }
                    }
                },
            }
        }
        if let Some((distance, index)) = shunted {
            let m = &self.nodes[index];
            if let Try::Taken(x) = try_node(m, self.cap_of(m), false) {
                return Walked::Taken {
                    index,
                    distance,
                    shunted: false,
                    x,
                };
            }
        }
        if any_open {
            Walked::Saturated
        } else {
            Walked::Unavailable
        }
    }

    /// Walks the key's order and reserves the first node that accepts new requests
    /// (healthy, not draining, its breaker admitting this key), was not tried yet, is
    /// under its cap, and does not shunt this key.
    pub fn choose(&self, target: impl Into<Target>, tried: &[usize], now: Instant) -> Walk {
        let target = target.into();
        let walked = self.walk(target, tried, |m, cap, ask| {
            let mut probe = false;
            if ask {
                let state = m.state();
                let (admission, flip) = state.breaker.admit(target.hash, &self.settings, now);
                state.log_flip(flip);
                if admission == Admission::Refuse {
                    return Try::Refused;
                }
                probe = admission == Admission::Probe;
            }
            match self.reserve(m, cap) {
                Some(reservation) => Try::Taken((reservation, probe)),
                None => {
                    // Lost a race for the last slot: give the probe back.
                    if probe {
                        m.state().record(Outcome::Neutral, true, &self.settings);
                    }
                    Try::Lost
                }
            }
        });
        match walked {
            Walked::Taken {
                index,
                distance,
                shunted,
                x: (reservation, probe),
            } => Walk::Chosen(Choice {
                index,
                distance,
                reservation,
                probe,
                shunted,
            }),
            Walked::Saturated => Walk::Saturated,
            Walked::Unavailable => Walk::Unavailable,
        }
    }

    /// The node [`Balancer::choose`] would take now, by the same checks, reserving
    /// nothing and moving no breaker (for explanations).
    pub fn peek(&self, target: impl Into<Target>, tried: &[usize], now: Instant) -> Peek {
        let target = target.into();
        let walked = self.walk(target, tried, |m, _, ask| {
            let breaker = &m.state().breaker;
            if ask && breaker.peek(target.hash, &self.settings, now) == Admission::Refuse {
                Try::Refused
            } else {
                Try::Taken(())
            }
        });
        match walked {
            Walked::Taken {
                index,
                distance,
                shunted,
                x: (),
            } => Peek::Node {
                index,
                distance,
                shunted,
            },
            Walked::Saturated => Peek::Saturated,
            Walked::Unavailable => Peek::Unavailable,
        }
    }

    /// Overcommits the least loaded (relative to weight) node that accepts new requests
    /// and whose breaker is closed or recovering: `when_saturated = "least_loaded"`.
    /// Ties go to the earlier node in the key's walk.
    pub fn choose_least_loaded(
        &self,
        target: impl Into<Target>,
        tried: &[usize],
    ) -> Option<Choice> {
        let (distance, index) = self
            .order(target.into())
            .enumerate()
            .filter(|(_, i)| {
                let state = self.nodes[*i].state();
                !tried.contains(i)
                    && state.accepts_new()
                    && matches!(
                        state.breaker.state(),
                        BreakerState::Closed | BreakerState::Recovering
                    )
            })
            .min_by(|(_, a), (_, b)| {
                let load = |i: usize| {
                    let n = &self.nodes[i];
                    n.state().in_flight() as f64 / n.weight() as f64
                };
                load(*a).total_cmp(&load(*b))
            })?;
        let reservation = self.reserve(&self.nodes[index], u32::MAX)?;
        Some(Choice {
            index,
            distance,
            reservation,
            probe: false,
            shunted: false,
        })
    }

    fn reserve(&self, m: &Node, cap: u32) -> Option<Reservation> {
        Reservation::take(m.state(), &self.load, cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::latency::Norm;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    fn balancer(n: usize, cap: u32, load_factor: Option<f64>) -> Balancer {
        Balancer::uniform(n, 160, cap, load_factor)
    }

    /// A key of a group as wide as the pool, with no home yet, and its first two nodes
    /// (where a new conversation of it is placed).
    fn grouped_key(b: &Balancer) -> (Target, Vec<usize>) {
        let target = Target {
            hash: 0xabcd_u64 << 32,
            group: Some((0xfeed_u64 << 40, b.nodes.len())),
            first: None,
        };
        (target, b.key_order(target).take(2).collect())
    }

    /// `n` other conversations made their home on `node` lately.
    fn homes_on(b: &Balancer, node: usize, n: u64) {
        for i in 1..=n {
            b.remember(i.wrapping_mul(0x9E37_79B9_7F4A_7C15), node);
        }
    }

    #[test]
    fn a_guessed_home_that_finds_only_its_groups_prefix_flips_to_the_other_choice() {
        let b = balancer(8, 4, None);
        let (target, pair) = grouped_key(&b);
        // 90 % expected, 75 % of it the group's prefix (cached on every node of the
        // group): finding 76 % is finding none of the history. Without the floor (half
        // of 90 %) that is a hit; alone, a balancer judges so (its guesses are
        // forgotten homes, not another replica's placements).
        b.learn(target, pair[0], 0.9, 0.0, 0.76);
        assert_eq!(b.home_of(target.hash), None, "no floor: 76 % ≥ 45 %");
        b.learn(target, pair[0], 0.9, 0.75, 0.76);
        assert_eq!(b.home_of(target.hash), None, "one replica: no floor");
        b.load().set_replicas(2);
        b.learn(target, pair[0], 0.9, 0.75, 0.76);
        assert_eq!(b.home_of(target.hash), Some(pair[1]));
        // Found most of the history above the floor: the guess was right.
        let other = Target {
            hash: 0x1234_u64 << 32,
            ..target
        };
        let first = b.key_order(other).next().unwrap();
        b.learn(other, first, 0.9, 0.75, 0.86);
        assert_eq!(b.home_of(other.hash), None);
        // Too little above the floor to judge (estimates are rough): no flip.
        b.learn(other, first, 0.8, 0.75, 0.5);
        assert_eq!(b.home_of(other.hash), None);
    }

    #[test]
    fn with_replicas_a_first_node_piled_with_homes_loses_its_margin() {
        let b = balancer(8, 4, None);
        b.load().set_replicas(2);
        let (target, pair) = grouped_key(&b);
        // One request in flight on the key's first node, none on the other choice:
        // within the replica margin, so a new conversation stays on its key's first.
        let at_first = Target {
            first: Some(pair[0]),
            ..target
        };
        let held = chosen(b.choose(at_first, &[], Instant::now()));
        assert_eq!(held.index, pair[0]);
        let large = SMALL_OPENING_TOKENS + 1;
        assert_eq!(b.first_of(target, Turn::First, large), Some(pair[0]));
        // Five conversations made their home there lately (none elsewhere): piled up,
        // so the less loaded node takes the new one.
        homes_on(&b, pair[0], 5);
        assert_eq!(b.first_of(target, Turn::First, large), Some(pair[1]));
        drop(held);
    }

    #[test]
    fn a_small_opening_goes_where_fewer_conversations_live_lately() {
        let b = balancer(8, 4, None);
        let (target, pair) = grouped_key(&b);
        let (small, large) = (SMALL_OPENING_TOKENS, SMALL_OPENING_TOKENS + 1);
        // A request in flight on the other choice, none on the key's first: by load,
        // the key's first, whatever the opening.
        let at_other = Target {
            first: Some(pair[1]),
            ..target
        };
        let held = chosen(b.choose(at_other, &[], Instant::now()));
        assert_eq!(held.index, pair[1]);
        assert_eq!(b.first_of(target, Turn::First, small), Some(pair[0]));
        assert_eq!(b.first_of(target, Turn::First, large), Some(pair[0]));
        // Two conversations made their home on the key's first node lately: a small
        // opening goes where fewer live, a large one still by load.
        homes_on(&b, pair[0], 2);
        assert_eq!(b.first_of(target, Turn::First, small), Some(pair[1]));
        assert_eq!(b.first_of(target, Turn::First, large), Some(pair[0]));
        // A later turn this balancer has no home for is not placed at all.
        assert_eq!(b.first_of(target, Turn::Later, small), None);
        drop(held);
    }

    #[test]
    fn a_grouped_walk_starts_within_the_groups_first_nodes() {
        let b = balancer(8, 1, None);
        let group = 0xfeed_u64 << 40;
        let ring: Vec<usize> = b.ring.successors(group).collect();
        let conversations: Vec<u64> = (0..400u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for width in [1, 3, 8] {
            let mut primaries = std::collections::HashSet::new();
            for &c in &conversations {
                let t = Target {
                    hash: c,
                    group: Some((group, width)),
                    first: None,
                };
                let walk: Vec<usize> = b.order(t).collect();
                let mut sorted = walk.clone();
                sorted.sort();
                assert_eq!(sorted, (0..8).collect::<Vec<_>>(), "each node once");
                let mut head = walk[..width].to_vec();
                head.sort();
                let mut first = ring[..width].to_vec();
                first.sort();
                assert_eq!(head, first, "the group's first {width} nodes come first");
                assert_eq!(walk[width..], ring[width..], "then the group's ring walk");
                assert_eq!(walk, b.order(t).collect::<Vec<_>>(), "deterministic");
                primaries.insert(walk[0]);
            }
            assert_eq!(
                primaries.len(),
                width,
                "conversations use all {width} nodes"
            );
        }
        // A bounded walk spills within the group first: width 2, cap 1.
        let t = Target {
            hash: 5,
            group: Some((group, 2)),
            first: None,
        };
        let first = chosen(b.choose(t, &[], Instant::now()));
        let second = chosen(b.choose(t, &[], Instant::now()));
        let third = chosen(b.choose(t, &[], Instant::now()));
        let mut pair = vec![first.index, second.index];
        pair.sort();
        let mut head = ring[..2].to_vec();
        head.sort();
        assert_eq!(pair, head);
        assert_eq!((second.distance, third.index), (1, ring[2]));
    }

    fn chosen(w: Walk) -> Choice {
        match w {
            Walk::Chosen(c) => c,
            other => panic!("expected a node, got {other:?}"),
        }
    }

    /// `peek` must name the node `choose` then takes, whatever state the nodes are in.
    fn assert_peek_is_choose(b: &Balancer, keys: &[u64], now: Instant, what: &str) {
        for &k in keys {
            let peeked = b.peek(k, &[], now);
            let taken = b.choose(k, &[], now);
            let found = match &taken {
                Walk::Chosen(c) => Peek::Node {
                    index: c.index,
                    distance: c.distance,
                    shunted: c.shunted,
                },
                Walk::Saturated => Peek::Saturated,
                Walk::Unavailable => Peek::Unavailable,
            };
            assert_eq!(peeked, found, "{what}: key {k:x}");
            // Give a half-open probe back, so every key sees the same state.
            if let Walk::Chosen(c) = taken {
                if c.probe {
                    c.reservation
                        .node()
                        .breaker
                        .record(Outcome::Neutral, true, &b.settings, now);
                }
            }
        }
    }

    #[test]
    fn peek_names_the_node_choose_takes_in_every_state() {
        let b = balancer(4, 2, None);
        let s = b.settings.clone();
        let keys: Vec<u64> = (0..300u64).map(|i| xxh3_64(&i.to_le_bytes())).collect();
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let n0 = &b.nodes[0].state().breaker;
        assert_peek_is_choose(&b, &keys, t0, "all closed");
        // Open: skipped until open_for is over.
        n0.record(Outcome::Failure, false, &s, t0);
        n0.record(Outcome::Failure, false, &s, t0);
        assert_peek_is_choose(&b, &keys, at(1), "open");
        // Past open_for: the next asker becomes the half-open probe.
        assert_peek_is_choose(&b, &keys, at(31), "open, past open_for");
        // Half-open with its probe out: refused.
        assert!(matches!(n0.admit(0, &s, at(31)).0, Admission::Probe));
        assert_peek_is_choose(&b, &keys, at(31), "half-open, probe taken");
        // Recovering: each canary step admits a share of the keys.
        n0.record(Outcome::Success, true, &s, at(31));
        assert_eq!(n0.state(), BreakerState::Recovering);
        for step in 0..4 {
            assert_peek_is_choose(&b, &keys, at(31 + 10 * step), "recovering");
        }
        // Shunting (another node): a fifth of its keys go on, by P90 normalized TTFT.
        let n1 = &b.nodes[1].state().breaker;
        let peers = Peers {
            reference: Some(Norm::EXPECTED),
            may_eject: true,
        };
        for i in 0..12 {
            let norm = Norm(if i < 2 { 1000 } else { 1600 });
            n1.observe_latency(Duration::from_secs(2), norm, &peers, &s, at(80));
        }
        assert!(n1.shunt_ratio() > 0.0);
        assert_peek_is_choose(&b, &keys, at(80), "shunting");
        // Draining and at cap.
        b.nodes[2].state().set_draining(true);
        assert_peek_is_choose(&b, &keys, at(80), "draining");
        let held: Vec<Choice> = (0..2)
            .filter_map(|_| match b.choose(keys[0], &[], at(80)) {
                Walk::Chosen(c) => Some(c),
                _ => None,
            })
            .collect();
        assert_eq!(held.len(), 2);
        assert_peek_is_choose(&b, &keys[..1], at(80), "at cap");
        drop(held);
    }

    #[test]
    fn overflow_fills_successors_in_ring_order() {
        let b = balancer(4, 4, None);
        let h = 12345;
        let order: Vec<usize> = b.ring.successors(h).collect();
        let mut held = Vec::new();
        for i in 0..16 {
            let c = chosen(b.choose(h, &[], Instant::now()));
            assert_eq!(c.index, order[i / 4], "request {i}");
            assert_eq!(c.distance, i / 4);
            held.push(c);
        }
        assert!(matches!(b.choose(h, &[], Instant::now()), Walk::Saturated));
        assert_eq!(b.load.in_flight(), 16);
        // Freeing a slot on the third node lets the next request land there.
        held.remove(9);
        assert_eq!(chosen(b.choose(h, &[], Instant::now())).index, order[2]);
        drop(held);
        assert!(b.nodes.iter().all(|m| m.state().in_flight() == 0));
    }

    #[test]
    fn walk_skips_tried_draining_and_unhealthy_nodes() {
        let b = balancer(4, 4, None);
        let order: Vec<usize> = b.ring.successors(99).collect();
        assert_eq!(
            chosen(b.choose(99, &[order[0]], Instant::now())).index,
            order[1]
        );
        b.nodes[order[0]].state().set_draining(true);
        b.nodes[order[1]].state().set_healthy(false);
        let c = chosen(b.choose(99, &[], Instant::now()));
        assert_eq!((c.index, c.distance), (order[2], 2));
        assert!(matches!(
            b.choose(99, &order, Instant::now()),
            Walk::Unavailable
        ));
    }

    #[test]
    fn load_factor_bounds_relative_load() {
        // c = 1.25 over 4 nodes: with nothing in flight each node may take ceil(1.25/4)=1.
        let b = balancer(4, 100, Some(1.25));
        let order: Vec<usize> = b.ring.successors(7).collect();
        let first = chosen(b.choose(7, &[], Instant::now()));
        assert_eq!(first.index, order[0]);
        // total 1 → ceil(1.25 × 2 / 4) = 1: the primary is full, spill.
        let second = chosen(b.choose(7, &[], Instant::now()));
        assert_eq!(second.index, order[1]);
    }

    #[test]
    fn least_loaded_overcommits_the_emptiest_node() {
        let b = balancer(3, 1, None);
        let _held: Vec<Choice> = (0..3)
            .map(|_| chosen(b.choose(5, &[], Instant::now())))
            .collect();
        assert!(matches!(b.choose(5, &[], Instant::now()), Walk::Saturated));
        let extra = b.choose_least_loaded(5, &[]).unwrap();
        assert_eq!(b.nodes[extra.index].state().in_flight(), 2);
    }

    #[test]
    fn queue_is_bounded_and_tickets_leave_on_drop() {
        let load: Arc<PoolLoad> = Arc::default();
        let a = load.enqueue(2).unwrap();
        let _b = load.enqueue(2).unwrap();
        assert!(load.enqueue(2).is_none());
        drop(a);
        assert_eq!(load.queued(), 1);
        assert!(load.enqueue(2).is_some());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn concurrent_reservations_never_exceed_caps(
            nodes in 1usize..6,
            cap in 1u32..5,
            threads in 2usize..8,
            seed in any::<u64>(),
        ) {
            let b = Arc::new(balancer(nodes, cap, None));
            let violations = Arc::new(AtomicU32::new(0));
            let handles: Vec<_> = (0..threads).map(|t| {
                let b = b.clone();
                let violations = violations.clone();
                std::thread::spawn(move || {
                    let mut held: Vec<Choice> = Vec::new();
                    let mut x = seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    for _ in 0..2_000 {
                        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                        if x % 3 == 0 && !held.is_empty() {
                            held.swap_remove((x as usize / 3) % held.len());
                        } else if let Walk::Chosen(c) = b.choose(x, &[], Instant::now()) {
                            held.push(c);
                        }
                        for m in b.nodes() {
                            if m.state().in_flight() > cap {
                                violations.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            }).collect();
            for h in handles {
                h.join().unwrap();
            }
            prop_assert_eq!(violations.load(Ordering::Relaxed), 0);
            prop_assert!(b.nodes.iter().all(|m| m.state().in_flight() == 0));
            prop_assert_eq!(b.load.in_flight(), 0);
        }
    }
}
