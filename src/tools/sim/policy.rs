//! The routing policies the simulator compares, each one type behind [`Policy`]:
//! baselines (round robin, least loaded, plain consistent hashing, CHWBL), prefixlb
//! itself (the proxy's own table, placed and walked through the one entry point the
//! proxy uses, [`Table::place`], on a virtual clock), SGLang-router-style cache-aware
//! routing, and an oracle that sees every engine's true cache.

use std::cmp::Reverse;
use std::time::{Duration, Instant};

use super::Engine;

use crate::config::{Config, NodeConfig};
use crate::routing::decision::{Placement, Ticket, Usage};
use crate::routing::node::HomeWaiter;
use crate::routing::table::{Registry, Table};
use crate::routing::walk::Walk;
use crate::routing::Mode;
use crate::tools::engine_model::{PrefixCache, Prompt};
use crate::tools::workload::{Rng, Turn};

/// The routing policies compared, by name.
pub const POLICIES: [&str; 8] = [
    "round_robin",
    "least_loaded",
    "consistent_hash",
    "prefixlb",
    "prefixlb-fifo",
    "chwbl",
    "cache_aware",
    "oracle",
];

/// What a policy may look at when it places a request.
pub struct View<'a> {
    /// Requests in flight per engine, as the balancer counts them.
    pub loads: &'a [usize],
    /// The engines themselves (only the oracle looks at their true caches).
    pub engines: &'a [Engine],
}

/// A request waiting to be placed.
pub struct Pending<'a> {
    pub turn: &'a Turn,
    pub prompt: &'a Prompt,
    /// What the policy keeps of the request across waits (prefixlb: its replica and
    /// placement, computed once so it is counted once, as the proxy counts it).
    pub state: &'a mut Option<Routed>,
    /// Now, in µs of virtual time.
    pub now: u64,
}

/// prefixlb's state of one request while it waits to be placed.
pub struct Routed {
    replica: usize,
    placement: Placement,
    /// Waiting for its full home until then (µs), counted there meanwhile.
    home_wait: Option<(u64, HomeWaiter)>,
}

/// A request that finished, as its balancer learns of it.
pub struct Done {
    /// prefixlb's ticket, finished now.
    pub ticket: Option<Ticket>,
    /// Now, and placement to first token, in µs.
    pub now: u64,
    pub ttft_us: u64,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

/// Where a policy sends a request.
pub enum Pick {
    To {
        engine: usize,
        /// prefixlb's ticket (its slot), held until the request finishes.
        ticket: Option<Ticket>,
        /// Not the key's first node.
        spilled: bool,
    },
    /// Every engine is at the policy's bound: wait for one to free.
    Wait,
    /// Wait for its home until then (µs) at the latest.
    WaitUntil(u64),
}

impl Pick {
    /// An engine chosen without a ticket or a spill.
    fn plain(engine: usize) -> Pick {
        Pick::To {
            engine,
            ticket: None,
            spilled: false,
        }
    }
}

/// A routing policy.
pub trait Policy {
    fn place(&mut self, req: Pending<'_>, view: &View<'_>) -> Result<Pick, String>;

    /// A request it placed got its first token (`now`, µs): its answer commits.
    fn first_token(&mut self, _ticket: &mut Ticket, _now: u64) {}

    /// A request it placed finished.
    fn finished(&mut self, _done: Done) {}

    /// How often its replicas disagreed on a request's first node (share of
    /// placements), for policies with replicas.
    fn disagreement(&self) -> Option<f64> {
        None
    }
}

/// How requests are spread over balancer replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    RoundRobin,
    /// Uniformly at random (seeded).
    Random,
}

/// The fleet a policy routes for.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub nodes: usize,
    pub cache_tokens: usize,
    pub block_tokens: usize,
    /// Balancer replicas (prefixlb): each with its own state, none shared.
    pub replicas: usize,
    pub spread: Spread,
    /// Replicas see each other's in-flight requests per engine, at once.
    pub share_load: bool,
    /// See [`super::Fleet::share_every_us`].
    pub share_every_us: u64,
    pub seed: u64,
}

