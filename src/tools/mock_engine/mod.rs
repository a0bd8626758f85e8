//! `prefixlb mock-engine`: an OpenAI-compatible engine emulator for tests, demos and
//! benchmarks. It streams SSE the way vLLM does (a role-only first chunk, one chunk per
//! token, an optional usage chunk, `data: [DONE]`), sleeps for the times the
//! [`engine_model`](crate::tools::engine_model) computes, exports vLLM's metric names, and
//! takes runtime faults on `POST /mock/fault`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::proxy::request_body::RequestBody;
use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

use crate::proxy::body::BoxBody;
use crate::tools::engine_model::{Costs, EngineModel, Prompt, BLOCK_TOKENS};
use wire::{
    completion, error, json_response, parse_job, sse_chunk, text, token_text, usage, usage_chunk,
    ChannelBody, Job, Kind,
};

mod anthropic;
mod audio;
mod kv_transfer;
mod pooling;
mod responses;
mod sglang;
mod wire;

/// How long a decode engine waits for its request's bootstrap room to be kept by its
/// prefill engine (sent at the same time) before it fails the request.
const ROOM_WAIT: Duration = Duration::from_secs(5);

/// `mock-engine` settings (the subcommand's flags).
#[derive(Debug, Clone)]
pub struct MockConfig {
    pub id: String,
    pub model: String,
    pub costs: Costs,
    pub cache_tokens: usize,
    pub max_num_seqs: usize,
    /// Context window (prompt + output tokens); longer requests get vLLM's 400.
    /// 0 = unlimited (the default).
    pub max_model_len: usize,
    /// LoRA adapters served beside `model`; with any, other models get a 404.
    pub adapters: Vec<String>,
    /// Answer `/v1/embeddings` with llama.cpp's 501, as a server started without
    /// `--embeddings` does.
    pub no_embeddings: bool,
    /// Data-parallel ranks behind the one URL, each with its own KV cache and prefill
    /// lane (vLLM's `--data-parallel-size`). Sequence slots and the decode slowdown
    /// stay the engine's as a whole.
    pub data_parallel_size: usize,
    /// SGLang's `--disaggregation-mode`: what it does with a request's bootstrap room.
    pub disaggregation_mode: Option<SglangRole>,
}

/// An engine's part in SGLang's disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SglangRole {
    /// Prefills, and keeps the KV cache under the request's `bootstrap_room`.
    Prefill,
    /// Pulls the KV cache from the room at the request's bootstrap address.
    Decode,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            id: "mock".into(),
            model: "mock".into(),
            costs: Costs::default(),
            cache_tokens: 200_000,
            max_num_seqs: 64,
            max_model_len: 0,
            adapters: Vec::new(),
            no_embeddings: false,
            data_parallel_size: 1,
            disaggregation_mode: None,
        }
    }
}

/// A fault the engine is told to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    /// Serve normally.
    #[default]
    Ok,
    /// Answer 500 (and fail `/health`).
    Error,
    /// Accept, send the role chunk, never a token.
    Stall,
    /// Add `ttft_ms` before the first token.
    Slow,
    /// Prefill `factor` times slower (a degraded GPU, a noisy neighbour).
    SlowPrefill,
    /// Streams: send two tokens, then drop the connection mid-body (no terminating
    /// chunk): a crashed engine or a reset connection.
    Reset,
    /// End the stream with no content and no `finish_reason` (a broken engine).
    Empty,
    /// Answer a stream with a 400 inside it: an SSE error event with code 400 after the
    /// role chunk (how SGLang reports some bad requests).
    ClientError,
    /// Serve normally, but answer `/metrics` only after `ttft_ms` (a stats page slow
    /// to build).
    SlowMetrics,
}

#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub mode: FaultMode,
    #[serde(default)]
    pub ttft_ms: u64,
    /// For `slow_prefill`.
    #[serde(default)]
    pub factor: u32,
}

