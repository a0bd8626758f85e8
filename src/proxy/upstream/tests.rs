//! The engine connection pool and the engine's body, over loopback sockets.

use super::*;
use http_body_util::BodyExt;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

/// A server on loopback that runs `serve` on each connection it accepts, counting them.
async fn engine_serving<F, Fut>(serve: F) -> (Authority, Arc<AtomicUsize>)
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            count.fetch_add(1, SeqCst);
            tokio::spawn(serve(s));
        }
    });
    (addr.to_string().parse().unwrap(), accepted)
}

/// An HTTP/1.1 server that answers every request on a connection with `answer`
/// (then closes it if `close`), counting connections accepted.
async fn engine_answering(answer: &'static [u8], close: bool) -> (Authority, Arc<AtomicUsize>) {
    engine_serving(move |mut s| async move {
        let mut buf = vec![0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if s.write_all(answer).await.is_err() || close {
                        return;
                    }
                }
            }
        }
    })
    .await
}

async fn engine() -> (Authority, Arc<AtomicUsize>) {
    engine_answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false).await
}

static BODY: Bytes = Bytes::from_static(b"{}");
static HOST: HeaderValue = HeaderValue::from_static("engine");

async fn send(
    up: &Arc<Upstream>,
    authority: &Authority,
) -> Result<Response<EngineBody>, UpstreamError> {
    send_by(up, authority, None).await
}

async fn send_by(
    up: &Arc<Upstream>,
    authority: &Authority,
    deadline: Option<Instant>,
) -> Result<Response<EngineBody>, UpstreamError> {
    let headers = UpstreamHeaders::default();
    let req = Outgoing {
        method: &Method::POST,
        target: "/x",
        host: &HOST,
        headers: &headers,
        rank: None,
        body: &BODY,
        tls: None,
        tls_name: None,
    };
    up.send(authority, req, tokio::time::Instant::now(), deadline)
        .await
}

/// One request on `up`, its body read and the connection handed back.
async fn round_trip(up: &Arc<Upstream>, authority: &Authority) -> Bytes {
    let mut body = send(up, authority).await.unwrap().into_body();
    let mut data = BytesMut::new();
    while let Some(frame) = body.frame().await {
        data.extend_from_slice(&frame.unwrap().into_data().unwrap());
    }
    body.release(tokio::time::Instant::now());
    data.freeze()
}

#[tokio::test]
async fn a_released_connection_carries_the_next_request() {
    let (authority, accepted) = engine().await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    for _ in 0..3 {
        assert_eq!(&round_trip(&up, &authority).await[..], b"ok");
    }
    assert_eq!(accepted.load(SeqCst), 1);
    assert_eq!(up.idle_count(), 1);
}

#[tokio::test]
async fn a_chunked_body_is_decoded_and_its_connection_reused() {
    let answer =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
                   6\r\ndata: \r\n4\r\nhi\n\n\r\n0\r\n\r\n";
    let (authority, accepted) = engine_answering(answer, false).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    for _ in 0..2 {
        assert_eq!(&round_trip(&up, &authority).await[..], b"data: hi\n\n");
    }
    assert_eq!(accepted.load(SeqCst), 1);
}

#[tokio::test]
async fn a_connection_the_engine_closed_is_not_reused() {
    let (authority, accepted) =
        engine_answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", true).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    for _ in 0..3 {
        assert_eq!(&round_trip(&up, &authority).await[..], b"ok");
        // Let the engine's close reach us before the next checkout.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(accepted.load(SeqCst), 3);
}

/// An HTTP/1.1 server that answers the first `answered` requests of each connection,
/// then reads the next and closes the connection without a byte of answer (as an
/// engine closing an idle connection just as a request comes), counting connections.
async fn engine_closing_after(answered: usize) -> (Authority, Arc<AtomicUsize>) {
    engine_serving(move |mut s| async move {
        let mut buf = vec![0u8; 4096];
        for _ in 0..answered {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if s.write_all(ok).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = s.read(&mut buf).await;
    })
    .await
}

#[tokio::test]
async fn a_reused_connection_closed_unanswered_sends_the_request_again_on_a_new_one() {
    let (authority, accepted) = engine_closing_after(1).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    assert_eq!(&round_trip(&up, &authority).await[..], b"ok");
    // The second request goes on the idle connection, which the engine closes: it goes
    // again on a new one, and is answered.
    assert_eq!(&round_trip(&up, &authority).await[..], b"ok");
    assert_eq!(accepted.load(SeqCst), 2);
}

#[tokio::test]
async fn a_new_connection_closed_unanswered_is_an_error() {
    // Once only: a new connection the engine closes unanswered says the engine is
    // the trouble, and the request fails (over, in the proxy).
    let (authority, accepted) = engine_closing_after(0).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    let Err(err) = send(&up, &authority).await else {
        panic!("answered")
    };
    assert!(
        matches!(err, UpstreamError::Closed | UpstreamError::Io(_)),
        "{err}"
    );
    assert_eq!(accepted.load(SeqCst), 1);
}

#[tokio::test]
async fn a_body_cut_short_is_an_error_and_its_connection_closed() {
    let (authority, _) =
        engine_answering(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", true).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    let mut body = send(&up, &authority).await.unwrap().into_body();
    assert_eq!(
        &body.frame().await.unwrap().unwrap().into_data().unwrap()[..],
        b"short"
    );
    let err = body.frame().await.unwrap().unwrap_err();
    assert_eq!(
        err.to_string(),
        "connection closed before the body was complete"
    );
    body.release(tokio::time::Instant::now());
    assert_eq!(up.idle_count(), 0);
}

#[tokio::test]
async fn a_malformed_head_is_an_error_naming_it() {
    let (authority, _) = engine_answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n", true).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    let err = send(&up, &authority).await.err().unwrap();
    assert!(
        err.to_string().starts_with("malformed response head"),
        "{err}"
    );
    let (authority, _) = engine_answering(b"HTTP/1.1 200 OK\r\ncontent-le", true).await;
    let err = send(&up, &authority).await.err().unwrap();
    assert_eq!(
        err.to_string(),
        "connection closed before the response head"
    );
}

/// An expired connection is not reused, and is not closed on the path of the
/// request that finds it expired either: it waits for the sweep (off the serving
/// threads), which closes it.
#[tokio::test]
async fn a_dropped_body_closes_its_connection_and_expired_ones_go() {
    let (authority, accepted) = engine().await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_millis(50));
    drop(send(&up, &authority).await.unwrap());
    round_trip(&up, &authority).await;
    assert_eq!(accepted.load(SeqCst), 2);
    tokio::time::sleep(Duration::from_millis(80)).await;
    let _unreleased = send(&up, &authority).await.unwrap();
    assert_eq!(
        accepted.load(SeqCst),
        3,
        "the expired connection was reused"
    );
    assert_eq!(
        up.idle_count(),
        1,
        "the request closed the expired connection"
    );
    up.sweep();
    assert_eq!(up.idle_count(), 0);
}

#[tokio::test]
async fn a_sweep_forgets_expired_connections_and_empty_engines() {
    let (authority, _) = engine().await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_millis(50));
    round_trip(&up, &authority).await;
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
    let err = send(&up, &authority).await.err().unwrap();
    assert!(err.to_string().starts_with("tcp connect error"), "{err}");
}

