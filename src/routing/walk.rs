//! The walk: which node of a pool serves a key. A key's order over the nodes (its ring
//! walk, or for a prefix group the group's first `width` nodes ranked by rendezvous with
//! the key, then the rest of the group's walk), and the bounded-load admission along it:
//! the first node that accepts new requests, was not tried, is under its cap, does not
//! shunt the key and whose breaker admits it. [`Balancer::choose`] reserves that node;
//! [`Balancer::peek`] names it and changes nothing (both run the same checks). Where a
//! conversation's walk starts (its home, or a new conversation's placement) and what a
//! finished request teaches are in [`super::place`]. The clock is passed in; no I/O.

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_64;

use super::breaker::{Admission, BreakerSettings, BreakerState, Outcome};
use super::group::{rendezvous, weighted_rendezvous};
use super::home::node_tag;
use super::node::{Node, NodeSource, NodeState, PoolLoad, Reservation};
use super::ring::{Ring, RingMember, Successors};
use crate::config::{NodeConfig, WhenSaturated};

#[cfg(test)]
pub(super) mod tests;

/// A node chosen for a request, with its slot already taken.
#[derive(Debug)]
pub struct Choice {
    /// Index of the node in the pool (and ring).
    pub index: usize,
    /// Position in the key's successor walk: 0 = primary.
    pub distance: usize,
    pub reservation: Reservation,
    /// This request is the node's half-open trial: its outcome must be recorded.
    pub trial: bool,
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

/// The nodes of a walk in order, each once: the key's ring walk, or for a grouped key
/// the first `width` nodes of the group's walk ranked by rendezvous score with the key
/// (so each conversation has its own order among them and spills scatter), then the
/// rest of the group's walk.
pub struct WalkOrder<'a> {
    /// The target's first node, yielded before the rest and skipped in it.
    first: Option<usize>,
    skip: Option<usize>,
    /// Scored head nodes not yet yielded (a group's width is a few nodes: on the stack).
    head: SmallVec<[(u64, usize); 8]>,
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
    pub(super) ring: Ring,
    pub(super) nodes: Vec<Node>,
    pub(super) load: Arc<PoolLoad>,
    /// CHWBL relative bound `c`, if configured.
    pub(super) load_factor: Option<f64>,
    pub(super) settings: Arc<BreakerSettings>,
    total_weight: u32,
    /// `xxh3_64(node id)` per node: rendezvous scores stay put across rebuilds.
    id_hashes: Vec<u64>,
    /// Nodes differ in weight: rank group nodes by weighted rendezvous.
    weighted: bool,
    /// Each node's tag in the pool's home table.
    pub(super) tags: Vec<u32>,
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
                    data_parallel_rank: None,
                    tls_name: None,
                    bootstrap_port: None,
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

    /// The nodes behind the same URL as node `index` (itself included): the ranks of
    /// one data-parallel server, which one connection failure takes out together.
    pub fn same_server(&self, index: usize) -> impl Iterator<Item = usize> + '_ {
        let url = self.nodes[index].url();
        (0..self.nodes.len()).filter(move |&i| self.nodes[i].url() == url)
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

    /// The nodes a target's walk visits, in order.
    pub fn order(&self, target: Target) -> WalkOrder<'_> {
        let first = target.first.filter(|&i| i < self.nodes.len());
        let mut order = self.key_order(target);
        order.first = first;
        order.skip = first;
        order
    }

    /// The key's own order (the target's `first` aside).
    pub(super) fn key_order(&self, target: Target) -> WalkOrder<'_> {
        let order = |head, rest| WalkOrder {
            first: None,
            skip: None,
            head,
            rest,
        };
        match target.group {
            None => order(SmallVec::new(), Some(self.ring.successors(target.hash))),
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
    pub(super) fn absolute_cap_of(&self, m: &Node) -> u32 {
        self.split_cap_of(m)
            .saturating_sub(m.state().others_in_flight())
            .max(1)
    }

    /// The cap in force on this replica's own view (before others' known load).
    pub(super) fn own_cap(&self, m: &Node) -> u32 {
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

    /// Whether a new request joins the pool's queue before walking: with
    /// `when_saturated = "queue"` a request does not overtake the ones already waiting
    /// (FIFO). A request failing over (`tried` not empty) walks at once.
    pub fn joins_queue(&self, when_saturated: WhenSaturated, tried: &[usize]) -> bool {
        when_saturated == WhenSaturated::Queue && tried.is_empty() && self.load.queued() > 0
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
            let mut trial = false;
            if ask {
                let state = m.state();
                let (admission, flip) = state.breaker.admit(target.hash, &self.settings, now);
                state.log_flip(flip);
                if admission == Admission::Refuse {
                    return Try::Refused;
                }
                trial = admission == Admission::Trial;
            }
            match self.reserve(m, cap) {
                Some(reservation) => Try::Taken((reservation, trial)),
                None => {
                    // Lost a race for the last slot: give the trial back.
                    if trial {
                        m.state()
                            .record(Outcome::Neutral, true, &self.settings, now);
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
                x: (reservation, trial),
            } => Walk::Chosen(Choice {
                index,
                distance,
                reservation,
                trial,
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
            trial: false,
            shunted: false,
        })
    }

    fn reserve(&self, m: &Node, cap: u32) -> Option<Reservation> {
        Reservation::take(m.state(), &self.load, cap)
    }
}
