//! `prefixlb agent`: runs beside one engine and heartbeats it into Redis while it is
//! healthy. Every `interval` it asks the engine's `/health`; while that answers 2xx it
//! learns the model names from `/v1/models` (unless given), reads the engine's load
//! from `/metrics` when the engine exposes vLLM, SGLang or llama.cpp metrics, and writes its
//! record with a TTL. An unhealthy engine's record is removed at once (the node leaves
//! at the balancers' next poll). SIGTERM or SIGINT removes it and exits 0. Credentials
//! Redis rejects end the agent with a non-zero exit; an unreachable Redis is retried.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::record::NodeRecord;
use super::store::{connection_info, unix_now, Store, StoreError};
use crate::engine_load;

/// What `prefixlb agent` is told.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub redis: String,
    pub password_env: Option<String>,
    pub key_prefix: String,
    /// The engine's base URL, as the balancers reach it.
    pub backend: String,
    pub pool: String,
    pub id: String,
    pub weight: u32,
    /// Model names; empty: learned from `/v1/models`.
    pub models: Vec<String>,
    pub interval: Duration,
    pub ttl: Duration,
    /// Data-parallel ranks behind the URL, each a node of its own (1: one node).
    pub data_parallel_size: u32,
}

/// The HTTP client for the engine.
type EngineClient = Client<HttpConnector, Empty<Bytes>>;

/// Runs until `stop` resolves; Err only for what retrying cannot fix.
pub async fn run(
    o: AgentOptions,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), StoreError> {
    let info = connection_info(&o.redis, o.password_env.as_deref())?;
    let deadline = o
        .interval
        .clamp(Duration::from_millis(200), Duration::from_secs(2));
    let client: EngineClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let started_at = unix_now();
    let mut store: Option<Store> = None;
    let mut registered = false;
    let mut last_state: Option<String> = None;
    let mut last_advice: Option<String> = None;
    let mut note = |state: String| {
        if last_state.as_ref() != Some(&state) {
            tracing::info!(node = %o.id, "{state}");
            last_state = Some(state);
        }
    };
    tokio::pin!(stop);
    loop {
        if store.is_none() {
            match Store::connect(info.clone(), &o.key_prefix, deadline).await {
                Ok(s) => store = Some(s),
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => note(format!("redis unreachable, retrying: {e}")),
            }
        }
        if let Some(s) = &mut store {
            let healthy = get(&client, &o.backend, "/health", deadline)
                .await
                .is_some();
            let outcome = if healthy {
                let models = if o.models.is_empty() {
                    models(&client, &o.backend, deadline).await
                } else {
                    o.models.clone()
                };
                let report = get(&client, &o.backend, "/metrics", deadline)
                    .await
                    .map(|text| engine_load::read(&text, o.data_parallel_size));
                // An engine of another number of ranks than announced: said once.
                if let Some(report) = &report {
                    let advice = report.rank_advice(o.data_parallel_size);
                    if let Some(advice) =
                        advice.as_ref().filter(|a| last_advice.as_ref() != Some(a))
                    {
                        tracing::warn!(node = %o.id, "{advice}");
                    }
                    last_advice = advice;
                }
                let load = report.as_ref().and_then(|r| r.whole);
                let rank_loads = match report {
                    Some(r) if o.data_parallel_size > 1 => r.by_rank,
                    _ => Vec::new(),
                };
                let record = NodeRecord {
                    id: o.id.clone(),
                    pool: o.pool.clone(),
                    url: o.backend.trim_end_matches('/').to_string(),
                    weight: o.weight,
                    models,
                    started_at,
                    load,
                    data_parallel_size: (o.data_parallel_size > 1).then_some(o.data_parallel_size),
                    rank_loads,
                };
                s.beat_node(&record, o.ttl).await.map(|()| {
                    registered = true;
                    format!("heartbeating as {} in pool {}", o.id, o.pool)
                })
            } else if registered {
                s.remove_node(&o.id).await.map(|()| {
                    registered = false;
                    "engine unhealthy: heartbeat removed".to_string()
                })
            } else {
                Ok("engine unhealthy: not heartbeating".to_string())
            };
            match outcome {
                Ok(state) => note(state),
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => note(format!("redis call failed, retrying: {e}")),
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(o.interval) => {}
            _ = &mut stop => break,
        }
    }
    if let Some(s) = &mut store {
        match s.remove_node(&o.id).await {
            Ok(()) => tracing::info!(node = %o.id, "deregistered"),
            Err(e) => {
                tracing::warn!(node = %o.id, error = %e, "could not deregister; the heartbeat expires by itself")
            }
        }
    }
    Ok(())
}

/// The body of a 2xx answer to `GET base+path` within `deadline`.
async fn get(client: &EngineClient, base: &str, path: &str, deadline: Duration) -> Option<String> {
    let uri: http::Uri = format!("{}{path}", base.trim_end_matches('/'))
        .parse()
        .ok()?;
    let call = async {
        let resp = client.get(uri).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(deadline, call).await.ok().flatten()
}

/// The model ids of `GET /v1/models` (none if it does not answer).
async fn models(client: &EngineClient, base: &str, deadline: Duration) -> Vec<String> {
    let Some(text) = get(client, base, "/v1/models", deadline).await else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    v["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .take(64)
                .collect()
        })
        .unwrap_or_default()
}