/// A running mock engine's shared state.
pub struct MockEngine {
    config: MockConfig,
    /// One cache model per data-parallel rank.
    ranks: Vec<Mutex<EngineModel>>,
    /// The rank that takes the next request that names none.
    next_rank: AtomicU64,
    /// The model's clock starts here.
    epoch: Instant,
    seqs: Semaphore,
    fault: Mutex<Fault>,
    running: AtomicU64,
    /// Each rank's sequences waiting and running (a server of several ranks shows
    /// them by rank in its metrics, as vLLM's `engine` label does).
    rank_waiting: Vec<AtomicU64>,
    rank_running: Vec<AtomicU64>,
    /// Each rank's KV cache held by its running sequences, in tokens (prompt and
    /// answer, as vLLM's `kv_cache_usage_perc` counts blocks in use, cached blocks no
    /// sequence holds left out).
    rank_kv_tokens: Vec<AtomicU64>,
    peak_running: AtomicU64,
    requests: AtomicU64,
    /// HTTP requests received on any path but /metrics, /health, /v1/models and /mock/fault.
    http_requests: AtomicU64,
    /// `GET /health` requests received.
    health_checks: AtomicU64,
    /// Requests to SGLang's native `/generate`.
    generate_requests: AtomicU64,
    /// Uploads to the audio APIs (`/v1/audio/transcriptions`, `/translations`).
    audio_requests: AtomicU64,
    /// Requests to the pooling and tokenizer endpoints (`/v1/rerank`, `/tokenize`, …).
    pooling_requests: AtomicU64,
    /// Generation requests whose prompt came as token ids.
    token_id_prompts: AtomicU64,
    cancelled: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    /// The Responses API's stored responses.
    store: responses::Store,
    /// Disaggregated prefills kept for decode engines, and pulls from prefill engines.
    transfers: Arc<kv_transfer::Ledger>,
}

/// Counts a running sequence, and the KV cache it holds, on its rank, for as long as
/// it lives.
struct Running {
    engine: Arc<MockEngine>,
    rank: usize,
    kv_tokens: u64,
}

impl Running {
    fn start(engine: &Arc<MockEngine>, job: &Job) -> Running {
        let now = engine.running.fetch_add(1, Ordering::AcqRel) + 1;
        engine.peak_running.fetch_max(now, Ordering::AcqRel);
        let kv_tokens = (job.prompt.tokens + job.max_tokens) as u64;
        engine.rank_running[job.rank].fetch_add(1, Ordering::AcqRel);
        engine.rank_kv_tokens[job.rank].fetch_add(kv_tokens, Ordering::AcqRel);
        Running {
            engine: engine.clone(),
            rank: job.rank,
            kv_tokens,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let e = &self.engine;
        e.running.fetch_sub(1, Ordering::AcqRel);
        e.rank_running[self.rank].fetch_sub(1, Ordering::AcqRel);
        e.rank_kv_tokens[self.rank].fetch_sub(self.kv_tokens, Ordering::AcqRel);
    }
}

impl MockEngine {
    pub fn new(config: MockConfig) -> Arc<MockEngine> {
        let ranks = config.data_parallel_size.max(1);
        Arc::new(MockEngine {
            ranks: (0..ranks)
                .map(|_| {
                    Mutex::new(EngineModel::new(
                        config.cache_tokens,
                        BLOCK_TOKENS,
                        config.costs,
                    ))
                })
                .collect(),
            next_rank: AtomicU64::new(0),
            epoch: Instant::now(),
            seqs: Semaphore::new(config.max_num_seqs.max(1)),
            config,
            fault: Mutex::new(Fault::default()),
            running: AtomicU64::new(0),
            rank_waiting: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            rank_running: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            rank_kv_tokens: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
            peak_running: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            http_requests: AtomicU64::new(0),
            health_checks: AtomicU64::new(0),
            generate_requests: AtomicU64::new(0),
            audio_requests: AtomicU64::new(0),
            pooling_requests: AtomicU64::new(0),
            token_id_prompts: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            store: responses::Store::default(),
            transfers: Arc::default(),
        })
    }

    /// Serves until `shutdown` resolves.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let engine = self;
        crate::server::listener::serve(
            listener,
            None,
            move |req, _peer: SocketAddr| {
                let engine = engine.clone();
                async move { engine.handle(req).await }
            },
            shutdown,
            Duration::from_secs(1),
            // An engine sees a client's fields and the balancer's (`x-forwarded-for`):
            // more than the balancer's own default lets through. Engines count none
            // (uvicorn's h11 limits only the head's size).
            crate::server::listener::ConnLimits {
                max_headers: 256,
                ..Default::default()
            },
        )
        .await;
    }