/// Builds a policy by name.
pub fn by_name(name: &str, config: &Config, setup: Setup) -> Result<Box<dyn Policy>, String> {
    let Setup {
        nodes,
        cache_tokens,
        block_tokens,
        ..
    } = setup;
    let model = config
        .pools
        .first()
        .and_then(|p| p.models.first())
        .cloned()
        .unwrap_or_default();
    let policy: Box<dyn Policy> = match name {
        "round_robin" => Box::new(RoundRobin { next: 0 }),
        "least_loaded" => Box::new(LeastLoaded),
        "consistent_hash" => Box::new(ConsistentHash {
            table: fleet_table(config, nodes, None, None),
            model,
        }),
        // `prefixlb-fifo`: the same, its waiters served oldest first (before the fair
        // queue; see `Run::fair`).
        "prefixlb" | "prefixlb-fifo" => Box::new(Bounded::new(
            (0..setup.replicas.max(1))
                .map(|_| {
                    let t = fleet_table(config, nodes, None, None);
                    for p in &t.pools {
                        p.balancer.load().set_replicas(setup.replicas as u32);
                    }
                    t
                })
                .collect(),
            model,
            setup,
            true,
        )),
        // The CHWBL relative bound alone (the absolute cap out of the way), walked as
        // CHWBL walks: no homes, no waiting.
        "chwbl" => Box::new(Bounded::new(
            vec![fleet_table(config, nodes, Some(1.25), Some(u32::MAX / 2))],
            model,
            setup,
            false,
        )),
        "cache_aware" => Box::new(CacheAware {
            trees: (0..nodes)
                .map(|_| PrefixCache::new(cache_tokens, block_tokens))
                .collect(),
        }),
        "oracle" => Box::new(Oracle {
            cap: config.routing.max_in_flight as usize,
        }),
        other => {
            return Err(format!(
                "unknown policy {other:?} (one of {})",
                POLICIES.join(", ")
            ))
        }
    };
    Ok(policy)
}

/// A table for `nodes` identical engines with the routing settings of `config`.
fn fleet_table(
    config: &Config,
    nodes: usize,
    load_factor: Option<f64>,
    max_in_flight: Option<u32>,
) -> Table {
    let mut c = config.clone();
    c.pools.truncate(1);
    let pool = &mut c.pools[0];
    pool.nodes = (0..nodes)
        .map(|i| NodeConfig {
            id: format!("engine-{i}"),
            url: http::Uri::from_static("http://127.0.0.1:1"),
            weight: 1,
            data_parallel_rank: None,
            tls_name: None,
            bootstrap_port: None,
        })
        .collect();
    if let Some(lf) = load_factor {
        c.routing.load_factor = Some(lf);
    }
    if let Some(m) = max_in_flight {
        c.routing.max_in_flight = m;
    }
    Table::build(c, &Registry::default())
}

/// A turn placed as the proxy places it (counted toward its group's share, as the
/// proxy counts it), on the simulator's clock.
fn place_turn(table: &Table, turn: &Turn, model: &str, mode: Mode) -> Result<Placement, String> {
    table
        .place(turn.path(), None, &turn.body(model), mode)
        .map_err(|e| e.to_string())
}

/// The least loaded engine (ties to the lowest index).
fn least_loaded(loads: &[usize]) -> usize {
    (0..loads.len()).min_by_key(|&i| (loads[i], i)).unwrap_or(0)
}

struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn place(&mut self, _: Pending<'_>, view: &View<'_>) -> Result<Pick, String> {
        self.next += 1;
        Ok(Pick::plain((self.next - 1) % view.loads.len()))
    }
}

struct LeastLoaded;

impl Policy for LeastLoaded {
    fn place(&mut self, _: Pending<'_>, view: &View<'_>) -> Result<Pick, String> {
        Ok(Pick::plain(least_loaded(view.loads)))
    }
}

/// The key's primary node, whatever its load.
struct ConsistentHash {
    table: Table,
    model: String,
}

impl Policy for ConsistentHash {
    fn place(&mut self, req: Pending<'_>, _: &View<'_>) -> Result<Pick, String> {
        let p = place_turn(&self.table, req.turn, &self.model, Mode::Replay)?.without_homes();
        let engine = p.pool().balancer.order(p.target).next().unwrap_or(0);
        Ok(Pick::plain(engine))
    }
}

