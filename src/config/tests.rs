//! The config's tests: defaults, every validation error at file:line:col, and the shipped example.

use super::*;

const MIN: &str = r#"
[[pools]]
name = "llama"
nodes = [{ id = "a", url = "http://127.0.0.1:8001" }]
"#;

fn err(text: &str) -> ConfigError {
    Config::parse(text, "t.toml").unwrap_err()
}

#[test]
fn minimal_config_gets_documented_defaults() {
    let c = Config::parse(MIN, "t.toml").unwrap();
    assert_eq!(c.server.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(c.server.admin_listen.to_string(), "127.0.0.1:9091");
    assert_eq!(c.server.max_body_bytes, 16 << 20);
    assert_eq!(c.server.request_timeout, Duration::from_secs(600));
    assert_eq!(c.routing.key, KeyMode::Hybrid);
    assert_eq!(c.routing.prefix_chars, 1024);
    assert_eq!(c.routing.vnodes, 160);
    assert_eq!(c.routing.max_in_flight, 4);
    assert_eq!(c.routing.max_attempts, 3);
    assert_eq!(c.routing.max_queue, 1024);
    assert_eq!(c.routing.when_saturated, WhenSaturated::Queue);
    assert_eq!(c.pools[0].models, vec!["llama".to_string()]);
    assert_eq!(c.pools[0].nodes[0].weight, 1);
    assert_eq!(c.health.metrics_path.as_deref(), Some("/metrics"));
}

#[test]
fn the_engine_metrics_path_may_be_turned_off_and_must_be_a_path() {
    let off = Config::parse(&format!("[health]\nmetrics_path = \"\"\n{MIN}"), "t.toml").unwrap();
    assert_eq!(off.health.metrics_path, None);
    let e = err(&format!("[health]\nmetrics_path = \"metrics\"\n{MIN}"));
    assert!(e.message.contains("health.metrics_path"), "{e}");
}

#[test]
fn pin_threads_reads_its_three_words_and_the_two_booleans() {
    let pin =
        |value: &str| Config::parse(&format!("[server]\npin_threads = {value}\n{MIN}"), "t.toml");
    assert_eq!(
        Config::parse(MIN, "t.toml").unwrap().server.pin_threads,
        PinThreads::Auto
    );
    for (value, expected) in [
        ("\"auto\"", PinThreads::Auto),
        ("\"always\"", PinThreads::Always),
        ("\"never\"", PinThreads::Never),
        ("true", PinThreads::Always),
        ("false", PinThreads::Never),
    ] {
        assert_eq!(pin(value).unwrap().server.pin_threads, expected, "{value}");
    }
    let e = pin("\"sometimes\"").unwrap_err();
    assert_eq!((e.line, e.col), (2, 15), "{e}");
    assert!(
        e.message
            .contains("expected one of `auto`, `always`, `never`"),
        "{e}"
    );
    assert!(pin("3").unwrap_err().message.contains("true or false"));
}

#[test]
fn shipped_example_is_valid() {
    let text = include_str!("../../config/prefixlb.toml");
    let c = Config::parse(text, "config/prefixlb.toml").unwrap();
    assert_eq!(c.routing.vnodes, 160);
}

/// `[discovery]`: a server without a port is asked on 53; a `discover = "dns"`
/// entry makes no node of its own, and its id is taken like a node's.
#[test]
fn discovery_settings_and_named_entries() {
    let c = Config::parse(
        "[discovery]\ninterval = \"1s\"\nnameservers = [\"10.96.0.10\", \"[fd00::a]:5353\"]\n\
         [[pools]]\nname = \"p\"\nnodes = [{ id = \"v\", url = \"http://vllm:8000\", discover = \"dns\", weight = 3 }]\n",
        "t.toml",
    )
    .unwrap();
    assert_eq!(c.discovery.interval, std::time::Duration::from_secs(1));
    let servers: Vec<String> = c
        .discovery
        .nameservers
        .iter()
        .map(|a| a.to_string())
        .collect();
    assert_eq!(servers, ["10.96.0.10:53", "[fd00::a]:5353"]);
    assert!(c.pools[0].nodes.is_empty());
    assert_eq!(c.pools[0].named[0].name(), "vllm");
    assert_eq!(c.pools[0].named[0].weight, 3);
    let dup = err("[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"},{id=\"a\",url=\"http://g:2\",discover=\"dns\"}]\n");
    assert!(dup.message.contains("duplicate node id"), "{dup}");
    let fast = err("[discovery]\ninterval = \"10ms\"\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
    assert!(fast.message.contains("at least 100ms"), "{fast}");
}

#[test]
fn unknown_key_is_located() {
    let e = err("[routing]\nvnodes = 10\nmax_inflight = 3\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
    assert_eq!((e.line, e.col), (3, 1), "{e}");
    assert!(e.message.contains("unknown field `max_inflight`"), "{e}");
    assert!(e.to_string().starts_with("t.toml:3:1: "));
}

#[test]
fn semantic_errors_point_at_the_value() {
    let dup = err("[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"},{id=\"a\",url=\"http://h:2\"}]\n");
    assert_eq!(dup.line, 3);
    assert!(dup.message.contains("duplicate node id"), "{dup}");

    let url = err("[[pools]]\nname=\"p\"\n[[pools.nodes]]\nid=\"a\"\nurl=\"h:1:2\"\n");
    assert_eq!((url.line, url.col), (5, 5), "{url}");

    let creds =
        err("[[pools]]\nname=\"p\"\n[[pools.nodes]]\nid=\"a\"\nurl=\"http://user:s3cret@h:1\"\n");
    assert_eq!((creds.line, creds.col), (5, 5), "{creds}");
    assert!(creds.message.contains("credentials"), "{creds}");
    assert!(
        !creds.to_string().contains("s3cret"),
        "the secret is not echoed: {creds}"
    );

    let node_url = |url: &str| {
        Config::parse(
            &format!("[[pools]]\nname=\"p\"\n[[pools.nodes]]\nid=\"a\"\nurl=\"{url}\"\n"),
            "t.toml",
        )
    };
    for bad in ["http://h:99999", "http://h:0", "http://[::1]:70000"] {
        let e = node_url(bad).unwrap_err();
        assert_eq!((e.line, e.col), (5, 5), "{e}");
        assert!(e.message.contains("a port is 1 to 65535"), "{bad}: {e}");
    }
    // An OpenAI base URL given for an engine: the client's path has its own /v1.
    for bad in [
        "http://h:8000/v1",
        "http://h:8000/v1/",
        "https://gw/llama/v1",
    ] {
        let e = node_url(bad).unwrap_err();
        assert!(e.message.contains("ends in /v1"), "{bad}: {e}");
    }
    for (bad, root) in [
        ("http://h:8000/v1", "\"http://h:8000\""),
        ("http://[::1]:8000/v1/", "\"http://[::1]:8000\""),
        ("https://gw/llama/v1", "\"https://gw/llama\""),
    ] {
        let e = node_url(bad).unwrap_err();
        assert!(e.message.contains(root), "names the root {root}: {e}");
    }
    for good in [
        "http://h:8000",
        "http://h",
        "http://[::1]:8000",
        "http://gw/llama",
        "http://h:65535/",
    ] {
        assert!(node_url(good).is_ok(), "{good}: {:?}", node_url(good).err());
    }

    let pool = |extra: &str| {
        format!("[[pools]]\nname=\"p\"\nmodels=[\"m\"]\n{extra}\n[[pools.nodes]]\nid=\"a\"\nurl=\"http://h:1\"\n")
    };
    let ok = Config::parse(
        &pool("aliases = { gpt-4o = \"m\", fast = \"m\" }"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(
        ok.pools[0].aliases,
        [("fast".into(), "m".into()), ("gpt-4o".into(), "m".into())]
    );
    assert_eq!(ok.pools[0].aliased("gpt-4o"), Some("m"));
    assert_eq!(ok.pools[0].aliased("m"), None);
    let lora = Config::parse(
        &pool("adapters = [\"sql-lora\"]\naliases = { sql = \"sql-lora\" }"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(lora.pools[0].adapters, ["sql-lora"]);
    assert_eq!(lora.pools[0].adapter("sql"), Some("sql-lora"));
    assert_eq!(lora.pools[0].adapter("sql-lora"), Some("sql-lora"));
    assert_eq!(lora.pools[0].adapter("m"), None);
    let twice = err(&pool("adapters = [\"m\"]"));
    assert_eq!((twice.line, twice.col), (4, 13), "{twice}");
    assert!(twice.message.contains("already a model"), "{twice}");
    let unserved = err(&pool("aliases = { gpt-4o = \"other\" }"));
    assert_eq!(unserved.line, 4, "{unserved}");
    assert!(unserved.message.contains("does not serve"), "{unserved}");
    let taken = err(&format!(
        "{}[[pools]]\nname=\"q\"\nmodels=[\"n\"]\naliases = {{ m = \"n\" }}\n[[pools.nodes]]\nid=\"b\"\nurl=\"http://h:2\"\n",
        pool("")
    ));
    assert_eq!(taken.line, 11, "{taken}");
    assert!(taken.message.contains("already a model"), "{taken}");

    let w = err("[[pools]]\nname=\"p\"\n[[pools.nodes]]\nid=\"a\"\nurl=\"http://h:1\"\nweight=0\n");
    assert_eq!(w.line, 6);
    assert!(w.message.contains("weight 0"), "{w}");

    let fb =
        err("[[pools]]\nname=\"p\"\nfallbacks=[\"q\"]\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
    assert_eq!(fb.line, 3);
    assert!(fb.message.contains("names no pool"), "{fb}");

    let d = err("[server]\nrequest_timeout=\"10 parsecs\"\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
    assert_eq!(d.line, 2);
    assert!(d.message.contains("unit"), "{d}");

    let none = err("[routing]\nvnodes=1\n");
    assert!(none.message.contains("no [[pools]]"), "{none}");

    let lf = err("[routing]\nload_factor=0.5\n[[pools]]\nname=\"p\"\nnodes=[{id=\"a\",url=\"http://h:1\"}]\n");
    assert_eq!(lf.line, 2);
}

#[test]
fn the_breaker_judges_normalized_ttft() {
    let b = Config::parse(MIN, "t.toml").unwrap().breaker;
    assert_eq!((b.slow_factor, b.max_ejected_share), (3.0, 0.5));
    assert_eq!(b.slow_ttft, Duration::from_secs(1));
    // A config written for raw-TTFT shunt steps says what replaced them.
    let old = err(&format!(
        "[breaker]\nshunt_steps = [{{ p90 = \"2s\", divert = 0.2 }}]\n{MIN}"
    ));
    assert_eq!(old.line, 2);
    assert!(old.message.contains("over_pool"), "{old}");
    let share = err(&format!("[breaker]\nmax_ejected_share = 1.5\n{MIN}"));
    assert!(share.message.contains("max_ejected_share 1.5"), "{share}");
    let factor = err(&format!("[breaker]\nslow_factor = 0.5\n{MIN}"));
    assert!(factor.message.contains("slow_factor 0.5"), "{factor}");
}

#[test]
fn secrets_never_print() {
    let c = Config::parse(
        &format!("[server]\nadmin_token = \"tok-3f9a\"\n{MIN}"),
        "t.toml",
    )
    .unwrap();
    let shown = format!("{c:?}");
    assert!(!shown.contains("tok-3f9a"), "{shown}");
    assert!(c.server.admin_token.unwrap().matches(b"tok-3f9a"));
}

#[test]
fn values_are_bounded_where_they_are_written() {
    for (line, key) in [
        ("[server]\nrequest_timeout = \"1e999s\"", "unit"),
        (
            "[server]\nrequest_timeout = \"99999999999999999999999s\"",
            "limit",
        ),
        ("[server]\nconnect_timeout = \"8d\"", "unit"),
        (
            "[server]\nmax_body_bytes = 99999999999999",
            "max_body_bytes",
        ),
        ("[server]\nmax_connections = 0", "max_connections"),
        ("[routing]\nmax_attempts = 100", "max_attempts"),
        ("[routing]\nprefix_chars = 9999999999", "prefix_chars"),
        ("[breaker]\nmin_samples = 100000", "min_samples"),
        ("[health]\nunhealthy_after = 0", "unhealthy_after"),
        ("[routing]\nextra_paths = [\"v1/x\"]", "extra_paths"),
    ] {
        let e = err(&format!("{line}\n{MIN}"));
        assert_eq!(e.line, 2, "{line}: {e}");
        assert!(e.message.contains(key), "{line}: {e}");
    }
    assert_eq!(
        parse_duration("168h").unwrap(),
        MAX_DURATION,
        "7 days is the limit"
    );
    assert!(parse_duration("169h").is_err());
}

#[test]
fn api_keys_come_from_a_file_and_the_environment() {
    let dir = std::env::temp_dir().join(format!("prefixlb-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("keys"), "# comment\n  k1  \n\nk2\n").unwrap();
    std::env::set_var("PREFIXLB_UNIT_KEYS", "k3,k4 k5");
    let text =
        format!("[auth]\napi_keys_file = \"keys\"\napi_keys_env = \"PREFIXLB_UNIT_KEYS\"\n{MIN}");
    let file = dir.join("c.toml");
    let c = Config::parse(&text, file.to_str().unwrap()).unwrap();
    assert_eq!(c.auth.keys.len(), 5);
    for k in ["k1", "k2", "k3", "k5"] {
        assert!(c.auth.admits(Some(format!("Bearer {k}").as_bytes())), "{k}");
    }
    assert!(!c.auth.admits(Some(b"Bearer k6")));
    assert!(!c.auth.admits(Some(b"k1")), "the Bearer scheme is required");
    assert!(!c.auth.admits(None));
    assert!(
        Config::parse(MIN, "t").unwrap().auth.admits(None),
        "no keys: open"
    );
    let missing = err(&format!("[auth]\napi_keys_file = \"nope\"\n{MIN}"));
    assert_eq!(missing.line, 2);
    let unset = err(&format!(
        "[auth]\napi_keys_env = \"PREFIXLB_UNSET_VAR_1\"\n{MIN}"
    ));
    assert!(unset.message.contains("not set"), "{unset}");
}

#[test]
fn upstream_uri_keeps_base_path() {
    let n = NodeConfig {
        id: "a".into(),
        url: "http://h:8000/engine/".parse().unwrap(),
        weight: 1,
        data_parallel_rank: None,
        tls_name: None,
        bootstrap_port: None,
    };
    assert_eq!(
        n.upstream_uri("/v1/chat/completions?x=1")
            .unwrap()
            .to_string(),
        "http://h:8000/engine/v1/chat/completions?x=1"
    );
}

#[test]
fn sse_keepalive_is_off_by_default_and_at_least_100ms_when_on() {
    let c = Config::parse(MIN, "t.toml").unwrap();
    assert_eq!(c.server.sse_keepalive, Duration::ZERO);
    let on = Config::parse(
        &format!("[server]\nsse_keepalive = \"15s\"\n{MIN}"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(on.server.sse_keepalive, Duration::from_secs(15));
    let e = err(&format!("[server]\nsse_keepalive = \"50ms\"\n{MIN}"));
    assert!(
        e.to_string()
            .contains("server.sse_keepalive must be 0s (off) or at least 100ms"),
        "{e}"
    );
}

#[test]
fn yield_after_defaults_to_three_quarters_of_a_millisecond_and_is_at_most_a_second() {
    let c = Config::parse(MIN, "t.toml").unwrap();
    assert_eq!(c.server.yield_after, Duration::from_micros(750));
    let off = Config::parse(&format!("[server]\nyield_after = \"0s\"\n{MIN}"), "t.toml").unwrap();
    assert_eq!(off.server.yield_after, Duration::ZERO);
    let e = err(&format!("[server]\nyield_after = \"2s\"\n{MIN}"));
    assert!(
        e.to_string()
            .contains("server.yield_after must be at most 1s"),
        "{e}"
    );
}

#[test]
fn lanes_default_to_one_per_cpu_the_process_may_use() {
    let per_cpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let c = Config::parse(MIN, "t.toml").unwrap();
    assert_eq!(c.server.lanes, per_cpu.min(256));
    let auto = Config::parse(&format!("[server]\nlanes = \"auto\"\n{MIN}"), "t.toml").unwrap();
    assert_eq!(auto.server.lanes, c.server.lanes);
    let shared = Config::parse(&format!("[server]\nlanes = 0\n{MIN}"), "t.toml").unwrap();
    assert_eq!(shared.server.lanes, 0);
    let three = Config::parse(&format!("[server]\nlanes = 3\n{MIN}"), "t.toml").unwrap();
    assert_eq!(three.server.lanes, 3);
    for (bad, says) in [
        ("lanes = 257", "lanes 257 is out of range 0..=256"),
        ("lanes = -1", "lanes must be \"auto\" or 0 or more"),
        ("lanes = \"all\"", "expected \"auto\" or a count of lanes"),
    ] {
        let e = err(&format!("[server]\n{bad}\n{MIN}"));
        assert!(e.to_string().contains(says), "{bad}: {e}");
    }
}

#[test]
fn a_data_parallel_server_is_a_node_per_rank() {
    let c = Config::parse(
        "[[pools]]\nname = \"p\"\n[[pools.nodes]]\nid = \"gpu\"\nurl = \"http://h:8000\"\n\
         weight = 2\ndata_parallel_size = 3\n[[pools.nodes]]\nid = \"one\"\nurl = \"http://h:9000\"\n",
        "t.toml",
    )
    .unwrap();
    let nodes: Vec<(&str, Option<u32>, u32, String)> = c.pools[0]
        .nodes
        .iter()
        .map(|n| {
            (
                n.id.as_str(),
                n.data_parallel_rank,
                n.weight,
                n.url.to_string(),
            )
        })
        .collect();
    let gpu = |id, rank| (id, Some(rank), 2, "http://h:8000/".to_string());
    assert_eq!(
        nodes,
        [
            gpu("gpu@0", 0),
            gpu("gpu@1", 1),
            gpu("gpu@2", 2),
            ("one", None, 1, "http://h:9000/".to_string())
        ]
    );
    let node = |extra: &str| {
        format!("[[pools]]\nname = \"p\"\n[[pools.nodes]]\nid = \"gpu\"\nurl = \"http://h:8000\"\n{extra}")
    };
    let zero = err(&node("data_parallel_size = 0\n"));
    assert!(zero.message.contains("data_parallel_size"), "{zero}");
    assert_eq!(zero.line, 6);
    assert!(err(&node("data_parallel_size = 257\n"))
        .message
        .contains("data_parallel_size"));
    // A rank's id is unique like any other.
    let clash = err(&node(
        "data_parallel_size = 2\n[[pools.nodes]]\nid = \"gpu@1\"\nurl = \"http://h:1\"\n",
    ));
    assert!(
        clash.message.contains("duplicate node id \"gpu@1\""),
        "{clash}"
    );
}

/// A disaggregated pool is two pools: its prefill engines under its own name, its
/// decode engines (of the file, a data-parallel server's ranks, names found in DNS)
/// in `{name}/decode`, which no model names and which has the decode cap.
#[test]
fn a_disaggregated_pool_puts_its_decode_engines_in_a_pool_of_their_own() {
    let c = Config::parse(
        r#"
[[pools]]
name = "llama"
models = ["m"]
disaggregation = "vllm"
decode_max_in_flight = 32
nodes = [
  { id = "p", url = "http://10.0.0.1:8000", role = "prefill" },
  { id = "pd", url = "http://prefill.svc:8000", role = "prefill", discover = "dns" },
  { id = "d", url = "http://10.0.0.2:8000", role = "decode", data_parallel_size = 2 },
  { id = "dd", url = "http://decode.svc:8000", role = "decode", discover = "dns" },
]
"#,
        "t.toml",
    )
    .unwrap();
    let names: Vec<&str> = c.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["llama", "llama/decode"]);
    let (prefill, decode) = (&c.pools[0], &c.pools[1]);
    let ids = |p: &PoolConfig| p.nodes.iter().map(|n| n.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(prefill), ["p"]);
    assert_eq!(ids(decode), ["d@0", "d@1"]);
    assert_eq!(prefill.named[0].id, "pd");
    assert_eq!(decode.named[0].id, "dd");
    assert_eq!(prefill.disaggregation, Some(Disaggregation::Vllm));
    assert_eq!(prefill.decode_pool.as_deref(), Some("llama/decode"));
    assert!(prefill.addressable() && !decode.addressable());
    assert_eq!(decode.decodes_for.as_deref(), Some("llama"));
    assert_eq!(
        (prefill.max_in_flight, decode.max_in_flight),
        (None, Some(32))
    );
    assert_eq!(decode.models, ["m"]);
    assert!(decode.fallbacks.is_empty() && !decode.default);
}

/// SGLang's disaggregation: each prefill engine's bootstrap port, on its node, a DNS
/// entry's every engine and a data-parallel server's every rank.
#[test]
fn an_sglang_disaggregated_pool_keeps_each_prefill_engine_s_bootstrap_port() {
    let c = Config::parse(
        r#"
[[pools]]
name = "llama"
models = ["m"]
disaggregation = "sglang"
nodes = [
  { id = "p", url = "http://10.0.0.1:30000", role = "prefill", bootstrap_port = 9000, data_parallel_size = 2 },
  { id = "q", url = "http://10.0.0.3:30000", role = "prefill" },
  { id = "pd", url = "http://prefill.svc:30000", role = "prefill", discover = "dns", bootstrap_port = 8999 },
  { id = "d", url = "http://10.0.0.2:30001", role = "decode" },
]
"#,
        "t.toml",
    )
    .unwrap();
    let prefill = &c.pools[0];
    assert_eq!(prefill.disaggregation, Some(Disaggregation::Sglang));
    let ports: Vec<(&str, Option<u16>)> = prefill
        .nodes
        .iter()
        .map(|n| (n.id.as_str(), n.bootstrap_port))
        .collect();
    assert_eq!(
        ports,
        [("p@0", Some(9000)), ("p@1", Some(9000)), ("q", None)]
    );
    let found = prefill.named[0].at(crate::config::Endpoint {
        ip: "10.0.0.9".parse().unwrap(),
        port: None,
    });
    assert_eq!(found[0].bootstrap_port, Some(8999));
    assert_eq!(c.pools[1].nodes[0].bootstrap_port, None);
}
