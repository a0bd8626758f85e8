//! What triggers a config reload: SIGHUP, and with `server.watch_config` a change of
//! the file's mtime, or of the client port's TLS files (a renewed certificate). The
//! reload itself ([`Control::reload`]) parses, validates and swaps the routing
//! snapshot; these triggers only decide when, and run it off the async workers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::control::Control;

/// Reloads the config on SIGHUP, and when `server.watch_config` is on, on a change of
/// the mtimes of the file and of the TLS files it names that has held for one poll
/// (polled every second: no watcher dependency needed), so a file still being written
/// is not applied half-way.
pub async fn run(control: Arc<Control>, mut stop: watch::Receiver<bool>) {
    let Some(path) = control.source().map(PathBuf::from) else {
        return;
    };
    let mtimes = || {
        let table = control.table();
        let tls = table.config.server.tls.as_ref().map(|t| t.files.as_slice());
        std::iter::once(&path)
            .chain(tls.unwrap_or_default())
            .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .collect::<Vec<_>>()
    };
    // The mtimes last applied, and those seen at the previous poll.
    let mut applied = mtimes();
    let mut previous = applied.clone();
    #[cfg(unix)]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        #[cfg(unix)]
        let sighup = async {
            match hangup.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let sighup = std::future::pending::<()>();
        let hup = tokio::select! {
            _ = sighup => true,
            _ = tokio::time::sleep(Duration::from_secs(1)) => false,
            _ = stop.wait_for(|s| *s) => return,
        };
        let now = mtimes();
        if hup {
            tracing::info!("SIGHUP: reloading the config");
        } else if !(control.table().config.server.watch_config && now != applied && now == previous)
        {
            previous = now;
            continue;
        } else {
            tracing::info!("config file changed: reloading");
        }
        applied = now.clone();
        previous = now;
        spawn_reload(&control).await;
    }
}

/// Runs a reload (file I/O and a table build) off the async workers.
async fn spawn_reload(control: &Arc<Control>) {
    let control = control.clone();
    // The outcome is logged and counted by `reload`.
    let _ = tokio::task::spawn_blocking(move || control.reload()).await;
}
