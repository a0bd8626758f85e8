//! Per-chunk delivery latency of a stream, straight from a `mock-engine` and through
//! prefixlb, measured side by side in one run: what the first-packet probe and relay
//! add to every token after commit.
//!
//! `cargo run --release --example relay_latency` — 1,000-token streams (2 ms per token),
//! alternating direct / through the balancer, 3 rounds each. Each chunk carries the
//! engine's emit time (`mock_timestamps`); latency = arrival − emit, same clock.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prefixlb::config::Config;
use prefixlb::proxy::sse::SseScanner;
use prefixlb::tools::engine_model::Costs;
use prefixlb::tools::mock_engine::{MockConfig, MockEngine};
use tokio::net::TcpListener;

const TOKENS: usize = 1000;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Streams one completion and returns each content chunk's latency in µs.
async fn stream(addr: SocketAddr) -> Vec<u64> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let body = serde_json::json!({
        "model": "mock", "stream": true, "max_tokens": TOKENS, "mock_timestamps": true,
        "messages": [{"role": "user", "content": "count to a thousand"}],
    });
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let mut body = client.request(req).await.unwrap().into_body();
    let (mut events, mut out) = (SseScanner::default(), Vec::new());
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        let arrived = now_us();
        for event in events.push(&data).into_iter().filter_map(|b| b.event) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&event.data) else {
                continue;
            };
            if let (Some(emitted), Some(_)) = (
                v["emitted_us"].as_u64(),
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .filter(|c| !c.is_empty()),
            ) {
                out.push(arrived.saturating_sub(emitted));
            }
        }
    }
    out
}

fn pct(sorted: &[u64], q: f64) -> u64 {
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let engine_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_addr = engine_listener.local_addr().unwrap();
    let engine = MockEngine::new(MockConfig {
        costs: Costs {
            prefill_per_token: Duration::ZERO,
            decode_per_token: Duration::from_millis(2),
            ..Costs::default()
        },
        ..MockConfig::default()
    });
    tokio::spawn(engine.serve(engine_listener, std::future::pending()));

    let lb_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let lb_addr = lb_listener.local_addr().unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = Config::parse(
        &format!("[server]\nlanes = 0\n[[pools]]\nname = \"mock\"\nnodes = [{{ id = \"e\", url = \"http://{engine_addr}\" }}]\n"),
        "relay_latency",
    )
    .unwrap();
    tokio::spawn(prefixlb::server::serve::run_on(
        lb_listener,
        admin,
        config,
        None,
        std::future::pending(),
    ));

    let (mut direct, mut relayed) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        direct.extend(stream(engine_addr).await);
        relayed.extend(stream(lb_addr).await);
    }
    direct.sort_unstable();
    relayed.sort_unstable();
    println!(
        "per-chunk latency (emit → client), {} chunks each way",
        direct.len()
    );
    println!("{:<10} {:>8} {:>8}", "", "p50 µs", "p99 µs");
    println!(
        "{:<10} {:>8} {:>8}",
        "direct",
        pct(&direct, 0.5),
        pct(&direct, 0.99)
    );
    println!(
        "{:<10} {:>8} {:>8}",
        "prefixlb",
        pct(&relayed, 0.5),
        pct(&relayed, 0.99)
    );
    println!(
        "added by the relay: p50 {} µs, p99 {} µs",
        pct(&relayed, 0.5) as i64 - pct(&direct, 0.5) as i64,
        pct(&relayed, 0.99) as i64 - pct(&direct, 0.99) as i64
    );
}
