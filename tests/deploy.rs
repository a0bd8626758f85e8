//! The deployment files in `deploy/` parse and say what the README says they do: a
//! multi-stage, non-root image; systemd units for `serve` and `agent`; Kubernetes
//! manifests with two probed `serve` replicas, their config (valid), a vLLM pod with
//! the agent as a sidecar, Redis, and a headless Service for DNS discovery; a Compose
//! file whose engines are found through Compose's DNS.

use std::collections::HashMap;
use std::path::Path;

use prefixlb::config::Config;
use yaml_rust2::{Yaml, YamlLoader};

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every document of a YAML file, by `kind/name`.
fn manifests(path: &str) -> HashMap<String, Yaml> {
    YamlLoader::load_from_str(&read(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .into_iter()
        .map(|d| {
            let kind = d["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{path}: a document without kind"));
            let name = d["metadata"]["name"].as_str().unwrap().to_string();
            (format!("{kind}/{name}"), d)
        })
        .collect()
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn kubernetes_manifests_parse_and_wire_serve_agent_and_redis() {
    let lb = manifests("deploy/k8s/prefixlb.yaml");
    let deploy = &lb["Deployment/prefixlb"];
    assert_eq!(deploy["spec"]["replicas"].as_i64(), Some(2));
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(strings(&c["args"])[0], "serve");
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"].as_bool(),
        Some(true)
    );
    // The ConfigMap's config is valid and takes its nodes from Redis.
    let toml = lb["ConfigMap/prefixlb"]["data"]["prefixlb.toml"]
        .as_str()
        .unwrap();
    let config = Config::parse(toml, "deploy/k8s/prefixlb.yaml").unwrap();
    let redis = config.redis.expect("[redis] configured");
    assert_eq!(redis.password_env.as_deref(), Some("REDIS_PASSWORD"));
    assert!(config.routing.split_cap_across_replicas);
    assert!(
        config.pools[0].nodes.is_empty(),
        "nodes come from heartbeats"
    );
    assert!(lb.contains_key("Service/prefixlb"));

    let engines = manifests("deploy/k8s/vllm-with-agent.yaml");
    let pod = &engines["Deployment/vllm-llama"]["spec"]["template"]["spec"];
    let agent = pod["containers"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|c| c["name"].as_str() == Some("agent"))
        .expect("an agent sidecar");
    let args = strings(&agent["args"]);
    assert_eq!(args[0], "agent");
    for flag in ["--redis", "--backend", "--pool", "--id"] {
        assert!(args.iter().any(|a| a == flag), "{flag} in {args:?}");
    }
    let pool = &args[args.iter().position(|a| a == "--pool").unwrap() + 1];
    assert_eq!(
        *pool, config.pools[0].name,
        "the agent joins the configured pool"
    );

    // The headless Service for DNS discovery names the same pods, and the config its
    // comment gives makes a node of each of its addresses.
    let headless = manifests("deploy/k8s/vllm-headless-service.yaml");
    let service = &headless["Service/vllm-llama"]["spec"];
    assert_eq!(service["clusterIP"].as_str(), Some("None"));
    assert_eq!(
        service["selector"]["app"].as_str(),
        engines["Deployment/vllm-llama"]["spec"]["selector"]["matchLabels"]["app"].as_str()
    );
    let commented: String = read("deploy/k8s/vllm-headless-service.yaml")
        .lines()
        .filter_map(|l| l.strip_prefix("#   "))
        .map(|l| format!("{l}\n"))
        .collect();
    let config = Config::parse(&commented, "deploy/k8s/vllm-headless-service.yaml").unwrap();
    assert_eq!(
        config.pools[0].named[0].name(),
        "vllm-llama.default.svc.cluster.local"
    );

    let redis = manifests("deploy/k8s/redis.yaml");
    assert!(redis.contains_key("Deployment/prefixlb-redis"));
    assert!(redis.contains_key("Service/prefixlb-redis"));
}

/// The Compose file: every engine service answers to the alias its config's DNS entry
/// names, on the port it gives, each with a GPU of its own, and the config is valid.
#[test]
fn the_compose_file_finds_its_engines_by_their_alias() {
    let docs = YamlLoader::load_from_str(&read("deploy/compose.yaml")).unwrap();
    let compose = &docs[0];
    let toml = read("deploy/compose.prefixlb.toml");
    let config = Config::parse(&toml, "deploy/compose.prefixlb.toml").unwrap();
    let entry = &config.pools[0].named[0];
    assert_eq!(entry.name(), "vllm");
    let services = compose["services"].as_hash().unwrap();
    let mut gpus = Vec::new();
    for (name, service) in services {
        let name = name.as_str().unwrap();
        let service = &merged(service);
        if name == "prefixlb" {
            let mount = format!(
                "./compose.prefixlb.toml:{}:ro",
                strings(&service["command"]).last().unwrap()
            );
            assert_eq!(strings(&service["volumes"]), [mount]);
            continue;
        }
        let aliases = strings(&service["networks"]["default"]["aliases"]);
        assert_eq!(aliases, [entry.name()], "{name}");
        let args = strings(&service["command"]);
        let port = &args[args.iter().position(|a| a == "--port").unwrap() + 1];
        assert_eq!(Some(port.parse().unwrap()), entry.url.port_u16(), "{name}");
        let device = &service["deploy"]["resources"]["reservations"]["devices"][0];
        gpus.extend(strings(&device["device_ids"]));
    }
    assert_eq!(gpus.len(), services.len() - 1, "a GPU per engine");
    gpus.sort();
    gpus.dedup();
    assert_eq!(gpus.len(), services.len() - 1, "each engine its own GPU");
}

/// A mapping with its YAML merge key (`<<: *anchor`, which Compose reads and
/// yaml-rust2 leaves as a key) merged in: its own keys win.
fn merged(y: &Yaml) -> Yaml {
    let Some(map) = y.as_hash() else {
        return y.clone();
    };
    let mut out = match map.get(&Yaml::String("<<".into())) {
        Some(Yaml::Hash(base)) => base.clone(),
        _ => Default::default(),
    };
    for (k, v) in map {
        if k.as_str() != Some("<<") {
            out.insert(k.clone(), v.clone());
        }
    }
    Yaml::Hash(out)
}

/// `[Section]` → key → values of a systemd unit file.
fn unit(path: &str) -> HashMap<String, HashMap<String, Vec<String>>> {
    let mut sections: HashMap<String, HashMap<String, Vec<String>>> = HashMap::new();
    let mut current = None;
    for (n, line) in read(path).lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = Some(name.to_string());
            sections.entry(name.to_string()).or_default();
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("{path}:{}: not key=value: {line}", n + 1));
        let section = current
            .as_ref()
            .unwrap_or_else(|| panic!("{path}:{}: outside a section", n + 1));
        sections
            .get_mut(section)
            .unwrap()
            .entry(key.trim().to_string())
            .or_default()
            .push(value.trim().to_string());
    }
    sections
}

