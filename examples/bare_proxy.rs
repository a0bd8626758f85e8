//! The floor under prefixlb's proxy overhead: hyper's server and hyper's client with
//! nothing of ours between them (no routing, limits, metrics, traces or failover),
//! served as prefixlb serves with `server.lanes = 2`: one current-thread runtime per
//! lane, each with its own `SO_REUSEPORT` listener and its own engine connections.
//! Requests alternate between the engines. For measuring beside `prefixlb serve` and
//! HAProxy under the same load, never for serving:
//!
//! ```sh
//! cargo build --release --example bare_proxy
//! target/release/examples/bare_proxy 127.0.0.1:19183 127.0.0.1:19200 127.0.0.1:19201
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The allocator prefixlb serves with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Body = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

const LANES: usize = 2;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((listen, engines)) = args.split_first().filter(|(_, e)| !e.is_empty()) else {
        eprintln!("usage: bare_proxy LISTEN ENGINE [ENGINE ...] (each host:port)");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().expect("LISTEN is host:port");
    let engines: Arc<Vec<String>> = Arc::new(engines.to_vec());
    let lanes: Vec<_> = (0..LANES)
        .map(|_| {
            let engines = engines.clone();
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime")
                    .block_on(lane(listen, engines))
            })
        })
        .collect();
    for lane in lanes {
        let _ = lane.join();
    }
}

async fn lane(listen: SocketAddr, engines: Arc<Vec<String>>) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.set_reuseaddr(true).expect("SO_REUSEADDR");
    socket.set_reuseport(true).expect("SO_REUSEPORT");
    socket.bind(listen).expect("bind");
    let listener = socket.listen(1024).expect("listen");
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (client, engines, next) = (client.clone(), engines.clone(), next.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let engine = &engines[next.fetch_add(1, Ordering::Relaxed) % engines.len()];
                forward(client.clone(), engine.clone(), req)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn forward(
    client: Client<HttpConnector, Full<Bytes>>,
    engine: String,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (mut parts, body) = req.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return Ok(status(StatusCode::BAD_REQUEST));
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = match format!("http://{engine}{path}").parse::<Uri>() {
        Ok(uri) => uri,
        Err(_) => return Ok(status(StatusCode::BAD_REQUEST)),
    };
    match client
        .request(Request::from_parts(parts, Full::new(body)))
        .await
    {
        Ok(resp) => Ok(resp.map(|b| b.boxed())),
        Err(_) => Ok(status(StatusCode::BAD_GATEWAY)),
    }
}

fn status(code: StatusCode) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::new()).map_err(|e| match e {}).boxed());
    *resp.status_mut() = code;
    resp
}