    async fn handle(self: Arc<Self>, req: Request<RequestBody>) -> Response<BoxBody> {
        let path = req.uri().path().to_string();
        // The W3C trace context it was sent, echoed (as `x-mock-traceparent`) so a
        // test can see that a balancer passed one on.
        let traceparent = req.headers().get("traceparent").cloned();
        // And its `x-request-id`, as `x-mock-request-id` (vLLM's own echo, with
        // `--enable-request-id-headers`, would be overwritten by the balancer's).
        let request_id = req.headers().get("x-request-id").cloned();
        if !matches!(
            path.as_str(),
            "/metrics" | "/health" | "/mock/fault" | "/mock/kv_transfers" | "/v1/models"
        ) && !path.starts_with("/mock/bootstrap/")
        {
            self.http_requests.fetch_add(1, Ordering::Relaxed);
        }
        let mut resp = match (req.method(), path.as_str()) {
            (&Method::GET, "/health") => {
                self.health_checks.fetch_add(1, Ordering::Relaxed);
                match self.fault.lock().mode {
                    FaultMode::Error => text(StatusCode::SERVICE_UNAVAILABLE, "unhealthy"),
                    _ => text(StatusCode::OK, ""),
                }
            }
            (&Method::GET, "/metrics") => {
                let fault = *self.fault.lock();
                if fault.mode == FaultMode::SlowMetrics {
                    tokio::time::sleep(Duration::from_millis(fault.ttft_ms)).await;
                }
                text(StatusCode::OK, &self.metrics())
            }
            (&Method::GET, "/v1/models") => json_response(StatusCode::OK, &self.models()),
            (&Method::POST, "/mock/fault") => self.set_fault(req).await,
            (&Method::GET, "/mock/kv_transfers") => {
                json_response(StatusCode::OK, &self.transfers.report())
            }
            (&Method::POST, "/v1/chat/completions") => self.clone().generate(req, Kind::Chat).await,
            (&Method::POST, "/v1/completions") => self.clone().generate(req, Kind::Text).await,
            (&Method::POST, "/v1/messages") => self.clone().generate(req, Kind::Messages).await,
            (&Method::POST, "/v1/messages/count_tokens") => self.count_tokens(req).await,
            (&Method::POST, "/v1/responses") => self.clone().generate(req, Kind::Responses).await,
            (&Method::POST, "/generate") => self.clone().generate(req, Kind::Generate).await,
            (
                &Method::POST,
                "/v1/rerank" | "/rerank" | "/v2/rerank" | "/v1/score" | "/score" | "/pooling"
                | "/classify" | "/tokenize" | "/detokenize",
            ) => {
                self.pooling_requests.fetch_add(1, Ordering::Relaxed);
                let Ok(body) = req.into_body().collect().await else {
                    return error(StatusCode::BAD_REQUEST, "could not read body");
                };
                match pooling::answer(&path, &body.to_bytes(), &self.config.model) {
                    Ok(v) => json_response(StatusCode::OK, &v),
                    Err((status, msg)) => error(
                        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
                        &msg,
                    ),
                }
            }
            (&Method::POST, "/v1/audio/transcriptions" | "/v1/audio/translations") => {
                self.audio_requests.fetch_add(1, Ordering::Relaxed);
                let per_word = self.config.costs.decode_per_token;
                audio::serve(req, &self.config.model, per_word).await
            }
            (method, p) if p.starts_with("/v1/responses/") => {
                self.store.serve(method, &p["/v1/responses/".len()..])
            }
            (&Method::POST, "/v1/embeddings") if self.config.no_embeddings => json_response(
                StatusCode::NOT_IMPLEMENTED,
                &json!({"error": {"code": 501, "message": "This server does not support embeddings. Start it with `--embeddings`", "type": "not_supported_error"}}),
            ),
            (&Method::POST, "/v1/embeddings") => match req.into_body().collect().await {
                Ok(body) => match wire::embeddings(&body.to_bytes(), &self.config.model) {
                    Ok(v) => json_response(StatusCode::OK, &v),
                    Err(msg) => error(StatusCode::BAD_REQUEST, &msg),
                },
                Err(_) => error(StatusCode::BAD_REQUEST, "could not read body"),
            },
            (&Method::GET, p) if p.starts_with("/mock/bootstrap/") => {
                let room = p["/mock/bootstrap/".len()..].parse::<u64>();
                match room.ok().and_then(|room| self.transfers.room_rank(room)) {
                    // The rank is named where there are several.
                    Some(rank) => json_response(
                        StatusCode::OK,
                        &json!({"engine": self.config.id, "rank": (self.ranks.len() > 1).then_some(rank)}),
                    ),
                    None => error(StatusCode::NOT_FOUND, "no such room"),
                }
            }
            _ => error(StatusCode::NOT_FOUND, &format!("no route for {path}")),
        };
        if let Ok(id) = header::HeaderValue::from_str(&self.config.id) {
            resp.headers_mut().insert("x-engine-id", id);
        }
        if let Some(tp) = traceparent {
            resp.headers_mut().insert("x-mock-traceparent", tp);
        }
        if let Some(id) = request_id {
            resp.headers_mut().insert("x-mock-request-id", id);
        }
        resp
    }

