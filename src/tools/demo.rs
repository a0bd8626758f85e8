//! `prefixlb demo`: starts emulated engines and the balancer in this process, drives
//! the same multi-turn chat workload over real HTTP twice (round-robin across the
//! engines, then through prefixlb with its defaults) and prints the comparison.
//! Each run gets fresh engines, so both start with cold caches.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use crate::tools::bench::{BenchOptions, BenchReport, Script, ScriptTurn};
use crate::tools::engine_model::Costs;
use crate::tools::mock_engine::{MockConfig, MockEngine};

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
                ..Costs::default()
            },
        }
    }
}

/// Runs both policies and returns (round-robin, prefixlb).
pub async fn compare(opts: &DemoOptions) -> std::io::Result<(BenchReport, BenchReport)> {
    let (engines, stop) = start_engines(opts).await?;
    let urls = engines.iter().map(|e| format!("http://{e}")).collect();
    let round_robin = drive(urls, opts).await;
    let _ = stop.send(true);

    let (engines, stop) = start_engines(opts).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let admin = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let config = balancer_config(&engines);
    let (lb_stop_tx, mut lb_stop) = watch::channel(false);
    let lb = tokio::spawn(crate::server::serve::run_on(
        listener,
        admin,
        config,
        None,
        async move {
            let _ = lb_stop.wait_for(|s| *s).await;
        },
    ));
    let prefixlb = drive(vec![format!("http://{addr}")], opts).await;
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

/// The demo's balancer: served from the runtime its engines and clients share (`lanes =
/// 0`; lanes would bind more listeners beside the one `compare` hands it).
fn balancer_config(engines: &[SocketAddr]) -> Config {
    let mut text = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_grace = \"1s\"\nlanes = 0\n[[pools]]\nname = \"demo\"\nmodels = [\"demo\"]\n",
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
            ..MockConfig::default()
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

/// Replays the demo's conversations against `targets` (several: round-robin) with
/// the bench driver: every conversation open at once, `concurrency` requests in flight.
async fn drive(targets: Vec<String>, opts: &DemoOptions) -> BenchReport {
    let system: Arc<str> = system_prompt(opts.system_chars).into();
    let scripts = (0..opts.conversations)
        .map(|c| Script {
            turns: (0..opts.turns)
                .map(|turn| {
                    let mut question = question(c, turn);
                    let mut messages = Vec::new();
                    if turn == 0 {
                        messages.push(("system", system.clone()));
                        question = format!("{}\n\n{question}", document(c, opts.document_chars));
                    }
                    messages.push(("user", question.into()));
                    ScriptTurn {
                        messages,
                        prompt: None,
                        max_tokens: opts.answer_tokens,
                    }
                })
                .collect(),
            messages_api: false,
        })
        .collect();
    let bench = BenchOptions {
        targets,
        model: "demo".into(),
        concurrency: opts.concurrency,
        rate: None,
        requests: None,
        stream: true,
        progress: false,
        session_header: None,
    };
    crate::tools::bench::run(scripts, &bench).await
}

/// The demo's printed report.
pub fn report(opts: &DemoOptions, rr: &BenchReport, lb: &BenchReport, took: Duration) -> String {
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
            s.hit_rate * 100.0,
            s.ttft_quantile(0.5).as_millis(),
            s.ttft_quantile(0.99).as_millis(),
            s.throughput_rps
        );
    }
    let q = |s: &BenchReport, p: f64| s.ttft_quantile(p).as_secs_f64().max(1e-6);
    let tail = p99_verdict(q(lb, 0.99) / q(rr, 0.99));
    let _ = writeln!(
        out,
        "\nverdict: prefixlb served {:.1}% of prompt tokens from the engines' KV caches vs {:.1}% for round-robin; \
         TTFT p50 {:.1}× lower, {tail}; throughput {:.2}×. ({:.1} s)",
        lb.hit_rate * 100.0,
        rr.hit_rate * 100.0,
        q(rr, 0.5) / q(lb, 0.5),
        lb.throughput_rps / rr.throughput_rps.max(1e-9),
        took.as_secs_f64()
    );
    out
}

/// The verdict on the TTFT p99, from prefixlb's p99 over round robin's: within 5 %
/// either way is a tie, not "1.0× lower".
fn p99_verdict(ratio: f64) -> String {
    if ratio > 1.05 {
        format!(
            "TTFT p99 {ratio:.1}× higher (requests wait for their conversation's engine \
             at its cap, and cold prefills can queue behind one another)"
        )
    } else if ratio < 1.0 / 1.05 {
        format!("TTFT p99 {:.1}× lower", 1.0 / ratio)
    } else {
        "TTFT p99 about the same".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::p99_verdict;

    #[test]
    fn a_p99_within_five_percent_is_a_tie() {
        assert_eq!(p99_verdict(1.03), "TTFT p99 about the same");
        assert_eq!(p99_verdict(0.97), "TTFT p99 about the same");
        assert_eq!(p99_verdict(0.5), "TTFT p99 2.0× lower");
        assert!(p99_verdict(1.5).starts_with("TTFT p99 1.5× higher"));
    }
}
