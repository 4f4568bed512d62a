//! Reloading the listener's certificate and client CA, the upstream client certificate and the
//! API key file: on SIGHUP (always) and when their files change (checked every
//! `tls.reload_interval_secs` / `auth.reload_interval_secs`). A file that does not load is
//! refused with the reason and what was in force stays. The task runs whatever is configured,
//! so that SIGHUP never terminates the process (its default action).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::auth::Auth;
use crate::config::ProxyConfig;
use kvmesh_tls::reload::{every_and_on_hup, log_outcome};

use crate::tls::{ServerTls, UpstreamTls};

/// The longest wait between two checks of the files.
const MAX_INTERVAL: Duration = Duration::from_secs(3600);

/// The reload task.
pub struct Reloader {
    tls: Option<Arc<ServerTls>>,
    auth: Option<Arc<Auth>>,
    upstream: Option<Arc<UpstreamTls>>,
    interval: Duration,
}

impl Reloader {
    /// A reloader of what is configured (possibly nothing: SIGHUP is then only logged).
    pub fn new(
        cfg: &ProxyConfig,
        tls: Option<Arc<ServerTls>>,
        auth: Option<Arc<Auth>>,
        upstream: Arc<UpstreamTls>,
    ) -> Self {
        let mut interval = MAX_INTERVAL;
        if tls.is_some() || upstream.has_client_cert() {
            interval = interval.min(Duration::from_secs(cfg.tls.reload_interval_secs));
        }
        // Inline keys come with the configuration file, which is not reloaded: only a key file.
        let auth = auth.filter(|_| !cfg.auth.key_file.is_empty());
        if auth.is_some() {
            interval = interval.min(Duration::from_secs(cfg.auth.reload_interval_secs));
        }
        Reloader {
            tls,
            auth,
            upstream: upstream.has_client_cert().then_some(upstream),
            interval: interval.max(Duration::from_secs(1)),
        }
    }

    /// One pass: reloads what changed (everything, with `force`); logs what happened.
    pub fn reload(&self, force: bool) {
        if force && self.tls.is_none() && self.auth.is_none() && self.upstream.is_none() {
            tracing::info!("SIGHUP: nothing to reload (only [tls] files, the upstream client certificate and auth.key_file are)");
        }
        if let Some(u) = self.upstream.as_ref() {
            log_outcome("upstream client certificate", u.reload(force));
        }
        if let Some(t) = self.tls.as_ref() {
            log_outcome("listener TLS certificate and client CA", t.reload(force));
        }
        if let Some(a) = self.auth.as_ref() {
            log_outcome("API key file", a.reload(force));
        }
    }
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let stop = async move {
            let _ = shutdown.changed().await;
        };
        every_and_on_hup(self.interval, stop, |force| self.reload(force)).await;
    }
}
