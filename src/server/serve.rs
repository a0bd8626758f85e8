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
use crate::config::Config;

/// Binds both listeners, announces them on stdout, and serves until `shutdown`.
pub async fn run(
    config: Config,
    source: PathBuf,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let listener = bind(config.server.listen, "listen", config.server.lanes > 0)?;
    let admin_listener = bind(config.server.admin_listen, "admin_listen", false)?;
    let (addr, admin_addr) = (listener.local_addr()?, admin_listener.local_addr()?);
    // Tests and scripts read this line to find ports chosen by the OS.
    println!("prefixlb listening on http://{addr} (admin http://{admin_addr})");
    tracing::info!(
        %addr,
        %admin_addr,
        pools = config.pools.len(),
        nodes = config.pools.iter().map(|p| p.nodes.len()).sum::<usize>(),
        "prefixlb serving"
    );
    run_on(listener, admin_listener, config, Some(source), shutdown).await;
    Ok(())
}

/// Serves on listeners already bound until `shutdown`, then drains.
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
    let lanes = config.server.lanes;
    let control = Control::with_lanes(config, source, lanes.max(1));
    let proxy = control.proxy().clone();

    // Admin and health checks outlive the client listener: /readyz says 503 while
    // in-flight requests drain.
    let (admin_stop_tx, mut admin_stop) = watch::channel(false);
    let health_task = tokio::spawn(health::run(proxy.clone(), admin_stop.clone()));
    let reload_task = tokio::spawn(reload::run(control.clone(), admin_stop.clone()));
    let fleet_task = tokio::spawn(crate::fleet::watcher::run(
        control.clone(),
        control.metrics().fleet.clone(),
        admin_stop.clone(),
    ));
    let admin_task = {
        let control = control.clone();
        tokio::spawn(listener::serve(
            admin_listener,
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
    if lanes > 0 {
        serve_lanes(listener, proxy.clone(), lanes, stopping, grace, limits).await;
    } else {
        let handler_proxy = proxy.clone();
        listener::serve(
            listener,
            move |req, peer| handler_proxy.clone().handle(req, peer),
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
    tracing::info!("stopped");
}

/// Serves the client port from `lanes` current-thread runtimes (`server.lanes`) until
/// `shutdown`: each lane a thread with its own `SO_REUSEPORT` listener (the kernel
/// spreads new connections over them) and its own engine connections, so a request is
/// served start to end on one thread with no cross-thread wake-ups. The control plane
/// (admin, health checks, reloads, Redis) stays on the shared runtime.
async fn serve_lanes(
    first: TcpListener,
    proxy: std::sync::Arc<crate::proxy::Proxy>,
    lanes: usize,
    shutdown: impl Future<Output = ()>,
    grace: std::time::Duration,
    limits: listener::ConnLimits,
) {
    let addr = match first.local_addr() {
        Ok(a) => a,
        Err(e) => return tracing::error!(error = %e, "the client listener has no address"),
    };
    let mut sockets = Vec::with_capacity(lanes);
    match first.into_std() {
        Ok(s) => sockets.push(s),
        Err(e) => return tracing::error!(error = %e, "cannot hand the client listener to a lane"),
    }
    for _ in 1..lanes {
        match bind(addr, "listen", true).and_then(TcpListener::into_std) {
            Ok(s) => sockets.push(s),
            Err(e) => {
                tracing::error!(error = %e, "a serving lane could not bind; serving with fewer")
            }
        }
    }
    // One connection cap for the port, whichever lane the kernel hands a client to.
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut threads = Vec::new();
    for (lane, socket) in sockets.into_iter().enumerate() {
        let proxy = proxy.clone();
        let slots = slots.clone();
        let mut stop = stop_rx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("prefixlb-lane-{lane}"))
            .spawn(move || {
                crate::proxy::set_lane(lane);
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => return tracing::error!(lane, error = %e, "cannot start a serving lane"),
                };
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(socket) {
                        Ok(l) => l,
                        Err(e) => return tracing::error!(lane, error = %e, "cannot serve a lane's listener"),
                    };
                    listener::serve_with_slots(
                        listener,
                        move |req, peer| proxy.clone().handle(req, peer),
                        async move {
                            let _ = stop.wait_for(|s| *s).await;
                        },
                        grace,
                        limits,
                        slots,
                    )
                    .await;
                });
            });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => tracing::error!(lane, error = %e, "cannot start a serving lane's thread"),
        }
    }
    shutdown.await;
    let _ = stop_tx.send(true);
    let _ = tokio::task::spawn_blocking(move || {
        for t in threads {
            let _ = t.join();
        }
    })
    .await;
}

/// Binds a listener; with `reuse_port`, `SO_REUSEPORT` so serving lanes share the port.
fn bind(addr: SocketAddr, key: &str, reuse_port: bool) -> std::io::Result<TcpListener> {
    let bound = (|| {
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.set_reuseaddr(true)?;
        if reuse_port {
            socket.set_reuseport(true)?;
        }
        socket.bind(addr)?;
        socket.listen(1024)
    })();
    bound
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot bind server.{key} {addr}: {e}")))
}
