//! The routing policies the simulator compares, each one type behind [`Policy`]:
//! baselines (round robin, least loaded, plain consistent hashing, CHWBL), prefixlb
//! itself (the proxy's own table and walk), SGLang-router-style cache-aware routing,
//! and an oracle that sees every engine's true cache.

use std::cmp::Reverse;
use std::time::Instant;

use super::Engine;
use crate::config::{Config, NodeConfig};
use crate::routing::node::Reservation;
use crate::routing::table::{Registry, Table};
use crate::routing::walk::{Target, Walk};
use crate::tools::engine_model::{PrefixCache, Prompt};
use crate::tools::workload::Turn;

/// The routing policies compared, by name.
pub const POLICIES: [&str; 7] = [
    "round_robin",
    "least_loaded",
    "consistent_hash",
    "prefixlb",
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
    /// The pool and walk target once computed (kept across waits, so the request is
    /// counted once toward its prefix group, as the proxy counts it).
    pub target: &'a mut Option<(usize, Target)>,
}

/// Where a policy sends a request.
pub enum Placement {
    To {
        engine: usize,
        /// prefixlb's reservation, held until the request finishes.
        reservation: Option<Reservation>,
        /// Not the key's first node.
        spilled: bool,
    },
    /// Every engine is at the policy's bound: wait for one to free.
    Wait,
}

impl Placement {
    /// An engine chosen without a reservation or a spill.
    fn plain(engine: usize) -> Placement {
        Placement::To {
            engine,
            reservation: None,
            spilled: false,
        }
    }
}

/// A routing policy.
pub trait Policy {
    fn place(&mut self, req: Pending<'_>, view: &View<'_>) -> Result<Placement, String>;
}

/// Builds a policy by name for a fleet of `nodes` engines.
pub fn by_name(
    name: &str,
    config: &Config,
    nodes: usize,
    cache_tokens: usize,
    block_tokens: usize,
) -> Result<Box<dyn Policy>, String> {
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
        "prefixlb" => Box::new(Bounded {
            table: fleet_table(config, nodes, None, None),
            model,
            epoch: Instant::now(),
        }),
        // The CHWBL relative bound alone (the absolute cap out of the way).
        "chwbl" => Box::new(Bounded {
            table: fleet_table(config, nodes, Some(1.25), Some(u32::MAX / 2)),
            model,
            epoch: Instant::now(),
        }),
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

/// The pool and walk target the proxy would compute for a turn (counting it toward its
/// group's share, as the proxy does).
fn plan_of(table: &Table, turn: &Turn, model: &str) -> Result<(usize, Target), String> {
    let plan = table
        .plan(turn.path(), None, &turn.body(model))
        .map_err(|e| e.to_string())?;
    let target = table.pools[plan.pool]
        .balancer
        .target(plan.hash, plan.group);
    Ok((plan.pool, target))
}

/// The least loaded engine (ties to the lowest index).
fn least_loaded(loads: &[usize]) -> usize {
    (0..loads.len()).min_by_key(|&i| (loads[i], i)).unwrap_or(0)
}

struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn place(&mut self, _: Pending<'_>, view: &View<'_>) -> Result<Placement, String> {
        self.next += 1;
        Ok(Placement::plain((self.next - 1) % view.loads.len()))
    }
}

struct LeastLoaded;

impl Policy for LeastLoaded {
    fn place(&mut self, _: Pending<'_>, view: &View<'_>) -> Result<Placement, String> {
        Ok(Placement::plain(least_loaded(view.loads)))
    }
}

/// The key's primary node, whatever its load.
struct ConsistentHash {
    table: Table,
    model: String,
}

impl Policy for ConsistentHash {
    fn place(&mut self, req: Pending<'_>, _: &View<'_>) -> Result<Placement, String> {
        let (pool, target) = plan_of(&self.table, req.turn, &self.model)?;
        let engine = self.table.pools[pool]
            .balancer
            .order(target)
            .next()
            .unwrap_or(0);
        Ok(Placement::plain(engine))
    }
}

/// The proxy's own table and walk: `prefixlb` (the config's bounds) or `chwbl`.
struct Bounded {
    table: Table,
    model: String,
    /// The balancer's clock, which only breakers read (they never trip here).
    epoch: Instant,
}

impl Policy for Bounded {
    fn place(&mut self, req: Pending<'_>, _: &View<'_>) -> Result<Placement, String> {
        let (pool, target) = match *req.target {
            Some(t) => t,
            None => plan_of(&self.table, req.turn, &self.model)?,
        };
        match self.table.pools[pool]
            .balancer
            .choose(target, &[], self.epoch)
        {
            Walk::Chosen(c) => Ok(Placement::To {
                engine: c.index,
                spilled: c.distance > 0,
                reservation: Some(c.reservation),
            }),
            _ => {
                *req.target = Some((pool, target));
                Ok(Placement::Wait)
            }
        }
    }
}

/// SGLang-router style: an approximate per-engine tree of what was sent there; follow
/// a match over half the prompt unless the load is badly uneven.
struct CacheAware {
    trees: Vec<PrefixCache>,
}

impl Policy for CacheAware {
    fn place(&mut self, req: Pending<'_>, view: &View<'_>) -> Result<Placement, String> {
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
        Ok(Placement::plain(engine))
    }
}

/// Sees every engine's true cache: among engines under prefixlb's bound
/// (`max_in_flight`), the longest cached prefix if over half the prompt is cached
/// there, else the least loaded.
struct Oracle {
    cap: usize,
}

impl Policy for Oracle {
    fn place(&mut self, req: Pending<'_>, view: &View<'_>) -> Result<Placement, String> {
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
            (Some((i, m)), _) if 2 * m > req.prompt.blocks.len() => Placement::plain(i),
            (_, Some(i)) => Placement::plain(i),
            _ => Placement::Wait,
        })
    }
}
