//! The routing table: one immutable snapshot of pools, their nodes and rings, built
//! from a validated [`Config`] and swapped whole. Node and pool runtime state (in-flight
//! counts, breakers, queues, group counters) lives in the [`Registry`], keyed by id, so
//! it survives every rebuild. A request is placed on it by
//! [`Table::place`](super::decision) (its own module).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::facts::KeyError;
use super::key::KeySpec;
use super::node::{Node, NodeSource, NodeState, PoolLoad};
use super::walk::Balancer;
use crate::config::{Config, PoolConfig};
use crate::name_hash::NameMap;

/// Runtime state by id, carried into every new table.
#[derive(Debug, Default)]
pub struct Registry {
    nodes: Mutex<HashMap<String, Arc<NodeState>>>,
    pools: Mutex<HashMap<String, Arc<PoolLoad>>>,
}

impl Registry {
    pub fn node(&self, id: &str) -> Arc<NodeState> {
        self.nodes
            .lock()
            .entry(id.to_string())
            .or_insert_with(|| Arc::new(NodeState::new(id)))
            .clone()
    }

    pub fn pool(&self, name: &str) -> Arc<PoolLoad> {
        self.pools
            .lock()
            .entry(name.to_string())
            .or_default()
            .clone()
    }
}

/// One pool of the snapshot.
#[derive(Debug)]
pub struct Pool {
    pub config: PoolConfig,
    /// The pool's nodes, their ring and bounds.
    pub balancer: Balancer,
}

impl Pool {
    /// The LoRA adapter a requested `model` names, if any: one the pool declares
    /// (directly or by an alias), or one an engine of the pool lists with a parent
    /// among the pool's models (learned from its `/v1/models`).
    pub fn adapter<'a>(&'a self, requested: &'a str) -> Option<&'a str> {
        self.config
            .adapter(requested)
            .or_else(|| self.learned_adapter(requested).then_some(requested))
    }

    /// Whether an engine of the pool lists `model` as an adapter of one of the pool's
    /// models (and the pool's config does not name it).
    pub fn learned_adapter(&self, model: &str) -> bool {
        let c = &self.config;
        // An adapter's parent must be one of the pool's models: a pool that names none
        // (a catch-all) learns none, and its requests lock nothing here.
        if c.models.is_empty() || c.models.iter().any(|m| m == model) || c.aliased(model).is_some()
        {
            return false;
        }
        self.balancer.nodes().iter().any(|n| {
            n.state()
                .served()
                .and_then(|s| s.parent_of(model).map(|p| c.models.iter().any(|m| m == p)))
                .unwrap_or(false)
        })
    }

    /// Adapters the pool's engines list that its config does not name, with the model
    /// each adapts.
    pub fn learned_adapters(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for n in self.balancer.nodes() {
            let Some(served) = n.state().served() else {
                continue;
            };
            for (id, parent) in &served.models {
                let Some(parent) = parent else { continue };
                let known = self.config.adapters.contains(id) || out.iter().any(|(a, _)| a == id);
                if !known && self.learned_adapter(id) {
                    out.push((id.clone(), parent.clone()));
                }
            }
        }
        out
    }
}

/// An immutable routing snapshot.
#[derive(Debug)]
pub struct Table {
    pub config: Config,
    /// Shared with the tickets of requests in flight, which learn into their pool.
    pub pools: Vec<Arc<Pool>>,
    by_model: NameMap<String, usize>,
    default_pool: Option<usize>,
}

/// Why no pool can take a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error(
        "The model `{}` does not exist. Available models: {available}",
        crate::clip::clip(model)
    )]
    UnknownModel { model: String, available: String },
    #[error("'model' is required: this balancer serves several pools ({available})")]
    ModelRequired { available: String },
    /// The request asks for reasoning and neither its pool nor a fallback supports it.
    #[error("this request asks for reasoning, and neither pool `{pool}` nor any of its fallbacks supports it (supports_thinking = false)")]
    NoThinking { pool: String },
}

