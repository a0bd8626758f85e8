//! One client connection served as HTTP/1.1: read a head ([`super::request`]), hand
//! the request to the handler, write its response ([`super::response`]), and go
//! again while both sides keep the connection. One task does it all; the handler's
//! future is polled from it, so a request costs no channel, no task and no timer of
//! its own.
//!
//! While a request is answered the connection keeps reading: body bytes go to the
//! handler as it asks for them ([`BodyPipe`]), bytes of a next request wait in the
//! buffer, and the client's close cancels the answer (the handler's future, and with
//! it the engine's exchange, is dropped). Three limits hold: `header_read_timeout`
//! from the connection's start and from each response's end until the next head is
//! in; a response write the client takes nothing of for `write_stall_timeout`; and
//! the head's size and field count.

use std::future::{poll_fn, Future};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use http::{Request, Response};
use http_body::Body;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use super::request::{
    is_h2_preface, parse_request, BodyFraming, HeadError, HeadLimits, RequestHead,
};
use super::response::{encode_head, push_chunk, Asked, Framing, CONTINUE, LAST_CHUNK};
use crate::proxy::body::BoxBody;
use crate::proxy::h1::{Chunked, Decoded};
use crate::proxy::request_body::{body_pipe, BodyPipe, RequestBody};
use crate::server::listener::{ClientIo, ConnLimits};

/// Room made before a read.
const READ_SIZE: usize = 32 * 1024;
/// A response's bytes are gathered up to this much before they are written.
const WRITE_AT: usize = 64 * 1024;
/// The most of a request body nobody read that is read and dropped to keep the
/// connection; past it, the connection is closed after the response.
const DRAIN_MAX: u64 = 64 * 1024;
/// A body up to this size that has not all come with its head is read on from the
/// socket before the handler is called, as far as the socket already holds it.
const EAGER_BODY: u64 = 256 * 1024;

/// How a connection's HTTP/1.1 service ended.
pub enum Ended<IO> {
    /// Done: closed, or to be closed.
    Closed,
    /// A head was refused with this status (answered, and the connection closed).
    Refused(http::StatusCode),
    /// The client opened with the HTTP/2 preface: these bytes have been read.
    Http2(IO, BytesMut),
}

/// The listener's shutdown, as one connection sees it.
pub struct Stop {
    rx: watch::Receiver<bool>,
    changed: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl Stop {
    pub fn new(rx: watch::Receiver<bool>) -> Stop {
        let mut watched = rx.clone();
        Stop {
            rx,
            changed: Box::pin(async move {
                let _ = watched.wait_for(|stop| *stop).await;
            }),
        }
    }

    /// Asked once a request: a version check first (an atomic read), since taking the
    /// channel's read lock would move its cache line between the serving cores.
    fn is_stopping(&self) -> bool {
        match self.rx.has_changed() {
            Ok(false) => false,
            _ => *self.rx.borrow(),
        }
    }

    /// Ready once the listener is shutting down.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.changed.as_mut().poll(cx)
    }
}

/// A request body's remainder, as the connection feeds it to the handler.
enum Feed {
    /// All of it has been handed over (or there was none).
    Done,
    Length {
        pipe: BodyPipe,
        left: u64,
    },
    Chunked {
        pipe: BodyPipe,
        decoder: Chunked,
    },
    /// The handler dropped the body with this much unread.
    Unread(u64),
    /// The body's framing broke, or a chunked body was left unread: the connection
    /// cannot find the next request.
    Lost,
}

impl Feed {
    /// Whether the connection can find the next request after this one's response:
    /// the body was all handed over, or what is left of it can be read past.
    fn can_finish(&self) -> bool {
        match self {
            Feed::Done => true,
            Feed::Length { left, .. } | Feed::Unread(left) => *left <= DRAIN_MAX,
            Feed::Chunked { .. } | Feed::Lost => false,
        }
    }
}

