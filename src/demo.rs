//! `prefixlb demo`: starts emulated engines and the balancer in this process, drives
//! the same multi-turn chat workload over real HTTP twice (round-robin across the
//! engines, then through prefixlb with its defaults) and prints the comparison.
//! Each run gets fresh engines, so both start with cold caches.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::engine_model::Costs;
use crate::mock_engine::{MockConfig, MockEngine};

/// The demo's shape; `Default` is what `prefixlb demo` runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub engines: usize,
    pub conversations: usize,
    pub turns: usize,
    /// Conversations in flight at once.
    pub concurrency: usize,
    /// Characters of the system prompt every conversation shares (≈ 4 per token).
    pub system_chars: usize,
    /// Characters of the document each conversation opens with (pasted code, a
    /// report, retrieved context): the per-conversation prefix that affinity saves.
    pub document_chars: usize,
    pub answer_tokens: usize,
    pub cache_tokens: usize,
    pub costs: Costs,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            engines: 4,
            conversations: 48,
            turns: 5,
            concurrency: 8,
            system_chars: 1200,
            document_chars: 6000,
            answer_tokens: 48,
            cache_tokens: 32_000,
            costs: Costs {
                prefill_per_token: Duration::from_micros(100),
                decode_per_token: Duration::from_millis(2),
            },
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    pub requests: usize,
    pub errors: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Time to first content token, per request, sorted.
    pub ttft: Vec<Duration>,
    pub elapsed: Duration,
}

impl RunStats {
    /// Token-weighted prefix-cache hit rate, as the engines reported it.
    pub fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// The q-quantile of TTFT (nearest rank).
    pub fn ttft_quantile(&self, q: f64) -> Duration {
        if self.ttft.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((q * self.ttft.len() as f64).ceil() as usize).clamp(1, self.ttft.len());
        self.ttft[rank - 1]
    }

    pub fn throughput(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Where a run sends its requests.
enum Target {
    /// Each request to the next engine in turn, as a round-robin balancer would.
    RoundRobin(Vec<SocketAddr>, AtomicUsize),
    Balancer(SocketAddr),
}

impl Target {
    fn next(&self) -> SocketAddr {
        match self {
            Target::RoundRobin(engines, next) => {
                engines[next.fetch_add(1, Ordering::Relaxed) % engines.len()]
            }
            Target::Balancer(addr) => *addr,
        }
    }
}

/// Runs both policies and returns (round-robin, prefixlb).
pub async fn compare(opts: &DemoOptions) -> std::io::Result<(RunStats, RunStats)> {
    let (engines, stop) = start_engines(opts).await?;
    let round_robin = drive(Target::RoundRobin(engines, AtomicUsize::new(0)), opts).await;
    let _ = stop.send(true);

    let (engines, stop) = start_engines(opts).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let admin = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let config = balancer_config(&engines);
    let (lb_stop_tx, mut lb_stop) = watch::channel(false);
    let lb = tokio::spawn(crate::serve::run_on(
        listener,
        admin,
        config,
        None,
        async move {
            let _ = lb_stop.wait_for(|s| *s).await;
        },
    ));
    let prefixlb = drive(Target::Balancer(addr), opts).await;
    let _ = lb_stop_tx.send(true);
    let _ = lb.await;
    let _ = stop.send(true);
    Ok((round_robin, prefixlb))
}

/// `prefixlb demo`: runs the comparison and renders the report.
pub async fn run() -> std::io::Result<String> {
    let opts = DemoOptions::default();
    let started = Instant::now();
    let (rr, lb) = compare(&opts).await?;
    Ok(report(&opts, &rr, &lb, started.elapsed()))
}

fn balancer_config(engines: &[SocketAddr]) -> Config {
    let mut text = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_grace = \"1s\"\n[[pools]]\nname = \"demo\"\nmodels = [\"demo\"]\n",
    );
    for (i, e) in engines.iter().enumerate() {
        let _ = writeln!(
            text,
            "[[pools.nodes]]\nid = \"engine-{i}\"\nurl = \"http://{e}\""
        );
    }
    Config::parse(&text, "demo").expect("the demo config is valid")
}

async fn start_engines(
    opts: &DemoOptions,
) -> std::io::Result<(Vec<SocketAddr>, watch::Sender<bool>)> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut addrs = Vec::new();
    for i in 0..opts.engines {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        addrs.push(listener.local_addr()?);
        let engine = MockEngine::new(MockConfig {
            id: format!("engine-{i}"),
            model: "demo".into(),
            costs: opts.costs,
            cache_tokens: opts.cache_tokens,
            max_num_seqs: 8,
            max_model_len: 0,
        });
        let mut stop = stop_rx.clone();
        tokio::spawn(engine.serve(listener, async move {
            let _ = stop.wait_for(|s| *s).await;
        }));
    }
    Ok((addrs, stop_tx))
}

/// The shared system prompt and each conversation's opening question.
fn system_prompt(chars: usize) -> String {
    let base = "You are a support assistant for a GPU cloud. Answer precisely, cite the runbook \
                section you rely on, and never invent commands. ";
    base.repeat(chars / base.len() + 1)[..chars].to_string()
}

/// The document conversation `c` opens with.
fn document(c: usize, chars: usize) -> String {
    let line = format!(
        "[incident {c}] node-{} kernel: NVRM: Xid 79, GPU has fallen off the bus; retrying. ",
        c * 31 % 97
    );
    line.repeat(chars / line.len() + 1)[..chars].to_string()
}

fn question(conversation: usize, turn: usize) -> String {
    format!(
        "Conversation {conversation}, question {turn}: our node pool {} reports rising latency on \
         instance type g{} after a driver update; what should we check next, and in which order?",
        conversation * 7 + turn,
        conversation % 5
    )
}