/// The proxy's own tables and walk: `prefixlb` (the config's bounds, its
/// conversations' homes, waiting for a full home when it pays; one table per replica)
/// or `chwbl` (the plain bounded walk).
struct Bounded {
    replicas: Vec<Table>,
    spread: Spread,
    rng: Rng,
    next: usize,
    model: String,
    /// Virtual time 0 on the balancer's clock (only breakers and slot times read it).
    epoch: Instant,
    /// prefixlb's placement (homes, waits) rather than the plain walk.
    smart: bool,
    placements: u64,
    disagreements: u64,
    /// Replicas see what the others hold on each node.
    share_load: bool,
    /// Every so often (µs), or at every decision (0).
    share_every_us: u64,
    /// When the last snapshot was shared (`share_every_us` > 0).
    shared_at: Option<u64>,
}

impl Bounded {
    fn new(replicas: Vec<Table>, model: String, setup: Setup, smart: bool) -> Self {
        Bounded {
            replicas,
            spread: setup.spread,
            rng: Rng::new(setup.seed ^ 0x5EED),
            next: 0,
            model,
            epoch: Instant::now(),
            smart,
            placements: 0,
            disagreements: 0,
            share_load: setup.share_load,
            share_every_us: setup.share_every_us,
            shared_at: None,
        }
    }

    /// `--share-load`: `replica` learns what the others hold in `pool` now, or, with a
    /// lag, every replica learns what the others held in every pool at the last
    /// snapshot, taken every `share_every_us`.
    fn share_load_at(&mut self, replica: usize, pool: usize, now: u64) {
        if self.share_every_us == 0 {
            self.share_in_flight(replica, pool);
            return;
        }
        if self
            .shared_at
            .is_some_and(|at| now < at.saturating_add(self.share_every_us))
        {
            return;
        }
        self.shared_at = Some(now);
        for r in 0..self.replicas.len() {
            for p in 0..self.replicas[r].pools.len() {
                self.share_in_flight(r, p);
            }
        }
    }

    /// Tells `replica` what the other replicas hold on each node now (`--share-load`:
    /// what a perfect shared budget would know; the balancer itself has no such feed).
    fn share_in_flight(&self, replica: usize, pool: usize) {
        let mine = &self.replicas[replica].pools[pool].balancer;
        for i in 0..mine.nodes().len() {
            let others: u32 = self
                .replicas
                .iter()
                .enumerate()
                .filter(|(r, _)| *r != replica)
                .map(|(_, t)| t.pools[pool].balancer.node(i).state().in_flight())
                .sum();
            mine.node(i).state().set_others_in_flight(others);
        }
    }

    fn pick_replica(&mut self) -> usize {
        let n = self.replicas.len();
        match self.spread {
            Spread::RoundRobin => {
                self.next += 1;
                (self.next - 1) % n
            }
            Spread::Random => (self.rng.next_u64() % n as u64) as usize,
        }
    }

    /// The balancer's clock at `now` µs of virtual time.
    fn at(&self, now: u64) -> Instant {
        self.epoch + Duration::from_micros(now)
    }

    /// Places a request on a replica: where its walk starts.
    fn route(&mut self, turn: &Turn, now: u64) -> Result<Routed, String> {
        let replica = self.pick_replica();
        if self.share_load && self.replicas.len() > 1 {
            // Before the placement: a new conversation is placed by load too. (The
            // simulated fleet has one pool.)
            self.share_load_at(replica, 0, now);
        }
        let table = &self.replicas[replica];
        let placement = place_turn(table, turn, &self.model, Mode::Replay)?;
        let placement = if self.smart {
            placement
        } else {
            placement.without_homes()
        };
        if self.replicas.len() > 1 {
            self.placements += 1;
            let first = placement.pool().balancer.order(placement.target).next();
            let disagree =
                self.replicas.iter().enumerate().any(|(r, other)| {
                    r != replica && other_first(other, turn, &self.model) != first
                });
            self.disagreements += u64::from(disagree);
        }
        Ok(Routed {
            replica,
            placement,
            home_wait: None,
        })
    }
}

/// The first node another replica would walk to for a turn (counting nothing).
fn other_first(table: &Table, turn: &Turn, model: &str) -> Option<usize> {
    let p = place_turn(table, turn, model, Mode::Explain).ok()?;
    p.pool().balancer.order(p.target).next()
}

