//! The simulator's tests: determinism, and each default against its reference policies.

use super::*;
use crate::tools::workload;

fn config() -> Config {
    Config::parse(
        "[[pools]]\nname = \"sim\"\nnodes = [{ id = \"x\", url = \"http://h:1\" }]\n",
        "t",
    )
    .unwrap()
}

fn fleet(nodes: usize) -> Fleet {
    Fleet::of(nodes, 60_000)
}

#[test]
fn simulation_is_deterministic() {
    let w = workload::synthetic("multi-turn", 5, 0.2).unwrap();
    let a = simulate(&w, &config(), &fleet(4), "prefixlb").unwrap();
    let b = simulate(&w, &config(), &fleet(4), "prefixlb").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.requests, w.requests());
}

/// The fleet of the acceptance numbers: 8 engines with 30,000 cached tokens each
/// (about the KV cache of an 8B model on a 24 GB GPU).
fn eight_engines() -> Fleet {
    Fleet::of(8, 30_000)
}

#[test]
fn the_oracle_beats_every_baseline() {
    // The reference: the cache-aware rule with every engine's true cache, under
    // prefixlb's bound. prefixlb may pass it (it waits for a home; the oracle never
    // waits), the baselines may not.
    for name in ["multi-turn", "shared-prefix"] {
        let w = workload::synthetic(name, 1, 1.0).unwrap();
        let run = |p| simulate(&w, &config(), &eight_engines(), p).unwrap();
        let oracle = run("oracle");
        for p in ["round_robin", "least_loaded", "chwbl"] {
            let r = run(p);
            assert!(oracle.hit_rate >= r.hit_rate, "{name}: {oracle:?} {r:?}");
            assert_eq!(r.requests, w.requests());
        }
    }
}

#[test]
fn long_preambles_are_found_in_chat_and_completions() {
    // Issue 10: every prompt starts with the same block in its first user message
    // (or a templated completions prompt); no system part names it.
    for name in [
        "long-preamble-512",
        "long-preamble-2048",
        "long-preamble-8192",
        "long-preamble-512-completions",
        "long-preamble-2048-completions",
        "long-preamble-8192-completions",
    ] {
        let w = workload::synthetic(name, 1, 1.0).unwrap();
        let run = |p| simulate(&w, &config(), &eight_engines(), p).unwrap();
        let (lb, rr, oracle) = (run("prefixlb"), run("round_robin"), run("oracle"));
        let why = format!("{name}: {lb:?} {rr:?} {oracle:?}");
        assert!(lb.hit_rate >= 0.9 * oracle.hit_rate, "{why}");
        // Round robin caches a long block everywhere; what it misses is the rest.
        assert!(1.0 - lb.hit_rate <= 0.6 * (1.0 - rr.hit_rate), "{why}");
        assert!(lb.spill_share < 0.05, "{why}");
    }
}

#[test]
fn new_conversations_spread_by_load_and_replicas_agree() {
    let w = workload::synthetic("multi-turn", 1, 1.0).unwrap();
    let one = simulate(&w, &config(), &eight_engines(), "prefixlb").unwrap();
    let oracle = simulate(&w, &config(), &eight_engines(), "oracle").unwrap();
    assert!(one.max_mean_load <= 1.25, "{one:?}");
    assert!(
        one.ttft_p99_ms <= 1.2 * oracle.ttft_p99_ms,
        "{one:?} {oracle:?}"
    );
    // Two replicas, each with its own state: within 2 points of one, over seeds 1–3,
    // on chats and on agents at the cache's edge (a few agents too many on one
    // engine and it thrashes). Agents leave their key's first node more often
    // (placed by recent homes), so a replica that has not yet seen one guesses its
    // node wrong more often: the disagreement bound is looser there.
    for (name, spread, disagree) in [
        ("multi-turn", Spread::RoundRobin, 0.1),
        ("multi-turn", Spread::Random, 0.1),
        ("agentic", Spread::RoundRobin, 0.15),
        ("agentic", Spread::Random, 0.15),
    ] {
        let fleet = Fleet {
            replicas: 2,
            spread,
            ..eight_engines()
        };
        let (mut ones, mut twos) = (0.0, 0.0);
        for seed in 1..=3 {
            let w = workload::synthetic(name, seed, 1.0).unwrap();
            ones += simulate(&w, &config(), &eight_engines(), "prefixlb")
                .unwrap()
                .hit_rate;
            let two = simulate(&w, &config(), &fleet, "prefixlb").unwrap();
            assert!(two.replica_disagreement.unwrap() < disagree, "{two:?}");
            twos += two.hit_rate;
        }
        assert!(
            twos / 3.0 >= ones / 3.0 - 0.02,
            "{name} {spread:?}: {ones} {twos}"
        );
    }
}

