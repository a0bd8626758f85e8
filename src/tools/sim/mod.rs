//! `prefixlb simulate`: a discrete-event fleet simulator in virtual time. Engines use
//! the same [`EngineModel`] as `mock-engine` (block LRU prefix cache, one prefill lane,
//! decode cost per token growing with the batch, `max_num_seqs` slots with a FIFO
//! queue). Conversations are replayed faithfully: turn k + 1 arrives its think time
//! after turn k's answer. Requests that find every engine at a policy's bound wait at
//! the balancer, oldest first. The policies are in [`policy`]; `prefixlb` is the
//! proxy's own code (`Table::place`, the placement's walk and its `Ticket`).

pub mod policy;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use serde::Serialize;

use crate::config::Config;
use crate::routing::decision::Ticket;
use crate::tools::engine_model::{Costs, EngineModel, Prompt, BLOCK_TOKENS};
use crate::tools::workload::{Tenant, Workload};
use policy::{Done, Pending, Pick, Policy, Routed, Setup, View};
pub use policy::{Spread, POLICIES};

/// Fleet shape.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub nodes: usize,
    pub cache_tokens: usize,
    pub costs: Costs,
    pub max_num_seqs: usize,
    /// Balancer replicas (the `prefixlb` policy), each with its own state.
    pub replicas: usize,
    pub spread: Spread,
    /// Replicas see each other's in-flight requests per engine, at once.
    pub share_load: bool,
    /// With `share_load`: how stale what they see is. Every `share_every_us` of
    /// virtual time all replicas learn the others' counts of that moment (what a feed
    /// through heartbeats would give); 0 means at every decision.
    pub share_every_us: u64,
}

impl Fleet {
    /// `nodes` engines of `cache_tokens` each, default costs, one balancer.
    pub fn of(nodes: usize, cache_tokens: usize) -> Fleet {
        Fleet {
            nodes,
            cache_tokens,
            costs: Costs::default(),
            max_num_seqs: 64,
            replicas: 1,
            spread: Spread::RoundRobin,
            share_load: false,
            share_every_us: 0,
        }
    }
}

/// One policy's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub policy: String,
    pub requests: usize,
    /// Cached prompt tokens / prompt tokens, in [0, 1].
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub throughput_rps: f64,
    /// Time-averaged requests in flight on the busiest engine over the mean of all
    /// engines (1.0 = perfectly even).
    pub max_mean_load: f64,
    /// The most requests any engine had in flight at once (prefixlb's bound is
    /// `max_in_flight`).
    pub peak_in_flight: usize,
    /// Share of requests not served by their key's primary node.
    pub spill_share: f64,
    /// With several balancer replicas: the share of requests whose first node another
    /// replica would have picked differently.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_disagreement: Option<f64>,
    /// Per tenant, where the workload names them (`multi-tenant-flood`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantReport>,
}

/// One tenant's requests and their time to first token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantReport {
    pub tenant: String,
    pub requests: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
}

struct Job {
    conv: usize,
    turn: usize,
    arrival: u64,
    prompt: Prompt,
    output: usize,
    /// prefixlb's ticket: its slot, and what its balancer learns when it finishes.
    ticket: Option<Ticket>,
    /// What the policy keeps of the request (`prefixlb` and `chwbl`).
    state: Option<Routed>,
    /// When it was placed, and its first token came (µs).
    placed: u64,
    first_token: u64,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// A retry is scheduled for this job (waiting for its home).
    retry_at: Option<u64>,
    /// Its conversation's tenant, if the workload names one.
    tenant: Option<Tenant>,
    /// Tokens it is charged when placed: prompt and output.
    cost: f64,
}

