//! Reloading the listener's certificate and the API keys: on SIGHUP (always) and when their
//! files change (checked every `tls.reload_interval_secs` / `auth.reload_interval_secs`). A
//! file that does not load is refused with the reason and what was in force stays.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::auth::Auth;
use crate::config::ProxyConfig;
use crate::tls::ListenerTls;

/// The reload task.
pub struct Reloader {
    tls: Option<Arc<ListenerTls>>,
    auth: Option<Arc<Auth>>,
    interval: Duration,
}

impl Reloader {
    /// A reloader of what is configured; `None` when nothing can be reloaded.
    pub fn new(
        cfg: &ProxyConfig,
        tls: Option<Arc<ListenerTls>>,
        auth: Option<Arc<Auth>>,
    ) -> Option<Self> {
        let mut secs = u64::MAX;
        if tls.is_some() {
            secs = secs.min(cfg.tls.reload_interval_secs);
        }
        // Inline keys come with the configuration file, which is not reloaded: only a key file.
        let auth = auth.filter(|_| !cfg.auth.key_file.is_empty());
        if auth.is_some() {
            secs = secs.min(cfg.auth.reload_interval_secs);
        }
        (tls.is_some() || auth.is_some()).then(|| Reloader {
            tls,
            auth,
            interval: Duration::from_secs(secs.max(1)),
        })
    }

    /// One pass: reloads what changed (everything, with `force`); logs what happened.
    pub fn reload(&self, force: bool) {
        if let Some(t) = self.tls.as_ref() {
            match t.reload(force) {
                Ok(true) => tracing::info!("TLS certificate and client CA reloaded"),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "TLS files not reloaded; the previous ones stay in force")
                }
            }
        }
        if let Some(a) = self.auth.as_ref() {
            match a.reload(force) {
                Ok(true) => tracing::info!(keys = a.len(), "API keys reloaded"),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "API keys not reloaded; the previous ones stay in force")
                }
            }
        }
    }
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGHUP; files are still polled");
                None
            }
        };
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let sighup = async {
                match hup.as_mut() {
                    Some(s) => s.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tick.tick() => self.reload(false),
                Some(()) = sighup => {
                    tracing::info!("SIGHUP: reloading");
                    self.reload(true);
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}
