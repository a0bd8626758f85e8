//! Admission: a slot on the first willing node of the key's walk. When the walk offers
//! another node because the request's home is full, the request waits for its home
//! instead when that pays (the home frees a slot sooner than a spill would cost in
//! prefill, see [`crate::routing::cost`]). When every willing node is at its cap (at
//! once, or when a home wait's budget runs out), `routing.when_saturated` applies:
//! wait in the pool's FIFO (bounded by `max_queue` and `queue_timeout`, re-running the
//! walk as slots free, so the key still lands on its nearest free node), refuse at
//! once, or overcommit the least loaded node.

use std::time::Duration;

use tokio::time::Instant;

use super::{now, ProxyError};
use crate::config::{RoutingConfig, WhenSaturated};
use crate::routing::decision::Placement;
use crate::routing::fair::Waiting;
use crate::routing::walk::{Choice, Peek, Walk};
use crate::telemetry::metrics::RequestMetrics;

/// Takes a slot on the first willing node of the placement's walk; when every willing
/// node is at cap, applies `routing.when_saturated`. Returns whether the request queued.
/// Who is asking, for the queue: its tenant and class, its cost, its deadline.
#[derive(Debug, Clone)]
pub(super) struct Asker<'t> {
    pub who: Waiting,
    /// The longest it waits in the queue: `routing.queue_timeout`, or less when the
    /// client said so (`x-request-timeout`).
    pub queue_timeout: std::time::Duration,
    /// Its class's queue bound.
    pub class_max: usize,
    /// Its class's name, for the metrics (borrowed from the request's snapshot: a
    /// shared `Arc<str>` cloned per request moved its count between the lanes' cores).
    pub class_name: &'t str,
    /// Its tenant is named in the config (else it is counted as `other`).
    pub known_tenant: bool,
    /// Its charge to its tenant's token budget, settled when it ends.
    pub charge: Option<super::tenant::Charge>,
    /// What its tenant has left of its rate limits, if it has any (boxed: most
    /// requests have none, and every request's future would carry its size).
    pub standing: Option<Box<super::tenant::Standing>>,
}

impl Asker<'_> {
    /// Its tenant's label, for the metrics (bounded: configured names, or `other`).
    pub fn tenant_label(&self) -> &str {
        super::tenant::label(&self.who.tenant, self.known_tenant)
    }
}

/// A node for the request: walked at `at` (the caller's reading of the clock), then,
/// as the walk and `routing` say, waited for at its home or in the queue. Returns the
/// choice, whether it waited for it, and how long.
pub(super) async fn admit(
    placement: &Placement,
    routing: &RoutingConfig,
    tried: &[usize],
    metrics: &RequestMetrics,
    asker: &Asker<'_>,
    at: std::time::Instant,
) -> Result<(Choice, bool, Duration), ProxyError> {
    let pool = &placement.pool().config.name;
    let name = || pool.clone();
    if !placement.api.is_load() {
        // It only tokenizes: the least loaded willing node, at once.
        return placement
            .choose_least_loaded(tried)
            .map(|c| (c, false, Duration::ZERO))
            .ok_or_else(|| ProxyError::NoNode { pool: name() });
    }
    // Time spent waiting, at its home or in the queue (for its trace).
    let mut waited_in_all = Duration::ZERO;
    // `tried` starts with the nodes that do not serve its adapter: what follows them
    // are the nodes of its own failed attempts.
    let failed = tried.get(placement.unserved().len()..).unwrap_or_default();
    let walk = if placement.joins_queue(routing.when_saturated, failed) {
        Walk::Saturated
    } else {
        placement.choose(tried, at)
    };
    let walk = match walk {
        Walk::Chosen(c) if c.distance > 0 && failed.is_empty() => {
            let Some((home, budget)) = placement.home_wait(c.index) else {
                return Ok((c, false, Duration::ZERO));
            };
            drop(c);
            let waited = Instant::now();
            let at_home = wait_for_home(placement, home, budget).await;
            waited_in_all = waited.elapsed();
            metrics.observe_queue_wait(pool, waited_in_all);
            if let Some(c) = at_home {
                return Ok((c, true, waited_in_all));
            }
            // The budget ran out: what the walk offers now, as for any request (the
            // pool may have filled meanwhile: then `when_saturated` applies).
            placement.choose(tried, now())
        }
        walk => walk,
    };
    match walk {
        Walk::Chosen(c) => Ok((c, false, waited_in_all)),
        Walk::Unavailable => Err(ProxyError::NoNode { pool: name() }),
        Walk::Saturated => match routing.when_saturated {
            WhenSaturated::Reject => Err(ProxyError::Saturated { pool: name() }),
            WhenSaturated::LeastLoaded => placement
                .choose_least_loaded(tried)
                .map(|c| (c, false, waited_in_all))
                .ok_or_else(|| ProxyError::NoNode { pool: name() }),
            WhenSaturated::Queue => {
                let waited = Instant::now();
                let admitted = wait_for_slot(placement, routing, tried, asker).await;
                metrics.observe_queue_wait(pool, waited.elapsed());
                let shed = match &admitted {
                    Ok(_) => None,
                    Err(ProxyError::QueueTimeout { .. }) => Some("deadline"),
                    Err(ProxyError::QueueFull { .. }) => Some("queue_full"),
                    Err(_) => None,
                };
                let class = asker.class_name;
                match shed {
                    Some(reason) => metrics.count_shed(pool, class, reason),
                    None => {
                        metrics.observe_tenant_wait(class, asker.tenant_label(), waited.elapsed())
                    }
                }
                let waited_in_all = waited_in_all + waited.elapsed();
                admitted.map(|c| (c, true, waited_in_all))
            }
        },
    }
}

