//! Keep-alive HTTP/1.1 connections to the engines, one idle list per engine address,
//! driven from the request's own task. A connection is leased to one request: its
//! head is written and the response head read right there, and the response body
//! ([`EngineBody`]) reads the rest from the socket as the client takes it. A body
//! read to its end hands the connection back ([`EngineBody::release`]); one cut short
//! (client gone, engine failed) closes it.
//!
//! hyper's client connection would do the same through a task of its own per
//! connection, with a channel for the request, another for the response and one for
//! each body: two task wake-ups and three hand-offs per request that this path does
//! not pay. The framing itself is [`super::h1`]'s (see `docs/performance.md`).
//!
//! An engine behind `https://` is reached over rustls ([`Io::Tls`]): the same framing
//! on the decrypted bytes, SNI from the URL's host, its connections kept apart from
//! plain ones to the same address.

use std::fmt;
use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::uri::Authority;
use http::{HeaderValue, Method, Response};
use http_body::{Body, Frame, SizeHint};
use parking_lot::Mutex;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_rustls::client::TlsStream;

use super::h1::{self, Chunked, Decoded, Framing, WireError};
use super::headers::UpstreamHeaders;
use crate::name_hash::NameMap;

/// An engine connection's read buffer starts this small: streams read events of a few
/// hundred bytes, and 1,000 open streams hold 1,000 of these buffers
/// (`scripts/streams_memory.sh`: at a fixed 16 KiB, 12 MB more than at 4 KiB; at
/// 4 KiB, about 4 MB more than at 1 KiB). A read that fills the room doubles the next
/// growth, up to [`MAX_READ_CHUNK`], so a large answer is still read in few calls.
const FIRST_READ_CHUNK: usize = 1024;
/// The most a read buffer grows by at once.
const MAX_READ_CHUNK: usize = 64 * 1024;
/// Below this much free room a read buffer grows first.
const MIN_READ_ROOM: usize = 256;
/// How long an engine that broke off reading a request has to have its answer read.
const EARLY_ANSWER: Duration = Duration::from_secs(2);

/// Why an exchange with an engine failed: connecting, sending, or reading the
/// response head or body.
#[derive(Debug)]
pub enum UpstreamError {
    Connect(io::Error),
    ConnectTimeout(Duration),
    /// The TLS handshake failed (the engine's certificate was not trusted, the
    /// engine refused ours, …) or there is no TLS client (`[tls]`).
    Tls(String),
    /// Writing the request or reading the response failed.
    Io(io::Error),
    /// The engine closed the connection before a complete response head.
    Closed,
    /// The engine closed the connection before the body's declared end.
    Cut,
    /// The response is not valid HTTP/1.1 (head or chunked framing).
    Wire(WireError),
    /// No response head by the request's deadline.
    Timeout,
}

impl fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpstreamError::Connect(e) => write!(f, "tcp connect error: {e}"),
            UpstreamError::ConnectTimeout(t) => {
                write!(f, "tcp connect timed out after {} ms", t.as_millis())
            }
            UpstreamError::Tls(e) => write!(f, "tls handshake failed: {e}"),
            UpstreamError::Io(e) => write!(f, "connection error: {e}"),
            UpstreamError::Closed => {
                write!(f, "connection closed before the response head")
            }
            UpstreamError::Cut => write!(f, "connection closed before the body was complete"),
            UpstreamError::Wire(e) => write!(f, "{e}"),
            UpstreamError::Timeout => write!(f, "no response head by the deadline"),
        }
    }
}

impl std::error::Error for UpstreamError {}