/// One simulated engine.
pub struct Engine {
    pub model: EngineModel,
    running: usize,
    waiting: VecDeque<Job>,
    /// Requests sent to it so far.
    pub served: u64,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive {
        conv: usize,
        turn: usize,
    },
    /// A request's wait for its home ran out: route again.
    Retry,
    /// A request's first token: its answer commits (the balancer settles it).
    FirstToken {
        slot: usize,
    },
    Finish {
        engine: usize,
        conv: usize,
        turn: usize,
        slot: usize,
    },
}

/// Time in microseconds.
fn us(secs: f64) -> u64 {
    (secs * 1e6).round() as u64
}

/// Simulates one policy over a workload.
pub fn simulate(
    workload: &Workload,
    config: &Config,
    fleet: &Fleet,
    policy: &str,
) -> Result<Report, String> {
    let block_tokens = workload
        .conversations
        .iter()
        .flat_map(|c| c.turns.first())
        .find_map(|t| t.trace.as_ref().map(|p| p.block_tokens))
        .unwrap_or(BLOCK_TOKENS);
    let setup = Setup {
        nodes: fleet.nodes,
        cache_tokens: fleet.cache_tokens,
        block_tokens,
        replicas: fleet.replicas,
        spread: fleet.spread,
        share_load: fleet.share_load,
        share_every_us: fleet.share_every_us,
        seed: workload.conversations.len() as u64,
    };
    let policy_impl = policy::by_name(policy, config, setup)?;
    let mut run = Run::new(workload, fleet, policy_impl, block_tokens);
    run.fair = policy == "prefixlb";
    while let Some(Reverse((now, _, event))) = run.st.events.pop() {
        match event {
            Event::Arrive { conv, turn } => run.arrive(conv, turn, now),
            Event::Retry => {}
            Event::FirstToken { slot } => {
                if let Some(job) = run.st.slots[slot].as_mut() {
                    if let Some(ticket) = job.ticket.as_mut() {
                        run.policy.first_token(ticket, now);
                    }
                }
            }
            Event::Finish {
                engine,
                conv,
                turn,
                slot,
            } => run.finish(engine, conv, turn, slot, now),
        }
        run.route_waiting(now)?;
    }
    if !run.pending.is_empty() {
        return Err(format!("{} requests were never routed", run.pending.len()));
    }
    Ok(run.report(policy))
}

/// One simulation in progress.
struct Run<'w> {
    workload: &'w Workload,
    max_num_seqs: usize,
    policy: Box<dyn Policy>,
    st: State,
    loads: Loads,
    /// Requests waiting at the balancer, oldest first.
    pending: Vec<Job>,
    /// Waiters go in the fair queue's order (a higher class first, then the tenant
    /// with the fewest tokens served): the `prefixlb` policy. Else oldest first.
    fair: bool,
    /// Tokens served per (class, tenant), as the fair queue counts them.
    counters: std::collections::HashMap<(usize, &'static str), f64>,
    spilled: usize,
    done: usize,
    first: u64,
    last: u64,
}

impl<'w> Run<'w> {
    fn new(
        workload: &'w Workload,
        fleet: &Fleet,
        policy: Box<dyn Policy>,
        block_tokens: usize,
    ) -> Self {
        let mut st = State {
            engines: (0..fleet.nodes)
                .map(|_| Engine {
                    model: EngineModel::new(fleet.cache_tokens, block_tokens, fleet.costs),
                    running: 0,
                    waiting: VecDeque::new(),
                    served: 0,
                })
                .collect(),
            events: BinaryHeap::new(),
            seq: 0,
            costs: fleet.costs,
            ttfts: Vec::new(),
            tenant_ttfts: Vec::new(),
            prompt_tokens: 0,
            cached_tokens: 0,
            slots: Vec::new(),
            free_slots: Vec::new(),
        };
        for (c, conv) in workload.conversations.iter().enumerate() {
            if let Some(t) = conv.turns.first() {
                st.push(us(t.delay), Event::Arrive { conv: c, turn: 0 });
            }
        }
        Run {
            workload,
            max_num_seqs: fleet.max_num_seqs,
            policy,
            st,
            loads: Loads::new(fleet.nodes),
            pending: Vec::new(),
            fair: false,
            counters: std::collections::HashMap::new(),
            spilled: 0,
            done: 0,
            first: u64::MAX,
            last: 0,
        }
    }

