//! The HTTP accept loop shared by the balancer, the admin listener and `mock-engine`:
//! hyper-util's `auto` server (HTTP/1.1 and h2c) with the limits a public port needs
//! ([`ConnLimits`]), back-off after accept errors, and a graceful shutdown that lets
//! open connections finish within a grace period.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

use super::head_timer::{Activity, Answer, HeadWatch};
use crate::config::ServerConfig;
use crate::proxy::body::BoxBody;

/// Per-listener connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Time to receive a request head. It also bounds a new connection's first bytes
    /// (before the protocol is known) and, on a kept-alive HTTP/1.1 connection, the
    /// idle wait for the next request (from the end of the last response; see
    /// [`super::head_timer`]).
    pub header_read_timeout: Duration,
    /// HTTP/1.1 header fields: a head with this many or more gets 431.
    pub max_headers: usize,
    /// Largest request head: HTTP/1.1 read buffer, HTTP/2 header list.
    pub max_header_bytes: usize,
    /// HTTP/2 keep-alive PING interval, and the time to answer one.
    pub http2_keep_alive_interval: Duration,
    /// Open connections at most; past it, new ones wait in the kernel's backlog.
    pub max_connections: usize,
    /// A response write the client does not take for this long closes the connection
    /// (so a client that stops reading cannot hold a node's slot).
    pub write_stall_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_read_timeout: Duration::from_secs(10),
            max_headers: 100,
            max_header_bytes: 64 * 1024,
            http2_keep_alive_interval: Duration::from_secs(20),
            max_connections: 10_000,
            write_stall_timeout: Duration::from_secs(120),
        }
    }
}

/// The most header fields hyper's HTTP/1.1 server takes when not told otherwise.
const HYPER_MAX_HEADERS: usize = 100;

impl ConnLimits {
    /// The balancer listener's limits from `[server]`.
    pub fn of(s: &ServerConfig) -> ConnLimits {
        ConnLimits {
            header_read_timeout: s.header_read_timeout,
            max_headers: s.max_headers,
            max_header_bytes: s.max_header_bytes,
            http2_keep_alive_interval: s.http2_keep_alive_interval,
            max_connections: s.max_connections,
            write_stall_timeout: s.idle_stream_timeout,
        }
    }

    fn builder(&self) -> auto::Builder<TokioExecutor> {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        let mut http1 = builder.http1();
        // `header_read_timeout` is not hyper's to keep: hyper would set a timer for
        // every request head; each connection keeps one of its own ([`head_timer`]).
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(None)
            .max_buf_size(self.max_header_bytes.max(8192));
        // hyper's own limit is 100 header fields, kept on the stack uninitialized; set
        // explicitly (even to 100), it builds a 100-entry array per request head, about
        // 1,500 instructions. So only a different limit is handed to it.
        if self.max_headers != HYPER_MAX_HEADERS {
            http1.max_headers(self.max_headers);
        }
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(self.http2_keep_alive_interval)
            .keep_alive_timeout(self.http2_keep_alive_interval)
            .max_header_list_size(self.max_header_bytes.min(u32::MAX as usize) as u32);
        builder
    }
}

/// Serves `handler` on `listener` until `shutdown` resolves, then waits up to `grace`
/// for open connections (and their streams) to finish.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnLimits,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    serve_with_slots(listener, handler, shutdown, grace, limits, slots).await;
}

/// [`serve`], counting open connections in `slots` (shared by the listeners of one
/// port's serving lanes, so `max_connections` holds for the port).
pub async fn serve_with_slots<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnLimits,
    slots: Arc<Semaphore>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let builder = limits.builder();
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut backoff = Duration::from_millis(5);
    loop {
        // At the connection cap, stop accepting: new clients wait in the backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Typically EMFILE: wait for descriptors to free instead of spinning.
                    tracing::warn!(error = %e, "accept failed; backing off {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        backoff = Duration::from_millis(5);
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let activity = Activity::new();
        let service = {
            let activity = activity.clone();
            service_fn(move |req: Request<Incoming>| {
                let answering = activity.answering(req.version());
                // Boxed: a request's future is ~6.6 KB (its routing, attempts and
                // relay; `-Zprint-type-sizes`). hyper keeps a slot of the service
                // future's size for each connection's whole life, idle or not, and
                // each request copied it twice (into that slot, then into this
                // block's await); boxed, the slot holds a pointer, the future lives
                // only while its request does and is copied once.
                let response = Box::pin(handler(req, peer));
                async move {
                    let response = response.await;
                    Ok::<_, Infallible>(response.map(|body| Answer::new(body, answering)))
                }
            })
        };
        let head = HeadWatch::new(activity, limits.header_read_timeout);
        let io = WriteWatch::new(TokioIo::new(stream), head, limits.write_stall_timeout);
        let conn = builder.serve_connection(io, service).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace of {grace:?} ran out; closing the remaining connections");
        }
    }
}

/// A client connection whose writes fail once the client has taken nothing for
/// `stall` while we had bytes to send: hyper then closes the connection, which drops
/// the response body (and so the upstream exchange and the node's slot). Its reads
/// fail once it has waited `header_read_timeout` for a request head ([`HeadWatch`]).
struct WriteWatch {
    inner: TokioIo<TcpStream>,
    head: HeadWatch,
    stall: Duration,
    /// Armed when a write first has to wait.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl WriteWatch {
    fn new(inner: TokioIo<TcpStream>, head: HeadWatch, stall: Duration) -> Self {
        WriteWatch {
            inner,
            head,
            stall,
            waiting: None,
        }
    }

    /// Passes a write's result on, turning a wait longer than `stall` into an error.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.waiting = None;
            return poll;
        }
        let stall = self.stall;
        let timer = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no response bytes for {stall:?}"),
            )));
        }
        Poll::Pending
    }
}

impl Read for WriteWatch {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if poll.is_pending() && self.head.poll_lapsed(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no request head within header_read_timeout",
            )));
        }
        poll
    }
}

impl Write for WriteWatch {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn termination() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