/// Serves HTTP/1.1 on `io` until either side ends it.
pub async fn serve<IO, H, F>(
    io: IO,
    peer: SocketAddr,
    handler: &H,
    limits: &ConnLimits,
    mut stop: Stop,
) -> Ended<IO>
where
    IO: ClientIo,
    H: Fn(Request<RequestBody>, SocketAddr) -> F,
    F: Future<Output = Response<BoxBody>> + Send + 'static,
{
    let mut conn = Conn {
        io,
        buf: BytesMut::new(),
        out: Vec::new(),
        written: 0,
        head_limits: HeadLimits {
            max_fields: limits.max_headers,
            max_bytes: limits.max_header_bytes,
        },
        head_timeout: limits.header_read_timeout,
        head_deadline: Instant::now() + limits.header_read_timeout,
        head_timer: None,
        stall_timeout: limits.write_stall_timeout,
        stall_timer: None,
    };
    let certified = conn.io.certified_name();
    let mut first = true;
    loop {
        if conn.buf.is_empty() {
            // Let the last request's buffer go: the next read takes whichever the
            // allocator freed last (another connection's, still in cache), where this
            // one's would be written further along each request, on cold lines.
            conn.buf = BytesMut::new();
        }
        let head = match conn.read_head(first, &mut stop).await {
            HeadRead::Head(head) => head,
            HeadRead::Http2 => return Ended::Http2(conn.io, conn.buf),
            HeadRead::Closed => return Ended::Closed,
            HeadRead::Refused(e) => {
                conn.refuse(&e).await;
                return Ended::Refused(e.status());
            }
        };
        first = false;
        let RequestHead {
            mut parts,
            body,
            keep_alive,
            mut expect_continue,
        } = head;
        let (body, mut feed) = conn.body(body);
        if matches!(feed, Feed::Done) {
            expect_continue = false;
        }
        if let Some(name) = &certified {
            parts.extensions.insert(name.clone());
        }
        let method = parts.method.clone();
        let version = parts.version;
        let mut answer = Box::pin(handler(Request::from_parts(parts, body), peer));
        let served =
            poll_fn(|cx| conn.poll_serve(cx, answer.as_mut(), &mut feed, &mut expect_continue))
                .await;
        drop(answer);
        let Ok(response) = served else {
            return Ended::Closed;
        };
        let asked = Asked {
            method: &method,
            version,
            keep_alive: keep_alive && feed.can_finish() && !stop.is_stopping(),
        };
        // The other connections this thread has ready run first (tokio polls a
        // yielded task again once it has polled for I/O events): the responses whose
        // engine answers came in together then go out back to back, after their reads,
        // as HAProxy sends its own, and a client holding many connections wakes once
        // for several of them rather than once each (docs/performance.md, "A fifteenth
        // sitting").
        tokio::task::yield_now().await;
        let Ok(keep) = conn.write_response(response, asked).await else {
            return Ended::Closed;
        };
        conn.head_deadline = Instant::now() + conn.head_timeout;
        if !keep || !conn.finish_body(feed).await {
            conn.close().await;
            return Ended::Closed;
        }
    }
}

// Returned once a request and moved straight on: a box would be an allocation more.
#[allow(clippy::large_enum_variant)]
enum HeadRead {
    Head(RequestHead),
    Http2,
    Closed,
    Refused(HeadError),
}

struct Conn<IO> {
    io: IO,
    /// Bytes read and not yet used.
    buf: BytesMut,
    /// Bytes to write, of which `written` have been.
    out: Vec<u8>,
    written: usize,
    head_limits: HeadLimits,
    head_timeout: std::time::Duration,
    /// When the wait for the next head runs out.
    head_deadline: Instant,
    /// Armed once, and moved to `head_deadline` only when it fires early.
    head_timer: Option<Pin<Box<Sleep>>>,
    stall_timeout: std::time::Duration,
    /// Armed when a write first has to wait; cleared when one makes progress.
    stall_timer: Option<Pin<Box<Sleep>>>,
}