    fn arrive(&mut self, conv: usize, turn: usize, now: u64) {
        self.first = self.first.min(now);
        let c = &self.workload.conversations[conv];
        let t = &c.turns[turn];
        let prompt = t.prompt();
        let cost = (prompt.tokens + t.output_tokens) as f64;
        if let (Some(tenant), true) = (c.tenant, self.fair) {
            self.lift(tenant);
        }
        self.pending.push(Job {
            conv,
            turn,
            arrival: now,
            prompt,
            output: t.output_tokens,
            tenant: c.tenant,
            cost,
            ticket: None,
            state: None,
            placed: 0,
            first_token: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            retry_at: None,
        });
    }

    fn finish(&mut self, engine: usize, conv: usize, turn: usize, slot: usize, now: u64) {
        self.last = self.last.max(now);
        self.done += 1;
        if let Some(job) = self.st.slots[slot].take() {
            self.policy.finished(Done {
                ticket: job.ticket,
                now,
                ttft_us: job.first_token - job.placed,
                prompt_tokens: job.prompt_tokens,
                cached_tokens: job.cached_tokens,
            });
        }
        self.st.free_slots.push(slot);
        self.loads.change(engine, now, false);
        self.st.engines[engine].running -= 1;
        let turns = &self.workload.conversations[conv].turns;
        if turn + 1 < turns.len() {
            let next = Event::Arrive {
                conv,
                turn: turn + 1,
            };
            self.st.push(now + us(turns[turn + 1].delay), next);
        }
        if let Some(next) = self.st.engines[engine].waiting.pop_front() {
            self.st.start(engine, next, now);
        }
    }

    /// Places what waits at the balancer, oldest first; a request that must wait
    /// (for any slot, or for its home) keeps its place and lets the others try.
    fn route_waiting(&mut self, now: u64) -> Result<(), String> {
        let mut waiting = std::mem::take(&mut self.pending);
        if self.fair && waiting.iter().any(|j| j.tenant.is_some()) {
            // The fair queue's order, as of now (counters move as requests are placed
            // below; the queue re-reads them at every freed slot).
            let key = |j: &Job| match j.tenant {
                Some(t) => (t.class, self.counter(t), j.arrival),
                None => (0, 0.0, j.arrival),
            };
            waiting.sort_by(|a, b| {
                key(a)
                    .partial_cmp(&key(b))
                    .unwrap_or(std::cmp::Ordering::Equal)
            });
        }
        let mut kept = Vec::with_capacity(waiting.len());
        for mut job in waiting.drain(..) {
            let turn = &self.workload.conversations[job.conv].turns[job.turn];
            let view = View {
                loads: &self.loads.now,
                engines: &self.st.engines,
            };
            let req = Pending {
                turn,
                prompt: &job.prompt,
                state: &mut job.state,
                now,
            };
            let (engine, ticket, spilled) = match self.policy.place(req, &view)? {
                Pick::Wait => {
                    kept.push(job);
                    continue;
                }
                Pick::WaitUntil(at) => {
                    if job.retry_at != Some(at) {
                        job.retry_at = Some(at);
                        self.st.push(at, Event::Retry);
                    }
                    kept.push(job);
                    continue;
                }
                Pick::To {
                    engine,
                    ticket,
                    spilled,
                } => (engine, ticket, spilled),
            };
            self.spilled += spilled as usize;
            if let Some(t) = job.tenant {
                *self.counters.entry((t.class, t.name)).or_default() += job.cost;
            }
            self.loads.change(engine, now, true);
            job.ticket = ticket;
            job.placed = now;
            let e = &mut self.st.engines[engine];
            e.served += 1;
            if e.running < self.max_num_seqs {
                self.st.start(engine, job, now);
            } else {
                e.waiting.push_back(job);
            }
        }
        self.pending = kept;
        Ok(())
    }