/// A connection's byte stream: plain TCP, or TLS over it.
enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Io {
    fn tcp(&self) -> &TcpStream {
        match self {
            Io::Plain(tcp) => tcp,
            Io::Tls(tls) => tls.get_ref().0,
        }
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Io::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

/// Writes `bufs` to `tcp` with one `sendmsg`, as tokio's vectored write does with
/// `writev`: the same bytes and segments, without the file layer `writev` goes
/// through on a socket (`vfs_writev`, the file-position lock; about 0.2 µs a request
/// at 256 connections, docs/performance.md "A fifteenth sitting").
fn poll_send_vectored(
    tcp: &TcpStream,
    cx: &mut Context<'_>,
    bufs: &[IoSlice<'_>],
) -> Poll<io::Result<usize>> {
    loop {
        ready!(tcp.poll_write_ready(cx))?;
        match tcp.try_io(tokio::io::Interest::WRITABLE, || {
            socket2::SockRef::from(tcp).send_vectored(bufs)
        }) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            done => return Poll::Ready(done),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_write(cx, b),
            Io::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, b),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(tcp) => poll_send_vectored(tcp, cx, bufs),
            Io::Tls(tls) => Pin::new(tls.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(tcp) => tcp.is_write_vectored(),
            Io::Tls(tls) => tls.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            Io::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Io::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Where idle connections wait: an engine's address, and whether they speak TLS.
/// Hashed and compared as the address's text, in one piece: `Authority`'s own `Hash`
/// lowercases and feeds SipHash a byte at a time, about 1,000 instructions per
/// request for a pool lookup and a return. A node's address is one text for its
/// whole life (from its URL), so exact comparison finds its connections.
#[derive(Clone)]
struct Origin {
    authority: Authority,
    tls: bool,
}

impl PartialEq for Origin {
    fn eq(&self, other: &Origin) -> bool {
        self.tls == other.tls && self.authority.as_str() == other.authority.as_str()
    }
}

impl Eq for Origin {}

impl std::hash::Hash for Origin {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.authority.as_str().hash(state);
        self.tls.hash(state);
    }
}

/// One connection to an engine, and the bytes read from it but not yet used.
struct Conn {
    io: Io,
    buf: BytesMut,
    /// How much the read buffer grows by next (doubles while reads fill it).
    read_chunk: usize,
    /// It has carried a request before (a stale one may fail; a fresh one should not).
    reused: bool,
    /// The timer of its requests' deadlines, kept across them (see [`Conn::poll_deadline`]).
    timer: Option<Pin<Box<Sleep>>>,
    /// The head of the request being written; its room is kept across requests.
    head: Vec<u8>,
}

impl Conn {
    /// Still usable after sitting idle: the engine has neither closed it nor sent
    /// anything unasked. Costs no system call while the socket has been quiet.
    fn usable(&self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(Waker::noop());
        // Over TLS too: anything the engine sent unasked (a close_notify, say) makes
        // the socket readable, and a connection that read it is not reused.
        let tcp = self.io.tcp();
        match tcp.poll_read_ready(&mut cx) {
            Poll::Pending => true,
            Poll::Ready(Err(_)) => false,
            // Readiness may be left over from the last read: ask the socket.
            Poll::Ready(Ok(())) => matches!(
                tcp.try_read(&mut [0u8; 1]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock
            ),
        }
    }

    /// Reads what the socket has into the buffer; `Ok(0)` at the engine's close.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < MIN_READ_ROOM {
            self.buf.reserve(self.read_chunk);
        }
        let room = self.buf.capacity() - self.buf.len();
        let read = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.io),
            cx,
            &mut self.buf
        ));
        if matches!(read, Ok(n) if n == room) {
            // The socket had at least as much as we had room for: more may be waiting.
            self.read_chunk = (self.read_chunk * 2).min(MAX_READ_CHUNK);
        }
        Poll::Ready(read)
    }

    /// Writes `req`: its head (encoded into [`Conn::head`]), then `body`.
    async fn write_request(&mut self, req: &Outgoing<'_>) -> io::Result<()> {
        self.head.clear();
        self.head
            .reserve(128 + req.target.len() + req.headers.written_len());
        h1::encode_request(
            req.method,
            req.target,
            req.host,
            req.headers,
            req.rank,
            req.body.len(),
            &mut self.head,
        );
        let (mut head, mut body) = (&self.head[..], &req.body[..]);
        while !head.is_empty() || !body.is_empty() {
            let n = self
                .io
                .write_vectored(&[IoSlice::new(head), IoSlice::new(body)])
                .await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let from_head = n.min(head.len());
            head = &head[from_head..];
            body = &body[n - from_head..];
        }
        // TLS may hold the last record back until flushed; TCP has nothing to flush.
        self.io.flush().await
    }

    /// Reads a response head, by `deadline` if there is one.
    async fn read_head(
        &mut self,
        method: &Method,
        deadline: Option<Instant>,
    ) -> Result<h1::ResponseHead, UpstreamError> {
        loop {
            // Nothing is buffered right after a request is written: read first.
            if !self.buf.is_empty() {
                if let Some(head) =
                    h1::parse_response(&mut self.buf, method).map_err(UpstreamError::Wire)?
                {
                    return Ok(head);
                }
            }
            let filled = poll_fn(|cx| match self.poll_fill(cx) {
                Poll::Ready(read) => Poll::Ready(read.map_err(UpstreamError::Io)),
                Poll::Pending => match deadline {
                    Some(d) => self
                        .poll_deadline(cx, d)
                        .map(|()| Err(UpstreamError::Timeout)),
                    None => Poll::Pending,
                },
            });
            if filled.await? == 0 {
                return Err(UpstreamError::Closed);
            }
        }
    }

    /// Ready once `deadline` has passed. A tokio timer set and cancelled for every
    /// request costs about 1,000 instructions; this one is the connection's, kept
    /// across its requests: armed once, moved earlier when a request's deadline is
    /// earlier than the one it holds, and otherwise moved only when it fires before
    /// the deadline (a past request's). With one budget per pool, successive requests'
    /// deadlines only grow, so a busy connection moves it about once per budget.
    fn poll_deadline(&mut self, cx: &mut Context<'_>, deadline: Instant) -> Poll<()> {
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() > deadline {
            timer.as_mut().reset(deadline);
        }
        loop {
            ready!(timer.as_mut().poll(cx));
            if timer.deadline() >= deadline {
                return Poll::Ready(());
            }
            timer.as_mut().reset(deadline);
        }
    }
}

