//! A toxic TCP relay for fault tests (this kernel has no netem): it sits between the
//! balancer and one engine and does to the engine's bytes what a bad network does.
//! The toxic can be changed at any time; it applies to bytes as they pass.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the relay does to the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Toxic {
    /// Pass everything through.
    None,
    /// Hold each piece from the engine `ms` (± `jitter_ms`) before passing it on.
    Latency { ms: u64, jitter_ms: u64 },
    /// At most this many bytes per second from the engine.
    Bandwidth { bytes_per_s: u64 },
    /// Stop forwarding in both directions without closing anything.
    Blackhole,
    /// Reset both connections once this many bytes came from the engine.
    ResetAfter { bytes: u64 },
    /// When the engine closes, wait this long before closing toward the balancer.
    SlowClose { ms: u64 },
}

/// A running relay: connect to `addr` instead of the engine.
pub struct Relay {
    pub addr: SocketAddr,
    toxic: Arc<Mutex<Toxic>>,
}

impl Relay {
    /// Starts a relay in front of `engine`, passing everything through.
    pub async fn start(engine: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let toxic = Arc::new(Mutex::new(Toxic::None));
        let shared = toxic.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let toxic = shared.clone();
                tokio::spawn(async move {
                    let Ok(upstream) = TcpStream::connect(engine).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = upstream.set_nodelay(true);
                    relay(client, upstream, toxic).await;
                });
            }
        });
        Relay { addr, toxic }
    }

    pub fn set(&self, toxic: Toxic) {
        *self.toxic.lock() = toxic;
    }
}

/// The toxic now (the lock is never held across an await).
fn current(toxic: &Mutex<Toxic>) -> Toxic {
    *toxic.lock()
}

async fn relay(client: TcpStream, upstream: TcpStream, toxic: Arc<Mutex<Toxic>>) {
    let (mut from_client, mut to_engine) = (client, upstream);
    let (mut cr, mut cw) = from_client.split();
    let (mut er, mut ew) = to_engine.split();
    let requests = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while current(&toxic) == Toxic::Blackhole {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if ew.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let answers = async {
        let mut buf = vec![0u8; 16 * 1024];
        let mut passed = 0u64;
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        loop {
            let n = match er.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    if let Toxic::SlowClose { ms } = current(&toxic) {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    return false;
                }
                Ok(n) => n,
            };
            let mut piece = &buf[..n];
            loop {
                let now = current(&toxic);
                match now {
                    Toxic::Blackhole => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    Toxic::Latency { ms, jitter_ms } => {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let jitter = if jitter_ms == 0 {
                            0
                        } else {
                            seed % (2 * jitter_ms + 1)
                        };
                        let wait = (ms + jitter).saturating_sub(jitter_ms);
                        tokio::time::sleep(Duration::from_millis(wait)).await;
                    }
                    Toxic::ResetAfter { bytes } if passed + piece.len() as u64 > bytes => {
                        let keep = bytes.saturating_sub(passed) as usize;
                        let _ = cw.write_all(&piece[..keep]).await;
                        return true;
                    }
                    _ => {}
                }
                if let Toxic::Bandwidth { bytes_per_s } = now {
                    // A tenth of a second's worth at a time.
                    let step = (bytes_per_s / 10).max(1) as usize;
                    let (now_piece, rest) = piece.split_at(step.min(piece.len()));
                    if cw.write_all(now_piece).await.is_err() {
                        return false;
                    }
                    passed += now_piece.len() as u64;
                    piece = rest;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if piece.is_empty() {
                        break;
                    }
                    continue;
                }
                if cw.write_all(piece).await.is_err() {
                    return false;
                }
                passed += piece.len() as u64;
                break;
            }
        }
    };
    let reset = tokio::select! {
        _ = requests => false,
        reset = answers => reset,
    };
    if reset {
        // An RST both ways: linger 0, then close.
        let _ = from_client.set_zero_linger();
        let _ = to_engine.set_zero_linger();
    }
}