/// Waits (counted at the home, woken as its slots free) for a slot at the request's
/// home, at most `budget`; gives up at once when the home turns requests away
/// (drained, unhealthy, breaker open).
async fn wait_for_home(
    placement: &Placement,
    home: usize,
    budget: std::time::Duration,
) -> Option<Choice> {
    let state = placement.pool().balancer.node(home).state().clone();
    let _counted = state.wait_here();
    let deadline = Instant::now() + budget;
    loop {
        let mut freed = std::pin::pin!(state.freed().notified());
        freed.as_mut().enable();
        if state.turned_away() {
            return None;
        }
        if let Walk::Chosen(c) = placement.choose(&[], now()) {
            if c.index == home {
                return Some(c);
            }
        }
        tokio::time::timeout_at(deadline, freed).await.ok()?;
    }
}

/// Waits in the pool's queue (bounded by `max_queue`, its class's bound and its
/// deadline) until a freed slot is its turn (see [`crate::routing::fair`]), then
/// re-runs the walk, so the key still lands on its nearest free node.
async fn wait_for_slot(
    placement: &Placement,
    routing: &RoutingConfig,
    tried: &[usize],
    asker: &Asker<'_>,
) -> Result<Choice, ProxyError> {
    let load = placement.pool().balancer.load();
    let pool = || placement.pool().config.name.clone();
    let place = load
        .enqueue(asker.who.clone(), routing.max_queue, asker.class_max)
        .ok_or_else(|| ProxyError::QueueFull {
            pool: pool(),
            max: routing.max_queue.min(asker.class_max),
        })?;
    let started = Instant::now();
    let deadline = started + asker.queue_timeout;
    let mut woken = false;
    loop {
        // Register for the wake-up before looking, so a turn given in between is not missed.
        let notify = place.woken();
        let mut wake = std::pin::pin!(notify.notified());
        wake.as_mut().enable();
        if woken || place.is_first() {
            match placement.choose(tried, now()) {
                Walk::Chosen(c) => {
                    place.admitted();
                    return Ok(c);
                }
                Walk::Unavailable => return Err(ProxyError::NoNode { pool: pool() }),
                // Its turn, and no slot it may take: when one is free that only
                // others may take (a node it tried, or lacking its adapter), the turn
                // goes on; else the slot went to a request that did not queue.
                Walk::Saturated if woken => {
                    if matches!(placement.peek(&[], now()), Peek::Node { .. }) {
                        place.pass();
                    } else {
                        place.rest();
                    }
                }
                Walk::Saturated => {}
            }
        } else {
            // Not its turn: it only notices what frees no slot (a node undrained,
            // healthy again; or every node gone).
            match placement.peek(tried, now()) {
                Peek::Unavailable => return Err(ProxyError::NoNode { pool: pool() }),
                Peek::Node { .. } => place.capacity_returned(),
                Peek::Saturated => {}
            }
        }
        if Instant::now() >= deadline {
            return Err(ProxyError::QueueTimeout {
                pool: pool(),
                waited_ms: started.elapsed().as_millis(),
            });
        }
        // (A node added by a reload is not seen: the request keeps the table it
        // started with.)
        let look = deadline.min(Instant::now() + QUEUE_LOOK_EVERY);
        woken = tokio::time::timeout_at(look, wake).await.is_ok();
    }
}

/// How often a queued request looks again at the pool when no slot frees.
const QUEUE_LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(250);