/// Why a request cannot be placed: the client's fault, or (`NoThinking`) no pool of
/// its chain serves what it asks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl Table {
    /// Builds a snapshot; state for ids already known to `registry` is reused.
    pub fn build(config: Config, registry: &Registry) -> Table {
        Table::build_with(config, registry, &HashMap::new())
    }

    /// [`Table::build`] for a config whose nodes named in `sources` came from
    /// elsewhere than the file (heartbeats, DNS); the rest are the file's.
    pub fn build_with(
        config: Config,
        registry: &Registry,
        sources: &HashMap<String, NodeSource>,
    ) -> Table {
        let mut by_model = NameMap::default();
        let breaker = Arc::new(config.breaker.clone());
        let mut default_pool = None;
        let pools = config
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                if p.addressable() {
                    let aliases = p.aliases.iter().map(|(alias, _)| alias);
                    for m in p.models.iter().chain(&p.adapters).chain(aliases) {
                        by_model.insert(m.clone(), i);
                    }
                }
                if p.default {
                    default_pool = Some(i);
                }
                let nodes = p
                    .nodes
                    .iter()
                    .map(|n| {
                        let per_weight = p.max_in_flight.unwrap_or(config.routing.max_in_flight);
                        let cap = per_weight.saturating_mul(n.weight);
                        let source = sources.get(&n.id).copied().unwrap_or(NodeSource::Static);
                        Node::new(n.clone(), source, cap, registry.node(&n.id))
                    })
                    .collect();
                Arc::new(Pool {
                    config: p.clone(),
                    balancer: Balancer::new(
                        nodes,
                        config.routing.vnodes,
                        registry.pool(&p.name),
                        config.routing.load_factor,
                        breaker.clone(),
                    )
                    .with_split_cap(config.routing.split_cap_across_replicas),
                })
            })
            .collect();
        Table {
            config,
            pools,
            by_model,
            default_pool,
        }
    }

    /// All model names served, in config order: each pool's models, adapters, aliases.
    pub fn models(&self) -> impl Iterator<Item = (&str, &Pool)> {
        let addressable = self.pools.iter().filter(|p| p.config.addressable());
        addressable.flat_map(|p| {
            let c = &p.config;
            let aliases = c.aliases.iter().map(|(alias, _)| alias);
            c.models
                .iter()
                .chain(&c.adapters)
                .chain(aliases)
                .map(move |m| (m.as_str(), &**p))
        })
    }

    fn model_list(&self) -> String {
        self.models().map(|(m, _)| m).collect::<Vec<_>>().join(", ")
    }

    /// The pool serving `model`: by name, else the `default` pool; a request without a
    /// model goes to the default pool, or to the only pool a model can name when there
    /// is one.
    pub fn pool_for(&self, model: Option<&str>) -> Result<usize, PoolError> {
        match model {
            Some(m) => self
                .by_model
                .get(m)
                .copied()
                .or_else(|| {
                    self.pools
                        .iter()
                        .position(|p| p.config.addressable() && p.learned_adapter(m))
                })
                .or(self.default_pool)
                .ok_or_else(|| PoolError::UnknownModel {
                    model: m.to_string(),
                    available: self.model_list(),
                }),
            None => self
                .default_pool
                .or_else(|| {
                    // The only pool a model can name (a disaggregated pool's decode
                    // engines are not one).
                    let mut named =
                        (0..self.pools.len()).filter(|&i| self.pools[i].config.addressable());
                    match (named.next(), named.next()) {
                        (Some(only), None) => Some(only),
                        _ => None,
                    }
                })
                .ok_or_else(|| PoolError::ModelRequired {
                    available: self.model_list(),
                }),
        }
    }

    /// The key spec of this table's routing settings.
    pub fn key_spec(&self) -> KeySpec {
        let r = &self.config.routing;
        KeySpec {
            mode: r.key,
            prefix_chars: r.prefix_chars,
            max_scan_bytes: r.max_scan_bytes,
            seed: r.hash_seed,
        }
    }

    /// Finds a node by id, with its pool.
    pub fn find_node(&self, id: &str) -> Option<(&Pool, &Node)> {
        self.pools.iter().find_map(|pool| {
            let node = pool.balancer.nodes().iter().find(|n| n.id() == id)?;
            Some((&**pool, node))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::group::Grouping;
    use crate::routing::Mode;

    fn table(text: &str) -> Table {
        Table::build(Config::parse(text, "t.toml").unwrap(), &Registry::default())
    }

    const TWO: &str = r#"
[[pools]]
name = "fast"
models = ["small", "small-instruct"]
nodes = [{ id = "a", url = "http://h:1" }]
[[pools]]
name = "deep"
models = ["big"]
nodes = [{ id = "b", url = "http://h:2" }]
"#;

    #[test]
    fn pools_are_found_by_model() {
        let t = table(TWO);
        assert_eq!(t.pool_for(Some("small-instruct")), Ok(0));
        assert_eq!(t.pool_for(Some("big")), Ok(1));
        let err = t.pool_for(Some("gpt-5")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "The model `gpt-5` does not exist. Available models: small, small-instruct, big"
        );
        assert!(matches!(
            t.pool_for(None),
            Err(PoolError::ModelRequired { .. })
        ));
    }

    #[test]
    fn default_pool_takes_unknown_and_missing_models() {
        let t = table(&TWO.replace("name = \"deep\"", "name = \"deep\"\ndefault = true"));
        assert_eq!(t.pool_for(Some("gpt-5")), Ok(1));
        assert_eq!(t.pool_for(None), Ok(1));
    }

    #[test]
    fn a_hot_group_spreads_by_weight() {
        let t = table(
            "[[pools]]\nname = \"p\"\nnodes = [{ id = \"big\", url = \"http://h:1\", weight = 3 }, \
             { id = \"s1\", url = \"http://h:2\" }, { id = \"s2\", url = \"http://h:3\" }]\n",
        );
        let mut served = [0usize; 3];
        // Long enough to be a group (not merely spread over the pool).
        let long = "Product details. ".repeat(80);
        for c in 0..3000 {
            let body = format!(
                r#"{{"messages": [{{"role": "system", "content": "One product's prompt. {long}"}}, {{"role": "user", "content": "conversation {c}"}}]}}"#
            );
            let placement = t
                .place("/v1/chat/completions", None, body.as_bytes(), Mode::Route)
                .unwrap();
            let b = &placement.pool().balancer;
            assert!(matches!(placement.grouping, Grouping::Group(_)));
            assert_eq!(
                placement.target.group.map(|g| g.1),
                Some(3),
                "the only group: all nodes"
            );
            served[b.order(placement.target).next().unwrap()] += 1;
        }
        let big = served[0] as f64 / 3000.0;
        assert!(
            (big - 0.6).abs() < 0.04,
            "weight 3 of 5 takes {big}: {served:?}"
        );
    }

    #[test]
    fn state_survives_a_rebuild() {
        let registry = Registry::default();
        let t1 = Table::build(Config::parse(TWO, "t").unwrap(), &registry);
        let held = match t1.pools[0]
            .balancer
            .choose(1, &[], std::time::Instant::now())
        {
            super::super::walk::Walk::Chosen(c) => c,
            w => panic!("{w:?}"),
        };
        let t2 = Table::build(
            Config::parse(&TWO.replace("h:1", "h:9"), "t").unwrap(),
            &registry,
        );
        assert_eq!(t2.pools[0].balancer.node(0).state().in_flight(), 1);
        drop(held);
        assert_eq!(t2.pools[0].balancer.node(0).state().in_flight(), 0);
    }
}