    /// `/v1/models`: the model, and each adapter with the model as its `parent`.
    fn models(&self) -> Value {
        let model = |id: &str| json!({"id": id, "object": "model", "created": 0, "owned_by": "mock-engine"});
        let mut data = vec![model(&self.config.model)];
        for a in &self.config.adapters {
            let mut m = model(a);
            m["parent"] = json!(self.config.model);
            data.push(m);
        }
        json!({"object": "list", "data": data})
    }

    async fn set_fault(&self, req: Request<RequestBody>) -> Response<BoxBody> {
        let Ok(body) = req.into_body().collect().await else {
            return error(StatusCode::BAD_REQUEST, "could not read body");
        };
        match serde_json::from_slice::<Fault>(&body.to_bytes()) {
            Ok(f) => {
                *self.fault.lock() = f;
                let factor = match f.mode {
                    FaultMode::SlowPrefill => f.factor.max(1),
                    _ => 1,
                };
                for rank in &self.ranks {
                    rank.lock().costs.prefill_per_token =
                        self.config.costs.prefill_per_token * factor;
                }
                tracing::info!(engine = %self.config.id, mode = ?f.mode, ttft_ms = f.ttft_ms, "fault set");
                json_response(StatusCode::OK, &json!(f))
            }
            Err(e) => error(StatusCode::BAD_REQUEST, &format!("bad fault: {e}")),
        }
    }

    /// `POST /v1/messages/count_tokens`: the prompt's tokens, as the cache model counts
    /// them; nothing runs.
    async fn count_tokens(&self, req: Request<RequestBody>) -> Response<BoxBody> {
        let Ok(body) = req.into_body().collect().await else {
            return anthropic::error(StatusCode::BAD_REQUEST, "could not read body");
        };
        let text = serde_json::from_slice::<Value>(&body.to_bytes())
            .map_err(|e| format!("invalid JSON: {e}"))
            .and_then(|v| anthropic::prompt_text(&v));
        match text {
            Ok(text) => json_response(
                StatusCode::OK,
                &json!({"input_tokens": Prompt::from_text(&text).tokens}),
            ),
            Err(msg) => anthropic::error(StatusCode::BAD_REQUEST, &msg),
        }
    }

