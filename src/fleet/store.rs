//! The fleet's Redis I/O (the `redis` crate, with tokio and its connection manager,
//! which reconnects by itself): an engine's heartbeat written or removed, and
//! membership read with this balancer's own heartbeat, each in ONE round trip (a Lua
//! script), with Redis's clock for expiries so balancer and agent clocks need not
//! agree. Every call has a deadline: a slow Redis is a failed call, never a stall.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError, Script};

use super::record::{Keys, Membership, NodeRecord};

/// Why a Redis call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis at {addr} rejected the credentials: {source}")]
    Auth { addr: String, source: RedisError },
    #[error("redis at {addr}: {source}")]
    Redis { addr: String, source: RedisError },
    #[error("redis at {addr}: no answer within {ms} ms")]
    Timeout { addr: String, ms: u128 },
    #[error("{0}")]
    Url(String),
}

impl StoreError {
    /// Whether retrying cannot help (wrong password, bad URL).
    pub fn is_fatal(&self) -> bool {
        matches!(self, StoreError::Auth { .. } | StoreError::Url(_))
    }
}

/// The connection details of `url` (`redis://[user:pass@]host:port[/db]` or
/// `rediss://`), with the password from the environment variable `password_env` when
/// given. Never logs the URL (it may hold a password).
pub fn connection_info(
    url: &str,
    password_env: Option<&str>,
) -> Result<ConnectionInfo, StoreError> {
    let mut info = url.into_connection_info().map_err(|e| {
        StoreError::Url(format!(
            "redis url: {}",
            e.detail().unwrap_or("not a redis:// or rediss:// URL")
        ))
    })?;
    if let Some(var) = password_env {
        let password = std::env::var(var).map_err(|_| {
            StoreError::Url(format!(
                "redis password: environment variable {var} is not set"
            ))
        })?;
        info.redis.password = Some(password);
    }
    Ok(info)
}

