//! `prefixlb bench`: an HTTP load generator for OpenAI-compatible endpoints (the
//! balancer, or engines directly). Conversations are replayed faithfully: turn k + 1 is
//! sent after turn k's answer, with the real answer in its history. Closed loop
//! (`concurrency` requests in flight) or open loop (`rate` requests per second).
//! Measures TTFT (first content event), end-to-end latency, output tokens/s, errors,
//! and the prefix-cache hit rate the engines report in `usage`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{json, Value};

use crate::proxy::sse::SseScanner;
use crate::tools::workload::{TurnApi, Workload};

/// One conversation to replay: per turn, the messages it adds and its output budget.
#[derive(Debug, Clone)]
pub struct Script {
    pub turns: Vec<ScriptTurn>,
    /// Sent to Anthropic's `/v1/messages` instead of the chat API.
    pub messages_api: bool,
}

#[derive(Debug, Clone)]
pub struct ScriptTurn {
    /// Messages added by this turn (the previous answer is added by the replay).
    pub messages: Vec<(&'static str, Arc<str>)>,
    /// A trace request's prompt, sent instead of messages.
    pub prompt: Option<TracePrompt>,
    pub max_tokens: usize,
}

impl Script {
    /// Scripts from a simulator workload (its generated answers are replaced by the
    /// engines' real ones during the replay). A trace request becomes a one-turn
    /// conversation sending its blocks as an untemplated `/v1/completions` prompt
    /// ([`crate::tools::workload::trace_text`]), as production prompt strings come, or
    /// as the token ids its workload asks for (to `/v1/completions` or `/generate`).
    pub fn from_workload(w: &Workload) -> Vec<Script> {
        w.conversations
            .iter()
            .map(|c| {
                if let Some(p) = c.turns.first().and_then(|t| t.trace.as_ref()) {
                    let ids = || crate::tools::workload::token_ids(p).into();
                    let prompt = match c.turns[0].api {
                        TurnApi::TokenIds => TracePrompt::Ids(ids()),
                        TurnApi::Generate => TracePrompt::Generate(ids()),
                        _ => TracePrompt::Text(crate::tools::workload::trace_text(p).into()),
                    };
                    return Script {
                        turns: vec![ScriptTurn {
                            messages: Vec::new(),
                            prompt: Some(prompt),
                            max_tokens: c.turns[0].output_tokens,
                        }],
                        messages_api: false,
                    };
                }
                let mut seen = 0;
                let turns = c
                    .turns
                    .iter()
                    .map(|t| {
                        // Skip the generated assistant answer that precedes this turn.
                        let skip = if seen == 0 { 0 } else { seen + 1 };
                        seen = t.messages.len();
                        ScriptTurn {
                            messages: t
                                .messages
                                .iter()
                                .skip(skip)
                                .map(|m| (m.role, m.content.clone()))
                                .collect(),
                            prompt: None,
                            max_tokens: t.output_tokens,
                        }
                    })
                    .collect();
                let messages_api = c.turns.first().is_some_and(|t| t.api == TurnApi::Messages);
                Script {
                    turns,
                    messages_api,
                }
            })
            .collect()
    }

    fn requests(scripts: &[Script]) -> usize {
        scripts.iter().map(|s| s.turns.len()).sum()
    }
}

/// A trace request's prompt, in the form its workload sends it.
#[derive(Debug, Clone)]
pub enum TracePrompt {
    /// An untemplated `/v1/completions` prompt string.
    Text(Arc<str>),
    /// A `/v1/completions` prompt of token ids (`continuations-tokens`).
    Ids(Arc<[u32]>),
    /// SGLang's `/generate` with `input_ids` (`continuations-generate`).
    Generate(Arc<[u32]>),
}

/// How to drive the load.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Base URLs; several are used round-robin (that is how the demo measures a
    /// round-robin balancer).
    pub targets: Vec<String>,
    pub model: String,
    /// Requests in flight (closed loop).
    pub concurrency: usize,
    /// Requests per second (open loop) instead of a closed loop.
    pub rate: Option<f64>,
    /// Stop after this many requests.
    pub requests: Option<usize>,
    pub stream: bool,
    pub progress: bool,
    /// A header carrying each conversation's id (`conv-N`), as the client of a
    /// session-keyed router sends one (vLLM's router's `consistent_hash` reads
    /// `x-session-id`; so does prefixlb's `routing.key_header`). None: no header.
    pub session_header: Option<http::HeaderName>,
}