    async fn generate(self: Arc<Self>, req: Request<RequestBody>, kind: Kind) -> Response<BoxBody> {
        // Errors in the shape of the API asked.
        let error = |status: StatusCode, msg: &str| match kind {
            Kind::Messages => anthropic::error(status, msg),
            _ => error(status, msg),
        };
        // SGLang's `/generate` takes its rank from the body, not a header.
        let rank = match kind {
            Kind::Generate => Ok(None),
            _ => self.rank_for(req.headers()).map(Some),
        };
        let rank = match rank {
            Ok(rank) => rank,
            Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
        };
        let request_id = req
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let Ok(body) = req.into_body().collect().await else {
            return error(StatusCode::BAD_REQUEST, "could not read body");
        };
        let body = body.to_bytes();
        let mut job = match parse_job(&body, kind, &self.config.model) {
            Ok(job) => job,
            Err(msg) => return error(StatusCode::BAD_REQUEST, &msg),
        };
        job.request_id = request_id;
        job.rank = match (rank, job.routed_dp_rank) {
            (Some(rank), _) => rank,
            (None, Some(r)) if usize::try_from(r).is_ok_and(|r| r < self.ranks.len()) => r as usize,
            (None, Some(r)) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &sglang::rank_out_of_range(r, self.ranks.len()),
                )
            }
            (None, None) => {
                self.next_rank.fetch_add(1, Ordering::Relaxed) as usize % self.ranks.len()
            }
        };
        if kind == Kind::Responses {
            // The conversation so far comes first, from this engine's own store.
            if let Some(previous) = &job.previous_response {
                let Some(earlier) = self.store.get(previous) else {
                    return responses::not_found(previous);
                };
                let v = serde_json::from_slice::<Value>(&body).unwrap_or_default();
                job.conversation = earlier.conversation + &job.conversation;
                job.prompt = Prompt::from_text(&(responses::instructions(&v) + &job.conversation));
            }
            job.response_id = self.store.new_id(&self.config.id);
        }
        let c = &self.config;
        if !c.adapters.is_empty() && job.model != c.model && !c.adapters.contains(&job.model) {
            // vLLM's answer for a model (or adapter) it does not serve.
            return error(
                StatusCode::NOT_FOUND,
                &format!("The model `{}` does not exist.", job.model),
            );
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        if kind == Kind::Generate {
            self.generate_requests.fetch_add(1, Ordering::Relaxed);
        }
        if job.token_ids {
            self.token_id_prompts.fetch_add(1, Ordering::Relaxed);
        }
        if job.image {
            // What llama.cpp answers for an image sent to a model without a projector.
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj",
            );
        }
        let limit = self.config.max_model_len;
        if limit > 0 && job.prompt.tokens + job.max_tokens > limit {
            // What vLLM answers when a request does not fit the context window.
            return error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({} in the messages, {} in the completion).",
                    job.prompt.tokens + job.max_tokens,
                    job.prompt.tokens,
                    job.max_tokens
                ),
            );
        }
        let fault = *self.fault.lock();
        if fault.mode == FaultMode::Error {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "injected fault: error");
        }
        match (self.config.disaggregation_mode, &job.bootstrap) {
            (None, _) => {}
            (Some(_), None) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "disaggregated serving needs the request's bootstrap_host, bootstrap_port and bootstrap_room",
                )
            }
            // Kept once prefilled (`prefill`); a prefill engine's answer ends with
            // its first token, as SGLang's does: its decode engine generates the rest.
            (Some(SglangRole::Prefill), Some(_)) => job.max_tokens = job.max_tokens.min(1),
            (Some(SglangRole::Decode), Some(b)) => match b.pull(ROOM_WAIT).await {
                Ok(engine) => {
                    let blocks = vec![b.room];
                    job.transfer = kv_transfer::Transfer::Consume { engine, blocks };
                }
                Err(msg) => return error(StatusCode::INTERNAL_SERVER_ERROR, &msg),
            },
        }
        if fault.mode == FaultMode::ClientError && !job.stream {
            return error(
                StatusCode::BAD_REQUEST,
                "injected fault: this request is invalid",
            );
        }

        if job.stream {
            let (tx, body) = ChannelBody::new(16);
            tokio::spawn(self.clone().stream(job, fault, tx));
            let mut resp = Response::new(BoxBody::new(body));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("text/event-stream"),
            );
            return resp;
        }

        self.complete(job, fault).await
    }

    /// A non-streaming answer, after the whole generation's time.
    async fn complete(self: Arc<Self>, job: Job, fault: Fault) -> Response<BoxBody> {
        let permit = self.admit(job.rank).await;
        let _running = Running::start(&self, &job);
        let plan = self.prefill(&job);
        self.count_prompt(plan.prompt_tokens, plan.cached_tokens);
        let content = match fault.mode {
            FaultMode::Stall => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                String::new()
            }
            FaultMode::Empty => String::new(),
            _ => {
                pause(plan.first_token() + slow_extra(fault)).await;
                let step = self.config.costs.decode_step(self.running());
                pause(step * job.max_tokens as u32).await;
                (0..job.max_tokens).map(token_text).collect()
            }
        };
        drop(permit);
        let completion_tokens = if content.is_empty() {
            0
        } else {
            job.max_tokens
        };
        let usage = match job.kind {
            Kind::Messages => {
                anthropic::usage(plan.prompt_tokens, completion_tokens, plan.cached_tokens)
            }
            Kind::Responses => {
                responses::usage(plan.prompt_tokens, completion_tokens, plan.cached_tokens)
            }
            _ => usage(plan.prompt_tokens, completion_tokens, plan.cached_tokens),
        };
        let mut body = completion(&job, &content, usage);
        if job.transfer == kv_transfer::Transfer::Produce {
            body["kv_transfer_params"] = self.transfers.produce(
                &self.config.id,
                completion_tokens,
                job.request_id.as_deref(),
            );
        }
        self.keep(&job, &content, &body);
        json_response(StatusCode::OK, &body)
    }

    /// The data-parallel rank a request runs on, as vLLM and SGLang pick it: the one
    /// its `x-data-parallel-rank` names (vLLM's 400 if there is no such rank), or
    /// SGLang's `x-override-routed-dp-rank` over it (read when SGLang runs with
    /// `SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1`; SGLang's 400), else (no header, or
    /// not a number) the next in turn.
    fn rank_for(&self, headers: &http::HeaderMap) -> Result<usize, String> {
        let ranks = self.ranks.len();
        let named = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        };
        match (
            named("x-override-routed-dp-rank"),
            named("x-data-parallel-rank"),
        ) {
            (Some(rank), _) if rank >= ranks => {
                Err(format!("routed_dp_rank={rank} out of range [0, {ranks})"))
            }
            (None, Some(rank)) if rank >= ranks => Err(format!(
                "data_parallel_rank {rank} is out of range [0, {ranks})."
            )),
            (Some(rank), _) | (None, Some(rank)) => Ok(rank),
            (None, None) => Ok(self.next_rank.fetch_add(1, Ordering::Relaxed) as usize % ranks),
        }
    }

    /// Admits a prompt to its rank's model now: cache lookup, prefill-lane wait,
    /// prefill time.
    fn prefill(&self, job: &Job) -> crate::tools::engine_model::PrefillPlan {
        let mut model = self.ranks[job.rank].lock();
        if let kv_transfer::Transfer::Consume { engine, blocks } = &job.transfer {
            // Its KV cache comes from the prefill engine: nothing to prefill here.
            self.transfers
                .consume(engine, blocks, job.request_id.as_deref());
            return model.receive(&job.prompt);
        }
        let plan = model.prefill(&job.prompt, self.epoch.elapsed());
        if let (Some(SglangRole::Prefill), Some(b)) =
            (self.config.disaggregation_mode, &job.bootstrap)
        {
            // Its decode engine can pull the KV cache once it is computed.
            let (ledger, room, after) = (self.transfers.clone(), b.room, plan.first_token());
            let rank = job.rank;
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                ledger.keep_room(room, rank);
            });
        }
        plan
    }

    /// Sequences running now.
    fn running(&self) -> usize {
        self.running.load(Ordering::Acquire) as usize
    }

    /// Produces one SSE stream. Every send doubles as a check that the client is still
    /// there: a failed send means it left, and the sequence is aborted at once.
    async fn stream(self: Arc<Self>, job: Job, fault: Fault, tx: mpsc::Sender<Bytes>) {
        let permit = tokio::select! {
            p = self.admit(job.rank) => p,
            _ = tx.closed() => return self.cancel(),
        };
        let _running = Running::start(&self, &job);
        let plan = self.prefill(&job);
        self.count_prompt(plan.prompt_tokens, plan.cached_tokens);
        if job.kind == Kind::Messages {
            return self.stream_messages(job, fault, tx, plan, permit).await;
        }
        if job.kind == Kind::Responses {
            return self.stream_responses(job, fault, tx, plan, permit).await;
        }
        let answers = !matches!(
            fault.mode,
            FaultMode::Stall | FaultMode::Empty | FaultMode::ClientError
        );
        if job.kind == Kind::Generate && answers {
            // SGLang's events: the text so far, the last token's with its finish
            // reason (no tokens: one empty event with it). (A stall, an empty stream or
            // an error event go as on the other APIs.)
            let (p, c, n) = (plan.prompt_tokens, plan.cached_tokens, job.max_tokens);
            let each = |i: usize| sglang::event(&sglang::answer(p, i + 1, c, i + 1 == n));
            let first = plan.first_token() + slow_extra(fault);
            if self.tokens(n, first, fault, &tx, each).await {
                if n == 0 {
                    let _ = tx.send(sglang::event(&sglang::answer(p, 0, c, true))).await;
                }
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            }
            drop(permit);
            return;
        }
        let chunk = |delta: Value, finish: Value| {
            sse_chunk(job.kind, &job.model, delta, finish, job.timestamps)
        };

        if job.kind == Kind::Chat
            && tx
                .send(chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                ))
                .await
                .is_err()
        {
            return self.cancel();
        }
        let tokens = match fault.mode {
            FaultMode::Stall => {
                tx.closed().await;
                return self.cancel();
            }
            FaultMode::Empty => {
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                return;
            }
            FaultMode::ClientError => {
                let event = json!({"error": {"message": "injected fault: this request is invalid", "type": "BadRequestError", "code": 400}});
                let _ = tx.send(Bytes::from(format!("data: {event}\n\n"))).await;
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                return;
            }
            _ => job.max_tokens,
        };
        let first = plan.first_token() + slow_extra(fault);
        if let Some(tool) = &job.tool {
            pause(first).await;
            for delta in wire::tool_call_deltas(tool) {
                if tx.send(chunk(delta, Value::Null)).await.is_err() {
                    return self.cancel();
                }
            }
            let _ = tx.send(chunk(json!({}), json!("tool_calls"))).await;
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            return;
        }
        let each = |i| chunk(json!({"content": token_text(i)}), Value::Null);
        if !self.tokens(tokens, first, fault, &tx, each).await {
            return;
        }
        let _ = tx.send(chunk(json!({}), json!("length"))).await;
        if job.include_usage {
            let usage = usage(plan.prompt_tokens, tokens, plan.cached_tokens);
            let _ = tx.send(usage_chunk(&job, usage)).await;
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        drop(permit);
    }

    /// An Anthropic Messages stream: `message_start` (with the prompt's usage) and a
    /// `ping`, then a text block of one delta per token or a tool call, then the stop
    /// reason and `message_stop`. Faults show as they do on the chat API.
    async fn stream_messages(
        self: &Arc<Self>,
        job: Job,
        fault: Fault,
        tx: mpsc::Sender<Bytes>,
        plan: crate::tools::engine_model::PrefillPlan,
        permit: tokio::sync::SemaphorePermit<'_>,
    ) {
        let usage = anthropic::usage(plan.prompt_tokens, 1, plan.cached_tokens);
        match fault.mode {
            FaultMode::Stall => {
                let _ = tx.send(anthropic::opening(&job, usage)[0].clone()).await;
                tx.closed().await;
                return self.cancel();
            }
            // Ends with nothing: no output, no stop reason.
            FaultMode::Empty => return,
            FaultMode::ClientError => {
                let _ = tx
                    .send(anthropic::error_event(
                        "invalid_request_error",
                        "injected fault: this request is invalid",
                    ))
                    .await;
                return;
            }
            _ => {}
        }
        for b in anthropic::opening(&job, usage) {
            if tx.send(b).await.is_err() {
                return self.cancel();
            }
        }
        let first = plan.first_token() + slow_extra(fault);
        if let Some(tool) = &job.tool {
            pause(first).await;
            let events = anthropic::tool_events(tool).into_iter();
            for b in events.chain(anthropic::closing("tool_use", 3, false)) {
                if tx.send(b).await.is_err() {
                    return self.cancel();
                }
            }
            return;
        }
        if tx.send(anthropic::text_start()).await.is_err() {
            return self.cancel();
        }
        let each = |i| anthropic::text_delta(token_text(i));
        if !self.tokens(job.max_tokens, first, fault, &tx, each).await {
            return;
        }
        for b in anthropic::closing("max_tokens", job.max_tokens, true) {
            let _ = tx.send(b).await;
        }
        drop(permit);
    }

    /// A Responses API stream: the response created and in progress, its message and
    /// text part added, one `response.output_text.delta` per token, then the text,
    /// part and item done and `response.completed` with the usage. The response is
    /// stored when it completes.
    async fn stream_responses(
        self: &Arc<Self>,
        job: Job,
        fault: Fault,
        tx: mpsc::Sender<Bytes>,
        plan: crate::tools::engine_model::PrefillPlan,
        permit: tokio::sync::SemaphorePermit<'_>,
    ) {
        let mut events = responses::Events::new();
        let opening = events.opening(&job, &job.response_id);
        match fault.mode {
            FaultMode::Stall => {
                let _ = tx.send(opening[0].clone()).await;
                tx.closed().await;
                return self.cancel();
            }
            FaultMode::Empty => return,
            _ => {}
        }
        for b in opening {
            if tx.send(b).await.is_err() {
                return self.cancel();
            }
        }
        let first = plan.first_token() + slow_extra(fault);
        let id = job.response_id.clone();
        let events = Mutex::new(events);
        let each = |i| events.lock().delta(&id, token_text(i));
        if !self.tokens(job.max_tokens, first, fault, &tx, each).await {
            return;
        }
        let content: String = (0..job.max_tokens).map(token_text).collect();
        let usage = responses::usage(plan.prompt_tokens, job.max_tokens, plan.cached_tokens);
        let completed = responses::response(&job, &id, Some(&content), usage);
        self.keep(&job, &content, &completed);
        let closing = events.lock().closing(&completed);
        for b in closing {
            let _ = tx.send(b).await;
        }
        drop(permit);
    }

    /// Stores a Responses API answer that asked to be stored: what a later response
    /// that continues it reads.
    fn keep(&self, job: &Job, content: &str, response: &Value) {
        if job.kind == Kind::Responses && job.store {
            let stored = responses::Stored {
                conversation: format!("{}assistant\n{content}\n", job.conversation),
                response: response.clone(),
            };
            self.store.put(job.response_id.clone(), stored);
        }
    }

    /// Sends `n` tokens as `each` encodes them, the first after `first`, then one per
    /// decode step; whether all went (not: the client left, or a reset was injected).
    async fn tokens(
        &self,
        n: usize,
        first: Duration,
        fault: Fault,
        tx: &mpsc::Sender<Bytes>,
        each: impl Fn(usize) -> Bytes,
    ) -> bool {
        for i in 0..n {
            let wait = if i == 0 {
                first
            } else {
                self.config.costs.decode_step(self.running())
            };
            tokio::select! {
                _ = pause(wait) => {}
                _ = tx.closed() => {
                    self.cancel();
                    return false;
                }
            }
            if fault.mode == FaultMode::Reset && i == 2 {
                let _ = tx.send(Bytes::from_static(wire::RESET)).await;
                return false;
            }
            if tx.send(each(i)).await.is_err() {
                self.cancel();
                return false;
            }
        }
        true
    }

    async fn admit(&self, rank: usize) -> tokio::sync::SemaphorePermit<'_> {
        self.rank_waiting[rank].fetch_add(1, Ordering::AcqRel);
        let permit = self
            .seqs
            .acquire()
            .await
            .expect("the semaphore is never closed");
        self.rank_waiting[rank].fetch_sub(1, Ordering::AcqRel);
        permit
    }

    fn cancel(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(engine = %self.config.id, "request cancelled by the client");
    }

    fn count_prompt(&self, prompt: usize, cached: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
    }

    fn metrics(&self) -> String {
        let m = &self.config.model;
        let g = |name: &str, kind: &str, help: &str, v: u64| {
            format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{model_name=\"{m}\"}} {v}\n"
            )
        };
        // Each rank's gauges, as vLLM gives them: one series per engine (rank),
        // labelled `engine`, when the server has several.
        let by_rank = |name: &str, help: &str, values: Vec<f64>| {
            let mut text = format!("# HELP {name} {help}\n# TYPE {name} gauge\n");
            for (rank, v) in values.iter().enumerate() {
                text += &match values.len() {
                    1 => format!("{name}{{model_name=\"{m}\"}} {v}\n"),
                    _ => format!("{name}{{model_name=\"{m}\",engine=\"{rank}\"}} {v}\n"),
                };
            }
            text
        };
        let each = |ranks: &[AtomicU64]| -> Vec<f64> {
            ranks
                .iter()
                .map(|v| v.load(Ordering::Acquire) as f64)
                .collect()
        };
        let cache = self.config.cache_tokens.max(1) as f64;
        [
            by_rank(
                "vllm:num_requests_running",
                "Sequences running now.",
                each(&self.rank_running),
            ),
            by_rank(
                "vllm:num_requests_waiting",
                "Sequences waiting for a slot.",
                each(&self.rank_waiting),
            ),
            by_rank(
                "vllm:kv_cache_usage_perc",
                "Share of the KV cache held by running sequences (prompt and answer), 0-1.",
                each(&self.rank_kv_tokens)
                    .into_iter()
                    .map(|tokens| (tokens / cache).min(1.0))
                    .collect(),
            ),
            g(
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prompt tokens looked up in the prefix cache.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            g(
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                self.cached_tokens.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_requests_total",
                "counter",
                "Generation requests received.",
                self.requests.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_http_requests_total",
                "counter",
                "HTTP requests received on any path but /metrics, /health, /v1/models and /mock/fault.",
                self.http_requests.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_health_checks_total",
                "counter",
                "GET /health requests received.",
                self.health_checks.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_generate_requests_total",
                "counter",
                "Requests to SGLang's native /generate.",
                self.generate_requests.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_audio_requests_total",
                "counter",
                "Uploads to /v1/audio/transcriptions and /v1/audio/translations.",
                self.audio_requests.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_pooling_requests_total",
                "counter",
                "Requests to the pooling and tokenizer endpoints (/v1/rerank, /score, /pooling, /classify, /tokenize, /detokenize).",
                self.pooling_requests.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_token_id_prompts_total",
                "counter",
                "Generation requests whose prompt came as token ids.",
                self.token_id_prompts.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_cancelled_total",
                "counter",
                "Requests aborted because the client left.",
                self.cancelled.load(Ordering::Relaxed),
            ),
            g(
                "mock_engine_peak_running",
                "gauge",
                "Most sequences ever running at once.",
                self.peak_running.load(Ordering::Acquire),
            ),
        ]
        .concat()
    }
}