impl Policy for Bounded {
    fn place(&mut self, req: Pending<'_>, _: &View<'_>) -> Result<Pick, String> {
        let routed_now = req.state.is_none();
        if routed_now {
            *req.state = Some(self.route(req.turn, req.now)?);
        }
        let at = self.at(req.now);
        let Some(r) = req.state.as_mut() else {
            return Err("unrouted".into());
        };
        if self.share_load && self.replicas.len() > 1 && !routed_now {
            // A request that waited: its walk reads the load of now.
            self.share_load_at(r.replica, 0, req.now);
        }
        let c = match r.placement.choose(&[], at) {
            Walk::Chosen(c) => c,
            _ => return Ok(Pick::Wait),
        };
        if self.smart && c.distance > 0 {
            if let Some(until) = home_wait(r, c.index, req.now) {
                // `c` is dropped: its slot goes back.
                return Ok(Pick::WaitUntil(until));
            }
        }
        r.home_wait = None;
        let (engine, spilled) = (c.index, c.distance > 0);
        let ticket = r.placement.ticket(c, at);
        Ok(Pick::To {
            engine,
            spilled,
            ticket: Some(ticket),
        })
    }

    fn first_token(&mut self, ticket: &mut Ticket, now: u64) {
        ticket.settle(self.at(now));
    }

    fn finished(&mut self, done: Done) {
        let Some(ticket) = done.ticket else {
            return;
        };
        let tokens = |n: usize| n.min(u32::MAX as usize) as u32;
        let usage = Usage {
            prompt_tokens: tokens(done.prompt_tokens),
            cached_tokens: tokens(done.cached_tokens),
        };
        let ttft = Duration::from_micros(done.ttft_us);
        ticket.finish(usage, Some(ttft), self.at(done.now));
    }

    fn disagreement(&self) -> Option<f64> {
        (self.replicas.len() > 1).then(|| self.disagreements as f64 / self.placements.max(1) as f64)
    }
}

/// Whether a request whose walk found its home full should wait for it rather than
/// spill to `spill`, and until when (µs): decided once, on the first spill offered.
fn home_wait(r: &mut Routed, spill: usize, now: u64) -> Option<u64> {
    if let Some((until, _)) = &r.home_wait {
        return (now < *until).then_some(*until);
    }
    let (home, budget) = r.placement.home_wait(spill)?;
    let until = now + budget.as_micros() as u64;
    let waiter = r.placement.pool().balancer.node(home).state().wait_here();
    r.home_wait = Some((until, waiter));
    Some(until)
}

/// SGLang-router style: an approximate per-engine tree of what was sent there; follow
/// a match over half the prompt unless the load is badly uneven.
struct CacheAware {
    trees: Vec<PrefixCache>,
}

impl Policy for CacheAware {
    fn place(&mut self, req: Pending<'_>, view: &View<'_>) -> Result<Pick, String> {
        let loads = view.loads;
        let (max, min) = (
            *loads.iter().max().unwrap_or(&0),
            *loads.iter().min().unwrap_or(&0),
        );
        let least = least_loaded(loads);
        let engine = if max - min > 32 && max as f64 > 1.1 * min as f64 {
            least
        } else {
            let blocks = req.prompt.blocks.len().max(1);
            let (best, matched) = (0..loads.len())
                .map(|i| (i, self.trees[i].cached_prefix(&req.prompt.blocks)))
                .max_by_key(|&(i, m)| (m, Reverse(loads[i]), Reverse(i)))
                .unwrap_or((0, 0));
            if matched as f64 / blocks as f64 > 0.5 {
                best
            } else {
                least
            }
        };
        self.trees[engine].serve(&req.prompt.blocks);
        Ok(Pick::plain(engine))
    }
}

/// Sees every engine's true cache: among engines under prefixlb's bound
/// (`max_in_flight`), the longest cached prefix if over half the prompt is cached
/// there, else the least loaded.
struct Oracle {
    cap: usize,
}

impl Policy for Oracle {
    fn place(&mut self, req: Pending<'_>, view: &View<'_>) -> Result<Pick, String> {
        let loads = view.loads;
        let free: Vec<usize> = (0..loads.len()).filter(|&i| loads[i] < self.cap).collect();
        let best = free
            .iter()
            .map(|&i| {
                let cache = &view.engines[i].model.cache;
                (i, cache.cached_prefix(&req.prompt.blocks))
            })
            .max_by_key(|&(i, m)| (m, Reverse(loads[i]), Reverse(i)));
        let least = free
            .iter()
            .copied()
            .min_by_key(|&i| (loads[i], view.engines[i].served, i));
        Ok(match (best, least) {
            (Some((i, m)), _) if 2 * m > req.prompt.blocks.len() => Pick::plain(i),
            (_, Some(i)) => Pick::plain(i),
            _ => Pick::Wait,
        })
    }
}