/// What a run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BenchReport {
    pub requests: usize,
    pub errors: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// cached / prompt tokens, as the engines reported them.
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    pub output_tokens_per_s: f64,
    pub throughput_rps: f64,
    pub duration_s: f64,
    #[serde(skip)]
    pub ttft: Vec<Duration>,
    #[serde(skip)]
    latency: Vec<Duration>,
    #[serde(skip)]
    output_tokens: u64,
}

impl BenchReport {
    fn finish(&mut self, elapsed: Duration) {
        self.ttft.sort();
        self.latency.sort();
        let ms = |v: &[Duration], q: f64| quantile(v, q).as_secs_f64() * 1000.0;
        self.hit_rate = self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64;
        self.ttft_p50_ms = ms(&self.ttft, 0.5);
        self.ttft_p90_ms = ms(&self.ttft, 0.9);
        self.ttft_p99_ms = ms(&self.ttft, 0.99);
        self.latency_p50_ms = ms(&self.latency, 0.5);
        self.latency_p99_ms = ms(&self.latency, 0.99);
        self.duration_s = elapsed.as_secs_f64();
        self.output_tokens_per_s = self.output_tokens as f64 / self.duration_s.max(1e-9);
        self.throughput_rps = self.requests as f64 / self.duration_s.max(1e-9);
    }

    /// The q-quantile of TTFT.
    pub fn ttft_quantile(&self, q: f64) -> Duration {
        quantile(&self.ttft, q)
    }

