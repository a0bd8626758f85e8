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

/// Reads an engine's load figures ([`EngineLoad`]) from its metrics.
pub trait FromMetrics: Sized {
    /// The whole server's figures.
    fn from_metrics(text: &str) -> Option<Self>;
    /// Each data-parallel rank's figures, for ranks `0..ranks`: from the series that
    /// name their rank (vLLM's `engine` label, SGLang's `dp_rank`); `None` for a rank
    /// no series names.
    fn by_rank(text: &str, ranks: u32) -> Vec<Option<Self>>;
}

impl FromMetrics for EngineLoad {
    /// Reads the known gauges out of a Prometheus text exposition: vLLM's
    /// `vllm:num_requests_running`, `vllm:num_requests_waiting`,
    /// `vllm:kv_cache_usage_perc` (or `vllm:gpu_cache_usage_perc`), SGLang's
    /// `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, and
    /// llama.cpp's `llamacpp:requests_processing`, `llamacpp:requests_deferred`
    /// (its server started with `--metrics`), summed over label sets (an engine may
    /// label by model). `None` if none is found.
    fn from_metrics(text: &str) -> Option<EngineLoad> {
        let mut load = EngineLoad::default();
        for s in samples(text) {
            s.add_to(&mut load);
        }
        (load != EngineLoad::default()).then_some(load)
    }

    fn by_rank(text: &str, ranks: u32) -> Vec<Option<EngineLoad>> {
        let mut loads = vec![EngineLoad::default(); ranks as usize];
        for s in samples(text) {
            if let Some(load) = s.rank.and_then(|r| loads.get_mut(r as usize)) {
                s.add_to(load);
            }
        }
        loads
            .into_iter()
            .map(|l| (l != EngineLoad::default()).then_some(l))
            .collect()
    }
}

/// Which of [`EngineLoad`]'s figures a series gives.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Figure {
    Running,
    Waiting,
    KvCacheUsage,
}

/// One sample of a known gauge: its figure, the rank it names, its value.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    figure: Figure,
    rank: Option<u32>,
    value: f64,
}

impl Sample {
    fn add_to(&self, load: &mut EngineLoad) {
        let slot = match self.figure {
            Figure::Running => &mut load.running,
            Figure::Waiting => &mut load.waiting,
            Figure::KvCacheUsage => &mut load.kv_cache_usage,
        };
        *slot = Some(slot.unwrap_or(0.0) + self.value);
    }
}

/// The samples of the known gauges in a Prometheus text exposition; lines that are
/// not one (comments, other series, values not finite) are skipped.
fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let figure = match &line[..name_end] {
            "vllm:num_requests_running"
            | "sglang:num_running_reqs"
            | "llamacpp:requests_processing" => Figure::Running,
            "vllm:num_requests_waiting"
            | "sglang:num_queue_reqs"
            | "llamacpp:requests_deferred" => Figure::Waiting,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                Figure::KvCacheUsage
            }
            _ => return None,
        };
        let value = line
            .rsplit_once(char::is_whitespace)
            .and_then(|(_, v)| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())?;
        let labels = line[name_end..]
            .strip_prefix('{')
            .and_then(|rest| rest.rsplit_once('}'))
            .map_or("", |(labels, _)| labels);
        let rank = label(labels, "engine")
            .or_else(|| label(labels, "dp_rank"))
            .and_then(|v| v.parse().ok());
        Some(Sample {
            figure,
            rank,
            value,
        })
    })
}

/// The value of label `name` in a series' label set (`a="1",b="x"`, the text between
/// its braces), if it has it. Values with escaped quotes are read to their end.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (key, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let mut end = 0;
        let bytes = after.as_bytes();
        while end < bytes.len() && bytes[end] != b'"' {
            end += if bytes[end] == b'\\' { 2 } else { 1 };
        }
        let value = after.get(..end)?;
        if key.trim() == name {
            return Some(value);
        }
        rest = after.get(end + 1..)?.trim_start().strip_prefix(',')?;
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
    fn engine_load_is_read_from_vllm_and_sglang_metrics() {
        let vllm = "# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"a\"} 3\nvllm:num_requests_running{model_name=\"b\"} 1\nvllm:num_requests_waiting{model_name=\"a\"} 2.0\nvllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\nvllm:other 9\n";
        assert_eq!(
            EngineLoad::from_metrics(vllm),
            Some(EngineLoad {
                running: Some(4.0),
                waiting: Some(2.0),
                kv_cache_usage: Some(0.25),
            })
        );
        let sglang =
            "sglang:num_running_reqs{tp_rank=\"0\"} 5\nsglang:num_queue_reqs{tp_rank=\"0\"} 0\n";
        let load = EngineLoad::from_metrics(sglang).unwrap();
        assert_eq!(
            (load.running, load.waiting, load.kv_cache_usage),
            (Some(5.0), Some(0.0), None)
        );
        // llama.cpp's server with `--metrics` (as xllamacpp 0.2 printed it).
        let llamacpp = "llamacpp:prompt_tokens_total 0\nllamacpp:requests_processing 1\nllamacpp:requests_deferred 2\nllamacpp:n_busy_slots_per_decode 0\n";
        let load = EngineLoad::from_metrics(llamacpp).unwrap();
        assert_eq!(
            (load.running, load.waiting, load.kv_cache_usage),
            (Some(1.0), Some(2.0), None)
        );
        assert_eq!(EngineLoad::from_metrics("tgi_queue_size 1\n"), None);
        assert_eq!(
            EngineLoad::from_metrics("vllm:num_requests_running NaN\n"),
            None
        );
    }

    #[test]
    fn a_data_parallel_server_s_load_is_read_rank_by_rank() {
        // vLLM labels each engine (rank) of a data-parallel server `engine`.
        let vllm = "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"a \\\"b\\\", c\"} 1\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 2\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"1\"} 0.5\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"7\"} 9\n";
        let ranks = EngineLoad::by_rank(vllm, 3);
        assert_eq!(
            ranks,
            [
                Some(EngineLoad {
                    running: Some(3.0),
                    ..EngineLoad::default()
                }),
                Some(EngineLoad {
                    running: Some(1.0),
                    waiting: Some(2.0),
                    kv_cache_usage: Some(0.5),
                }),
                None,
            ]
        );
        assert_eq!(EngineLoad::from_metrics(vllm).unwrap().running, Some(13.0));
        // SGLang's `dp_rank`.
        let sglang = "sglang:num_running_reqs{dp_rank=\"1\",tp_rank=\"0\"} 5\n\
                      sglang:num_queue_reqs{tp_rank=\"0\",dp_rank=\"0\"} 4\n";
        let ranks = EngineLoad::by_rank(sglang, 2);
        assert_eq!(ranks[0].unwrap().waiting, Some(4.0));
        assert_eq!(ranks[1].unwrap().running, Some(5.0));
        // Series that name no rank give no rank's figures.
        assert_eq!(
            EngineLoad::by_rank("vllm:num_requests_running{model_name=\"m\"} 3\n", 2),
            [None, None]
        );
        assert_eq!(label("a=\"1\",engine=\"2\"", "engine"), Some("2"));
        assert_eq!(label("a=\"x\\\"engine=\\\"3\"", "engine"), None);
        assert_eq!(label("broken", "engine"), None);
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
