//! Keep-alive HTTP/1.1 connections to the engines: one idle list per engine address.
//! A connection is leased to one request and comes back when the relayed body has
//! been read to its end; a body cut short (client gone, engine failed) drops it.
//!
//! hyper-util's pooled client does the same job with more per request: a boxed
//! future, connection-info extensions on every response, a `Host` string formatted
//! afresh, and a task spawned per request to wait for the connection to go idle. On
//! the load measured in `scripts/load_vs_haproxy.sh` that showed; this pool hands
//! the connection back from the body itself (see `docs/performance.md`).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;
use tokio::time::Instant;

type Sender = SendRequest<Full<Bytes>>;

/// Why a request could not be sent to an engine, or got no response head.
#[derive(Debug)]
pub enum UpstreamError {
    Connect(std::io::Error),
    ConnectTimeout(Duration),
    Handshake(hyper::Error),
    Exchange(hyper::Error),
}

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpstreamError::Connect(e) => write!(f, "tcp connect error: {e}"),
            UpstreamError::ConnectTimeout(t) => {
                write!(f, "tcp connect timed out after {} ms", t.as_millis())
            }
            UpstreamError::Handshake(e) => write!(f, "HTTP/1 handshake: {}", chain(e)),
            UpstreamError::Exchange(e) => write!(f, "{}", chain(e)),
        }
    }
}

impl std::error::Error for UpstreamError {}

/// An error and its causes, e.g. "connection closed before message completed".
fn chain(e: &hyper::Error) -> String {
    use std::error::Error as _;
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// An idle connection and since when.
struct Idle {
    sender: Sender,
    since: Instant,
}

impl Idle {
    /// Idle for less than `keep` at `now`.
    fn fresh(&self, now: Instant, keep: Duration) -> bool {
        now.duration_since(self.since) < keep
    }
}

/// The connections to every engine, shared by all requests.
pub struct Upstream {
    idle: Mutex<HashMap<Authority, Vec<Idle>>>,
    connect_timeout: Duration,
    /// How long an idle connection is kept for reuse.
    keep_idle: Duration,
}

/// A connection leased to one request; [`Lease::release`] hands it back.
pub struct Lease {
    sender: Sender,
    authority: Authority,
    upstream: Arc<Upstream>,
}

impl Lease {
    /// The response was read to its end: the connection can carry the next one.
    pub fn release(self) {
        if self.sender.is_closed() {
            return;
        }
        let idle = Idle {
            sender: self.sender,
            since: Instant::now(),
        };
        self.upstream
            .idle
            .lock()
            .entry(self.authority)
            .or_default()
            .push(idle);
    }
}

impl Upstream {
    pub fn new(connect_timeout: Duration, keep_idle: Duration) -> Arc<Upstream> {
        Arc::new(Upstream {
            idle: Mutex::new(HashMap::new()),
            connect_timeout,
            keep_idle,
        })
    }

    /// Idle connections held now, across engines.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().values().map(Vec::len).sum()
    }

    /// Sends `req` (origin-form URI, `Host` set) to the engine at `authority`: on the
    /// most recently idle connection that is still open, else on a new one. A request
    /// that a reused connection refused before sending a byte (the engine closed it
    /// meanwhile) goes again on the next.
    pub async fn send(
        self: &Arc<Self>,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Result<(Response<Incoming>, Lease), UpstreamError> {
        while let Some(mut sender) = self.checkout(authority) {
            if !sender.is_ready() && sender.ready().await.is_err() {
                continue;
            }
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok((resp, self.lease(sender, authority))),
                Err(mut e) => match e.take_message() {
                    Some(unsent) => req = unsent,
                    None => return Err(UpstreamError::Exchange(e.into_error())),
                },
            }
        }
        let mut sender = self.connect(authority).await?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(UpstreamError::Exchange)?;
        Ok((resp, self.lease(sender, authority)))
    }

    fn lease(self: &Arc<Self>, sender: Sender, authority: &Authority) -> Lease {
        Lease {
            sender,
            authority: authority.clone(),
            upstream: self.clone(),
        }
    }

    /// Drops closed and expired idle connections of every engine, and the lists of
    /// engines left with none (engines that left the fleet are otherwise never asked
    /// again). Called on the health checker's beat.
    pub fn sweep(&self) {
        let now = Instant::now();
        self.idle.lock().retain(|_, list| {
            list.retain(|c| !c.sender.is_closed() && c.fresh(now, self.keep_idle));
            !list.is_empty()
        });
    }

    /// The newest usable idle connection; closed and expired ones are dropped.
    fn checkout(&self, authority: &Authority) -> Option<Sender> {
        let mut idle = self.idle.lock();
        let list = idle.get_mut(authority)?;
        let now = Instant::now();
        // The oldest are at the front: drop the expired ones in one go.
        let fresh = list
            .iter()
            .position(|c| c.fresh(now, self.keep_idle))
            .unwrap_or(list.len());
        list.drain(..fresh);
        while let Some(c) = list.pop() {
            if !c.sender.is_closed() {
                return Some(c.sender);
            }
        }
        None
    }

    async fn connect(&self, authority: &Authority) -> Result<Sender, UpstreamError> {
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(80);
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| UpstreamError::ConnectTimeout(self.connect_timeout))?
            .map_err(UpstreamError::Connect)?;
        stream.set_nodelay(true).map_err(UpstreamError::Connect)?;
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(UpstreamError::Handshake)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A minimal HTTP/1.1 server answering every request on a connection with
    /// "ok", counting connections accepted.
    async fn engine() -> (Authority, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {
                                let r = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                                if s.write_all(r).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        (addr.to_string().parse().unwrap(), accepted)
    }

    /// One request on `up`, its body read; the lease, not yet handed back.
    async fn round_trip(up: &Arc<Upstream>, authority: &Authority) -> Lease {
        let (resp, lease) = up.send(authority, request(authority)).await.unwrap();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        lease
    }

    fn request(authority: &Authority) -> Request<Full<Bytes>> {
        Request::builder()
            .uri("/x")
            .header(http::header::HOST, authority.as_str())
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }

    #[tokio::test]
    async fn a_released_connection_carries_the_next_request() {
        let (authority, accepted) = engine().await;
        let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
        for _ in 0..3 {
            round_trip(&up, &authority).await.release();
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(up.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_dropped_lease_is_not_reused_and_expired_ones_go() {
        let (authority, accepted) = engine().await;
        let up = Upstream::new(Duration::from_secs(1), Duration::from_millis(50));
        let (_resp, lease) = up.send(&authority, request(&authority)).await.unwrap();
        drop(lease);
        round_trip(&up, &authority).await.release();
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_millis(80)).await;
        let _lease = round_trip(&up, &authority).await;
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(up.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_sweep_forgets_expired_connections_and_empty_engines() {
        let (authority, _) = engine().await;
        let up = Upstream::new(Duration::from_secs(1), Duration::from_millis(50));
        round_trip(&up, &authority).await.release();
        up.sweep();
        assert_eq!(up.idle_count(), 1, "still fresh");
        tokio::time::sleep(Duration::from_millis(80)).await;
        up.sweep();
        assert_eq!(up.idle_count(), 0);
        assert!(up.idle.lock().is_empty());
    }

    #[tokio::test]
    async fn refused_connections_are_an_error_naming_the_cause() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority: Authority = listener.local_addr().unwrap().to_string().parse().unwrap();
        drop(listener);
        let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
        let err = up
            .send(&authority, request(&authority))
            .await
            .err()
            .unwrap();
        assert!(err.to_string().starts_with("tcp connect error"), "{err}");
    }
}