    fn counter(&self, t: Tenant) -> f64 {
        self.counters
            .get(&(t.class, t.name))
            .copied()
            .unwrap_or(0.0)
    }

    /// A tenant that starts waiting is lifted to the lowest counter of its class's
    /// waiting tenants (it banks no credit while idle).
    fn lift(&mut self, t: Tenant) {
        let waiting = |name| {
            self.pending.iter().any(|j| {
                j.tenant
                    .is_some_and(|o| o.class == t.class && o.name == name)
            })
        };
        if waiting(t.name) {
            return;
        }
        let floor = self
            .pending
            .iter()
            .filter_map(|j| j.tenant.filter(|o| o.class == t.class))
            .map(|o| self.counter(o))
            .fold(f64::INFINITY, f64::min);
        if floor.is_finite() && self.counter(t) < floor {
            self.counters.insert((t.class, t.name), floor);
        }
    }

    fn report(mut self, policy: &str) -> Report {
        let mut ttfts = std::mem::take(&mut self.st.ttfts);
        ttfts.sort_by(f64::total_cmp);
        let quantile = |sorted: &[f64], p: f64| {
            sorted
                .get(((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1)) - 1)
                .copied()
                .unwrap_or(0.0)
        };
        let q = |p: f64| quantile(&ttfts, p);
        let mut by_tenant: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
        for (t, ttft) in std::mem::take(&mut self.st.tenant_ttfts) {
            by_tenant.entry(t).or_default().push(ttft);
        }
        let tenants = by_tenant
            .into_iter()
            .map(|(t, mut v)| {
                v.sort_by(f64::total_cmp);
                TenantReport {
                    tenant: t.to_string(),
                    requests: v.len(),
                    ttft_p50_ms: quantile(&v, 0.5),
                    ttft_p99_ms: quantile(&v, 0.99),
                }
            })
            .collect();
        let areas = self.loads.areas(self.last);
        let mean = areas.iter().sum::<f64>() / areas.len().max(1) as f64;
        let span = (self.last.saturating_sub(self.first)) as f64 / 1e6;
        let done = self.done;
        Report {
            policy: policy.to_string(),
            requests: done,
            hit_rate: self.st.cached_tokens as f64 / self.st.prompt_tokens.max(1) as f64,
            ttft_mean_ms: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
            ttft_p50_ms: q(0.5),
            ttft_p99_ms: q(0.99),
            throughput_rps: done as f64 / span.max(1e-9),
            max_mean_load: areas.iter().cloned().fold(0.0, f64::max) / mean.max(1e-9),
            peak_in_flight: self.loads.peak.iter().copied().max().unwrap_or(0),
            spill_share: self.spilled as f64 / done.max(1) as f64,
            replica_disagreement: self.policy.disagreement(),
            tenants,
        }
    }
}

/// Requests in flight per engine (as the balancer counts them): now, at peak, and
/// integrated over time.
struct Loads {
    now: Vec<usize>,
    peak: Vec<usize>,
    /// Σ in-flight × µs.
    area: Vec<f64>,
    since: Vec<u64>,
}

impl Loads {
    fn new(engines: usize) -> Self {
        Loads {
            now: vec![0; engines],
            peak: vec![0; engines],
            area: vec![0.0; engines],
            since: vec![0; engines],
        }
    }

    /// One request more (`up`) or less on `engine` at time `at`.
    fn change(&mut self, engine: usize, at: u64, up: bool) {
        self.area[engine] += self.now[engine] as f64 * at.saturating_sub(self.since[engine]) as f64;
        self.since[engine] = at;
        if up {
            self.now[engine] += 1;
            self.peak[engine] = self.peak[engine].max(self.now[engine]);
        } else {
            self.now[engine] -= 1;
        }
    }