/// Waits `d`, and not at all when it is zero. A zero `tokio::time::sleep` is not over
/// at its first poll: it waits for the timer, so an engine set to cost nothing
/// (`--decode-ms-per-token 0 --prefill-us-per-token 0`) served 13,000 requests a second
/// at 32 connections, at 2.54 ms p50 and a fifth of a core (docs/performance.md, "A
/// twentieth sitting").
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

fn slow_extra(fault: Fault) -> Duration {
    if fault.mode == FaultMode::Slow {
        Duration::from_millis(fault.ttft_ms)
    } else {
        Duration::ZERO
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Waker};

    use super::*;

    /// A zero pause must not wait for the timer (it held a mock engine set to cost
    /// nothing at 2.54 ms p50); with `tokio::time::sleep(ZERO)` the first poll is
    /// pending.
    #[tokio::test]
    async fn a_zero_pause_is_over_at_once_and_another_waits_for_the_timer() {
        let mut cx = Context::from_waker(Waker::noop());
        let mut zero = std::pin::pin!(pause(Duration::ZERO));
        assert!(zero.as_mut().poll(&mut cx).is_ready());
        let mut some = std::pin::pin!(pause(Duration::from_millis(50)));
        assert!(some.as_mut().poll(&mut cx).is_pending());
    }
}
