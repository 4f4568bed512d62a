//! Reloading files from a timer and from SIGHUP, for every kvmesh binary that reloads
//! certificates or keys. The task also keeps SIGHUP (whose default action ends the process)
//! from ending it.

use std::future::Future;
use std::time::Duration;

/// Runs `reload(false)` every `every` (a check for changed files) and `reload(true)` on each
/// SIGHUP (reload whatever the files say), one at a time, until `stop` resolves.
pub async fn every_and_on_hup<F: Future<Output = ()>>(
    every: Duration,
    stop: impl Future<Output = ()>,
    mut reload: impl FnMut(bool) -> F,
) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGHUP; files are still polled");
            None
        }
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        let sighup = async {
            match hup.as_mut() {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        let force = tokio::select! {
            _ = tick.tick() => false,
            Some(()) = sighup => true,
            () = &mut stop => return,
        };
        // A reload that hangs (a name lookup, say) must not hold up shutdown.
        tokio::select! {
            () = reload(force) => {}
            () = &mut stop => return,
        }
    }
}

/// Logs what one reload of `what` did: new files in force (info), nothing changed (nothing),
/// or files refused with the old ones kept (error).
pub fn log_outcome(what: &str, outcome: Result<bool, impl std::fmt::Display>) {
    match outcome {
        Ok(true) => tracing::info!("{what} reloaded"),
        Ok(false) => {}
        Err(e) => tracing::error!(error = %e, "{what} not reloaded; what was in force stays"),
    }
}
