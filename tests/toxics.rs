//! Faults on the wire: one of four `mock-engine`s is reached through a toxic TCP relay
//! (added latency and jitter, a bandwidth limit, a blackhole that stops forwarding
//! without closing, a reset after some bytes, a slow close) while clients load the
//! balancer as in the soak. Asserted for each toxic: no request hangs past its
//! deadlines (`first_token_timeout`, `idle_stream_timeout`), every request ends whole
//! or with an explicit error, the blackholed node is ejected and comes back once the
//! toxic is gone, and every in-flight count returns to 0.
//!
//! The short run is part of `cargo test` (~30 s); the long one is
//! `cargo test --release --test toxics -- --ignored` (11 minutes).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::load::{one, rss_kb, Rng, Tally};
use common::toxic::{Relay, Toxic};
use common::*;

const ENGINE: &[&str] = &["--decode-ms-per-token", "2", "--prefill-us-per-token", "5"];

const TOXICS: [(&str, Toxic); 7] = [
    (
        "latency 150 ± 100 ms",
        Toxic::Latency {
            ms: 150,
            jitter_ms: 100,
        },
    ),
    ("bandwidth 2 KB/s", Toxic::Bandwidth { bytes_per_s: 2_000 }),
    ("blackhole", Toxic::Blackhole),
    ("reset after 300 bytes", Toxic::ResetAfter { bytes: 300 }),
    (
        "reset after 1,500 bytes (mid-stream)",
        Toxic::ResetAfter { bytes: 1_500 },
    ),
    ("slow close 2 s", Toxic::SlowClose { ms: 2_000 }),
    (
        "latency 800 ms",
        Toxic::Latency {
            ms: 800,
            jitter_ms: 0,
        },
    ),
];

async fn state_of(lb: &Proc, id: &str) -> (String, bool) {
    let n = node_info(lb, id).await;
    (
        n["state"].as_str().unwrap_or("").to_string(),
        n["healthy"].as_bool().unwrap_or(false),
    )
}

async fn toxics(rounds: usize, each: Duration, clients: usize) {
    let engines: Vec<Proc> = (0..4).map(|i| engine(&format!("e{i}"), ENGINE)).collect();
    let relay = Relay::start(engines[0].addr).await;
    let addrs = [
        relay.addr,
        engines[1].addr,
        engines[2].addr,
        engines[3].addr,
    ];
    let config = config_at(
        &addrs,
        "idle_stream_timeout = \"1s\"\nrequest_timeout = \"4s\"\n[breaker]\nopen_for = \"1s\"\ncanary_step = \"200ms\"\n[health]\ninterval = \"300ms\"\ntimeout = \"500ms\"",
    )
    .replace("models = [\"mock\"]\n", "models = [\"mock\"]\nfirst_token_timeout = \"1s\"\n");
    let lb = Arc::new(balancer(&config));
    for i in 0..20 {
        stream_chat(&lb, &format!("warm{i}"), 4).await;
    }
    let rss0 = rss_kb(lb.pid());
    let tally = Arc::new(Tally::default());
    let mut ejected = false;
    for round in 0..rounds {
        for (name, toxic) in TOXICS {
            relay.set(toxic);
            let end = Instant::now() + each;
            let workers: Vec<_> = (0..clients)
                .map(|c| {
                    let (lb, tally) = (lb.clone(), tally.clone());
                    tokio::spawn(async move {
                        let mut rng =
                            Rng(0x9E37_79B9_7F4A_7C15
                                ^ ((c as u64 + 1) * 0x1000_0001 + round as u64));
                        while Instant::now() < end {
                            one(&lb, &mut rng, &tally).await;
                        }
                    })
                })
                .collect();
            let mut left_rotation = false;
            while Instant::now() < end {
                let (state, healthy) = state_of(&lb, "n0").await;
                left_rotation |= state == "open" || state == "half_open" || !healthy;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            for w in workers {
                w.await.unwrap();
            }
            if toxic == Toxic::Blackhole {
                assert!(left_rotation, "the blackholed node was never taken out");
                ejected = true;
            }
            // The toxic removed, the node comes back and every slot returns.
            relay.set(Toxic::None);
            let back = eventually(Duration::from_secs(15), || async {
                let (state, healthy) = state_of(&lb, "n0").await;
                let mut quiet = true;
                for (_, n) in in_flight(&lb).await {
                    quiet &= n == 0;
                }
                if state != "closed" && healthy {
                    // The canary only admits a share of keys: send it some traffic.
                    for k in 0..8 {
                        stream_chat(&lb, &format!("probe{k}"), 2).await;
                    }
                }
                state == "closed" && healthy && quiet
            })
            .await;
            assert!(
                back,
                "after {name}: n0 {:?}, in flight {:?}",
                state_of(&lb, "n0").await,
                in_flight(&lb).await
            );
            eprintln!("round {round}, {name}: {}", tally.summary());
        }
    }
    assert!(ejected);
    let rss1 = rss_kb(lb.pid());
    eprintln!("toxics: {}; RSS {rss0} -> {rss1} kB", tally.summary());
    tally.assert_kept(85);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn toxics_on_one_engine_lose_nothing_short() {
    toxics(1, Duration::from_secs(3), 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "11 minutes: cargo test --release --test toxics -- --ignored"]
async fn toxics_on_one_engine_lose_nothing_long() {
    toxics(10, Duration::from_secs(8), 24).await;
}