    /// The time integrals up to `end`.
    fn areas(&self, end: u64) -> Vec<f64> {
        (0..self.now.len())
            .map(|e| self.area[e] + self.now[e] as f64 * end.saturating_sub(self.since[e]) as f64)
            .collect()
    }
}

/// The fleet's mutable state during a run: engines, the event queue, and the tallies.
struct State {
    engines: Vec<Engine>,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    /// Tie-breaker that keeps same-time events in insertion order.
    seq: u64,
    costs: Costs,
    ttfts: Vec<f64>,
    /// (tenant, TTFT ms) of the requests whose workload names a tenant.
    tenant_ttfts: Vec<(&'static str, f64)>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Running jobs (with their tickets), until they finish.
    slots: Vec<Option<Job>>,
    free_slots: Vec<usize>,
}

impl State {
    fn push(&mut self, at: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    /// Starts a job on an engine: prefill (cache lookup and insert), then decode.
    fn start(&mut self, engine: usize, mut job: Job, now: u64) {
        let e = &mut self.engines[engine];
        e.running += 1;
        let plan = e
            .model
            .prefill(&job.prompt, std::time::Duration::from_micros(now));
        self.prompt_tokens += plan.prompt_tokens as u64;
        self.cached_tokens += plan.cached_tokens as u64;
        let first_token = now + plan.first_token().as_micros() as u64;
        job.first_token = first_token;
        job.prompt_tokens = plan.prompt_tokens;
        job.cached_tokens = plan.cached_tokens;
        let ttft = (first_token - job.arrival) as f64 / 1000.0;
        self.ttfts.push(ttft);
        if let Some(t) = job.tenant {
            self.tenant_ttfts.push((t.name, ttft));
        }
        // The batch as this sequence starts decoding sets its pace (an approximation:
        // the real pace changes as others come and go).
        let step = self.costs.decode_step(e.running);
        let finish = first_token + (step * job.output as u32).as_micros() as u64;
        let (conv, turn, ticketed) = (job.conv, job.turn, job.ticket.is_some());
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s] = Some(job);
                s
            }
            None => {
                self.slots.push(Some(job));
                self.slots.len() - 1
            }
        };
        if ticketed {
            self.push(first_token, Event::FirstToken { slot });
        }
        self.push(
            finish,
            Event::Finish {
                engine,
                conv,
                turn,
                slot,
            },
        );
    }
}

/// The reports as a table.
pub fn table(reports: &[Report]) -> String {
    let replicas = reports.iter().any(|r| r.replica_disagreement.is_some());
    let mut out = format!(
        "{:<16} {:>8} {:>9} {:>10} {:>10} {:>10} {:>9} {:>9} {:>5} {:>7}{}\n",
        "policy",
        "requests",
        "hit rate",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "req/s",
        "max/mean",
        "peak",
        "spill",
        if replicas { "  disagree" } else { "" }
    );
    for r in reports {
        out.push_str(&format!(
            "{:<16} {:>8} {:>8.1}% {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.2} {:>9.2} {:>5} {:>6.1}%{}\n",
            r.policy,
            r.requests,
            r.hit_rate * 100.0,
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.throughput_rps,
            r.max_mean_load,
            r.peak_in_flight,
            r.spill_share * 100.0,
            match (replicas, r.replica_disagreement) {
                (true, Some(d)) => format!(" {:>8.1}%", d * 100.0),
                _ => String::new(),
            }
        ));
    }
    for r in reports.iter().filter(|r| !r.tenants.is_empty()) {
        for t in &r.tenants {
            out.push_str(&format!(
                "  {:<14} tenant {:<8} {:>6} requests  TTFT p50 {:>9.1}ms  p99 {:>9.1}ms\n",
                r.policy, t.tenant, t.requests, t.ttft_p50_ms, t.ttft_p99_ms
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests;