/// Reads membership and heartbeats this balancer. KEYS: engines' set, balancers' set,
/// this balancer's record. ARGV: engine record key prefix, this balancer's id, its
/// record, TTL in ms. Returns `{replicas, records}`.
const POLL: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
redis.call('SET', KEYS[3], ARGV[3], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local replicas = redis.call('ZCARD', KEYS[2])
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local records = {}
if #ids > 0 then
  local keys = {}
  for i, id in ipairs(ids) do keys[i] = ARGV[1] .. id end
  records = redis.call('MGET', unpack(keys))
end
return {replicas, records}
";

/// Writes a heartbeat. KEYS: the record, the set. ARGV: record, TTL in ms, member id.
const BEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
";

/// One fleet's Redis.
#[derive(Clone)]
pub struct Store {
    conn: ConnectionManager,
    keys: Keys,
    addr: String,
    deadline: Duration,
}

impl Store {
    /// Connects (and checks the credentials with a `PING`) within `deadline`.
    pub async fn connect(
        info: ConnectionInfo,
        prefix: &str,
        deadline: Duration,
    ) -> Result<Store, StoreError> {
        let addr = info.addr.to_string();
        let client =
            redis::Client::open(info).map_err(|e| StoreError::Url(format!("redis url: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(deadline)
            .set_response_timeout(deadline)
            .set_number_of_retries(1)
            .set_max_delay(deadline.as_millis() as u64);
        let fail = |source: RedisError| classify(&addr, source);
        // One plain attempt first: the connection manager retries a refused password
        // until its deadline, which would hide why.
        let timeout = || StoreError::Timeout {
            addr: addr.clone(),
            ms: (deadline * 2).as_millis(),
        };
        let mut pinged =
            tokio::time::timeout(deadline * 2, client.get_multiplexed_async_connection())
                .await
                .map_err(|_| timeout())?
                .map_err(fail)?;
        tokio::time::timeout(
            deadline,
            redis::cmd("PING").query_async::<String>(&mut pinged),
        )
        .await
        .map_err(|_| timeout())?
        .map_err(fail)?;
        drop(pinged);
        let conn = tokio::time::timeout(
            deadline * 2,
            client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| StoreError::Timeout {
            addr: addr.clone(),
            ms: (deadline * 2).as_millis(),
        })?
        .map_err(fail)?;
        let store = Store {
            conn,
            keys: Keys::new(prefix),
            addr,
            deadline,
        };
        let mut conn = store.conn.clone();
        store
            .timed(async move { redis::cmd("PING").query_async::<String>(&mut conn).await })
            .await?;
        Ok(store)
    }

    /// Where it connects (host and port, never the password).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Writes an engine's heartbeat, living `ttl`.
    pub async fn beat_node(
        &mut self,
        record: &NodeRecord,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let json = serde_json::to_string(record).expect("a record serializes");
        let mut conn = self.conn.clone();
        let (key, set) = (self.keys.node(&record.id), self.keys.nodes());
        let id = record.id.clone();
        self.timed(async move {
            Script::new(BEAT)
                .key(key)
                .key(set)
                .arg(json)
                .arg(ttl.as_millis() as u64)
                .arg(id)
                .invoke_async::<i64>(&mut conn)
                .await
        })
        .await
        .map(|_| ())
    }

    /// Removes an engine's heartbeat: it leaves at the balancers' next poll.
    pub async fn remove_node(&mut self, id: &str) -> Result<(), StoreError> {
        self.remove(self.keys.node(id), self.keys.nodes(), id.to_string())
            .await
    }

    /// Removes a balancer's heartbeat.
    pub async fn remove_balancer(&mut self, id: &str) -> Result<(), StoreError> {
        self.remove(
            self.keys.balancer(id),
            self.keys.balancers(),
            id.to_string(),
        )
        .await
    }

    async fn remove(&mut self, key: String, set: String, id: String) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        self.timed(async move {
            redis::pipe()
                .atomic()
                .del(key)
                .ignore()
                .zrem(set, id)
                .ignore()
                .query_async::<()>(&mut conn)
                .await
        })
        .await
    }

    /// Heartbeats balancer `id` (record `json`, living `ttl`) and reads the live
    /// engines and the number of live balancers, in one round trip. Records that do
    /// not parse are skipped (and named).
    pub async fn poll(
        &mut self,
        id: &str,
        json: &str,
        ttl: Duration,
    ) -> Result<(Membership, Vec<String>), StoreError> {
        let mut conn = self.conn.clone();
        let node_prefix = self.keys.node("");
        let (nodes, balancers, me) = (
            self.keys.nodes(),
            self.keys.balancers(),
            self.keys.balancer(id),
        );
        let (id, json) = (id.to_string(), json.to_string());
        let (replicas, raw): (u32, Vec<Option<String>>) = self
            .timed(async move {
                Script::new(POLL)
                    .key(nodes)
                    .key(balancers)
                    .key(me)
                    .arg(node_prefix)
                    .arg(id)
                    .arg(json)
                    .arg(ttl.as_millis() as u64)
                    .invoke_async(&mut conn)
                    .await
            })
            .await?;
        let mut bad = Vec::new();
        let mut records: Vec<NodeRecord> = raw
            .into_iter()
            .flatten()
            .filter_map(|text| match serde_json::from_str(&text) {
                Ok(r) => Some(r),
                Err(e) => {
                    bad.push(format!(
                        "unreadable node record ({e}): {}",
                        crate::clip::clip(&text)
                    ));
                    None
                }
            })
            .collect();
        records.sort_by(|a, b| a.id.cmp(&b.id));
        Ok((
            Membership {
                nodes: records,
                replicas: replicas.max(1),
            },
            bad,
        ))
    }

    async fn timed<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.deadline, call).await {
            Err(_) => Err(StoreError::Timeout {
                addr: self.addr.clone(),
                ms: self.deadline.as_millis(),
            }),
            Ok(r) => r.map_err(|e| classify(&self.addr, e)),
        }
    }
}

fn classify(addr: &str, e: RedisError) -> StoreError {
    let auth = e.kind() == ErrorKind::AuthenticationFailed
        || e.code().is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH")
        || e.to_string().contains("WRONGPASS");
    if auth {
        StoreError::Auth {
            addr: addr.to_string(),
            source: e,
        }
    } else {
        StoreError::Redis {
            addr: addr.to_string(),
            source: e,
        }
    }
}

/// Unix time in seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
