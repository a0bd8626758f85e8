//! The HTTP accept loop shared by the balancer, the admin listener and `mock-engine`:
//! HTTP/1.1 served by the balancer's own server ([`super::h1`]), a connection that
//! opens with the HTTP/2 preface handed to hyper's HTTP/2 server (h2c), HTTPS where
//! the port has a certificate ([`super::tls`]: HTTP/2 or HTTP/1.1 by ALPN), the
//! limits a public port needs ([`ConnLimits`]), back-off after accept errors, and a
//! graceful shutdown that lets open connections finish within a grace period.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::Incoming;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use super::h1::conn::{self, Ended, Stop};
use super::head_timer::{Activity, Answer, HeadWatch};
use super::tls::{Accepted, ClientTls};
use super::window_watch::Windows;
use crate::config::ServerConfig;
use crate::proxy::body::BoxBody;
use crate::proxy::request_body::RequestBody;
use crate::proxy::tenant::CertifiedName;
use crate::telemetry::metrics::RequestMetrics;
use crate::telemetry::outcome::RequestOutcome;

/// Per-listener connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Time to receive a request head. It also bounds a new connection's first bytes
    /// (before the protocol is known) and, on a kept-alive HTTP/1.1 connection, the
    /// idle wait for the next request (from the end of the last response; see
    /// [`super::h1::conn`] and, for HTTP/2, [`super::head_timer`]).
    pub header_read_timeout: Duration,
    /// HTTP/1.1 header fields: a head with this many or more gets 431.
    pub max_headers: usize,
    /// Largest request head (HTTP/1.1: then 431; HTTP/2: the header list).
    pub max_header_bytes: usize,
    /// HTTP/2 keep-alive PING interval, and the time to answer one.
    pub http2_keep_alive_interval: Duration,
    /// Open connections at most; past it, new ones wait unserved (one per accept loop
    /// accepted, the rest in the kernel's backlog).
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

    /// hyper's HTTP/2 server, for connections that open with the preface.
    fn http2(&self) -> http2::Builder<TokioExecutor> {
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder
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
    tls: Option<Arc<ClientTls>>,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnLimits,
) where
    H: Fn(Request<RequestBody>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let mut port = Port::alone(listener, &limits, None, None);
    port.tls = tls;
    serve_port(port, handler, shutdown, grace, limits).await;
}

/// A client connection's byte stream: plain TCP, or TLS over it.
pub trait ClientIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// Reads into `buf` what the connection can give without waiting (`WouldBlock`
    /// when it has nothing; `Ok(0)` at its end).
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize>;

    /// The name in the certificate the client showed (TLS with client certificates).
    fn certified_name(&self) -> Option<CertifiedName> {
        None
    }
}

impl ClientIo for TcpStream {
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        TcpStream::try_read_buf(self, buf)
    }
}

impl ClientIo for tokio_rustls::server::TlsStream<TcpStream> {
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        super::tls::try_read_buf(self, buf)
    }

    fn certified_name(&self) -> Option<CertifiedName> {
        super::tls::certified_name(self)
    }
}

/// A listener and what its connections count against.
pub struct Port {
    pub listener: TcpListener,
    /// Slots under the port's `max_connections` (shared by a port's serving lanes).
    pub slots: Arc<Semaphore>,
    /// Counts its open connections, where they are counted.
    pub open: Option<IntGauge>,
    /// Counts the request heads it refuses (`requests_total`, pool and node `none`),
    /// where requests are counted.
    pub refusals: Option<Arc<RequestMetrics>>,
    /// Its TLS server, when it serves HTTPS.
    pub tls: Option<Arc<ClientTls>>,
}

/// What an open client connection holds until it closes: its slot under the port's
/// `max_connections` and, where connections are counted, its place in the count.
struct Hold {
    _slot: OwnedSemaphorePermit,
    open: Option<IntGauge>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(open) = &self.open {
            open.dec();
        }
    }
}

impl Port {
    /// A port served by one accept loop: `max_connections` slots of its own.
    pub fn alone(
        listener: TcpListener,
        limits: &ConnLimits,
        open: Option<IntGauge>,
        refusals: Option<Arc<RequestMetrics>>,
    ) -> Port {
        Port {
            listener,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            open,
            refusals,
            tls: None,
        }
    }

    /// Accepts one connection and waits for a free slot for it; `None` once `shutdown`
    /// resolves. At the cap the accepted connection waits here, not served nor
    /// counted, and the next ones in the kernel's backlog: a slot is taken only for a
    /// connection in hand, since a lane that took one before its `accept` would hold it
    /// while the kernel queued the next client on another lane's listener. Accept
    /// errors (typically EMFILE) back off, doubling up to a second, instead of spinning.
    async fn accept<S: Future<Output = ()>>(
        &self,
        shutdown: &mut Pin<&mut S>,
    ) -> Option<(TcpStream, SocketAddr, Hold)> {
        let mut backoff = Duration::from_millis(5);
        let (stream, peer) = loop {
            tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok(accepted) => break accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed; backing off {backoff:?}");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = shutdown.as_mut() => return None,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                },
                _ = shutdown.as_mut() => return None,
            }
        };
        let slot = tokio::select! {
            slot = self.slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            _ = shutdown.as_mut() => return None,
        };
        let _ = stream.set_nodelay(true);
        if let Some(open) = &self.open {
            open.inc();
        }
        let hold = Hold {
            _slot: slot,
            open: self.open.clone(),
        };
        Some((stream, peer, hold))
    }
}