    /// The report as a small table.
    pub fn table(&self) -> String {
        format!(
            "requests {}  errors {}  cache hit {:.1}%  TTFT p50 {:.1} ms p90 {:.1} ms p99 {:.1} ms  latency p50 {:.1} ms p99 {:.1} ms  {:.1} req/s  {:.0} output tok/s  ({:.1} s)\n",
            self.requests,
            self.errors,
            self.hit_rate * 100.0,
            self.ttft_p50_ms,
            self.ttft_p90_ms,
            self.ttft_p99_ms,
            self.latency_p50_ms,
            self.latency_p99_ms,
            self.throughput_rps,
            self.output_tokens_per_s,
            self.duration_s
        )
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// A conversation in progress.
struct Live {
    script: usize,
    turn: usize,
    history: Vec<Value>,
}

struct Shared {
    scripts: Vec<Script>,
    line: Mutex<VecDeque<Live>>,
    report: Mutex<BenchReport>,
    sent: std::sync::atomic::AtomicUsize,
    /// Round-robin position over the targets.
    next_target: std::sync::atomic::AtomicUsize,
    limit: usize,
}

/// Replays the scripts against the targets.
pub async fn run(scripts: Vec<Script>, opts: &BenchOptions) -> BenchReport {
    let total = Script::requests(&scripts);
    let limit = opts.requests.unwrap_or(total).min(total);
    let line = (0..scripts.len())
        .map(|script| Live {
            script,
            turn: 0,
            history: Vec::new(),
        })
        .collect();
    let shared = Arc::new(Shared {
        scripts,
        line: Mutex::new(line),
        report: Mutex::new(BenchReport::default()),
        sent: Default::default(),
        next_target: Default::default(),
        limit,
    });
    let bar = if opts.progress {
        let bar = indicatif::ProgressBar::new(limit as u64);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} requests  {per_sec}  eta {eta}",
        ) {
            bar.set_style(style);
        }
        Some(bar)
    } else {
        None
    };
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        // Under the idle timeout of servers that close keep-alive connections
        // early (llama.cpp's and uvicorn's are 5 s), so a pooled connection is
        // never stale.
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(3))
        .build(HttpConnector::new());
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    // Closed loop: `concurrency` workers. Open loop: a ticket every 1/rate s, each
    // running one request, so slow answers do not slow the arrivals.
    match opts.rate {
        None => {
            for _ in 0..opts.concurrency.max(1) {
                let (shared, client, opts, bar) =
                    (shared.clone(), client.clone(), opts.clone(), bar.clone());
                workers.spawn(
                    async move { while step(&shared, &client, &opts, bar.as_ref()).await {} },
                );
            }
        }
        Some(rate) => {
            let gap = Duration::from_secs_f64(1.0 / rate.max(1e-3));
            let mut next = tokio::time::Instant::now();
            for _ in 0..limit {
                tokio::time::sleep_until(next).await;
                next += gap;
                let (shared, client, opts, bar) =
                    (shared.clone(), client.clone(), opts.clone(), bar.clone());
                workers.spawn(async move {
                    // A conversation may be busy with its previous turn: wait for one.
                    while !step(&shared, &client, &opts, bar.as_ref()).await {
                        if shared.sent.load(std::sync::atomic::Ordering::Relaxed) >= shared.limit {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                });
            }
        }
    }
    while workers.join_next().await.is_some() {}
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut report = std::mem::take(&mut *shared.report.lock());
    report.finish(started.elapsed());
    report
}

/// Sends the next turn of the conversation at the front of the line. Returns false
/// when nothing could be sent (all done, or every open conversation is busy).
async fn step(
    shared: &Shared,
    client: &Client<HttpConnector, Full<Bytes>>,
    opts: &BenchOptions,
    bar: Option<&indicatif::ProgressBar>,
) -> bool {
    let next = shared.line.lock().pop_front();
    let Some(mut live) = next else { return false };
    if shared
        .sent
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        >= shared.limit
    {
        return false;
    }
    let turn = &shared.scripts[live.script].turns[live.turn];
    for (role, content) in &turn.messages {
        live.history
            .push(message_json(role, content, live.history.len()));
    }
    let (api, mut body) = match &turn.prompt {
        Some(TracePrompt::Text(prompt)) => (
            Api::Completions,
            json!({"model": opts.model, "prompt": &**prompt, "max_tokens": turn.max_tokens, "stream": opts.stream}),
        ),
        Some(TracePrompt::Ids(ids)) => (
            Api::Completions,
            json!({"model": opts.model, "prompt": &**ids, "max_tokens": turn.max_tokens, "stream": opts.stream}),
        ),
        Some(TracePrompt::Generate(ids)) => (
            Api::Generate,
            json!({"model": opts.model, "input_ids": &**ids, "sampling_params": {"max_new_tokens": turn.max_tokens}, "stream": opts.stream}),
        ),
        None if shared.scripts[live.script].messages_api => (
            Api::Messages,
            anthropic_body(&opts.model, &live.history, turn.max_tokens, opts.stream),
        ),
        None => (
            Api::Chat,
            json!({"model": opts.model, "messages": live.history, "max_tokens": turn.max_tokens, "stream": opts.stream}),
        ),
    };
    if opts.stream && matches!(api, Api::Chat | Api::Completions) {
        body["stream_options"] = json!({"include_usage": true});
    }
    let target = &opts.targets[shared
        .next_target
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        % opts.targets.len()];
    // The conversation's id, made only for a run that sends it.
    let id = opts
        .session_header
        .as_ref()
        .map(|_| format!("conv-{}", live.script));
    let session = opts.session_header.as_ref().zip(id.as_deref());
    let outcome = match exchange(client, target, api, &body, opts.stream, session).await {
        Ok(reply) => Some(reply),
        Err(why) => {
            tracing::warn!(target = %target, error = %why, "request failed");
            None
        }
    };
    {
        let mut r = shared.report.lock();
        r.requests += 1;
        match &outcome {
            Some(reply) => {
                r.prompt_tokens += reply.prompt_tokens;
                r.cached_tokens += reply.cached_tokens;
                r.output_tokens += reply.completion_tokens;
                r.ttft.push(reply.ttft);
                r.latency.push(reply.latency);
            }
            None => r.errors += 1,
        }
    }
    if let Some(bar) = bar {
        bar.inc(1);
    }
    let Some(reply) = outcome else { return true }; // the conversation ends with the error
    live.history
        .push(json!({"role": "assistant", "content": reply.text}));
    live.turn += 1;
    if live.turn < shared.scripts[live.script].turns.len() {
        // Users think for different times: rejoin somewhere in the back half of the
        // line (deterministically), so turns interleave as they do in real traffic.
        let mut line = shared.line.lock();
        let back = line.len() / 2 + 1;
        let at = line.len() - (live.script * 7919 + live.turn * 104_729) % back;
        line.insert(at, live);
    }
    true
}

/// A chat message as the OpenAI API wants it: a tool result names the call it answers
/// (strict validators, SGLang's router among them, refuse one without `tool_call_id`).
pub fn message_json(role: &str, content: &str, position: usize) -> Value {
    if role == "tool" {
        return json!({"role": role, "content": content, "tool_call_id": format!("call_{position}")});
    }
    json!({"role": role, "content": content})
}

/// An Anthropic Messages body from OpenAI-style messages, as an agent client sends
/// it: system messages joined into the top-level `system`, each message's content as
/// one text block (a tool's output as a `tool_result` block of a user message), and a
/// cache marker on the newest block (clients move it forward every turn).
pub fn anthropic_body(model: &str, messages: &[Value], max_tokens: usize, stream: bool) -> Value {
    let text = |m: &Value| m["content"].as_str().unwrap_or("").to_string();
    let system: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "system")
        .map(text)
        .collect();
    let mut turns: Vec<Value> = messages
        .iter()
        .filter(|m| m["role"] != "system")
        .map(|m| match m["role"].as_str() {
            Some("tool") => json!({"role": "user", "content": [{
                "type": "tool_result",
                "tool_use_id": m["tool_call_id"].as_str().unwrap_or("call"),
                "content": text(m),
            }]}),
            role => json!({"role": role.unwrap_or("user"), "content": [{"type": "text", "text": text(m)}]}),
        })
        .collect();
    if let Some(last) = turns.last_mut() {
        last["content"][0]["cache_control"] = json!({"type": "ephemeral"});
    }
    let mut body =
        json!({"model": model, "max_tokens": max_tokens, "stream": stream, "messages": turns});
    if !system.is_empty() {
        body["system"] = json!([{"type": "text", "text": system.join("\n"), "cache_control": {"type": "ephemeral"}}]);
    }
    body
}