#[test]
fn systemd_units_parse_and_run_serve_and_agent_unprivileged() {
    for (path, command) in [
        ("deploy/systemd/prefixlb.service", "serve"),
        ("deploy/systemd/prefixlb-agent.service", "agent"),
    ] {
        let u = unit(path);
        for section in ["Unit", "Service", "Install"] {
            assert!(u.contains_key(section), "{path}: [{section}]");
        }
        let exec = &u["Service"]["ExecStart"][0];
        let words: Vec<&str> = exec.split_whitespace().collect();
        assert_eq!(words[0], "/usr/local/bin/prefixlb", "{path}");
        assert_eq!(words[1], command, "{path}");
        assert_eq!(u["Service"]["DynamicUser"], ["yes"], "{path}: not root");
        assert_eq!(u["Service"]["KillSignal"], ["SIGTERM"], "{path}");
        assert_eq!(u["Install"]["WantedBy"], ["multi-user.target"], "{path}");
    }
}

#[test]
fn the_image_is_multi_stage_and_runs_as_a_user() {
    let docker = read("deploy/Dockerfile");
    let from: Vec<&str> = docker.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert!(from.len() >= 2, "multi-stage: {from:?}");
    assert!(from[0].contains(" AS build"));
    let user = docker
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    assert!(
        user.trim() != "root" && user.trim() != "0",
        "runs as {user}"
    );
    assert!(docker.contains("ENTRYPOINT [\"/usr/local/bin/prefixlb\"]"));
    assert!(
        docker.contains("--no-default-features"),
        "the balancer and agent alone"
    );
}