/// Serves `handler` on the connections of `port` until `shutdown` resolves, then
/// waits up to `grace` for open connections (and their streams) to finish.
pub async fn serve_port<H, F>(
    port: Port,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnLimits,
) where
    H: Fn(Request<RequestBody>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    // HTTP/1.1 connections watch this; once it says stop, each closes when idle, and
    // `closed()` resolves when the last has dropped its receiver.
    let (stop, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let service = Service {
        handler,
        h2: limits.http2(),
        limits,
        refusals: port.refusals.clone(),
    };
    while let Some((stream, peer, hold)) = port.accept(&mut shutdown).await {
        let service = service.clone();
        let stop = Stop::new(stop_rx.clone());
        let watcher = graceful.watcher();
        let tls = port.tls.clone();
        tokio::spawn(async move {
            let _hold = hold;
            let Some(tls) = tls else {
                return service.serve(stream, peer, stop, watcher).await;
            };
            match tls.accept(stream, limits.header_read_timeout).await {
                Ok(Accepted {
                    stream,
                    http2: true,
                }) => {
                    service
                        .serve_http2(watcher, stream, BytesMut::new(), peer)
                        .await
                }
                Ok(Accepted { stream, .. }) => service.serve(stream, peer, stop, watcher).await,
                Err((refusal, e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    if let Some(requests) = &service.refusals {
                        requests.count_tls_refusal(refusal.as_str());
                    }
                }
            }
        });
    }
    drop(port);
    drop(stop_rx);
    let _ = stop.send(true);
    let drained = async { tokio::join!(graceful.shutdown(), stop.closed()) };
    tokio::select! {
        _ = drained => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("shutdown grace of {grace:?} ran out; closing the remaining connections");
        }
    }
}

/// What every connection of a port is served with.
#[derive(Clone)]
struct Service<H> {
    handler: H,
    limits: ConnLimits,
    /// hyper's HTTP/2 server, for connections that speak HTTP/2.
    h2: http2::Builder<TokioExecutor>,
    /// Where refused request heads are counted.
    refusals: Option<Arc<RequestMetrics>>,
}

impl<H, F> Service<H>
where
    H: Fn(Request<RequestBody>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    /// One client connection: HTTP/1.1, or HTTP/2 if it opens with the preface.
    async fn serve<IO: ClientIo>(self, stream: IO, peer: SocketAddr, stop: Stop, watcher: Watcher) {
        match conn::serve(stream, peer, &self.handler, &self.limits, stop).await {
            Ended::Closed => {}
            Ended::Refused(status) => {
                if let Some(requests) = &self.refusals {
                    let outcome = RequestOutcome::of_status(status.as_u16());
                    requests.count_unanswered("none", outcome);
                }
            }
            Ended::Http2(stream, read) => self.serve_http2(watcher, stream, read, peer).await,
        }
    }

    /// An HTTP/2 connection (its preface, if already read, in `read`), served by hyper.
    async fn serve_http2<IO: ClientIo>(
        self,
        graceful: Watcher,
        stream: IO,
        read: BytesMut,
        peer: SocketAddr,
    ) {
        let Service {
            handler,
            limits,
            h2,
            ..
        } = self;
        let activity = Activity::new();
        let windows = Windows::new(limits.write_stall_timeout);
        let certified = stream.certified_name();
        let service = {
            let activity = activity.clone();
            service_fn(move |mut req: Request<Incoming>| {
                if let Some(name) = &certified {
                    req.extensions_mut().insert(name.clone());
                }
                let answering = activity.answering(req.version());
                let response = Box::pin(handler(req.map(RequestBody::from), peer));
                let windows = windows.clone();
                async move {
                    let response = response.await;
                    Ok::<_, Infallible>(
                        response.map(|body| Answer::new(windows.watch(body), answering)),
                    )
                }
            })
        };
        let head = HeadWatch::new(activity, limits.header_read_timeout);
        let io = Replay {
            read: read.freeze(),
            io: stream,
        };
        let io = WriteWatch::new(TokioIo::new(io), head, limits.write_stall_timeout);
        if let Err(e) = graceful.watch(h2.serve_connection(io, service)).await {
            tracing::debug!(%peer, error = %e, "connection ended");
        }
    }
}

/// A stream whose first reads return bytes already read from it.
struct Replay<IO> {
    read: Bytes,
    io: IO,
}

impl<IO: ClientIo> AsyncRead for Replay<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.read.is_empty() {
            let n = self.read.len().min(buf.remaining());
            buf.put_slice(&self.read.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: ClientIo> AsyncWrite for Replay<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// An HTTP/2 client connection whose writes fail once the client has taken nothing for
/// `stall` while we had bytes to send: hyper then closes the connection, which drops
/// the response body (and so the upstream exchange and the node's slot). Its reads
/// fail once it has waited `header_read_timeout` for a request head ([`HeadWatch`]).
struct WriteWatch<IO> {
    inner: TokioIo<Replay<IO>>,
    head: HeadWatch,
    stall: Duration,
    /// Armed when a write first has to wait.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<IO: ClientIo> WriteWatch<IO> {
    fn new(inner: TokioIo<Replay<IO>>, head: HeadWatch, stall: Duration) -> Self {
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

impl<IO: ClientIo> Read for WriteWatch<IO> {
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

impl<IO: ClientIo> Write for WriteWatch<IO> {
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
