//! Where a conversation lives: the start of a key's walk. A conversation this balancer
//! remembers goes to its home first; a new one goes to the less loaded of its first two
//! nodes (a short opening: where fewer conversations made their home lately). A request
//! whose home is full may wait for it when that costs less than a cold prefill
//! elsewhere. A finished request teaches the pool its prefill rate, its node's slot
//! time and, when it was routed with no remembered home and missed, where its
//! conversation lives. Why each rule and threshold: docs/evidence.md. No I/O; the
//! clock is passed in.

use std::time::{Duration, Instant};

use super::breaker::BreakerState;
use super::cost::{self, Stakes};
use super::decision::{Ticket, Usage};
use super::facts::Turn;
use super::group::Grouping;
use super::home::Entry;
use super::latency::{self, Peers};
use super::walk::{Balancer, Target};
use super::Mode;

#[cfg(test)]
mod tests;

/// How many of a new conversation's first nodes are compared by load with balancer
/// replicas (more spreads better and makes replicas disagree more often), and under
/// `load_factor`, for an opening larger than [`SMALL_OPENING_TOKENS`].
const NEW_CONVERSATION_CHOICES: usize = 2;

/// The least share of a prompt above its group's prefix that a miss is judged on.
const MIN_HISTORY_SHARE: f64 = 0.1;

/// With balancer replicas, a key's first node that became home to this many more
/// conversations lately than the pool's mean loses its replica margin: new
/// conversations go by load alone (docs/evidence.md, "replicas").
const PILED_UP_HOMES: f64 = 2.0;

/// A new conversation whose own text (above its group's prefix) is at most this many
/// tokens is placed by the conversations each node became home to lately before load:
/// moving it costs a balancer replica that did not see it placed at most this text to
/// find it, and a short opening says nothing of how long the conversation grows (an
/// agent opens with a few hundred tokens of its own and ends thousands long), so the
/// count of homes, not the requests in flight at the moment, is what keeps long
/// sessions from piling up on one engine. Larger openings (a document, a long first
/// message) would cost that replica their whole text: with replicas they go by load
/// alone (docs/evidence.md, "A small opening is placed by where conversations live");
/// alone, with nobody to disagree, they are placed like small ones.
pub const SMALL_OPENING_TOKENS: u32 = 256;

/// Ranks a node at its cap after every node under it, whatever their recent homes.
const FULL: f64 = 1e6;

/// With balancer replicas, how much less loaded (in nodes: its cap in requests, or a
/// slot time of queued prefill) the other choice must be to take a prompt string whose
/// turn the syntax cannot tell (docs/evidence.md, `continuations`).
const UNTOLD_MARGIN: f64 = 1.0;

/// A conversation's remembered home: its node, and the prompt tokens it last sent
/// there (what that node should hold of it, if nothing was evicted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Home {
    pub index: usize,
    pub tokens: u32,
}

impl Balancer {
    /// The walk target of a key placed by `grouping`, with no node first; a counted
    /// decision (`mode.counts()`) counts the request toward its group's share.
    pub fn target(&self, hash: u64, grouping: Grouping<u64>, mode: Mode) -> Target {
        let nodes = self.nodes.len();
        let group = match grouping {
            Grouping::Ring => None,
            // The whole pool: the group hash is never walked.
            Grouping::Pool => Some((0, nodes)),
            Grouping::Group(g) => Some((g, self.load.groups.width(g, nodes, mode))),
        };
        Target {
            hash,
            group,
            first: None,
        }
    }

    /// A `hybrid` key's target (`Pool` or `Group` placement) with a node first: the
    /// conversation's remembered `home`, or, for a new conversation (and a prompt
    /// string seen nowhere yet), the less loaded of its first two nodes (within its
    /// group's nodes; for an opening of at most [`SMALL_OPENING_TOKENS`] of its own,
    /// `own_tokens`, the one fewer conversations made their home lately; with no other
    /// balancer replica and no `load_factor`, every opening is placed that way across
    /// all its group's nodes), so new work spreads by load while every later turn finds
    /// its home. A later turn this balancer has no home for starts at the key's own
    /// first node. Ring keys are returned as they are.
    pub fn place(&self, target: Target, home: Option<Home>, turn: Turn, own_tokens: u32) -> Target {
        if target.group.is_none() {
            return target;
        }
        Target {
            first: self.first_of(target, home, turn, own_tokens),
            ..target
        }
    }