/// The engine closed the connection with no answer at all (EOF, or a reset: the
/// request arrived after its close).
fn unanswered(e: &UpstreamError) -> bool {
    match e {
        UpstreamError::Closed => true,
        UpstreamError::Io(e) => e.kind() == io::ErrorKind::ConnectionReset,
        _ => false,
    }
}

/// An idle connection and since when.
struct Idle {
    conn: Conn,
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
    idle: Mutex<NameMap<Origin, Vec<Idle>>>,
    connect_timeout: Duration,
    /// How long an idle connection is kept for reuse.
    keep_idle: Duration,
}

/// A request for an engine, borrowed from the client's.
pub struct Outgoing<'r> {
    pub method: &'r Method,
    /// Origin-form path and query.
    pub target: &'r str,
    pub host: &'r HeaderValue,
    pub headers: &'r UpstreamHeaders,
    /// The data-parallel rank of a node that is one.
    pub rank: Option<&'r HeaderValue>,
    pub body: &'r Bytes,
    /// The TLS client, for an engine behind `https://`.
    pub tls: Option<&'r Arc<ClientConfig>>,
    /// The name its certificate is checked against, where it is not the authority's
    /// host ([`Node::tls_name`](crate::routing::node::Node::tls_name)).
    pub tls_name: Option<&'r str>,
}

impl Upstream {
    pub fn new(connect_timeout: Duration, keep_idle: Duration) -> Arc<Upstream> {
        Arc::new(Upstream {
            idle: Mutex::new(NameMap::default()),
            connect_timeout,
            keep_idle,
        })
    }