impl<IO: ClientIo> Conn<IO> {
    async fn read_head(&mut self, first: bool, stop: &mut Stop) -> HeadRead {
        // How much of the buffer has been searched for a head's end: a head that
        // comes in pieces is parsed once it can be whole, not again at every piece
        // (which, for a client sending a byte at a time, is quadratic).
        let mut searched = 0;
        loop {
            if !self.buf.is_empty() && self.head_may_end(&mut searched) {
                let h2 = if first {
                    is_h2_preface(&self.buf)
                } else {
                    Some(false)
                };
                match h2 {
                    Some(true) => return HeadRead::Http2,
                    None => {}
                    Some(false) => match parse_request(&mut self.buf, self.head_limits) {
                        Ok(Some(head)) => return HeadRead::Head(head),
                        Ok(None) => {}
                        Err(e) => return HeadRead::Refused(e),
                    },
                }
            }
            let more = poll_fn(|cx| {
                match self.poll_read(cx, READ_SIZE) {
                    Poll::Ready(Ok(n)) => return Poll::Ready(n > 0),
                    Poll::Ready(Err(_)) => return Poll::Ready(false),
                    Poll::Pending => {}
                }
                if self.buf.is_empty() && stop.poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                self.poll_head_timer(cx).map(|()| false)
            })
            .await;
            if !more {
                return HeadRead::Closed;
            }
        }
    }

    /// Whether the head should be parsed now: on the first look, when the bytes read
    /// since the last look can end a head (an empty line), or when the buffer has
    /// reached the head limit (the parser then says what is wrong).
    fn head_may_end(&self, searched: &mut usize) -> bool {
        let first_look = *searched == 0;
        let from = searched.saturating_sub(2);
        *searched = self.buf.len();
        // The first look parses whatever came: bytes that are not HTTP at all (a TLS
        // handshake on a plain port) are refused at once, not at the head timeout.
        first_look
            || self.buf.len() >= self.head_limits.max_bytes
            || memchr::memmem::find(&self.buf[from..], b"\n\r\n").is_some()
            || memchr::memmem::find(&self.buf[from..], b"\n\n").is_some()
    }

    /// The request's body, and what the connection still has to feed it.
    fn body(&mut self, framing: BodyFraming) -> (RequestBody, Feed) {
        match framing {
            BodyFraming::Length(0) => (RequestBody::empty(), Feed::Done),
            BodyFraming::Length(n) if self.has_whole(n) => {
                let whole = self.buf.split_to(n as usize).freeze();
                (RequestBody::Whole(Some(whole)), Feed::Done)
            }
            BodyFraming::Length(n) => {
                let (pipe, receiver) = body_pipe();
                (
                    RequestBody::Arriving(receiver, Some(n)),
                    Feed::Length { pipe, left: n },
                )
            }
            BodyFraming::Chunked => {
                let (pipe, receiver) = body_pipe();
                let decoder = Chunked::default();
                (
                    RequestBody::Arriving(receiver, None),
                    Feed::Chunked { pipe, decoder },
                )
            }
        }
    }

    /// Whether a body of `n` bytes is in the buffer, after reading what the socket
    /// already holds of it if it is no larger than [`EAGER_BODY`]: a body sent with its
    /// head (as clients send them) is then handed over whole, in one piece, whatever
    /// the size of the read that brought the head.
    fn has_whole(&mut self, n: u64) -> bool {
        if self.buf.len() as u64 >= n {
            return true;
        }
        if n > EAGER_BODY {
            return false;
        }
        while (self.buf.len() as u64) < n {
            // Room for what is missing, a read's worth at a time: nothing is set
            // aside for bytes the socket does not have (a declared length is a claim).
            self.make_room(n as usize - self.buf.len());
            match self.io.try_read_buf(&mut self.buf) {
                Ok(read) if read > 0 => {}
                _ => return false,
            }
        }
        true
    }

    /// Polls the handler, feeding it its body and watching the client; `Err` once the
    /// client has gone.
    fn poll_serve(
        &mut self,
        cx: &mut Context<'_>,
        mut answer: Pin<&mut (dyn Future<Output = Response<BoxBody>> + Send)>,
        feed: &mut Feed,
        expect_continue: &mut bool,
    ) -> Poll<Result<Response<BoxBody>, ()>> {
        loop {
            if let Poll::Ready(response) = answer.as_mut().poll(cx) {
                return Poll::Ready(Ok(response));
            }
            if !self.out.is_empty() {
                match ready!(self.poll_write_out(cx)) {
                    Ok(()) => {}
                    Err(_) => return Poll::Ready(Err(())),
                }
            }
            ready!(self.poll_feed(cx, feed, expect_continue))?;
        }
    }