    pub(super) fn first_of(
        &self,
        target: Target,
        home: Option<Home>,
        turn: Turn,
        own_tokens: u32,
    ) -> Option<usize> {
        if let Some(home) = home {
            return Some(home.index);
        }
        if turn == Turn::Later {
            return None;
        }
        // A small opening, and any opening with no other balancer replica (and no
        // `load_factor`): by recent homes (one home weighs a full node of requests) and
        // load, prefill queued included, but never to a node at its cap (the walk would
        // spill it).
        let alone = self.load.replicas() == 1;
        let by_homes = self.places_by_homes(own_tokens) || (alone && self.load_factor.is_none());
        // With no other replica to disagree with, such an opening is compared across all
        // of its group's nodes: sessions that start together (a burst of agents) then
        // spread evenly, where two choices leave some node one session more than its
        // cache holds (docs/evidence.md, `agentic` over HTTP), and documents opened
        // together do not queue their cold prefills behind one another on one engine
        // (`doc-qa` over HTTP).
        let n = if by_homes && alone {
            usize::MAX
        } else {
            NEW_CONVERSATION_CHOICES
        };
        let choices = match target.group {
            Some((_, width)) => width.clamp(1, n),
            None => n,
        };
        // With other balancer replicas, any node but the key's own first must be clearly
        // less loaded (by two requests at equal caps, not one): a new conversation placed
        // away from its key's first node costs a replica that did not see it placed one
        // miss to find it. Alone, the less loaded node takes it; so it does with
        // replicas when the key's first node has piled up homes: the margin keeps new
        // conversations on their keys' first nodes, and hashing alone piles them up
        // until the engine's cache thrashes (docs/evidence.md, `agentic`).
        let mut order = self.key_order(target).take(choices);
        let key_first = order.next()?;
        //
        // A prompt string's turn cannot be told: if it continues a conversation another
        // replica placed, no miss will say where that conversation lives (a miss is only
        // judged against a history the syntax shows), so disagreeing would cost its
        // whole history for good. It leaves its key's first node only for one a full
        // node less loaded, or when that node is at its cap (the walk would spill it,
        // and a spill is remembered nowhere).
        let margin = if self.load.replicas() > 1 && turn == Turn::Unknown {
            let n = &self.nodes[key_first];
            let s = n.state();
            if s.in_flight() + s.others_in_flight() >= self.own_cap(n) {
                0.0
            } else {
                UNTOLD_MARGIN
            }
        } else if self.load.replicas() > 1 && !self.piled_up(key_first) {
            1.0 / f64::from(self.cap_of(&self.nodes[key_first]).max(1))
        } else {
            0.0
        };
        // The recent homes read once (one lock, one mean) for all the candidates; taken
        // after `piled_up`, which reads them too.
        let homes = by_homes.then(|| self.load.recent_homes.above_mean_of(&self.tags));
        let load = |i: usize| {
            let n = &self.nodes[i];
            let s = n.state();
            let in_flight = f64::from(s.in_flight() + s.others_in_flight())
                / f64::from(self.own_cap(n).max(1))
                + self.prefill_queued(i);
            match &homes {
                None => in_flight,
                Some(_) if in_flight >= 1.0 => in_flight + FULL,
                Some(homes) => in_flight + homes.of(self.tags[i]),
            }
        };
        std::iter::once((load(key_first), 0, key_first))
            .chain(order.enumerate().map(|(k, i)| (load(i) + margin, k + 1, i)))
            .filter(|&(_, _, i)| self.nodes[i].state().accepts_new())
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, _, i)| i)
    }

    /// Node `index`'s prefill backlog in slot times: the estimated prompt tokens sent
    /// there and not yet past their first token, at the pool's prefill rate, over how
    /// long a request holds a slot there. An engine prefills one prompt at a time, so a
    /// new conversation placed behind a long cold prefill waits it out: a node with a
    /// slot time of prefill queued weighs as a full node of requests.
    fn prefill_queued(&self, index: usize) -> f64 {
        let s = self.nodes[index].state();
        match s.slot_time.get() {
            Some(slot) if !slot.is_zero() => {
                let queued =
                    self.load.prefill.per_token().as_secs_f64() * f64::from(s.prefill_backlog());
                queued / slot.as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// Whether a new conversation with `own_tokens` of its own text (above its group's
    /// prefix) is placed by recent homes before load ([`SMALL_OPENING_TOKENS`]). Not
    /// with `load_factor`, which asks for balance by requests in flight.
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

    /// The home remembered for `hash`, if its node is in this pool.
    pub fn home_of(&self, hash: u64) -> Option<Home> {
        let entry = self.load.homes.get(hash)?;
        let index = self.tags.iter().position(|&t| t == entry.node)?;
        Some(Home {
            index,
            tokens: entry.tokens,
        })
    }

    /// Records where a request of `tokens` prompt tokens was admitted: a conversation
    /// placed with no home yet, or served at its home, is at home there from now on,
    /// holding that prompt (an engine caches a prompt as it prefills it, so a request
    /// of the same conversation that comes meanwhile goes there too). A spill is a
    /// visit: the home stays where the conversation was placed, where every replica
    /// looks for it.
    pub fn admitted(&self, target: Target, index: usize, distance: usize, tokens: u32) {
        if distance == 0 || target.first.is_none() {
            self.remember(target.hash, index, tokens);
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
        // A spill waits for the prefills queued at its node first. (The home's own queue
        // drains while this request waits there for a slot.)
        let lane = |i: usize| self.nodes[i].state().prefill_backlog();
        let budget = cost::wait_budget(
            stakes.saved(self.in_group(target, spill)),
            lane(spill).saturating_sub(lane(home)),
            self.load.prefill.per_token(),
            state.slot_time.get(),
            cap,
            state.waiting(),
        )?;
        Some((home, budget))
    }

    /// What a finished request teaches: the pool's prefill rate (from a stream's time
    /// to first token and the tokens its node prefilled before it), the node's slot
    /// time, and, for a request routed with no remembered home, where its conversation
    /// lives ([`Balancer::rehome`]).
    pub(super) fn learn(&self, t: &Ticket, usage: Usage, ttft: Option<Duration>, now: Instant) {
        if let (Some(ttft), true) = (ttft, usage.prompt_tokens > 0) {
            self.load
                .prefill
                .observe(ttft, t.ahead.saturating_add(t.uncached(usage)));
        }
        let node = &self.nodes[t.index];
        node.state()
            .slot_time
            .observe(now.saturating_duration_since(t.since));
        if t.stakes.guessed && usage.prompt_tokens > 0 {
            let found = f64::from(usage.cached_tokens) / f64::from(usage.prompt_tokens);
            let s = &t.stakes;
            self.rehome(t.target, t.index, s, found);
        }
    }

    /// What a finished request that was routed with no remembered home says of its
    /// conversation's home. It was served by `served` and was expected to find a share
    /// of its prompt cached there (`stakes.expect`), some of it (its group's prefix,
    /// `stakes.group_share`) on any node of its group; when it found less than half of
    /// what lies above that floor, its
    /// conversation's cache was elsewhere: on the other of its first two nodes, where a
    /// new conversation is placed (another replica placed it there, or its home was
    /// forgotten). That node becomes its home, so replicas that never share a word
    /// agree again after one miss. (A miss at a remembered home is an eviction: no
    /// other node holds more, and the caller does not ask.)
    pub(super) fn rehome(&self, target: Target, served: usize, stakes: &Stakes, found: f64) {
        let (expected, floor) = (stakes.expect, stakes.group_share);
        // Ring keys (key headers, `conversation`/`prefix` modes) have no homes.
        let ringed = target.group.is_none() && target.first.is_none();
        // A group's prefix is found on all its nodes: only the history above it tells
        // the home (when there is enough of it to tell, past estimation error).
        // Alone, a guessed home was forgotten, not placed by another replica: no floor.
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
        // The other node holds the history this request expected.
        if let [a, b] = pair[..] {
            if served == a {
                self.remember(target.hash, b, stakes.history);
            } else if served == b {
                self.remember(target.hash, a, stakes.history);
            }
        }
    }

    /// Judges a finished stream's latency against its work and the node's peers (see
    /// [`latency`]): may shunt, open, or mark node `index` degraded. Called before the
    /// request is learned from, so the sample is judged by what the pool knew before it.
    pub(super) fn judge_latency(
        &self,
        index: usize,
        ttft: Duration,
        ahead: u32,
        uncached: u32,
        now: Instant,
    ) {
        let s = &self.settings;
        let expectation = self.load.prefill.expectation();
        let Some(norm) = expectation.normalize(ttft, ahead, uncached, s.slow_ttft) else {
            return;
        };
        let mut out = 0;
        let mut p90s = Vec::with_capacity(self.nodes.len());
        let mut latest = Vec::with_capacity(self.nodes.len());
        for (i, n) in self.nodes.iter().enumerate() {
            let b = &n.state().breaker;
            if matches!(b.state(), BreakerState::Open | BreakerState::HalfOpen) {
                out += 1;
            }
            if i != index {
                p90s.extend(b.summary(s.min_samples).map(|(_, p90)| p90));
                latest.extend(b.latest());
            }
        }
        let may_eject = latency::may_eject(out, self.nodes.len(), s.max_ejected_share);
        let peers = Peers::of(&mut p90s, &mut latest, may_eject);
        let state = self.nodes[index].state();
        state.log_flip(state.breaker.observe_latency(ttft, norm, &peers, s, now));
    }

    /// Remembers the node that served `hash` a prompt of `tokens`: its conversation's
    /// home from now on.
    pub fn remember(&self, hash: u64, index: usize, tokens: u32) {
        let node = self.tags[index];
        let before = self.load.homes.get(hash).map(|e| e.node);
        self.load.homes.set(hash, Entry { node, tokens });
        if before != Some(node) {
            self.load.recent_homes.moved(before, node);
        }
    }
}