    /// Idle connections held now, across engines.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().values().map(Vec::len).sum()
    }

    /// Sends `req` to the engine at `authority` and reads the response head: on the
    /// most recently idle connection that is still open, else on a new one. A reused
    /// connection that fails while the request is written goes again on the next (the
    /// engine cannot have acted on part of a request); one the engine closes with no
    /// answer at all goes again once, on a new connection.
    ///
    /// With a `deadline`, a response head that has not come by then is
    /// [`UpstreamError::Timeout`] (connecting and writing count towards it). `now` is
    /// the caller's reading of the clock as it sends (idle connections older than
    /// [`Upstream`]'s keep-alive are not reused).
    pub async fn send(
        self: &Arc<Self>,
        authority: &Authority,
        req: Outgoing<'_>,
        now: Instant,
        deadline: Option<Instant>,
    ) -> Result<Response<EngineBody>, UpstreamError> {
        let origin = Origin {
            authority: authority.clone(),
            tls: req.tls.is_some(),
        };
        // The other connections this thread has ready run first (tokio polls a yielded
        // task again once it has polled for I/O events): the requests whose client
        // reads came in together then go to the engines back to back, and an engine
        // wakes once for several of them rather than once each, as the client does for
        // the responses (`server::h1`; docs/performance.md, "A sixteenth sitting").
        tokio::task::yield_now().await;
        // Set once a reused connection closed unanswered: the next goes on a new one.
        let mut new_only = false;
        let (conn, head) = loop {
            let checked_out = if new_only {
                None
            } else {
                self.checkout(&origin, now)
            };
            let mut conn = match checked_out {
                Some(conn) => conn,
                // Boxed: connecting (TLS included) is a large future and a rare one;
                // inline, its size would be copied with every request's future.
                None => {
                    let connect = self.connect(authority, req.tls, req.tls_name);
                    Box::pin(within(deadline, connect)).await??
                }
            };
            match within(deadline, conn.write_request(&req)).await? {
                Ok(()) => {}
                Err(e) => {
                    // An engine may answer before it has read the whole body (a 413 for
                    // one too large) and close: that answer, not the broken write, is
                    // what the request gets. The connection is spent either way.
                    let early =
                        tokio::time::timeout(EARLY_ANSWER, conn.read_head(req.method, deadline));
                    match early.await {
                        Ok(Ok(mut head)) => {
                            head.reusable = false;
                            return Ok(self.response(origin, head, conn));
                        }
                        // A reused connection the engine had closed meanwhile: it saw
                        // nothing of this request, which goes again on the next one.
                        _ if conn.reused => continue,
                        _ => return Err(UpstreamError::Io(e)),
                    }
                }
            }
            match conn.read_head(req.method, deadline).await {
                Ok(head) => break (conn, head),
                // A reused connection closed (or reset) without a byte of answer: the
                // engine closed it as idle while the request was on its way (llama.cpp
                // and uvicorn close idle connections after 5 s; a busy host can hold
                // a request past the pool's 4 s). The request goes again, once, on a
                // new connection, as nginx retries one that fails on a cached
                // keepalive connection. An engine that died fails to connect then.
                Err(e) if conn.reused && !new_only && conn.buf.is_empty() && unanswered(&e) => {
                    new_only = true;
                }
                Err(e) => return Err(e),
            }
        };
        Ok(self.response(origin, head, conn))
    }

    /// The response of a head read from `conn`, with the body that reads the rest.
    fn response(
        self: &Arc<Self>,
        origin: Origin,
        head: h1::ResponseHead,
        conn: Conn,
    ) -> Response<EngineBody> {
        let body = EngineBody {
            decoding: match head.framing {
                Framing::Empty | Framing::Length(0) => Decoding::Done,
                Framing::Length(n) => Decoding::Length(n),
                Framing::Chunked => Decoding::Chunked(Chunked::default()),
                Framing::UntilClose => Decoding::UntilClose,
            },
            reusable: head.reusable,
            conn: Some(conn),
            home: Some((self.clone(), origin)),
        };
        Response::from_parts(head.parts, body)
    }

    fn put_back(&self, origin: Origin, mut conn: Conn, now: Instant) {
        conn.reused = true;
        let idle = Idle { conn, since: now };
        self.idle.lock().entry(origin).or_default().push(idle);
    }

    /// Closes the closed and expired idle connections of every engine, and forgets
    /// the engines left with none (engines that left the fleet are otherwise never
    /// asked again). Called on the health checker's beat, off the serving threads; the
    /// sockets are closed after the lock is let go, so a request wanting a connection
    /// meanwhile does not wait for a burst's worth of closes.
    pub fn sweep(&self) {
        let now = Instant::now();
        let mut stale = Vec::new();
        self.idle.lock().retain(|_, list| {
            let (keep, gone): (Vec<Idle>, Vec<Idle>) = std::mem::take(list)
                .into_iter()
                .partition(|c| c.fresh(now, self.keep_idle) && c.conn.usable());
            *list = keep;
            stale.extend(gone);
            !list.is_empty()
        });
        drop(stale);
    }

    /// The newest usable idle connection at `now`. Expired ones are left for
    /// [`Upstream::sweep`]: after a burst (a thousand streams) hundreds expire
    /// together, and closing them here put every close on one request's path (about 3 ms
    /// for the first request 4 s after a burst of 1,000 connections).
    fn checkout(&self, origin: &Origin, now: Instant) -> Option<Conn> {
        let mut idle = self.idle.lock();
        let list = idle.get_mut(origin)?;
        // The newest are at the back: once the last has expired, so have the rest.
        while list.last().is_some_and(|c| c.fresh(now, self.keep_idle)) {
            let c = list.pop()?;
            if c.conn.usable() {
                return Some(c.conn);
            }
        }
        None
    }

    /// A new connection, its TLS handshake (SNI and the certificate's name: `tls_name`,
    /// else the host) included in `connect_timeout`.
    async fn connect(
        &self,
        authority: &Authority,
        tls: Option<&Arc<ClientConfig>>,
        tls_name: Option<&str>,
    ) -> Result<Conn, UpstreamError> {
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority
            .port_u16()
            .unwrap_or(if tls.is_some() { 443 } else { 80 });
        let connect = async {
            let tcp = TcpStream::connect((host, port))
                .await
                .map_err(UpstreamError::Connect)?;
            tcp.set_nodelay(true).map_err(UpstreamError::Connect)?;
            let Some(tls) = tls else {
                return Ok(Io::Plain(tcp));
            };
            let named = tls_name.unwrap_or(host);
            let name = ServerName::try_from(named.to_string())
                .map_err(|e| UpstreamError::Tls(format!("{named:?} is no server name: {e}")))?;
            let stream = tokio_rustls::TlsConnector::from(tls.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| UpstreamError::Tls(e.to_string()))?;
            Ok(Io::Tls(Box::new(stream)))
        };
        let io = tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| UpstreamError::ConnectTimeout(self.connect_timeout))??;
        Ok(Conn {
            io,
            buf: BytesMut::with_capacity(FIRST_READ_CHUNK),
            read_chunk: FIRST_READ_CHUNK,
            reused: false,
            timer: None,
            head: Vec::new(),
        })
    }
}

