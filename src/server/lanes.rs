//! Serving lanes (`server.lanes`): the client port served by that many
//! single-threaded runtimes, each a thread with its own `SO_REUSEPORT` listener (the
//! kernel spreads new connections over them) and its own engine connections, so a
//! request is served start to end on one thread with no cross-thread wake-ups. Each
//! lane counts its open connections (`prefixlb_client_connections{lane}`). The control
//! plane (admin, health checks, reloads, Redis) stays on the shared runtime.
//!
//! Each lane is pinned to a CPU of its own (`server.pin_threads`, see [`super::cpus`]).
//!
//! Handing each new connection to the lane with the fewest open (as Envoy's optional
//! connection balancing does; its default, like this, leaves the spread to the
//! kernel) was tried and not kept: the kernel's spread already left the lanes' work
//! near even, and neither throughput nor p99 moved (docs/performance.md, "Balanced
//! lanes"; tried again with the lanes pinned, "An eleventh sitting": even splits, the
//! same p99).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::{IntCounterVec, IntGaugeVec};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::listener::{self, ConnLimits};
use super::tls::ClientTls;
use super::{cpus, yielding};
use crate::config::{PinThreads, ServerConfig};
use crate::proxy::Proxy;
use crate::telemetry::metrics::RequestMetrics;

/// How the client port is served: how many lanes, and whether each is pinned to a CPU.
#[derive(Debug, Clone, Copy)]
pub struct Lanes {
    pub count: usize,
    pub pin: PinThreads,
    /// A serving thread busy this long without a break offers its CPU (see
    /// [`super::yielding`]); the shared runtime's workers too.
    pub yield_after: Duration,
}

impl Lanes {
    pub fn of(server: &ServerConfig) -> Lanes {
        Lanes {
            count: server.lanes,
            pin: server.pin_threads,
            yield_after: server.yield_after,
        }
    }
}

/// What the lanes share: their series (open connections and CPU yields, by lane;
/// where the request heads they refuse are counted) and the port's TLS server.
pub struct LaneShared {
    pub open: IntGaugeVec,
    pub yields: IntCounterVec,
    pub requests: Arc<RequestMetrics>,
    pub tls: Option<Arc<ClientTls>>,
}

/// Serves the client port from `lanes.count` lanes until `shutdown`, then lets each
/// lane drain its connections for up to `grace`. `first` is the port's listener (bound
/// with `SO_REUSEPORT`); `shared` counts each lane's connections and yields.
pub async fn serve(
    first: TcpListener,
    proxy: &'static Proxy,
    lanes: Lanes,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    limits: ConnLimits,
    shared: LaneShared,
) {
    let addr = match first.local_addr() {
        Ok(a) => a,
        Err(e) => return tracing::error!(error = %e, "the client listener has no address"),
    };
    let mut sockets = Vec::with_capacity(lanes.count);
    match first.into_std() {
        Ok(s) => sockets.push(s),
        Err(e) => return tracing::error!(error = %e, "cannot hand the client listener to a lane"),
    }
    for _ in 1..lanes.count {
        match super::serve::bind(addr, "listen", true).and_then(TcpListener::into_std) {
            Ok(s) => sockets.push(s),
            Err(e) => {
                tracing::error!(error = %e, "a serving lane could not bind; serving with fewer")
            }
        }
    }
    // One connection cap for the port, whichever lane the kernel hands a client to.
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let allowed = cpus::chosen(lanes.pin, lanes.count, cpus::allowed());
    if !allowed.is_empty() {
        tracing::info!(cpus = ?allowed, "serving lanes pinned: lane n to the n-th of these CPUs");
    }
    let mut threads = Vec::new();
    for (lane, socket) in sockets.into_iter().enumerate() {
        let cpu = cpus::nth(lane, &allowed);
        let slots = slots.clone();
        let label = lane.to_string();
        let open = shared.open.with_label_values(&[&label]);
        let yields = shared.yields.with_label_values(&[&label]);
        let requests = shared.requests.clone();
        let tls = shared.tls.clone();
        let yield_after = lanes.yield_after;
        let mut stop = stop_rx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("prefixlb-lane-{lane}"))
            .spawn(move || {
                if let Some(cpu) = cpu {
                    cpus::pin_this_thread(cpu, "lane");
                }
                crate::proxy::set_lane(lane);
                // The lane's log lines go out in one write when it runs out of work.
                crate::telemetry::log_buffer::buffer_this_thread();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .on_thread_park(crate::telemetry::log_buffer::flush_this_thread)
                    .on_thread_unpark(yielding::woke)
                    .build();
                let rt = match rt {
                    Ok(rt) => rt,
                    Err(e) => return tracing::error!(lane, error = %e, "cannot start a serving lane"),
                };
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(socket) {
                        Ok(l) => l,
                        Err(e) => return tracing::error!(lane, error = %e, "cannot serve a lane's listener"),
                    };
                    let port = listener::Port {
                        listener,
                        slots,
                        open: Some(open),
                        refusals: Some(requests),
                        tls,
                    };
                    listener::serve_port(
                        port,
                        move |req, peer| {
                            yielding::before_request_counted(yield_after, &yields);
                            proxy.handle(req, peer)
                        },
                        async move {
                            let _ = stop.wait_for(|s| *s).await;
                        },
                        grace,
                        limits,
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