#[test]
fn shared_load_is_seen_as_of_the_last_snapshot() {
    let w = workload::synthetic("agentic", 3, 1.0).unwrap();
    let two = |share_load, share_every_us| Fleet {
        replicas: 2,
        spread: Spread::Random,
        share_load,
        share_every_us,
        ..eight_engines()
    };
    let run = |f: &Fleet| simulate(&w, &config(), f, "prefixlb").unwrap();
    let alone = run(&two(false, 0));
    let at_once = run(&two(true, 0));
    assert_ne!(
        alone.hit_rate, at_once.hit_rate,
        "sharing changes placements here"
    );
    // A snapshot every hour: the only one is taken at the first decision, when
    // nothing is in flight, so the replicas never learn anything.
    let never = run(&two(true, 3_600_000_000));
    assert_eq!(alone.hit_rate, never.hit_rate);
    assert_eq!(alone.replica_disagreement, never.replica_disagreement);
}

#[test]
fn defaults_reach_the_oracle_and_triple_round_robin_within_their_bound() {
    let defaults = config();
    let bound = defaults.routing.max_in_flight as usize;
    for seed in 1..=3 {
        for name in ["multi-turn", "shared-prefix"] {
            let w = workload::synthetic(name, seed, 1.0).unwrap();
            let run = |p| simulate(&w, &defaults, &eight_engines(), p).unwrap();
            let (lb, rr, oracle) = (run("prefixlb"), run("round_robin"), run("oracle"));
            let why = format!("{name} seed {seed}: {lb:?} {rr:?} {oracle:?}");
            assert!(lb.hit_rate >= 0.9 * oracle.hit_rate, "{why}");
            assert!(lb.hit_rate >= 3.0 * rr.hit_rate, "{why}");
            assert!(lb.peak_in_flight <= bound, "{why}");
        }
    }
}

#[test]
fn each_key_mode_wins_where_it_should() {
    // `prefix` gathers a shared prefix, `conversation` spreads conversations, and
    // `hybrid` (the default) does both.
    let mode = |key: &str| {
        Config::parse(
            &format!("[routing]\nkey = \"{key}\"\n[[pools]]\nname = \"sim\"\nnodes = [{{ id = \"x\", url = \"http://h:1\" }}]\n"),
            "t",
        )
        .unwrap()
    };
    let hit = |w: &Workload, key: &str| {
        simulate(w, &mode(key), &eight_engines(), "prefixlb")
            .unwrap()
            .hit_rate
    };
    let shared = workload::synthetic("shared-prefix", 1, 1.0).unwrap();
    let agents = workload::synthetic("agentic", 1, 1.0).unwrap();
    assert!(hit(&shared, "prefix") > 2.0 * hit(&shared, "conversation"));
    assert!(hit(&agents, "conversation") > 1.3 * hit(&agents, "prefix"));
    assert!(hit(&shared, "hybrid") >= 0.97 * hit(&shared, "prefix"));
    assert!(hit(&agents, "hybrid") >= 0.97 * hit(&agents, "conversation"));
    // Many tenants' one-line prompts: no groups, so no worse than `conversation`.
    let tenants = workload::synthetic("multi-tenant", 1, 1.0).unwrap();
    assert!(hit(&tenants, "hybrid") >= 0.97 * hit(&tenants, "conversation"));
}