/// `fut`, by `deadline` if there is one. It is polled once before any timer is made:
/// connecting and writing a request usually finish at once.
async fn within<F: Future>(deadline: Option<Instant>, fut: F) -> Result<F::Output, UpstreamError> {
    let mut fut = std::pin::pin!(fut);
    if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        return Ok(out);
    }
    match deadline {
        Some(d) => tokio::time::timeout_at(d, fut)
            .await
            .map_err(|_| UpstreamError::Timeout),
        None => Ok(fut.await),
    }
}

/// Where a body is in its framing.
#[derive(Debug)]
enum Decoding {
    /// This many bytes to go.
    Length(u64),
    Chunked(Chunked),
    UntilClose,
    /// Read to its end.
    Done,
}

/// An engine's response body, read from the connection as it is polled.
pub struct EngineBody {
    decoding: Decoding,
    /// The connection may carry the next request once the body is done.
    reusable: bool,
    /// `None` once the body failed (the connection is closed) or was handed back.
    conn: Option<Conn>,
    /// The pool and engine the connection goes back to.
    home: Option<(Arc<Upstream>, Origin)>,
}

impl EngineBody {
    /// Hands the connection back for the next request if the body was read to its
    /// end and the engine keeps the connection open; otherwise it is closed. `now`:
    /// the caller's reading of the clock (the connection is idle from then).
    pub fn release(&mut self, now: Instant) {
        let done = matches!(self.decoding, Decoding::Done);
        if let (true, true, Some(conn), Some((upstream, origin))) =
            (done, self.reusable, self.conn.take(), self.home.take())
        {
            upstream.put_back(origin, conn, now);
        }
    }

    fn fail(&mut self, e: UpstreamError) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        self.conn = None;
        self.decoding = Decoding::Done;
        self.reusable = false;
        Poll::Ready(Some(Err(e)))
    }
}

impl Body for EngineBody {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let buffered = !conn.buf.is_empty();
            match &mut this.decoding {
                Decoding::Done => return Poll::Ready(None),
                Decoding::Length(left) if buffered => {
                    let n = (conn.buf.len() as u64).min(*left);
                    *left -= n;
                    if *left == 0 {
                        this.decoding = Decoding::Done;
                    }
                    let data = conn.buf.split_to(n as usize).freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Decoding::UntilClose if buffered => {
                    let data = conn.buf.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Decoding::Chunked(chunked) if buffered => match chunked.decode(&mut conn.buf) {
                    Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(Decoded::End) => {
                        this.decoding = Decoding::Done;
                        return Poll::Ready(None);
                    }
                    Ok(Decoded::NeedMore) => {}
                    Err(e) => return this.fail(UpstreamError::Wire(e)),
                },
                _ => {}
            }
            match ready!(conn.poll_fill(cx)) {
                Ok(0) if matches!(this.decoding, Decoding::UntilClose) => {
                    this.decoding = Decoding::Done;
                    this.reusable = false;
                    return Poll::Ready(None);
                }
                Ok(0) => return this.fail(UpstreamError::Cut),
                Ok(_) => {}
                Err(e) => return this.fail(UpstreamError::Io(e)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.decoding, Decoding::Done)
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoding {
            Decoding::Done => SizeHint::with_exact(0),
            Decoding::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests;
