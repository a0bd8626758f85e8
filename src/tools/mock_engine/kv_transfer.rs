//! vLLM's disaggregated prefill, as a KV connector (`NixlConnector`) shows it on the
//! wire: a request whose `kv_transfer_params` say `do_remote_decode` is prefilled here
//! and answered with the params a decode engine pulls the KV cache with (this
//! engine's id and a block id of its own); a request whose params say
//! `do_remote_prefill` names the engine and blocks it pulls from, and is not
//! prefilled here. Every prefill kept and every pull is recorded with its request's
//! `x-request-id` (which vLLM asks both legs to share), so a test can check that each
//! decode engine was handed what a prefill engine answered (`GET /mock/kv_transfers`).
//!
//! SGLang's disaggregation too: a prefill engine (`--disaggregation-mode prefill`)
//! keeps each request's KV cache under its `bootstrap_room`, and answers `GET
//! /mock/bootstrap/{room}` for it (its bootstrap server, on its own HTTP port here); a
//! decode engine pulls the room from the `bootstrap_host` and `bootstrap_port` its
//! request names, and fails the request if no such room is kept there in time.

use parking_lot::Mutex;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a request's `kv_transfer_params` ask of this engine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) enum Transfer {
    /// None: the request is served whole.
    #[default]
    None,
    /// Prefill, and keep the KV cache for a decode engine.
    Produce,
    /// Pull the prompt's KV cache from `engine`'s `blocks`.
    Consume { engine: String, blocks: Vec<u64> },
}

impl Transfer {
    /// From a request body's `kv_transfer_params`.
    pub(super) fn of(request: &Value) -> Transfer {
        let p = &request["kv_transfer_params"];
        if p["do_remote_decode"] == true {
            return Transfer::Produce;
        }
        if p["do_remote_prefill"] != true {
            return Transfer::None;
        }
        Transfer::Consume {
            engine: p["remote_engine_id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            blocks: p["remote_block_ids"]
                .as_array()
                .map(|ids| ids.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default(),
        }
    }
}

/// The bootstrap an SGLang-disaggregated request names: its prefill engine's host and
/// port (SGLang's default, 8998, if null), its room (the first, for a batch), and the
/// data-parallel rank of the prefill engine that holds it, if named
/// (`disagg_prefill_dp_rank`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
    pub prefill_rank: Option<u64>,
}

impl Bootstrap {
    pub(super) fn of(request: &Value) -> Option<Bootstrap> {
        let first = |v: &Value| match v {
            Value::Array(items) => items.first().cloned().unwrap_or(Value::Null),
            v => v.clone(),
        };
        Some(Bootstrap {
            host: first(&request["bootstrap_host"]).as_str()?.to_string(),
            port: first(&request["bootstrap_port"])
                .as_u64()
                .map_or(Some(8998), |p| u16::try_from(p).ok())?,
            room: first(&request["bootstrap_room"]).as_u64()?,
            prefill_rank: request["disagg_prefill_dp_rank"].as_u64(),
        })
    }

    /// Pulls the room from its prefill engine: that engine's id once it keeps it, else
    /// (after `wait`) why not.
    pub(super) async fn pull(&self, wait: std::time::Duration) -> Result<String, String> {
        let until = tokio::time::Instant::now() + wait;
        let at = format!("{}:{}", self.host, self.port);
        loop {
            if let Some((engine, rank)) = kept_at(&at, self.room).await {
                // A data-parallel prefill server keeps it in one rank, which the
                // request must name.
                if rank.is_some() && rank != self.prefill_rank {
                    return Err(format!(
                        "KV transfer failed: bootstrap room {} is in prefill rank {rank:?} at {at}, and the request names rank {:?} (disagg_prefill_dp_rank)",
                        self.room, self.prefill_rank
                    ));
                }
                return Ok(engine);
            }
            if tokio::time::Instant::now() >= until {
                return Err(format!(
                    "KV transfer failed: bootstrap room {} not kept at {at}",
                    self.room
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}

/// Asks the engine at `at` whether it keeps `room`: its id, and the rank that keeps
/// it if it runs several, if so.
async fn kept_at(at: &str, room: u64) -> Option<(String, Option<u64>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(at).await.ok()?;
    let ask =
        format!("GET /mock/bootstrap/{room} HTTP/1.1\r\nhost: {at}\r\nconnection: close\r\n\r\n");
    stream.write_all(ask.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    let answer = String::from_utf8_lossy(&answer);
    if !answer.starts_with("HTTP/1.1 200") {
        return None;
    }
    let (_, body) = answer.split_once("\r\n\r\n")?;
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    Some((v["engine"].as_str()?.to_string(), v["rank"].as_u64()))
}

/// One pull: the engine and blocks pulled from, and the request's `x-request-id`.
type Pull = (String, Vec<u64>, Option<String>);

/// The transfers an engine took part in.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// The `x-request-id` of each request it prefilled for a decode engine, by block.
    produced: Mutex<Vec<Option<String>>>,
    /// Tokens answered to the requests it prefilled for a decode engine.
    produced_tokens: AtomicU64,
    consumed: Mutex<Vec<Pull>>,
    /// The bootstrap rooms whose KV cache it kept, in order, each with the rank that
    /// keeps it.
    rooms: Mutex<Vec<(u64, usize)>>,
}

impl Ledger {
    /// The params a prefill answer of `tokens` tokens to request `id` carries: this
    /// engine's id and a new block id.
    pub(super) fn produce(&self, engine: &str, tokens: usize, id: Option<&str>) -> Value {
        let block = {
            let mut produced = self.produced.lock();
            produced.push(id.map(str::to_string));
            produced.len() - 1
        };
        self.produced_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": engine,
            "remote_block_ids": [block],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        })
    }

    /// Keeps a prefill's KV cache under `room`, in `rank`.
    pub(super) fn keep_room(&self, room: u64, rank: usize) {
        self.rooms.lock().push((room, rank));
    }

    /// The rank that keeps `room`, if one does.
    pub(super) fn room_rank(&self, room: u64) -> Option<usize> {
        let rooms = self.rooms.lock();
        rooms
            .iter()
            .find(|(r, _)| *r == room)
            .map(|(_, rank)| *rank)
    }

    pub(super) fn consume(&self, engine: &str, blocks: &[u64], id: Option<&str>) {
        let pull = (engine.to_string(), blocks.to_vec(), id.map(str::to_string));
        self.consumed.lock().push(pull);
    }

    /// `GET /mock/kv_transfers`: how many prefills this engine kept for a decode
    /// engine, the tokens it answered them and each one's `x-request-id` (by block
    /// id), and each pull it made (engine id, block ids, `x-request-id`).
    pub(super) fn report(&self) -> Value {
        let produced = self.produced.lock();
        json!({
            "produced": produced.len(),
            "produced_tokens": self.produced_tokens.load(Ordering::Relaxed),
            "produced_ids": *produced,
            "consumed": *self.consumed.lock(),
            "rooms": self.rooms.lock().iter().map(|(room, _)| *room).collect::<Vec<_>>(),
        })
    }
}
