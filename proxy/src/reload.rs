//! Reloading, on SIGHUP (always) and when files change:
//!
//! - the configuration file (checked every `config_reload_interval_secs`): the keys of
//!   [`crate::config::reload::RELOADABLE`] (engines, policy and routing knobs, upstream
//!   timeouts, inline API keys, the log filter, ...) are put in force; other changed keys keep
//!   their old values until a restart and are named in the log;
//! - the listener's certificate and client CA, the upstream client certificate (every
//!   `tls.reload_interval_secs`) and the API key file (every `auth.reload_interval_secs`).
//!
//! A file that does not load, or a configuration that `check-config` would refuse, is refused
//! with the reason and what was in force stays. Requests in flight are not disturbed: they
//! hold what they were routed with (an engine removed by a reload finishes the requests it
//! has). The task runs whatever is configured, so that SIGHUP never terminates the process
//! (its default action).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use kvmesh_filters::residency::ResidencyIndex;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::auth::Auth;
use crate::config::reload::{plan, ReloadPlan};
use crate::config::{EngineAddr, Overrides, ProxyConfig};
use crate::fleet::{probe_client, Engine, Fleet, HealthCheck, ModelsProbe, StagedEngines};
use crate::metrics::Metrics;
use crate::service::Live;
use kvmesh_tls::reload::{every_and_on_hup, log_outcome};

use crate::tls::{ServerTls, UpstreamTls};

/// The longest wait between two checks of the files.
const MAX_INTERVAL: Duration = Duration::from_secs(3600);

/// Puts a new log filter in force (the logger is the binary's); an error leaves the old one.
pub type SetLogFilter = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The reload task.
pub struct Reloader {
    tls: Option<Arc<ServerTls>>,
    auth: Option<Arc<Auth>>,
    upstream: Option<Arc<UpstreamTls>>,
    config: Option<Arc<ConfigReload>>,
    interval: Duration,
}

impl Reloader {
    /// A reloader of what is configured (possibly nothing: SIGHUP is then only logged), and of
    /// the configuration file with `config`.
    pub fn new(
        cfg: &ProxyConfig,
        tls: Option<Arc<ServerTls>>,
        auth: Option<Arc<Auth>>,
        upstream: Arc<UpstreamTls>,
        config: Option<ConfigReload>,
    ) -> Self {
        let mut interval = MAX_INTERVAL;
        if tls.is_some() || upstream.has_client_cert() {
            interval = interval.min(Duration::from_secs(cfg.tls.reload_interval_secs));
        }
        let key_file = auth.clone().filter(|_| !cfg.auth.key_file.is_empty());
        if key_file.is_some() {
            interval = interval.min(Duration::from_secs(cfg.auth.reload_interval_secs));
        }
        let config = config.map(|mut c| {
            c.interval_secs = cfg.config_reload_interval_secs;
            if c.interval_secs > 0 {
                interval = interval.min(Duration::from_secs(c.interval_secs));
            }
            c
        });
        Reloader {
            tls,
            auth: key_file,
            upstream: upstream.has_client_cert().then_some(upstream),
            config: config.map(Arc::new),
            interval: interval.max(Duration::from_secs(1)),
        }
    }

