//! What lives in Redis, and how it becomes nodes: the heartbeat records of engines
//! (`prefixlb agent`) and of balancer replicas, the key names under a fleet's prefix,
//! and the merge of heartbeating nodes into the configured pools. Pure.
//!
//! Keys, under `key_prefix` (default `prefixlb`):
//! - `{prefix}:node:{id}`: an engine's [`NodeRecord`] as JSON, with a TTL;
//! - `{prefix}:nodes`: a sorted set of engine ids scored by expiry (Unix ms), so
//!   membership is read with a constant number of round trips and no `SCAN`;
//! - `{prefix}:balancer:{id}` and `{prefix}:balancers`: the same for `serve` replicas.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

pub use crate::routing::node::EngineLoad;

use crate::config::{parse_node_url, Config, NodeConfig, MAX_DATA_PARALLEL_SIZE};

/// Key names of one fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.to_string(),
        }
    }

    pub fn node(&self, id: &str) -> String {
        format!("{}:node:{id}", self.prefix)
    }

    pub fn nodes(&self) -> String {
        format!("{}:nodes", self.prefix)
    }

    pub fn balancer(&self, id: &str) -> String {
        format!("{}:balancer:{id}", self.prefix)
    }

    pub fn balancers(&self) -> String {
        format!("{}:balancers", self.prefix)
    }
}

/// One engine's heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    pub pool: String,
    /// The engine's base URL, as the balancers reach it.
    pub url: String,
    pub weight: u32,
    /// Model names it serves (added to its pool's).
    #[serde(default)]
    pub models: Vec<String>,
    /// When its agent started (Unix seconds).
    pub started_at: u64,
    #[serde(default)]
    pub load: Option<EngineLoad>,
    /// Data-parallel ranks behind its URL (`prefixlb agent --data-parallel-size`),
    /// each a node of its own (`{id}@{rank}`); absent: one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
    /// Each rank's load figures, by rank, where the engine's metrics name its ranks
    /// (a server of several ranks only); `load` is then the server's as a whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_loads: Vec<Option<EngineLoad>>,
}

/// What the watcher read: the live heartbeating engines (sorted by id) and the
/// number of balancer replicas (this one included).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Membership {
    pub nodes: Vec<NodeRecord>,
    pub replicas: u32,
}

/// Why a heartbeating node was left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skipped {
    /// A static node has its id: the static one wins.
    StaticClash { id: String },
    /// Its pool is not in the config.
    UnknownPool { id: String, pool: String },
    /// Its URL or weight is unusable.
    Invalid { id: String, why: String },
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Skipped::StaticClash { id } => write!(
                f,
                "node {id:?} heartbeats in Redis but a static node has that id; the static one is used"
            ),
            Skipped::UnknownPool { id, pool } => write!(
                f,
                "node {id:?} heartbeats for pool {pool:?}, which the config does not have; ignored"
            ),
            Skipped::Invalid { id, why } => write!(f, "node {id:?} from Redis ignored: {why}"),
        }
    }
}

