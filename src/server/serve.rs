//! `prefixlb serve`: binds the client and admin listeners, runs the proxy until
//! SIGTERM/Ctrl-C, then drains: `/readyz` turns 503, no new connections are accepted,
//! and in-flight requests get `shutdown_grace` to finish.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::control::Control;
use super::{admin, health, listener, reload};
use crate::config::{Config, PoolConfig};

/// The longest the balancer waits for its DNS names' first lookups before it serves.
const FIRST_LOOKUP_WAIT: std::time::Duration = std::time::Duration::from_secs(6);

/// Binds both listeners, announces them on stdout, and serves until `shutdown`.
pub async fn run(
    config: Config,
    source: PathBuf,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let lanes = config.server.lanes > 0;
    if lanes {
        claim(config.server.listen, "listen")?;
    }
    let listener = bind(config.server.listen, "listen", lanes)?;
    let admin_listener = bind(config.server.admin_listen, "admin_listen", false)?;
    let (addr, admin_addr) = (listener.local_addr()?, admin_listener.local_addr()?);
    // Tests and scripts read this line to find ports chosen by the OS.
    let scheme = if config.server.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let admin_scheme = if config.server.admin_tls {
        "https"
    } else {
        "http"
    };
    println!("prefixlb listening on {scheme}://{addr} (admin {admin_scheme}://{admin_addr})");
    tracing::info!(
        %addr,
        %admin_addr,
        pools = config.pools.len(),
        nodes = config.pools.iter().map(|p| p.nodes.len()).sum::<usize>(),
        dns_names = crate::fleet::dns::names(&config).len(),
        lanes = config.server.lanes,
        tls = config.server.tls.is_some(),
        "prefixlb serving"
    );
    let uncapped = |p: &&PoolConfig| p.decodes_for.is_some() && p.max_in_flight.is_none();
    for pool in config.pools.iter().filter(uncapped) {
        tracing::warn!(
            pool = %pool.name,
            cap = config.routing.max_in_flight,
            "each decode engine streams at most routing.max_in_flight answers at once: a decode engine batches many; set decode_max_in_flight near what one runs (docs/operating.md, \"Prefill/decode disaggregation\")"
        );
    }
    run_on(listener, admin_listener, config, Some(source), shutdown).await;
    Ok(())
}