    /// Moves a request body along: hands buffered bytes to the handler when it wants
    /// them, reads when it wants more. Ready when something happened.
    fn poll_feed(
        &mut self,
        cx: &mut Context<'_>,
        feed: &mut Feed,
        expect_continue: &mut bool,
    ) -> Poll<Result<(), ()>> {
        let pipe = match feed {
            Feed::Length { pipe, .. } | Feed::Chunked { pipe, .. } => pipe,
            Feed::Done | Feed::Unread(_) | Feed::Lost => return self.poll_watch(cx),
        };
        match pipe.poll_wanted(cx) {
            Poll::Pending => return self.poll_watch(cx),
            Poll::Ready(Err(_)) => {
                *feed = match feed {
                    Feed::Length { left, .. } => Feed::Unread(*left),
                    _ => Feed::Lost,
                };
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Ok(())) => {}
        }
        if std::mem::take(expect_continue) {
            self.out.extend_from_slice(CONTINUE);
            return Poll::Ready(Ok(()));
        }
        let want = match feed {
            Feed::Length { pipe, left } => {
                if !self.buf.is_empty() {
                    let n = (self.buf.len() as u64).min(*left);
                    pipe.send(self.buf.split_to(n as usize).freeze());
                    *left -= n;
                    if *left == 0 {
                        if let Feed::Length { pipe, .. } = std::mem::replace(feed, Feed::Done) {
                            pipe.end();
                        }
                    }
                    return Poll::Ready(Ok(()));
                }
                (*left).min(WRITE_AT as u64) as usize
            }
            Feed::Chunked { pipe, decoder } => match decoder.decode(&mut self.buf) {
                Ok(Decoded::Data(data)) => {
                    pipe.send(data);
                    return Poll::Ready(Ok(()));
                }
                Ok(Decoded::End) => {
                    if let Feed::Chunked { pipe, .. } = std::mem::replace(feed, Feed::Done) {
                        pipe.end();
                    }
                    return Poll::Ready(Ok(()));
                }
                Ok(Decoded::NeedMore) => READ_SIZE,
                Err(e) => {
                    if let Feed::Chunked { pipe, .. } = std::mem::replace(feed, Feed::Lost) {
                        pipe.fail(format!("request body: {e}").into());
                    }
                    return Poll::Ready(Ok(()));
                }
            },
            _ => unreachable!("matched above"),
        };
        match ready!(self.poll_read(cx, want)) {
            Ok(n) if n > 0 => Poll::Ready(Ok(())),
            // The client left mid-body: the answer is for nobody.
            _ => Poll::Ready(Err(())),
        }
    }

    /// Reads while there is room, to see the client close; `Err` once it has.
    fn poll_watch(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        if self.buf.len() >= self.head_limits.max_bytes {
            return Poll::Pending;
        }
        match ready!(self.poll_read(cx, READ_SIZE)) {
            Ok(n) if n > 0 => Poll::Ready(Ok(())),
            _ => Poll::Ready(Err(())),
        }
    }

    /// Writes a response; `Ok(keep)`: whether the connection may go on. `Err`: the
    /// client has gone, stalled, or the body failed or broke its length (the
    /// connection must close, the client seeing a response cut short).
    async fn write_response(
        &mut self,
        response: Response<BoxBody>,
        asked: Asked<'_>,
    ) -> Result<bool, ()> {
        let (parts, mut body) = response.into_parts();
        let (framing, keep) = encode_head(
            parts.status,
            &parts.headers,
            &body.size_hint(),
            asked,
            &mut self.out,
        );
        let mut left = match framing {
            Framing::Length(n) => n,
            _ => 0,
        };
        let mut done = framing == Framing::Empty;
        poll_fn(|cx| loop {
            if !done && self.out.len() < WRITE_AT {
                match Pin::new(&mut body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data() {
                            match framing {
                                Framing::Chunked => push_chunk(&mut self.out, &data),
                                Framing::Length(_) if data.len() as u64 > left => {
                                    tracing::warn!("a response body ran past its content-length");
                                    return Poll::Ready(Err(()));
                                }
                                _ => {
                                    left -= (data.len() as u64).min(left);
                                    self.out.extend_from_slice(&data);
                                }
                            }
                        }
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => {
                        tracing::debug!(error = %e, "a response body failed; closing the connection");
                        return Poll::Ready(Err(()));
                    }
                    Poll::Ready(None) => {
                        done = true;
                        if framing == Framing::Chunked {
                            self.out.extend_from_slice(LAST_CHUNK);
                        }
                        if left > 0 {
                            tracing::warn!("a response body ended short of its content-length");
                            return Poll::Ready(Err(()));
                        }
                    }
                    Poll::Pending => {}
                }
            }
            if !self.out.is_empty() {
                if ready!(self.poll_write_out(cx)).is_err() {
                    return Poll::Ready(Err(()));
                }
                continue;
            }
            if done {
                return Poll::Ready(Ok(keep));
            }
            // The body is waiting, and nothing is left to write: watch the client.
            ready!(self.poll_watch(cx))?;
        })
        .await
    }

