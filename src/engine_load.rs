//! What an engine says of its own load: the running and waiting sequences and the KV
//! cache in use, read out of the Prometheus text of its `/metrics` (vLLM, SGLang,
//! llama.cpp), for the whole server and, where the series name one, for each
//! data-parallel rank. Shown to operators (`/admin/nodes`, `prefixlb_engine_*`), never
//! routed on. Read by `prefixlb agent` for the nodes that heartbeat, and by the health
//! checks for the nodes of the config. Pure.

use crate::routing::node::EngineLoad;

/// What an engine's metrics page says of its load, read in one pass ([`read`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// The whole server's figures, summed over label sets (an engine may label by
    /// model, or by rank); `None` if no known gauge is found.
    pub whole: Option<EngineLoad>,
    /// Each data-parallel rank's figures, for the ranks asked (`0..ranks`), from the
    /// series that name their rank; `None` for a rank no series names.
    pub by_rank: Vec<Option<EngineLoad>>,
    /// How many distinct ranks the series name.
    pub ranks_named: u32,
}

/// Reads the known gauges out of a Prometheus text exposition (vLLM's
/// `vllm:num_requests_running`, `vllm:num_requests_waiting`,
/// `vllm:kv_cache_usage_perc` or `vllm:gpu_cache_usage_perc`; SGLang's
/// `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`;
/// llama.cpp's `llamacpp:requests_processing`, `llamacpp:requests_deferred` and, in
/// older builds, `llamacpp:kv_cache_usage_ratio`, its server started with
/// `--metrics`); a series' rank is its `engine` label (vLLM) or its `dp_rank` (SGLang).
pub fn read(text: &str, ranks: u32) -> Report {
    let mut whole = EngineLoad::default();
    let mut by_rank = vec![EngineLoad::default(); ranks as usize];
    let mut named = Vec::new();
    for s in samples(text) {
        s.add_to(&mut whole);
        if let Some(rank) = s.rank {
            named.push(rank);
            if let Some(load) = by_rank.get_mut(rank as usize) {
                s.add_to(load);
            }
        }
    }
    named.sort_unstable();
    named.dedup();
    let some = |l: EngineLoad| (l != EngineLoad::default()).then_some(l);
    Report {
        whole: some(whole),
        by_rank: by_rank.into_iter().map(some).collect(),
        ranks_named: named.len() as u32,
    }
}

impl Report {
    /// What to tell the operator when the metrics name another number of data-parallel
    /// ranks than the server is given here (`given`: its `data_parallel_size`, 1 for
    /// none): a server of N ranks routed as one node scatters each conversation over its
    /// ranks' caches, and one given more ranks than it has is sent ranks it refuses.
    /// Distinct ranks are counted, not the highest: a rank served alone (vLLM's external
    /// load balancing, `--data-parallel-rank 3`) names one. `None` when they agree or the
    /// metrics name no rank.
    pub fn rank_advice(&self, given: u32) -> Option<String> {
        let (named, given) = (self.ranks_named, given.max(1));
        (named > 0 && named != given).then(|| {
            format!(
                "its engine's metrics name {named} data-parallel rank(s) (series labelled \
                 `engine` or `dp_rank`) where it is given {given}: set data_parallel_size = \
                 {named} on its node (prefixlb agent: --data-parallel-size {named}) so that \
                 each rank keeps its own conversations"
            )
        })
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
            "vllm:kv_cache_usage_perc"
            | "vllm:gpu_cache_usage_perc"
            | "sglang:token_usage"
            | "llamacpp:kv_cache_usage_ratio" => Figure::KvCacheUsage,
            _ => return None,
        };
        // `name{labels} value [timestamp]`: the value is the first word after the
        // labels (the last `}`: no value or timestamp holds one).
        let (labels, rest) = match line[name_end..].strip_prefix('{') {
            Some(braced) => braced.rsplit_once('}')?,
            None => ("", &line[name_end..]),
        };
        let value = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_load_is_read_from_vllm_and_sglang_metrics() {
        let vllm = "# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"a\"} 3\nvllm:num_requests_running{model_name=\"b\"} 1\nvllm:num_requests_waiting{model_name=\"a\"} 2.0\nvllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\nvllm:other 9\n";
        assert_eq!(
            read(vllm, 0).whole,
            Some(EngineLoad {
                running: Some(4.0),
                waiting: Some(2.0),
                kv_cache_usage: Some(0.25),
            })
        );
        let sglang =
            "sglang:num_running_reqs{tp_rank=\"0\"} 5\nsglang:num_queue_reqs{tp_rank=\"0\"} 0\n";
        let load = read(sglang, 0).whole.unwrap();
        assert_eq!(
            (load.running, load.waiting, load.kv_cache_usage),
            (Some(5.0), Some(0.0), None)
        );
        // A sample's timestamp is not its value.
        let stamped = "vllm:num_requests_running{model_name=\"m\"} 3 1733550000000\n";
        assert_eq!(read(stamped, 0).whole.unwrap().running, Some(3.0));
        // Older llama.cpp servers gave the KV cache in use too.
        let older = "llamacpp:requests_processing 2\nllamacpp:kv_cache_usage_ratio 0.5\n";
        assert_eq!(read(older, 0).whole.unwrap().kv_cache_usage, Some(0.5));
        // llama.cpp's server with `--metrics` (as xllamacpp 0.2 printed it).
        let llamacpp = "llamacpp:prompt_tokens_total 0\nllamacpp:requests_processing 1\nllamacpp:requests_deferred 2\nllamacpp:n_busy_slots_per_decode 0\n";
        let load = read(llamacpp, 0).whole.unwrap();
        assert_eq!(
            (load.running, load.waiting, load.kv_cache_usage),
            (Some(1.0), Some(2.0), None)
        );
        assert_eq!(read("tgi_queue_size 1\n", 0).whole, None);
        assert_eq!(read("vllm:num_requests_running NaN\n", 0).whole, None);
    }