    /// One pass: reloads what changed (everything, with `force`); logs what happened.
    pub async fn reload(&self, force: bool) {
        let nothing = self.tls.is_none()
            && self.auth.is_none()
            && self.upstream.is_none()
            && self.config.is_none();
        if force && nothing {
            tracing::info!("SIGHUP: nothing to reload (no configuration file, no [tls] files, no upstream client certificate, no auth.key_file)");
        }
        if let Some(c) = self.config.as_ref() {
            // `config_reload_interval_secs = 0`: the file is read on SIGHUP only.
            if force || c.interval_secs > 0 {
                c.reload(force).await;
            }
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

/// Re-reading the configuration file and putting what may change in force.
pub struct ConfigReload {
    /// The file, read again with the same environment and command-line overrides.
    pub path: PathBuf,
    /// The command line's overrides (they still win over the file).
    pub overrides: Overrides,
    /// Where the configuration in force lives (the gateway's).
    pub live: Arc<ArcSwap<Live>>,
    /// The engines.
    pub fleet: Arc<Fleet>,
    /// Residency: a removed engine's entries are dropped.
    pub index: Arc<ResidencyIndex>,
    /// The API keys in force, when `[auth]` is on.
    pub auth: Option<Arc<Auth>>,
    /// TLS towards engines, for probing new ones.
    pub upstream: Arc<UpstreamTls>,
    /// The outcome counters.
    pub metrics: Arc<Metrics>,
    /// The logger's filter, when it can be changed.
    pub set_log_filter: Option<SetLogFilter>,
    /// The file's contents as last read: the timer reloads only when they change (`None`:
    /// read at the next check).
    pub seen: parking_lot::Mutex<Option<blake3::Hash>>,
    /// `config_reload_interval_secs` (set by [`Reloader::new`]; 0: on SIGHUP only).
    pub interval_secs: u64,
    /// The contents of a file refused because none of its engines passed a probe: tried
    /// again (quietly) at each check while the file stays so.
    pub retry_engines: parking_lot::Mutex<Option<blake3::Hash>>,
}

/// Longest a reload waits for its new engines' first probe (name lookups included).
const PROBE_WAIT: Duration = Duration::from_secs(15);

/// A reload read and checked, not yet in force.
struct Staged {
    plan: ReloadPlan,
    /// The engines' addresses, when `[[engines]]` changed.
    engines: Option<Vec<EngineAddr>>,
}

impl ConfigReload {
    /// Reads the file again when it changed (always, with `force`), then puts it in force.
    pub async fn reload(self: &Arc<Self>, force: bool) {
        // Reading the file and resolving engine names block: off the runtime's threads.
        let this = self.clone();
        let (retry, staged) = match tokio::task::spawn_blocking(move || this.read(force)).await {
            Ok(None) => return,
            Ok(Some(s)) => s,
            Err(e) => (false, Err(format!("the reload task stopped: {e}"))),
        };
        let outcome = match staged {
            Ok(s) => self.put_in_force(s).await,
            Err(e) => Err(e),
        };
        let (label, successful) = match outcome {
            Ok(p) if p.applied.is_empty() => {
                if force {
                    tracing::info!(file = %self.path.display(), "configuration reload: nothing changed that a reload applies");
                }
                self.report_restart(&p);
                ("unchanged", true)
            }
            Ok(p) => {
                tracing::info!(
                    file = %self.path.display(),
                    applied = %p.applied.join(", "),
                    "configuration reloaded"
                );
                self.report_restart(&p);
                ("applied", true)
            }
            Err(why) if retry => {
                tracing::debug!(file = %self.path.display(), error = %why, "configuration reload still refused");
                return;
            }
            Err(why) => {
                tracing::error!(file = %self.path.display(), error = %why, "configuration reload refused; the configuration in force stays");
                ("refused", false)
            }
        };
        self.metrics
            .config_reloads
            .with_label_values(&[label])
            .inc();
        self.metrics
            .config_last_reload_successful
            .set(i64::from(successful));
    }

    fn report_restart(&self, p: &ReloadPlan) {
        self.metrics
            .config_restart_pending
            .set(i64::try_from(p.needs_restart.len()).unwrap_or(i64::MAX));
        if !p.needs_restart.is_empty() {
            tracing::warn!(
                file = %self.path.display(),
                keys = %p.needs_restart.join(", "),
                "changed keys that take effect only after a restart (their old values stay)"
            );
        }
    }

    /// Loads and checks the file (`None`: unchanged since last read, and not forced); `true`
    /// with a quiet retry of a file refused for its engines (the same contents: it was
    /// reported, and counted, once).
    fn read(&self, force: bool) -> Option<(bool, Result<Staged, String>)> {
        let now = std::fs::read(&self.path).ok().map(|b| blake3::hash(&b));
        let retry = {
            let mut seen = self.seen.lock();
            let mut retry_of = self.retry_engines.lock();
            let retry = !force && now.is_some() && *retry_of == now;
            if !force && !retry && *seen == now {
                return None;
            }
            if *retry_of != now {
                *retry_of = None;
            }
            // A refused file is reported once, not at every check, until it changes again.
            *seen = now;
            retry
        };
        let staged = ProxyConfig::load_with(Some(&self.path), &self.overrides)
            .and_then(|new| plan(&self.live.load().cfg, &new))
            .and_then(|plan| {
                let engines = if plan.applied.iter().any(|k| k == "engines") {
                    Some(plan.cfg.engine_addrs()?)
                } else {
                    None
                };
                Ok(Staged { plan, engines })
            });
        Some((retry, staged.map_err(|e| e.to_string())))
    }

    /// Puts a checked reload in force. What can fail runs before anything changes, so that a
    /// refusal leaves the old configuration whole; new engines are probed first, so that an
    /// engine that replaces another serves at once.
    async fn put_in_force(&self, s: Staged) -> Result<ReloadPlan, String> {
        let p = s.plan;
        if p.applied.is_empty() {
            return Ok(p);
        }
        let changed = |key: &str| p.applied.iter().any(|k| k == key);
        let engines = match s.engines {
            Some(addrs) => Some(self.stage_engines(addrs, &p.cfg).await?),
            None => None,
        };
        if changed("auth.keys") {
            if let Some(auth) = self.auth.clone() {
                // Reads `auth.key_file` too: off the runtime's threads.
                let keys = p.cfg.auth.keys.clone();
                tokio::task::spawn_blocking(move || auth.set_inline_keys(keys))
                    .await
                    .map_err(|e| format!("the reload task stopped: {e}"))?
                    .map_err(|e| format!("`[[auth.keys]]`: {e}"))?;
            }
        }
        if changed("log") {
            if let Some(set) = self.set_log_filter.as_ref() {
                // Checked by `problems()` already: a filter that parses.
                if let Err(e) = set(&p.cfg.log) {
                    tracing::error!(error = %e, "`log` not changed");
                }
            }
        }
        if let Some(staged) = engines {
            for e in &staged.added {
                tracing::info!(engine = %e.name, url = %e.url, healthy = e.healthy(), "engine added by reload");
            }
            for e in self.fleet.commit_configured(staged) {
                tracing::info!(engine = %e.name, "engine removed by reload (requests on it finish there)");
                self.forget(e);
            }
        }
        let next = self.live.load().reloaded(p.cfg.clone());
        self.live.store(Arc::new(next));
        Ok(p)
    }

    /// New engines made and probed, not yet in force. Refused (and retried at the next check)
    /// when engines serve now and none of the new list would: a mistyped URL must not take the
    /// fleet down.
    async fn stage_engines(
        &self,
        addrs: Vec<EngineAddr>,
        cfg: &ProxyConfig,
    ) -> Result<StagedEngines, String> {
        let staged = self.fleet.stage_configured(addrs);
        let health: Arc<dyn HealthCheck> = Arc::new(ModelsProbe {
            client: probe_client(&self.upstream),
            timeout: Duration::from_millis(cfg.health.timeout_ms),
        });
        // Those that have not answered in time stay down until a probe passes.
        let _ = tokio::time::timeout(PROBE_WAIT, self.fleet.probe(&staged.added, &health)).await;
        let serving_now = self
            .fleet
            .engines()
            .iter()
            .any(|e| e.peer.is_none() && e.healthy());
        if serving_now
            && !staged.configured.is_empty()
            && !staged.configured.iter().any(|e| e.healthy())
        {
            let refused = *self.seen.lock();
            *self.retry_engines.lock() = refused;
            let urls: Vec<&str> = staged.configured.iter().map(|e| e.url.as_str()).collect();
            let when = if self.interval_secs > 0 {
                "at each check"
            } else {
                "at each SIGHUP"
            };
            return Err(format!(
                "no engine of the new `[[engines]]` passes its health probe ({}); the engines in force stay, and the file is tried again {when} until one does",
                urls.join(", ")
            ));
        }
        Ok(staged)
    }

    /// A removed engine: its residency and per-engine series go now, and again once the last
    /// request on it has finished (one that was settling could have recorded residency after
    /// the first drop).
    fn forget(&self, e: Arc<Engine>) {
        let (index, fleet, metrics) =
            (self.index.clone(), self.fleet.clone(), self.metrics.clone());
        // Its series go unless an engine of the same name (at a new URL) replaced it.
        let forget = move |e: &Engine| {
            index.drop_node(e.id);
            if !fleet.engines().iter().any(|x| x.name == e.name) {
                let models = e.models().map(|m| m.to_vec()).unwrap_or_default();
                metrics.per_engine.forget(&e.name, &models);
            }
        };
        forget(&e);
        // Requests on it hold it (their dispatch guard); when the last has finished, what
        // they recorded meanwhile goes too.
        tokio::spawn(async move {
            while Arc::strong_count(&e) > 1 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            forget(&e);
        });
    }
}