    /// After a response: reads past what the handler left of its request body.
    /// `false`: the connection cannot go on.
    async fn finish_body(&mut self, feed: Feed) -> bool {
        if !feed.can_finish() {
            return false;
        }
        let mut left = match feed {
            Feed::Length { left, .. } | Feed::Unread(left) => left,
            _ => return true,
        };
        while left > 0 {
            if !self.buf.is_empty() {
                let n = (self.buf.len() as u64).min(left);
                self.buf.advance(n as usize);
                left -= n;
                continue;
            }
            let read = poll_fn(|cx| {
                if let Poll::Ready(r) = self.poll_read(cx, left as usize) {
                    return Poll::Ready(matches!(r, Ok(n) if n > 0));
                }
                self.poll_head_timer(cx).map(|()| false)
            })
            .await;
            if !read {
                return false;
            }
        }
        true
    }

    /// Answers a head that cannot be served, and closes.
    async fn refuse(&mut self, e: &HeadError) {
        let status = e.status();
        // As a request the proxy refuses is (never a header's value: the reasons name
        // at most a method or a header's name, clipped).
        tracing::info!(status = status.as_u16(), error = %e, "request head refused");
        let body = serde_json::json!({
            "error": {
                "message": e.to_string(),
                "type": "invalid_request_error",
                "code": status.canonical_reason().unwrap_or("bad request").to_ascii_lowercase().replace(' ', "_"),
            }
        })
        .to_string();
        self.out.extend_from_slice(
            format!(
                "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                status.as_str(),
                status.canonical_reason().unwrap_or(""),
                body.len()
            )
            .as_bytes(),
        );
        if poll_fn(|cx| self.poll_write_out(cx)).await.is_ok() {
            self.close().await;
        }
    }

    /// Ends the connection with a FIN once what was written has gone.
    async fn close(&mut self) {
        let _ = poll_fn(|cx| Pin::new(&mut self.io).poll_shutdown(cx)).await;
    }

    fn poll_read(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        self.make_room(want);
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// Room in the buffer for a read of about `want` bytes (1 KiB to 64 KiB).
    fn make_room(&mut self, want: usize) {
        let want = want.clamp(1024, WRITE_AT);
        if self.buf.capacity() - self.buf.len() < want / 2 {
            self.buf.reserve(want);
        }
    }

    /// Writes `out` whole; an error if the client takes none of it for the stall limit.
    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.out.len() {
            match Pin::new(&mut self.io).poll_write(cx, &self.out[self.written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    self.stall_timer = None;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    let stall = self.stall_timeout;
                    let timer = self
                        .stall_timer
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(stall)));
                    ready!(timer.as_mut().poll(cx));
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client took no response bytes for {stall:?}"),
                    )));
                }
            }
        }
        self.out.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }

    /// Ready once `head_deadline` has passed.
    fn poll_head_timer(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let deadline = self.head_deadline;
        let timer = self
            .head_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        loop {
            ready!(timer.as_mut().poll(cx));
            if Instant::now() >= deadline {
                return Poll::Ready(());
            }
            // Set for an earlier wait: move it to this one's end.
            timer.as_mut().reset(deadline);
        }
    }
}