/// One conversation in progress.
struct Conversation {
    id: usize,
    turn: usize,
    messages: Vec<Value>,
}

/// Drives the workload like a crowd of users: every conversation is open at once and
/// goes back into the line after each answer (its "think time"), so turn
/// k + 1 is sent after turn k's answer, with the answer in the history, while the
/// other conversations interleave. `concurrency` requests are in flight at a time.
async fn drive(target: Target, opts: &DemoOptions) -> RunStats {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let system = system_prompt(opts.system_chars);
    let line: VecDeque<Conversation> = (0..opts.conversations)
        .map(|id| Conversation {
            id,
            turn: 0,
            messages: vec![json!({"role": "system", "content": system})],
        })
        .collect();
    let shared = Arc::new((target, Mutex::new(RunStats::default()), Mutex::new(line)));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..opts.concurrency {
        let (shared, client, opts) = (shared.clone(), client.clone(), opts.clone());
        workers.spawn(async move {
            let (target, stats, line) = &*shared;
            loop {
                let next = line.lock().pop_front();
                let Some(mut conv) = next else { break };
                let mut content = question(conv.id, conv.turn);
                if conv.turn == 0 {
                    content = format!("{}\n\n{content}", document(conv.id, opts.document_chars));
                }
                conv.messages
                    .push(json!({"role": "user", "content": content}));
                let body = json!({
                    "model": "demo", "messages": conv.messages, "stream": true,
                    "max_tokens": opts.answer_tokens, "stream_options": {"include_usage": true},
                });
                let outcome = stream_once(&client, target.next(), &body).await;
                let mut s = stats.lock();
                s.requests += 1;
                let Some(reply) = outcome else {
                    s.errors += 1;
                    continue; // the conversation ends with the error
                };
                s.prompt_tokens += reply.prompt_tokens;
                s.cached_tokens += reply.cached_tokens;
                s.ttft.push(reply.ttft);
                drop(s);
                conv.messages
                    .push(json!({"role": "assistant", "content": reply.text}));
                conv.turn += 1;
                if conv.turn < opts.turns {
                    // Users think for different times: rejoin somewhere in the back half.
                    let mut line = line.lock();
                    let back = line.len() / 2 + 1;
                    let at = line.len() - (conv.id * 7919 + conv.turn * 104_729) % back;
                    line.insert(at, conv);
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let mut s = std::mem::take(&mut *shared.1.lock());
    s.elapsed = started.elapsed();
    s.ttft.sort();
    s
}

struct Reply {
    text: String,
    ttft: Duration,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// Sends one streaming chat request and reads its SSE stream to the end.
async fn stream_once(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    body: &Value,
) -> Option<Reply> {
    let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .ok()?;
    let sent = Instant::now();
    let resp = client.request(req).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut reply = Reply {
        text: String::new(),
        ttft: Duration::ZERO,
        prompt_tokens: 0,
        cached_tokens: 0,
    };
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.ok()?.into_data() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(payload) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if payload == "[DONE]" {
                return Some(reply);
            }
            let Ok(v) = serde_json::from_str::<Value>(payload) else {
                continue;
            };
            if let Some(content) = v["choices"][0]["delta"]["content"]
                .as_str()
                .filter(|c| !c.is_empty())
            {
                if reply.text.is_empty() {
                    reply.ttft = sent.elapsed();
                }
                reply.text.push_str(content);
            }
            if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
                reply.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                reply.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
        }
    }
    Some(reply)
}

/// The demo's printed report.
pub fn report(opts: &DemoOptions, rr: &RunStats, lb: &RunStats, took: Duration) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "prefixlb demo: {} emulated engines (KV cache {} tokens each, prefill {} µs/token, decode {} ms/token)",
        opts.engines,
        opts.cache_tokens,
        opts.costs.prefill_per_token.as_micros(),
        opts.costs.decode_per_token.as_millis()
    );
    let _ = writeln!(
        out,
        "workload: {} conversations × {} turns, each opening with its own ~{}-token document behind a shared \
         ~{}-token system prompt; {} requests in flight, streaming\n",
        opts.conversations,
        opts.turns,
        opts.document_chars / 4,
        opts.system_chars / 4,
        opts.concurrency
    );
    let _ = writeln!(
        out,
        "{:<12} {:>8} {:>6} {:>10} {:>9} {:>9} {:>7}",
        "policy", "requests", "errors", "cache hit", "TTFT p50", "TTFT p99", "req/s"
    );
    for (name, s) in [("round-robin", rr), ("prefixlb", lb)] {
        let _ = writeln!(
            out,
            "{:<12} {:>8} {:>6} {:>9.1}% {:>6} ms {:>6} ms {:>7.1}",
            name,
            s.requests,
            s.errors,
            s.hit_rate() * 100.0,
            s.ttft_quantile(0.5).as_millis(),
            s.ttft_quantile(0.99).as_millis(),
            s.throughput()
        );
    }
    let p50 = |s: &RunStats| s.ttft_quantile(0.5).as_secs_f64().max(1e-6);
    let _ = writeln!(
        out,
        "\nverdict: prefixlb served {:.1}% of prompt tokens from the engines' KV caches vs {:.1}% for round-robin; \
         TTFT p50 {:.1}× lower, throughput {:.2}×. ({:.1} s)",
        lb.hit_rate() * 100.0,
        rr.hit_rate() * 100.0,
        p50(rr) / p50(lb),
        lb.throughput() / rr.throughput().max(1e-9),
        took.as_secs_f64()
    );
    out
}