/// One answer.
pub struct Reply {
    pub text: String,
    pub ttft: Duration,
    pub latency: Duration,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

impl Reply {
    /// Takes the output count of an Anthropic `message_delta`'s usage (and its
    /// input counts, where the engine repeats them).
    fn usage_delta(&mut self, u: &Value) {
        if u.get("input_tokens").is_some() {
            self.usage(u);
        } else if let Some(out) = u["output_tokens"].as_u64() {
            self.completion_tokens = out;
        }
    }

    /// Takes the token counts of an OpenAI or Anthropic `usage` object.
    fn usage(&mut self, u: &Value) {
        self.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
        self.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        self.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
        if u.get("input_tokens").is_some() {
            // Anthropic's: `input_tokens` leaves out the cache's reads and writes.
            let n = |k: &str| u[k].as_u64().unwrap_or(0);
            self.cached_tokens = n("cache_read_input_tokens");
            self.prompt_tokens =
                n("input_tokens") + self.cached_tokens + n("cache_creation_input_tokens");
        }
        if let Some(out) = u["output_tokens"].as_u64() {
            self.completion_tokens = out;
        }
    }

    /// Takes SGLang's `/generate` answer or event: its text so far and its counts.
    fn generated(&mut self, v: &Value) {
        let m = &v["meta_info"];
        let n = |k: &str| m[k].as_u64().unwrap_or(0);
        self.prompt_tokens = n("prompt_tokens");
        self.cached_tokens = n("cached_tokens");
        self.completion_tokens = n("completion_tokens");
        if let Some(text) = v["text"].as_str() {
            text.clone_into(&mut self.text);
        }
    }
}

/// Which API a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    /// Anthropic's Messages API.
    Messages,
    /// SGLang's native `/generate`.
    Generate,
}

