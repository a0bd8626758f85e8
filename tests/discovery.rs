//! Nodes found in DNS (`discover = "dns"`) against a real DNS server: `dnsmasq`
//! answering a name from a hosts file the test rewrites (and reloads with SIGHUP), as
//! a Kubernetes headless Service's records change when pods come and go, with
//! `mock-engine`s on loopback addresses of their own (127.0.0.2, 127.0.0.3, …) behind
//! it. Without `dnsmasq` on the PATH each test prints a skip line, except under
//! `CI=true`, where that fails (CI installs Debian's `dnsmasq-base`).

mod common;

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::tls::{make_pki_for, tls_front_on};
use common::*;

const NAME: &str = "engines.prefixlb.test";

/// A `dnsmasq` answering `NAME` from a hosts file, on a free loopback port, and
/// SRV records given when it starts.
struct Dns {
    port: u16,
    hosts: PathBuf,
    /// `--srv-host` values: `_service._proto.name,target,port`.
    srv: Vec<String>,
    child: Option<Child>,
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Dns {
    /// `None` (after a skip line) when `dnsmasq` is not installed, outside CI.
    fn start(addresses: &[&str]) -> Option<Dns> {
        if !installed("dnsmasq", "dnsmasq-base", "the DNS discovery tests") {
            return None;
        }
        let hosts = write_config("").with_extension("hosts");
        let mut dns = Dns {
            port: 0,
            hosts,
            srv: Vec::new(),
            child: None,
        };
        dns.answer(addresses);
        // A port another test's server takes between our look and dnsmasq's bind
        // (dnsmasq listens on TCP as well as UDP) makes it exit: another port, then.
        for _ in 0..10 {
            dns.port = free_udp_and_tcp_port();
            if dns.up() {
                return Some(dns);
            }
        }
        panic!("dnsmasq did not start on any of 10 ports");
    }

    /// Starts dnsmasq on its port; false if it exited instead (the port was taken).
    fn up(&mut self) -> bool {
        let mut child = Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
            ])
            .args(["--no-hosts", "--local-ttl=300", "--pid-file="])
            .arg(format!("--addn-hosts={}", self.hosts.display()))
            .args(self.srv.iter().map(|r| format!("--srv-host={r}")))
            .args(["--listen-address=127.0.0.1", "--bind-interfaces"])
            .arg(format!("--port={}", self.port))
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        // Up once its port is taken.
        let deadline = Instant::now() + Duration::from_secs(5);
        while UdpSocket::bind(("127.0.0.1", self.port)).is_ok() {
            if child.try_wait().unwrap().is_some() {
                return false;
            }
            assert!(Instant::now() < deadline, "dnsmasq did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        true
    }

    /// From now on the SRV records are `records` (dnsmasq reads them when it starts:
    /// it is started again, on its port).
    fn answer_srv(&mut self, records: &[String]) {
        self.stop();
        self.srv = records.to_vec();
        assert!(
            self.up(),
            "dnsmasq did not start again on port {}",
            self.port
        );
    }

    /// From now on `NAME` resolves to `addresses` (none: no record).
    fn answer(&mut self, addresses: &[&str]) {
        self.answer_hosts(&addresses.iter().map(|a| (*a, NAME)).collect::<Vec<_>>());
    }

    /// From now on each name resolves to its addresses.
    fn answer_hosts(&mut self, hosts: &[(&str, &str)]) {
        let lines: String = hosts
            .iter()
            .map(|(a, name)| format!("{a} {name}\n"))
            .collect();
        std::fs::write(&self.hosts, lines).unwrap();
        if let Some(child) = &self.child {
            let ok = Command::new("kill")
                .args(["-HUP", &child.id().to_string()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill -HUP dnsmasq");
        }
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn server(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// A loopback port free for UDP and for TCP.
fn free_udp_and_tcp_port() -> u16 {
    loop {
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A port free on each of `ips` (loopback addresses), for engines that share one.
fn common_port(ips: &[&str]) -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.2:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if ips.iter().all(|ip| TcpListener::bind((*ip, port)).is_ok()) {
            return port;
        }
    }
}

/// A `mock-engine` at `ip:port`.
fn engine_on(ip: &str, port: u16) -> Proc {
    let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
    engine_at(&format!("e{ip}"), addr, &[])
}

/// A balancer whose one node entry, `gpu`, is `url` found by `discover`, asking `dns`.
fn discovering(dns: &Dns, url: &str, discover: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [health]\ninterval = \"100ms\"\n\
         [discovery]\ninterval = \"200ms\"\nnameservers = [\"{}\"]\n\
         [[pools]]\nname = \"mock\"\nmodels = [\"mock\"]\n\
         nodes = [{{ id = \"gpu\", url = \"{url}\", discover = \"{discover}\" }}]\n",
        dns.server()
    )
}

/// [`discovering`] the engines at `NAME`'s addresses on `port`.
fn dns_config(dns: &Dns, port: u16) -> String {
    discovering(dns, &format!("http://{NAME}:{port}"), "dns")
}

/// The nodes `lb` has, as (id, source, healthy), sorted by id.
async fn nodes(lb: &Proc) -> Vec<(String, String, bool)> {
    admin_nodes(lb)
        .await
        .iter()
        .map(|n| {
            (
                n["id"].as_str().unwrap().to_string(),
                n["source"].as_str().unwrap().to_string(),
                n["healthy"].as_bool().unwrap(),
            )
        })
        .collect()
}

async fn node_ids(lb: &Proc) -> Vec<String> {
    nodes(lb).await.into_iter().map(|(id, _, _)| id).collect()
}

/// The node each of `n` new conversations was served by, counted by node.
async fn served_by(lb: &Proc, n: usize, tag: &str) -> std::collections::BTreeMap<String, usize> {
    let mut by = std::collections::BTreeMap::new();
    for i in 0..n {
        let body = chat(&[("user", &format!("{tag} conversation {i}"))], false, 4);
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        *by.entry(reply.header("x-prefixlb-node").to_string())
            .or_insert(0) += 1;
    }
    by
}

/// Every address of the name is a node that serves; an address added to the name
/// joins, one removed leaves; when the DNS server stops answering, the nodes stay
/// and keep serving, and `prefixlb_dns_up` says so.
#[tokio::test(flavor = "multi_thread")]
async fn the_nodes_follow_what_the_name_resolves_to() {
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    let Some(mut dns) = Dns::start(&ips[..2]) else {
        return;
    };
    let port = common_port(&ips);
    let _engines: Vec<Proc> = ips.iter().map(|ip| engine_on(ip, port)).collect();
    let config = write_config(&dns_config(&dns, port));
    // `check` says what the name resolves to from here.
    let said =
        String::from_utf8(run_cli(&["check", "--config", config.to_str().unwrap()])).unwrap();
    assert!(
        said.contains(&format!("dns {NAME}: 2 now (127.0.0.2, 127.0.0.3)")),
        "{said}"
    );
    // `route` explains with the nodes the name has now.
    let body = config.with_extension("json");
    std::fs::write(&body, chat(&[("user", "hi")], false, 4).to_string()).unwrap();
    let routed = run_cli(&[
        "route",
        "--config",
        config.to_str().unwrap(),
        body.to_str().unwrap(),
    ]);
    let routed: serde_json::Value = serde_json::from_slice(&routed).unwrap();
    let mut walk: Vec<&str> = routed["successors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["node"].as_str().unwrap())
        .collect();
    walk.sort();
    assert_eq!(walk, ["gpu-127.0.0.2", "gpu-127.0.0.3"], "{routed}");
    let lb = balancer_from_file(&config);
    // The first lookup is waited for: the nodes are there from the first request.
    assert_eq!(node_ids(&lb).await, ["gpu-127.0.0.2", "gpu-127.0.0.3"]);
    assert!(
        eventually(Duration::from_secs(5), || async {
            nodes(&lb).await
                == [
                    ("gpu-127.0.0.2".into(), "dns".into(), true),
                    ("gpu-127.0.0.3".into(), "dns".into(), true),
                ]
        })
        .await,
        "{:?}",
        nodes(&lb).await
    );
    // Their engines' load is read as for the nodes of the config.
    let loads = eventually(Duration::from_secs(5), || async {
        engine_running(&lb).await.iter().all(|(_, r)| r.is_some())
    })
    .await;
    assert!(loads, "{:?}", engine_running(&lb).await);
    // `/admin/summary` (the status page's header) shows the name answering, with its
    // two engines.
    let summary = get_json(&lb.admin_url("/admin/summary")).await;
    assert_eq!(
        summary["dns"],
        serde_json::json!([{"entry": "gpu", "name": NAME, "discover": "dns", "up": true, "servers": 2}])
    );
    let by = served_by(&lb, 24, "first").await;
    assert_eq!(
        by.keys().collect::<Vec<_>>(),
        ["gpu-127.0.0.2", "gpu-127.0.0.3"],
        "{by:?}"
    );

    // A pod comes: its address joins.
    dns.answer(&ips);
    let joined = eventually(Duration::from_secs(5), || async {
        node_ids(&lb).await.len() == 3
    })
    .await;
    assert!(joined, "{:?}", nodes(&lb).await);
    let by = served_by(&lb, 36, "second").await;
    assert!(by.get("gpu-127.0.0.4").is_some_and(|&n| n > 0), "{by:?}");

    // A pod goes: its address leaves, and a stream it was serving finishes.
    let mut session = String::new();
    for k in 0..200 {
        session = format!("s{k}");
        if walk_of(&lb, &session).await[0] == "gpu-127.0.0.2" {
            break;
        }
    }
    let (url, s) = (lb.url("/v1/chat/completions"), session.clone());
    let stream = tokio::spawn(async move {
        let body = chat(&[("user", "hello")], true, 400);
        post_json(&url, &body, &[("x-session-id", &s)]).await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    dns.answer(&ips[1..]);
    let left = eventually(Duration::from_secs(5), || async {
        node_ids(&lb).await == ["gpu-127.0.0.3", "gpu-127.0.0.4"]
    })
    .await;
    assert!(left, "{:?}", nodes(&lb).await);
    assert!(
        !stream.is_finished(),
        "the stream (4 s) ended before its node left"
    );
    let reply = stream.await.unwrap();
    assert_eq!(reply.header("x-prefixlb-node"), "gpu-127.0.0.2");
    assert!(
        reply.text().ends_with("data: [DONE]\n\n"),
        "{}",
        reply.text()
    );
    assert_eq!(reply.text().matches("\"content\":").count(), 401);
    let by = served_by(&lb, 12, "third").await;
    assert!(!by.contains_key("gpu-127.0.0.2"), "{by:?}");
    assert_eq!(
        metric(&lb.admin_url("/metrics"), "prefixlb_dns_up").await,
        1.0
    );

    // The DNS server goes: the last addresses stay, and serve.
    dns.stop();
    let down = eventually(Duration::from_secs(15), || async {
        metric(&lb.admin_url("/metrics"), "prefixlb_dns_up").await == 0.0
    })
    .await;
    assert!(down, "prefixlb_dns_up stayed 1 with the DNS server stopped");
    let summary = get_json(&lb.admin_url("/admin/summary")).await;
    assert_eq!(summary["dns"][0]["up"], false, "{summary}");
    assert_eq!(summary["dns"][0]["servers"], 2, "{summary}");
    assert_eq!(node_ids(&lb).await, ["gpu-127.0.0.3", "gpu-127.0.0.4"]);
    let by = served_by(&lb, 12, "fourth").await;
    assert_eq!(by.values().sum::<usize>(), 12, "{by:?}");
}

/// A name that resolves to nothing yet: the balancer starts, its pool has no node
/// (503, said so), and the nodes come when the name has addresses. A name with IPv4
/// and IPv6 addresses (a dual-stack pod) is its IPv4 ones; one with IPv6 only, those.
#[tokio::test(flavor = "multi_thread")]
async fn a_name_with_no_address_yet_gets_nodes_when_it_has_some() {
    let Some(mut dns) = Dns::start(&[]) else {
        return;
    };
    let port = common_port(&["127.0.0.5"]);
    let _engine = engine_on("127.0.0.5", port);
    let lb = balancer(&dns_config(&dns, port));
    assert!(node_ids(&lb).await.is_empty());
    let body = chat(&[("user", "anyone there?")], false, 4);
    let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    dns.answer(&["127.0.0.5"]);
    let served = eventually(Duration::from_secs(5), || async {
        let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
        reply.status == 200
    })
    .await;
    assert!(served, "{:?}", nodes(&lb).await);
    assert_eq!(node_ids(&lb).await, ["gpu-127.0.0.5"]);

    // The same engine's IPv6 address as well: still one node.
    dns.answer(&["127.0.0.5", "::1"]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(node_ids(&lb).await, ["gpu-127.0.0.5"]);
    // IPv6 only.
    let _v6 = engine_at("e6", format!("[::1]:{port}").parse().unwrap(), &[]);
    dns.answer(&["::1"]);
    let v6 = eventually(Duration::from_secs(5), || async {
        node_ids(&lb).await == ["gpu-::1"]
    })
    .await;
    assert!(v6, "{:?}", nodes(&lb).await);
    let reply = post_json(&lb.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.header("x-prefixlb-node"), "gpu-::1");
}

/// A reload that gives the name up drops its nodes and its `prefixlb_dns_up` series;
/// one that gives it again brings them back.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_gives_a_name_up_and_back() {
    let Some(dns) = Dns::start(&["127.0.0.8"]) else {
        return;
    };
    let port = common_port(&["127.0.0.8", "127.0.0.9"]);
    let _engines = [engine_on("127.0.0.8", port), engine_on("127.0.0.9", port)];
    // Health checks every 30 s: the first round, at start, finds the name's nodes.
    let with_name = dns_config(&dns, port).replace(
        "[health]\ninterval = \"100ms\"",
        "[health]\ninterval = \"30s\"",
    );
    assert_ne!(with_name, dns_config(&dns, port));
    let path = write_config(&with_name);
    let lb = balancer_from_file(&path);
    assert_eq!(node_ids(&lb).await, ["gpu-127.0.0.8"]);
    let checked = eventually(Duration::from_secs(3), || async {
        engine_running(&lb).await == [("gpu-127.0.0.8".to_string(), Some(0.0))]
    })
    .await;
    assert!(checked, "{:?}", engine_running(&lb).await);
    let series = || async {
        call("GET", &lb.admin_url("/metrics"), &[], "")
            .await
            .text()
            .contains(&format!("prefixlb_dns_up{{name=\"{NAME}\"}} 1"))
    };
    assert!(series().await);
    let fixed = with_name.replace(
        &format!("{{ id = \"gpu\", url = \"http://{NAME}:{port}\", discover = \"dns\" }}"),
        &format!("{{ id = \"fixed\", url = \"http://127.0.0.9:{port}\" }}"),
    );
    assert_ne!(fixed, with_name);
    std::fs::write(&path, &fixed).unwrap();
    let reload = call("POST", &lb.admin_url("/admin/reload"), &[], "").await;
    assert_eq!(reload.status, 200, "{}", reload.text());
    assert_eq!(node_ids(&lb).await, ["fixed"]);
    let dropped = eventually(Duration::from_secs(3), || async { !series().await }).await;
    assert!(dropped, "prefixlb_dns_up{{name={NAME:?}}} stayed");
    std::fs::write(&path, &with_name).unwrap();
    let reload = call("POST", &lb.admin_url("/admin/reload"), &[], "").await;
    assert_eq!(reload.status, 200, "{}", reload.text());
    let back = eventually(Duration::from_secs(3), || async {
        node_ids(&lb).await == ["gpu-127.0.0.8"] && series().await
    })
    .await;
    assert!(back, "{:?}", nodes(&lb).await);
}

/// `discover = "srv"`: each SRV record's target is a node on the record's port (two
/// engines on one host are two nodes; a target with no address is left out), and a
/// record that goes takes its node with it.
#[tokio::test(flavor = "multi_thread")]
async fn srv_records_give_each_engine_its_own_port() {
    let Some(mut dns) = Dns::start(&[]) else {
        return;
    };
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < 3 {
        let port = common_port(&["127.0.0.6", "127.0.0.7"]);
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    let _engines = [
        engine_on("127.0.0.6", ports[0]),
        engine_on("127.0.0.6", ports[1]),
        engine_on("127.0.0.7", ports[2]),
    ];
    dns.answer_hosts(&[
        ("127.0.0.6", "a.prefixlb.test"),
        ("127.0.0.7", "b.prefixlb.test"),
    ]);
    let service = "_vllm._tcp.prefixlb.test";
    let records: Vec<String> = [("a", ports[0]), ("a", ports[1]), ("b", ports[2])]
        .iter()
        .map(|(host, port)| format!("{service},{host}.prefixlb.test,{port}"))
        .collect();
    // And a record whose target has no address: left out, the others kept.
    let unresolved = format!("{service},gone.prefixlb.test,{}", ports[0]);
    dns.answer_srv(&[records.clone(), vec![unresolved]].concat());
    let config = discovering(&dns, &format!("http://{service}"), "srv");
    let lb = balancer(&config);
    let mut want: Vec<String> = vec![
        format!("gpu-127.0.0.6:{}", ports[0]),
        format!("gpu-127.0.0.6:{}", ports[1]),
        format!("gpu-127.0.0.7:{}", ports[2]),
    ];
    want.sort();
    assert_eq!(node_ids(&lb).await, want);
    let healthy = eventually(Duration::from_secs(5), || async {
        nodes(&lb)
            .await
            .iter()
            .all(|(_, source, up)| source == "dns" && *up)
    })
    .await;
    assert!(healthy, "{:?}", nodes(&lb).await);
    let by = served_by(&lb, 36, "srv").await;
    assert_eq!(by.keys().cloned().collect::<Vec<_>>(), want, "{by:?}");

    // The record of the second engine on 127.0.0.6 goes.
    dns.answer_srv(&[records[0].clone(), records[2].clone()]);
    let gone = format!("gpu-127.0.0.6:{}", ports[1]);
    let left = eventually(Duration::from_secs(5), || async {
        let ids = node_ids(&lb).await;
        ids.len() == 2 && !ids.contains(&gone)
    })
    .await;
    assert!(left, "{:?}", nodes(&lb).await);
}

/// Engines behind TLS found in DNS: each is reached at its address, and its
/// certificate, which names the DNS name and not the address, is checked against the
/// name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_behind_tls_found_in_dns_are_checked_against_the_name() {
    let ips = ["127.0.0.2", "127.0.0.3"];
    let Some(dns) = Dns::start(&ips) else {
        return;
    };
    let port = common_port(&ips);
    let pki = make_pki_for("dns", &[NAME]);
    let engines: Vec<Proc> = ips
        .iter()
        .map(|ip| engine(&format!("e{ip}"), &[]))
        .collect();
    for (ip, e) in ips.iter().zip(&engines) {
        let listen = format!("{ip}:{port}").parse().unwrap();
        tls_front_on(&pki, e.addr, listen, false).await;
    }
    let ca = pki.path("ca.pem");
    let config = discovering(&dns, &format!("https://{NAME}:{port}"), "dns").replace(
        "[discovery]",
        &format!("[tls]\nca_file = {:?}\n[discovery]", ca.to_str().unwrap()),
    );
    let lb = balancer(&config);
    let healthy = eventually(Duration::from_secs(10), || async {
        let n = nodes(&lb).await;
        n.len() == 2 && n.iter().all(|(_, _, healthy)| *healthy)
    })
    .await;
    assert!(healthy, "{:?}", admin_nodes(&lb).await);
    let by = served_by(&lb, 24, "tls").await;
    let want = ["gpu-127.0.0.2", "gpu-127.0.0.3"];
    assert_eq!(by.keys().cloned().collect::<Vec<_>>(), want, "{by:?}");
}

/// What `discover` cannot be given with, refused with where and why.
#[test]
fn discover_is_refused_where_it_cannot_work() {
    let entry = |url: &str, discover: &str| {
        format!("[[pools]]\nname = \"p\"\nnodes = [{{ id = \"e\", url = \"{url}\", discover = \"{discover}\" }}]\n")
    };
    let said = check_refuses(&entry("http://10.0.0.1:8000", "dns"));
    assert!(said.contains("is an address"), "{said}");
    let said = check_refuses(&entry("http://engines:8000", "a"));
    assert!(said.contains("\"dns\""), "{said}");
    let said = check_refuses(&entry("http://_vllm._tcp.engines:8000", "srv"));
    assert!(said.contains("leave the port out"), "{said}");
    let said = check_refuses(
        "[discovery]\nnameservers = [\"resolver.local\"]\n[[pools]]\nname = \"p\"\nnodes = [{ id = \"e\", url = \"http://10.0.0.1:8000\" }]\n",
    );
    assert!(said.contains("is not an address"), "{said}");
}