    #[test]
    fn a_data_parallel_server_s_load_is_read_rank_by_rank() {
        // vLLM labels each engine (rank) of a data-parallel server `engine`.
        let vllm = "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"a \\\"b\\\", c\"} 1\n\
                    vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 2\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"1\"} 0.5\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"7\"} 9\n";
        let ranks = read(vllm, 3).by_rank;
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
        assert_eq!(read(vllm, 0).whole.unwrap().running, Some(13.0));
        // SGLang's `dp_rank`.
        let sglang = "sglang:num_running_reqs{dp_rank=\"1\",tp_rank=\"0\"} 5\n\
                      sglang:num_queue_reqs{tp_rank=\"0\",dp_rank=\"0\"} 4\n";
        let ranks = read(sglang, 2).by_rank;
        assert_eq!(ranks[0].unwrap().waiting, Some(4.0));
        assert_eq!(ranks[1].unwrap().running, Some(5.0));
        // Series that name no rank give no rank's figures.
        assert_eq!(
            read("vllm:num_requests_running{model_name=\"m\"} 3\n", 2).by_rank,
            [None, None]
        );
        assert_eq!(label("a=\"1\",engine=\"2\"", "engine"), Some("2"));
        assert_eq!(label("a=\"x\\\"engine=\\\"3\"", "engine"), None);
        assert_eq!(label("broken", "engine"), None);
    }

    #[test]
    fn a_server_given_another_number_of_ranks_than_its_metrics_name_is_told_of() {
        let vllm = |engines: &[u32]| -> String {
            engines
                .iter()
                .map(|e| {
                    format!("vllm:num_requests_running{{model_name=\"m\",engine=\"{e}\"}} 0\n")
                })
                .collect()
        };
        let four = vllm(&[0, 1, 2, 3]);
        let advice = read(&four, 0).rank_advice(1).unwrap();
        assert!(advice.contains("data_parallel_size = 4"), "{advice}");
        assert!(advice.contains("given 1"), "{advice}");
        assert_eq!(read(&four, 0).rank_advice(4), None);
        assert!(read(&four, 0).rank_advice(8).unwrap().contains("given 8"));
        // A plain vLLM names its one engine `engine="0"`; a rank served alone names one.
        assert_eq!(read(&vllm(&[0]), 0).rank_advice(1), None);
        assert_eq!(read(&vllm(&[3]), 0).rank_advice(1), None);
        assert!(read(&vllm(&[0]), 0).rank_advice(2).is_some());
        // Metrics that name no rank say nothing.
        assert_eq!(
            read("llamacpp:requests_processing 1\n", 0).rank_advice(4),
            None
        );
    }

    proptest::proptest! {
        /// An engine's metrics page is the engine's to write: whatever it holds, it is
        /// read without a panic, and no rank's figures fall outside the ranks asked.
        #[test]
        fn any_page_is_read_without_a_panic(
            lines in proptest::collection::vec(
                "(vllm:num_requests_running|sglang:num_queue_reqs|x)?[{}=\",\\\\a-z0-9 .-]{0,40}",
                0..8,
            ),
            ranks in 0u32..4,
        ) {
            let page = lines.join("\n");
            proptest::prop_assert_eq!(read(&page, ranks).by_rank.len(), ranks as usize);
        }
    }
}