/// The config with the heartbeating nodes added to their pools (after the static
/// ones, sorted by id, so every replica builds the same ring), the ids that came from
/// Redis, and what was left out. A model a node announces joins its pool unless
/// another pool serves it.
pub fn merge(
    static_config: &Config,
    members: &[NodeRecord],
) -> (Config, HashSet<String>, Vec<Skipped>) {
    let mut config = static_config.clone();
    let static_ids: HashSet<&str> = static_config
        .pools
        .iter()
        .flat_map(|p| p.nodes.iter().map(|n| n.id.as_str()))
        .collect();
    let mut owner: HashMap<String, usize> = HashMap::new();
    for (i, p) in config.pools.iter().enumerate() {
        for m in &p.models {
            owner.insert(m.clone(), i);
        }
    }
    let mut dynamic = HashSet::new();
    let mut skipped = Vec::new();
    let mut sorted: Vec<&NodeRecord> = members.iter().collect();
    sorted.sort_by(|a, b| a.id.cmp(&b.id));
    for r in sorted {
        let invalid = |why: String| Skipped::Invalid {
            id: r.id.clone(),
            why,
        };
        // Checked before its nodes are made: a record may say anything.
        let ranks = r.data_parallel_size.unwrap_or(1);
        if !(1..=MAX_DATA_PARALLEL_SIZE).contains(&ranks) {
            skipped.push(invalid(format!(
                "data_parallel_size {ranks} is out of range 1..={MAX_DATA_PARALLEL_SIZE}"
            )));
            continue;
        }
        // Its nodes, their URL filled in once it is checked below.
        let nodes = NodeConfig::ranks(r.id.clone(), http::Uri::default(), r.weight, ranks);
        if nodes.iter().any(|n| static_ids.contains(n.id.as_str())) {
            skipped.push(Skipped::StaticClash { id: r.id.clone() });
            continue;
        }
        let Some(pool) = config.pools.iter().position(|p| p.name == r.pool) else {
            skipped.push(Skipped::UnknownPool {
                id: r.id.clone(),
                pool: r.pool.clone(),
            });
            continue;
        };
        if r.id.trim().is_empty() || nodes.iter().any(|n| dynamic.contains(&n.id)) {
            skipped.push(invalid("empty or repeated id".into()));
            continue;
        }
        if !(1..=1000).contains(&r.weight) {
            skipped.push(invalid(format!(
                "weight {} is out of range 1..=1000",
                r.weight
            )));
            continue;
        }
        let url = match parse_node_url(r.url.trim_end_matches('/')) {
            Ok(url) => url,
            Err(why) => {
                skipped.push(invalid(why));
                continue;
            }
        };
        for m in &r.models {
            if !owner.contains_key(m) {
                owner.insert(m.clone(), pool);
                config.pools[pool].models.push(m.clone());
            }
        }
        for mut node in nodes {
            node.url = url.clone();
            dynamic.insert(node.id.clone());
            config.pools[pool].nodes.push(node);
        }
    }
    (config, dynamic, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, pool: &str, url: &str) -> NodeRecord {
        NodeRecord {
            id: id.into(),
            pool: pool.into(),
            url: url.into(),
            weight: 1,
            models: vec!["m-new".into()],
            started_at: 0,
            load: None,
            data_parallel_size: None,
            rank_loads: Vec::new(),
        }
    }

    #[test]
    fn heartbeating_nodes_join_their_pools_sorted_and_static_ids_win() {
        let config = Config::parse(
            "[redis]\nurl = \"redis://127.0.0.1:6379\"\n[[pools]]\nname = \"a\"\nmodels = [\"m\"]\nnodes = [{ id = \"s1\", url = \"http://h:1\" }]\n[[pools]]\nname = \"b\"\nmodels = [\"m-new\"]\n",
            "t.toml",
        )
        .unwrap();
        let members = [
            record("z", "a", "http://h:9/"),
            record("s1", "a", "http://h:2"),
            record("y", "a", "http://h:8"),
            record("x", "nope", "http://h:7"),
            record("w", "b", "ftp://h:6"),
        ];
        let (merged, dynamic, skipped) = merge(&config, &members);
        let ids: Vec<&str> = merged.pools[0]
            .nodes
            .iter()
            .map(|n| n.id.as_str())
            .collect();
        assert_eq!(ids, ["s1", "y", "z"]);
        assert_eq!(
            merged.pools[0].nodes[0].url.to_string(),
            "http://h:1/",
            "static wins"
        );
        assert_eq!(dynamic, HashSet::from(["y".to_string(), "z".to_string()]));
        assert_eq!(merged.pools[0].models, ["m"], "m-new belongs to pool b");
        assert!(merged.pools[1].nodes.is_empty());
        assert_eq!(skipped.len(), 3, "{skipped:?}");
        assert!(skipped.contains(&Skipped::StaticClash { id: "s1".into() }));
        assert!(skipped
            .iter()
            .any(|s| matches!(s, Skipped::UnknownPool { id, .. } if id == "x")));
        assert!(skipped.iter().any(
            |s| matches!(s, Skipped::Invalid { id, why } if id == "w" && why.contains("needs a scheme"))
        ));
    }

    #[test]
    fn a_heartbeating_data_parallel_server_joins_as_a_node_per_rank() {
        let config = Config::parse(
            "[redis]\nurl = \"redis://127.0.0.1:6379\"\n[[pools]]\nname = \"a\"\nmodels = [\"m\"]\nnodes = [{ id = \"s@1\", url = \"http://h:1\" }]\n",
            "t.toml",
        )
        .unwrap();
        let split = |id: &str, ranks| NodeRecord {
            data_parallel_size: Some(ranks),
            ..record(id, "a", "http://h:9")
        };
        let members = [split("d", 2), split("s", 2), split("z", 0)];
        let (merged, dynamic, skipped) = merge(&config, &members);
        let nodes: Vec<(&str, Option<u32>)> = merged.pools[0]
            .nodes
            .iter()
            .map(|n| (n.id.as_str(), n.data_parallel_rank))
            .collect();
        assert_eq!(nodes, [("s@1", None), ("d@0", Some(0)), ("d@1", Some(1))]);
        assert_eq!(dynamic, HashSet::from(["d@0".into(), "d@1".into()]));
        assert!(skipped.contains(&Skipped::StaticClash { id: "s".into() }));
        assert!(skipped.iter().any(
            |s| matches!(s, Skipped::Invalid { id, why } if id == "z" && why.contains("data_parallel_size"))
        ));
        // An agent without ranks writes the record it always wrote.
        let plain = serde_json::to_value(record("p", "a", "http://h:9")).unwrap();
        assert!(plain.get("data_parallel_size").is_none(), "{plain}");
    }

    #[test]
    fn records_round_trip_as_json() {
        let r = record("n1", "a", "http://h:1");
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<NodeRecord>(&text).unwrap(), r);
        let keys = Keys::new("fleet");
        assert_eq!(keys.node("n1"), "fleet:node:n1");
        assert_eq!(keys.nodes(), "fleet:nodes");
    }
}