/// Serves on listeners already bound until `shutdown`, then drains. With serving lanes
/// (`server.lanes` > 0), `listener` must be bound with `SO_REUSEPORT`, as [`run`] binds
/// it, for the other lanes to bind the same port; `lanes = 0` serves any listener.
pub async fn run_on(
    listener: TcpListener,
    admin_listener: TcpListener,
    config: Config,
    source: Option<PathBuf>,
    shutdown: impl Future<Output = ()>,
) {
    let grace = config.server.shutdown_grace;
    let limits = listener::ConnLimits::of(&config.server);
    let admin_addr = admin_listener.local_addr().ok();
    if config.server.admin_token.is_none() && admin_addr.is_some_and(|a| !a.ip().is_loopback()) {
        tracing::warn!(
            admin_listen = ?admin_addr,
            "the admin listener is not on loopback and has no admin_token: anyone who can reach it can drain nodes and reload the config"
        );
    }
    let lanes = super::lanes::Lanes::of(&config.server);
    let control = Control::with_lanes(config, source, lanes.count.max(1));
    let proxy = control.proxy().clone();

    // Admin and health checks outlive the client listener: /readyz says 503 while
    // in-flight requests drain.
    let (admin_stop_tx, mut admin_stop) = watch::channel(false);
    let reload_task = tokio::spawn(reload::run(control.clone(), admin_stop.clone()));
    let fleet_task = tokio::spawn(crate::fleet::watcher::run(
        control.clone(),
        control.metrics().fleet.clone(),
        admin_stop.clone(),
    ));
    let (looked_up, first_lookup) = tokio::sync::oneshot::channel();
    let dns_task = tokio::spawn(crate::fleet::dns::run(
        control.clone(),
        control.metrics().fleet.clone(),
        admin_stop.clone(),
        looked_up,
    ));
    // Nodes named in DNS are routable, and checked, from the first request: the first
    // lookups are waited for (briefly; a name that does not answer is looked up again
    // later).
    if !crate::fleet::dns::names(&control.table().config).is_empty() {
        let _ = tokio::time::timeout(FIRST_LOOKUP_WAIT, first_lookup).await;
    }
    let health_task = tokio::spawn(health::run(proxy.clone(), admin_stop.clone()));
    let admin_task = {
        let control = control.clone();
        let tls = control.admin_tls().cloned();
        tokio::spawn(listener::serve(
            admin_listener,
            tls,
            move |req, peer| admin::handle(control.clone(), req, peer),
            async move {
                let _ = admin_stop.wait_for(|stop| *stop).await;
            },
            std::time::Duration::from_secs(1),
            listener::ConnLimits::default(),
        ))
    };

    let stopping = {
        let proxy = proxy.clone();
        async move {
            shutdown.await;
            proxy.set_stopping();
            tracing::info!("shutting down: no new connections; in-flight requests have {grace:?}");
        }
    };
    let open = control.metrics().client_connections.clone();
    let tls = control.client_tls().cloned();
    // The request handlers hold the proxy for the life of the process: a reference,
    // where an `Arc` cloned and dropped per request moved its count between the
    // serving cores twice a request.
    let handler: &'static crate::proxy::Proxy = Box::leak(Box::new(proxy.clone()));
    if lanes.count > 0 {
        let shared = super::lanes::LaneShared {
            open,
            yields: control.metrics().lane_yields.clone(),
            requests: control.metrics().requests.clone(),
            tls,
        };
        super::lanes::serve(listener, handler, lanes, stopping, grace, limits, shared).await;
    } else {
        let open = Some(open.with_label_values(&["0"]));
        let requests = Some(control.metrics().requests.clone());
        let mut port = listener::Port::alone(listener, &limits, open, requests);
        port.tls = tls;
        // The shared runtime's workers start their stretches in its unpark hook
        // (src/main.rs); their yields count as lane 0's.
        let yields = control.metrics().lane_yields.with_label_values(&["0"]);
        let yield_after = lanes.yield_after;
        listener::serve_port(
            port,
            move |req, peer| {
                super::yielding::before_request_counted(yield_after, &yields);
                handler.handle(req, peer)
            },
            stopping,
            grace,
            limits,
        )
        .await;
    }
    let _ = admin_stop_tx.send(true);
    let _ = admin_task.await;
    let _ = health_task.await;
    let _ = reload_task.await;
    let _ = fleet_task.await;
    let _ = dns_task.await;
    tracing::info!("stopped");
}

/// Fails if another socket listens on `addr` already. Serving lanes bind the port with
/// `SO_REUSEPORT`, which the kernel lets every process of the same user share: without
/// this, a second `prefixlb serve` on a busy port would start and take part of its
/// connections, where without lanes it fails with "address in use". The probe is
/// bound, never listens, and is closed at once.
fn claim(addr: SocketAddr, key: &str) -> std::io::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    socket(addr)
        .and_then(|probe| probe.bind(addr))
        .map_err(|e| cannot_bind(e, key, addr))
}

/// Binds a listener; with `reuse_port`, `SO_REUSEPORT` so serving lanes share the port.
pub(super) fn bind(addr: SocketAddr, key: &str, reuse_port: bool) -> std::io::Result<TcpListener> {
    let bound = (|| {
        let socket = socket(addr)?;
        if reuse_port {
            socket.set_reuseport(true)?;
        }
        socket.bind(addr)?;
        socket.listen(1024)
    })();
    bound.map_err(|e| cannot_bind(e, key, addr))
}

/// A socket for `addr` with `SO_REUSEADDR` (a restart binds while the last run's
/// connections linger in `TIME_WAIT`).
fn socket(addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    Ok(socket)
}

fn cannot_bind(e: std::io::Error, key: &str, addr: SocketAddr) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("cannot bind server.{key} {addr}: {e}"))
}