/// The read buffer starts at 1 KiB: a head several times larger (one long header
/// field), then a 512 KiB body, then a large chunked body, all come whole, twice on
/// one connection.
#[tokio::test]
async fn a_head_and_bodies_far_larger_than_the_first_read_buffer_come_whole() {
    let big = "x".repeat(6 * 1024);
    let body: String = (0..512 * 1024)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    let chunk = "y".repeat(100 * 1024);
    let answer = format!(
        "HTTP/1.1 200 OK\r\nx-long: {big}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer: &'static [u8] = Box::leak(answer.into_bytes().into_boxed_slice());
    let (authority, accepted) = engine_answering(answer, false).await;
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    for _ in 0..2 {
        assert_eq!(round_trip(&up, &authority).await, body.as_bytes());
    }
    assert_eq!(accepted.load(SeqCst), 1);

    let chunked = format!(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len(),
        chunk.len()
    );
    let chunked: &'static [u8] = Box::leak(chunked.into_bytes().into_boxed_slice());
    let (authority, _) = engine_answering(chunked, false).await;
    for _ in 0..2 {
        assert_eq!(round_trip(&up, &authority).await.len(), 2 * chunk.len());
    }
}

/// An engine that answers the first `answered` requests on each connection at once,
/// then reads the next ones and never answers them.
async fn engine_answering_first(answered: usize) -> Authority {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut seen = 0;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) if seen < answered => {
                            seen += 1;
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if s.write_all(ok).await.is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                    }
                }
            });
        }
    });
    addr.to_string().parse().unwrap()
}

/// Sends a request that gets no answer, by `deadline`: it must fail with a timeout
/// at the deadline (not before it, nor long after).
async fn times_out_at(up: &Arc<Upstream>, authority: &Authority, deadline: Instant) {
    let sent = tokio::time::timeout(
        Duration::from_secs(5),
        send_by(up, authority, Some(deadline)),
    );
    let err = sent
        .await
        .expect("no timeout by the deadline")
        .err()
        .unwrap();
    assert!(matches!(err, UpstreamError::Timeout), "{err}");
    let now = Instant::now();
    assert!(now >= deadline, "{:?} early", deadline - now);
    assert!(
        now - deadline < Duration::from_secs(2),
        "{:?} late",
        now - deadline
    );
}

/// One answered request on `up`, by `deadline`, its connection handed back.
async fn answered_by(up: &Arc<Upstream>, authority: &Authority, deadline: Instant) {
    let mut body = send_by(up, authority, Some(deadline))
        .await
        .unwrap()
        .into_body();
    while body.frame().await.is_some() {}
    body.release(tokio::time::Instant::now());
    assert_eq!(up.idle_count(), 1, "one connection, reused");
}

/// A request's deadline holds on its connection whatever deadline the connection's
/// timer held for the request before it: a farther one (the timer is moved earlier),
/// or a nearer one already past (the timer fires, and is moved on without failing
/// the request).
#[tokio::test]
async fn a_head_not_come_by_the_deadline_is_a_timeout_whatever_came_before() {
    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    let authority = engine_answering_first(1).await;
    answered_by(&up, &authority, Instant::now() + Duration::from_secs(3600)).await;
    times_out_at(&up, &authority, Instant::now() + Duration::from_millis(300)).await;

    let up = Upstream::new(Duration::from_secs(1), Duration::from_secs(4));
    let authority = engine_answering_first(1).await;
    let near = Instant::now() + Duration::from_millis(100);
    answered_by(&up, &authority, near).await;
    tokio::time::sleep_until(near + Duration::from_millis(50)).await;
    times_out_at(&up, &authority, Instant::now() + Duration::from_millis(300)).await;
}