/// Sends one chat or completions request to `base`, with the session header and id
/// if given, and reads the answer (an SSE stream or JSON), or says why there is none.
pub async fn exchange(
    client: &Client<HttpConnector, Full<Bytes>>,
    base: &str,
    api: Api,
    body: &Value,
    stream: bool,
    session: Option<(&http::HeaderName, &str)>,
) -> Result<Reply, String> {
    let path = match api {
        Api::Chat => "/v1/chat/completions",
        Api::Completions => "/v1/completions",
        Api::Messages => "/v1/messages",
        Api::Generate => "/generate",
    };
    let mut req = http::Request::post(format!("{}{path}", base.trim_end_matches('/')))
        .header("content-type", "application/json");
    if let Some((name, id)) = session {
        req = req.header(name, id);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| format!("bad request: {e}"))?;
    let sent = Instant::now();
    let resp = client
        .request(req)
        .await
        .map_err(|e| format!("transport: {e:?}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(format!("HTTP {status}: {}", crate::clip::clip(&text)));
    }
    let mut reply = Reply {
        text: String::new(),
        ttft: Duration::ZERO,
        latency: Duration::ZERO,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
    };
    let body = resp.into_body();
    if !stream {
        let bytes = body
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))?;
        reply.latency = sent.elapsed();
        reply.ttft = reply.latency;
        if api == Api::Generate {
            reply.generated(&v);
            return Ok(reply);
        }
        let choice = &v["choices"][0];
        reply.text = choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str())
            .or(v["content"][0]["text"].as_str())
            .unwrap_or("")
            .to_string();
        reply.usage(&v["usage"]);
        return Ok(reply);
    }
    read_stream(body, sent, reply).await
}

/// Reads an SSE answer to its `[DONE]` (Anthropic's: its `message_stop`); an error on
/// an error event or a stream that ends without its end.
async fn read_stream(mut body: Incoming, sent: Instant, mut reply: Reply) -> Result<Reply, String> {
    let mut events = SseScanner::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("stream: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        for block in events.push(&data) {
            let Some(event) = block.event else {
                continue;
            };
            if event.data == "[DONE]" {
                reply.latency = sent.elapsed();
                return Ok(reply);
            }
            let Ok(v) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            if let Some(e) = v.get("error") {
                return Err(format!(
                    "error event: {}",
                    crate::clip::clip(&e.to_string())
                ));
            }
            // Anthropic's stream: its usage arrives in `message_start` and
            // `message_delta`, text in `content_block_delta`, and `message_stop` ends it.
            match v["type"].as_str() {
                Some("message_stop") => {
                    reply.latency = sent.elapsed();
                    return Ok(reply);
                }
                Some("message_start") => reply.usage(&v["message"]["usage"]),
                Some("message_delta") => reply.usage_delta(&v["usage"]),
                Some("content_block_delta") => {
                    if let Some(text) = v["delta"]["text"].as_str().filter(|t| !t.is_empty()) {
                        if reply.text.is_empty() {
                            reply.ttft = sent.elapsed();
                        }
                        reply.text.push_str(text);
                    }
                }
                _ => {}
            }
            if v["type"].is_string() {
                continue;
            }
            // SGLang's `/generate`: each event carries the text so far.
            if v.get("meta_info").is_some() {
                if reply.text.is_empty() && v["text"].as_str().is_some_and(|t| !t.is_empty()) {
                    reply.ttft = sent.elapsed();
                }
                reply.generated(&v);
                continue;
            }
            let choice = &v["choices"][0];
            if let Some(content) = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str())
                .filter(|c| !c.is_empty())
            {
                if reply.text.is_empty() {
                    reply.ttft = sent.elapsed();
                }
                reply.text.push_str(content);
            }
            if v.get("usage").is_some_and(|u| !u.is_null()) {
                reply.usage(&v["usage"]);
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}