#[test]
fn a_replayed_trace_keeps_affinity() {
    // Trace prompts are block ids; `prefix_chars` must cover as many tokens of them
    // as of real text, or every turn of a conversation gets a new key.
    let w = workload::synthetic("multi-turn", 1, 1.0).unwrap();
    let t = workload::trace(&workload::to_trace(&w), 512).unwrap();
    let run = |p| simulate(&t, &config(), &eight_engines(), p).unwrap();
    let (lb, rr, oracle) = (run("prefixlb"), run("round_robin"), run("oracle"));
    assert!(lb.hit_rate >= 3.0 * rr.hit_rate, "{lb:?} {rr:?}");
    assert!(lb.hit_rate >= 0.9 * oracle.hit_rate, "{lb:?} {oracle:?}");
}

#[test]
fn unknown_policies_are_errors() {
    let w = workload::synthetic("rag", 5, 0.01).unwrap();
    assert!(simulate(&w, &config(), &fleet(2), "random").is_err());
}

#[test]
fn prompt_strings_that_continue_others_find_their_cache() {
    // Production-shaped prompt strings (`continuations`: untemplated completions
    // prompts behind one preamble, 39 % continuing an earlier request) on engines big
    // enough to hold them: at the card's cap, prefixlb keeps up with the oracle that
    // sees every cache under the same cap, triples round robin, and keeps the TTFT
    // tail within a tenth of the uncapped cache-aware router's.
    let w = workload::synthetic("continuations", 1, 0.2).unwrap();
    let run = |p| simulate(&w, &config(), &Fleet::of(8, 2_048_000), p).unwrap();
    let (ours, oracle, aware, rr) = (
        run("prefixlb"),
        run("oracle"),
        run("cache_aware"),
        run("round_robin"),
    );
    assert!(
        ours.hit_rate >= 0.95 * oracle.hit_rate,
        "{ours:?} {oracle:?}"
    );
    assert!(ours.hit_rate >= 3.0 * rr.hit_rate, "{ours:?} {rr:?}");
    assert!(
        ours.ttft_p99_ms <= 1.1 * aware.ttft_p99_ms,
        "{ours:?} {aware:?}"
    );
    assert!(ours.peak_in_flight <= 4);
}

#[test]
fn the_messages_api_reaches_the_chat_apis_hit_rate() {
    // Issue 25: the same conversations sent as Anthropic Messages (system on top,
    // content as blocks, a cache marker moving to the newest block) are keyed as well
    // as over chat: the mean over five seeds within one point. One seed alone moves by
    // about a point either way, as any change of key moves which conversations share
    // a node.
    for name in ["multi-turn", "agentic"] {
        let mean = |api: &str| {
            let rates: Vec<f64> = (1..=5)
                .map(|seed| {
                    let w = workload::synthetic(&format!("{name}{api}"), seed, 1.0).unwrap();
                    simulate(&w, &config(), &eight_engines(), "prefixlb")
                        .unwrap()
                        .hit_rate
                })
                .collect();
            rates.iter().sum::<f64>() / rates.len() as f64
        };
        let (chat, messages) = (mean(""), mean("-messages"));
        assert!(
            (chat - messages).abs() <= 0.01,
            "{name}: chat {chat:.4}, messages {messages:.4}"
        );
    }
}

#[test]
fn a_batch_flood_does_not_keep_the_interactive_tenant_waiting() {
    // Issue 26: 400 batch jobs (class 1) in the first ten seconds while 48 users chat
    // (class 0). Oldest first, a chat turn that arrives behind the flood waits for all
    // of it; with the fair queue it waits for the next free slot.
    let w = workload::synthetic("multi-tenant-flood", 1, 1.0).unwrap();
    let run = |p| simulate(&w, &config(), &eight_engines(), p).unwrap();
    let chat = |r: &Report| {
        r.tenants
            .iter()
            .find(|t| t.tenant == "chat")
            .unwrap()
            .clone()
    };
    let (fair, fifo) = (run("prefixlb"), run("prefixlb-fifo"));
    assert_eq!(fair.requests, w.requests());
    let (a, b) = (chat(&fair), chat(&fifo));
    assert!(a.ttft_p99_ms * 10.0 < b.ttft_p99_ms, "{a:?} {b:?}");
    assert!(a.ttft_p99_ms < 5_000.0, "{a:?}");
}
