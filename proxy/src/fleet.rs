//! The engines behind the proxy: their load, health and models, and the RAII guard that keeps
//! load counts honest whatever happens to a request.
//!
//! Engines are the configured ones (probed over HTTP) plus, with gossip, peers' engines (their
//! state comes from the peer's node record). In sidecar mode a peer's engine is reached through
//! the peer proxy (`via_peer`), which serves the forwarded request locally.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_filters::route::Candidate;
use kvmesh_filters::NodeId;

use crate::config::EngineAddr;

/// Where a peer's engine came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLink {
    /// The peer proxy's node id.
    pub node_id: String,
    /// Requests go to the peer proxy (sidecar mode) rather than straight to its engine.
    pub via_peer: bool,
}

/// One engine and its live state.
pub struct Engine {
    /// Its [`NodeId`] in the residency index (stable while the engine is known).
    pub id: NodeId,
    /// Configured name.
    pub name: String,
    /// Configured URL.
    pub url: String,
    /// Resolved address; a configured engine named by host is resolved again at each health
    /// probe (a restarted container or pod may come back on another IP).
    addr: ArcSwap<SocketAddr>,
    /// Its host name has not resolved yet (it never has since start): down until it does.
    unresolved: AtomicBool,
    /// When a failed lookup of its name was last logged (ms since the fleet's epoch).
    unresolved_logged_ms: AtomicU64,
    /// For an `https://` URL, its host: the SNI and the name its certificate must carry.
    pub tls_host: Option<String>,
    /// A stable key for session hashing (from the name).
    pub key: u64,
    inflight: AtomicU64,
    pending_prefill: AtomicU64,
    healthy: AtomicBool,
    static_models: bool,
    models: ArcSwap<Vec<String>>,
    models_known: AtomicBool,
    /// Set for engines learnt by gossip.
    pub peer: Option<PeerLink>,
    /// Load the peer reports for it (its own count includes what we sent).
    reported_inflight: AtomicU64,
    reported_pending: AtomicU64,
    /// Load the peer's last beacon carried, and when it came ([`mono_ms`]; 0: never). Until it
    /// is [`kvmesh_cluster::beacon::FRESH`] old it stands for the peer's report instead of the
    /// gossiped record's, which is older.
    beacon_inflight: AtomicU64,
    beacon_pending: AtomicU64,
    beacon_at_ms: AtomicU64,
    /// A peer that refused a connection is skipped until then ([`mono_ms`]), whatever its
    /// record says meanwhile.
    down_until_ms: AtomicU64,
    /// Recent time to first byte through this engine, microseconds (an EWMA; 0: none seen).
    ttft_ewma_us: AtomicU64,
    /// When it was last updated ([`mono_ms`]).
    ttft_at_ms: AtomicU64,
}

/// How long a TTFT estimate stands without a new answer: after it, the engine gets the benefit
/// of the doubt again (so that refusing by an old estimate cannot lock an engine out for good).
pub const TTFT_ESTIMATE_TTL: Duration = Duration::from_secs(10);

/// The host of an `https://` URL (checked when the engine is added); `None` for `http://`.
fn tls_host(url: &str) -> Option<String> {
    crate::config::url_is_tls(url)
        .then(|| crate::config::engine_url_host(url).map(|(h, _)| h).ok())
        .flatten()
}

/// Milliseconds since the first call (a process-wide monotonic clock for atomics).
fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Engine {
    /// An engine with no load, no TTFT estimate and no peer, down; `models`, when not empty,
    /// are its models for good (else they are learnt by probing).
    fn fresh(id: NodeId, name: String, url: String, addr: SocketAddr, models: Vec<String>) -> Self {
        let static_models = !models.is_empty();
        Engine {
            id,
            key: name_key(&name),
            tls_host: tls_host(&url),
            name,
            url,
            addr: ArcSwap::from_pointee(addr),
            unresolved: AtomicBool::new(false),
            unresolved_logged_ms: AtomicU64::new(0),
            inflight: AtomicU64::new(0),
            pending_prefill: AtomicU64::new(0),
            healthy: AtomicBool::new(false),
            static_models,
            models_known: AtomicBool::new(static_models),
            models: ArcSwap::from_pointee(models),
            peer: None,
            reported_inflight: AtomicU64::new(0),
            reported_pending: AtomicU64::new(0),
            beacon_inflight: AtomicU64::new(0),
            beacon_pending: AtomicU64::new(0),
            beacon_at_ms: AtomicU64::new(0),
            down_until_ms: AtomicU64::new(0),
            ttft_ewma_us: AtomicU64::new(0),
            ttft_at_ms: AtomicU64::new(0),
        }
    }

    /// A configured engine, down until its first probe.
    fn configured(id: NodeId, a: EngineAddr) -> Self {
        if let Some(why) = &a.unresolved {
            tracing::warn!(engine = %a.name, "{why}; down until it resolves");
        }
        Engine {
            unresolved: AtomicBool::new(a.unresolved.is_some()),
            ..Engine::fresh(id, a.name, a.url, a.addr, a.models)
        }
    }

    /// The engine a peer published (its models as published, known at once).
    fn of_peer(id: NodeId, p: &PeerEngine) -> Self {
        let mut e = Engine::fresh(id, p.node_id.clone(), p.url.clone(), p.addr, Vec::new());
        e.healthy = AtomicBool::new(p.ready);
        e.static_models = true;
        e.models = ArcSwap::from_pointee(p.models.clone());
        e.models_known = AtomicBool::new(true);
        e.peer = Some(PeerLink {
            node_id: p.node_id.clone(),
            via_peer: p.via_peer,
        });
        e.reported_inflight = AtomicU64::new(p.inflight);
        e.reported_pending = AtomicU64::new(p.pending_prefill_bytes);
        e
    }

    /// Requests in flight on this engine: ours, or what its peer reports, whichever is larger.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed).max(self.reported().0)
    }

    /// The peer's report (in flight, pending prefill bytes): its last beacon's while that is
    /// fresh, else its gossiped record's.
    fn reported(&self) -> (u64, u64) {
        let at = self.beacon_at_ms.load(Ordering::Relaxed);
        if at != 0
            && mono_ms().saturating_sub(at) <= kvmesh_cluster::beacon::FRESH.as_millis() as u64
        {
            (
                self.beacon_inflight.load(Ordering::Relaxed),
                self.beacon_pending.load(Ordering::Relaxed),
            )
        } else {
            (
                self.reported_inflight.load(Ordering::Relaxed),
                self.reported_pending.load(Ordering::Relaxed),
            )
        }
    }

    /// Folds one observed time to first byte into the engine's estimate (weight 1/5; a stale
    /// estimate is replaced).
    pub fn observe_ttft(&self, ttft: Duration) {
        let us = u64::try_from(ttft.as_micros()).unwrap_or(u64::MAX).max(1);
        let now = mono_ms();
        let at = self.ttft_at_ms.swap(now, Ordering::Relaxed);
        if now.saturating_sub(at) > TTFT_ESTIMATE_TTL.as_millis() as u64 {
            self.ttft_ewma_us.store(0, Ordering::Relaxed);
        }
        let _ = self
            .ttft_ewma_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == 0 { us } else { old - old / 5 + us / 5 })
            });
    }

    /// The engine's recent time to first byte (an EWMA of its answers through this proxy,
    /// measured from dispatch); `None` before the first answer, or when the last is older than
    /// [`TTFT_ESTIMATE_TTL`].
    pub fn ttft_estimate(&self) -> Option<Duration> {
        let age = mono_ms().saturating_sub(self.ttft_at_ms.load(Ordering::Relaxed));
        if age > TTFT_ESTIMATE_TTL.as_millis() as u64 {
            return None;
        }
        match self.ttft_ewma_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// Uncached prompt bytes dispatched here whose first response byte has not come back yet
    /// (ours, or the peer's report, whichever is larger).
    pub fn pending_prefill(&self) -> u64 {
        self.pending_prefill
            .load(Ordering::Relaxed)
            .max(self.reported().1)
    }

    /// Requests this proxy has in flight on the engine.
    pub fn own_inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Uncached prompt bytes this proxy dispatched to the engine and not yet answered.
    pub fn own_pending_prefill(&self) -> u64 {
        self.pending_prefill.load(Ordering::Relaxed)
    }

    /// Whether requests to it go through a peer proxy.
    pub fn via_peer(&self) -> bool {
        self.peer.as_ref().is_some_and(|p| p.via_peer)
    }

    /// Whether the last health probe (or request) succeeded; for a peer, whether its record
    /// says it is ready and it has not refused a connection within the last `peer_down`.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
            && (self.peer.is_none() || mono_ms() >= self.down_until_ms.load(Ordering::Relaxed))
    }

    /// Marks the engine down until the next successful probe (a connection to it failed).
    pub fn mark_down(&self) {
        self.healthy.store(false, Ordering::Relaxed);
    }

    /// Where requests to it go.
    pub fn addr(&self) -> SocketAddr {
        **self.addr.load()
    }

    /// Resolves a configured engine's host name again and switches to its new address, if it
    /// has one (an IP literal or a peer changes nothing; a failed lookup keeps the address and
    /// is logged at most every 30 s while the name has never resolved). `now_ms`: the fleet's
    /// clock.
    async fn re_resolve(&self, now_ms: u64) {
        if self.peer.is_some() {
            return;
        }
        let Ok((host, port)) = crate::config::engine_url_host(&self.url) else {
            return;
        };
        if host.parse::<std::net::IpAddr>().is_ok() {
            return;
        }
        let lookup = tokio::net::lookup_host((host.as_str(), port)).await;
        let addrs: Vec<SocketAddr> = match lookup {
            Ok(a) => a.collect(),
            Err(e) => {
                let last = self.unresolved_logged_ms.load(Ordering::Relaxed);
                if self.unresolved.load(Ordering::Relaxed) && now_ms.saturating_sub(last) >= 30_000
                {
                    self.unresolved_logged_ms.store(now_ms, Ordering::Relaxed);
                    tracing::warn!(engine = %self.name, url = %self.url, error = %e, "engine host does not resolve; down until it does");
                }
                return;
            }
        };
        let current = self.addr();
        let Some(&new) = addrs.first() else { return };
        if self.unresolved.swap(false, Ordering::Relaxed) {
            tracing::info!(engine = %self.name, url = %self.url, addr = %new, "engine host resolved");
            self.addr.store(Arc::new(new));
        } else if !addrs.contains(&current) {
            // Kept while the name still resolves to it (round-robin DNS). A change moves the
            // traffic: worth an operator's eye (DNS is trusted as at start).
            tracing::warn!(engine = %self.name, url = %self.url, old = %current, new = %new, "engine address changed");
            self.addr.store(Arc::new(new));
        }
    }

    /// Marks the engine healthy, as a successful probe would (unit tests of the decision).
    #[cfg(test)]
    pub(crate) fn mark_up(&self) {
        self.healthy.store(true, Ordering::Relaxed);
    }

    /// The models it serves, if known.
    pub fn models(&self) -> Option<Arc<Vec<String>>> {
        self.models_known
            .load(Ordering::Relaxed)
            .then(|| self.models.load_full())
    }

    fn serves(&self, model: &str) -> bool {
        self.models().is_some_and(|m| m.iter().any(|x| x == model))
    }
}

/// All engines.
pub struct Fleet {
    engines: ArcSwap<Vec<Arc<Engine>>>,
    /// Serialises changes to `engines` (readers never wait).
    change: parking_lot::Mutex<()>,
    next_id: AtomicU32,
    total_inflight: AtomicU64,
    epoch: Instant,
    peer_down: Duration,
}

/// What a peer's node record says about its engine.
#[derive(Debug, Clone)]
pub struct PeerEngine {
    /// The peer proxy's node id (the engine's name in metrics and headers).
    pub node_id: String,
    /// Where requests go: the peer proxy (sidecar mode) or its engine (gateway mode).
    pub addr: SocketAddr,
    /// That address as a URL.
    pub url: String,
    /// Through the peer proxy.
    pub via_peer: bool,
    /// Models it serves.
    pub models: Vec<String>,
    /// Healthy, per the peer.
    pub ready: bool,
    /// In flight, per the peer.
    pub inflight: u64,
    /// Pending prefill bytes, per the peer.
    pub pending_prefill_bytes: u64,
}

fn name_key(name: &str) -> u64 {
    let h = blake3::hash(name.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(b)
}

/// Configured engines made by [`Fleet::stage_configured`], not yet in force.
#[derive(Default)]
pub struct StagedEngines {
    /// The configured engines, in configuration order.
    pub configured: Vec<Arc<Engine>>,
    /// Those that are new (or changed, and so new).
    pub added: Vec<Arc<Engine>>,
}

/// Why no engine can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoute {
    /// No engine is known to serve the model.
    UnknownModel,
    /// Engines serve it, but none is healthy.
    NoneHealthy,
}

impl Fleet {
    /// A fleet from validated engine addresses; every engine starts unhealthy until probed.
    /// Peers refusing connections are skipped for `peer_down`.
    pub fn new(addrs: Vec<EngineAddr>, peer_down: Duration) -> Arc<Self> {
        let engines: Vec<Arc<Engine>> = addrs
            .into_iter()
            .enumerate()
            .map(|(i, a)| Arc::new(Engine::configured(NodeId(i as u32), a)))
            .collect();
        Arc::new(Fleet {
            next_id: AtomicU32::new(engines.len() as u32),
            engines: ArcSwap::from_pointee(engines),
            change: parking_lot::Mutex::new(()),
            total_inflight: AtomicU64::new(0),
            epoch: Instant::now(),
            peer_down,
        })
    }

    /// The configured engines `addrs` would make (a reload), not yet in force: an engine whose
    /// name, URL and static models are unchanged is kept with its state (node id, residency,
    /// health, load); any other is new, with a fresh node id, down until probed (the reload
    /// probes it before [`Fleet::commit_configured`], so that it serves at once).
    pub fn stage_configured(&self, addrs: Vec<EngineAddr>) -> StagedEngines {
        let engines = self.engines.load_full();
        let mut staged = StagedEngines::default();
        for a in addrs {
            let same = engines.iter().find(|e| {
                e.peer.is_none()
                    && e.name == a.name
                    && e.url == a.url
                    && match a.models.is_empty() {
                        true => !e.static_models,
                        false => e.static_models && **e.models.load() == a.models,
                    }
            });
            let e = match same {
                Some(e) => e.clone(),
                None => {
                    let id = NodeId(self.next_id.fetch_add(1, Ordering::Relaxed));
                    let e = Arc::new(Engine::configured(id, a));
                    staged.added.push(e.clone());
                    e
                }
            };
            staged.configured.push(e);
        }
        staged
    }

    /// Puts staged engines in force as the configured ones; peers' engines stay. Requests
    /// already on a removed engine finish there (they hold it). Returns the engines no longer
    /// configured, whose residency the caller drops.
    pub fn commit_configured(&self, staged: StagedEngines) -> Vec<Arc<Engine>> {
        let _one_writer = self.change.lock();
        let engines = self.engines.load_full();
        let removed = engines
            .iter()
            .filter(|e| e.peer.is_none() && !staged.configured.iter().any(|n| Arc::ptr_eq(n, e)))
            .cloned()
            .collect();
        let mut next = staged.configured;
        next.extend(engines.iter().filter(|e| e.peer.is_some()).cloned());
        self.engines.store(Arc::new(next));
        removed
    }

    /// Every engine: configured ones first, in configuration order, then peers'.
    pub fn engines(&self) -> Arc<Vec<Arc<Engine>>> {
        self.engines.load_full()
    }

    /// Requests in flight through the proxy.
    pub fn total_inflight(&self) -> u64 {
        self.total_inflight.load(Ordering::Relaxed)
    }

    /// Whether at least one engine is healthy.
    pub fn ready(&self) -> bool {
        self.engines.load().iter().any(|e| e.healthy())
    }

    /// Healthy engines serving `model`, as routing candidates (overlap left at 0). With
    /// `local_only`, only configured engines (a request forwarded by a peer).
    pub fn candidates(&self, model: &str, local_only: bool) -> Result<Vec<Candidate>, NoRoute> {
        let engines = self.engines.load();
        let pool: Vec<&Arc<Engine>> = engines
            .iter()
            .filter(|e| !local_only || e.peer.is_none())
            .collect();
        let serving: Vec<&&Arc<Engine>> = pool.iter().filter(|e| e.serves(model)).collect();
        if serving.is_empty() {
            // An engine whose list is unknown yet might serve it: say "unhealthy", not "unknown".
            let unknown = pool.iter().any(|e| e.models().is_none());
            return Err(if unknown {
                NoRoute::NoneHealthy
            } else {
                NoRoute::UnknownModel
            });
        }
        let c: Vec<Candidate> = serving
            .into_iter()
            .filter(|e| e.healthy())
            .map(|e| Candidate {
                node: e.id,
                key: e.key,
                inflight: e.inflight(),
                pending_prefill_bytes: e.pending_prefill(),
                overlap_blocks: 0,
            })
            .collect();
        if c.is_empty() {
            Err(NoRoute::NoneHealthy)
        } else {
            Ok(c)
        }
    }

    /// The engine with id `node`.
    pub fn get(&self, node: NodeId) -> Option<Arc<Engine>> {
        self.engines.load().iter().find(|e| e.id == node).cloned()
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A connection to `engine` failed: mark it down (until the next good probe, or for a
    /// peer, for `peer_down` whatever its gossip says; then it is up again if its record says
    /// it is ready, even if that record has not changed since: an idle peer publishes none).
    pub fn mark_down(&self, engine: &Engine) {
        if engine.peer.is_some() {
            let until = mono_ms()
                .saturating_add(u64::try_from(self.peer_down.as_millis()).unwrap_or(u64::MAX));
            engine.down_until_ms.store(until, Ordering::Relaxed);
        } else {
            engine.mark_down();
        }
    }

    /// Adds or updates the engine a peer published; returns its node id.
    pub fn upsert_peer(&self, p: &PeerEngine) -> NodeId {
        let _one_writer = self.change.lock();
        let engines = self.engines.load_full();
        if let Some(e) = engines
            .iter()
            .find(|e| e.peer.as_ref().is_some_and(|l| l.node_id == p.node_id))
        {
            if e.addr() == p.addr && e.via_peer() == p.via_peer {
                e.reported_inflight.store(p.inflight, Ordering::Relaxed);
                e.reported_pending
                    .store(p.pending_prefill_bytes, Ordering::Relaxed);
                if **e.models.load() != p.models {
                    e.models.store(Arc::new(p.models.clone()));
                }
                e.healthy.store(p.ready, Ordering::Relaxed);
                return e.id;
            }
        }
        // New peer, or it moved: a fresh entry (and a fresh node id for its residency).
        let id = NodeId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let engine = Arc::new(Engine::of_peer(id, p));
        let mut next: Vec<Arc<Engine>> = engines
            .iter()
            .filter(|e| e.peer.as_ref().is_none_or(|l| l.node_id != p.node_id))
            .cloned()
            .collect();
        next.push(engine);
        self.engines.store(Arc::new(next));
        tracing::info!(peer = %p.node_id, addr = %p.addr, via_peer = p.via_peer, "peer engine added");
        id
    }

    /// A peer's load beacon: its engine's load as the peer counts it now. Returns whether the
    /// peer's engine is in the fleet.
    pub fn peer_load(&self, node_id: &str, load: kvmesh_cluster::Load) -> bool {
        let engines = self.engines.load();
        let Some(e) = engines
            .iter()
            .find(|e| e.peer.as_ref().is_some_and(|l| l.node_id == node_id))
        else {
            return false;
        };
        e.beacon_inflight.store(load.inflight, Ordering::Relaxed);
        e.beacon_pending
            .store(load.pending_prefill_bytes, Ordering::Relaxed);
        e.beacon_at_ms.store(mono_ms().max(1), Ordering::Relaxed);
        true
    }

    /// Whether the fleet holds `node_id`'s engine at a URL other than `url`.
    pub fn has_peer_elsewhere(&self, node_id: &str, url: &str) -> bool {
        self.engines
            .load()
            .iter()
            .any(|e| e.peer.as_ref().is_some_and(|l| l.node_id == node_id) && e.url != url)
    }

    /// The models of the engine peer `node_id` published, when it is in the fleet.
    pub fn peer_models(&self, node_id: &str) -> Option<Vec<String>> {
        self.engines
            .load()
            .iter()
            .find(|e| e.peer.as_ref().is_some_and(|l| l.node_id == node_id))
            .map(|e| e.models().map(|m| m.to_vec()).unwrap_or_default())
    }

    /// Forgets a peer's engine (it left).
    pub fn remove_peer(&self, node_id: &str) {
        let _one_writer = self.change.lock();
        let engines = self.engines.load_full();
        let next: Vec<Arc<Engine>> = engines
            .iter()
            .filter(|e| e.peer.as_ref().is_none_or(|l| l.node_id != node_id))
            .cloned()
            .collect();
        if next.len() != engines.len() {
            self.engines.store(Arc::new(next));
            tracing::info!(peer = %node_id, "peer engine removed");
        }
    }

    /// Counts a request against `engine` until the guard drops; `prefill_bytes` count as pending
    /// prefill until [`Dispatch::prefill_done`].
    pub fn dispatch(self: &Arc<Self>, engine: &Arc<Engine>, prefill_bytes: u64) -> Dispatch {
        engine.inflight.fetch_add(1, Ordering::Relaxed);
        engine
            .pending_prefill
            .fetch_add(prefill_bytes, Ordering::Relaxed);
        self.total_inflight.fetch_add(1, Ordering::Relaxed);
        Dispatch {
            fleet: self.clone(),
            engine: engine.clone(),
            prefill_bytes,
        }
    }

    /// Probes every configured engine once, concurrently, with `health` (in the proxy,
    /// [`ModelsProbe`]: `GET /v1/models`). (Peers' engines are known through gossip.)
    pub async fn probe_all(&self, health: &Arc<dyn HealthCheck>) {
        let configured: Vec<Arc<Engine>> = self
            .engines
            .load()
            .iter()
            .filter(|e| e.peer.is_none())
            .cloned()
            .collect();
        self.probe(&configured, health).await;
    }

    /// Probes `engines` once, concurrently, with `health`.
    pub async fn probe(&self, engines: &[Arc<Engine>], health: &Arc<dyn HealthCheck>) {
        let mut probes = tokio::task::JoinSet::new();
        let now_ms = self.now_ms();
        for e in engines {
            let (e, health) = (e.clone(), health.clone());
            probes.spawn(async move {
                e.re_resolve(now_ms).await;
                // Never resolved: down whatever a probe by name would say.
                let result = if e.unresolved.load(Ordering::Relaxed) {
                    None
                } else {
                    health.check(&e).await
                };
                match result {
                    Some(models) => {
                        if !e.static_models {
                            e.models.store(Arc::new(models));
                            e.models_known.store(true, Ordering::Relaxed);
                        }
                        if !e.healthy.swap(true, Ordering::Relaxed) {
                            tracing::info!(engine = %e.name, "engine is up");
                        }
                    }
                    _ => {
                        if e.healthy.swap(false, Ordering::Relaxed) {
                            tracing::warn!(engine = %e.name, url = %e.url, "engine failed its health probe");
                        }
                    }
                }
            });
        }
        while probes.join_next().await.is_some() {}
    }
}

/// One health check of an engine (the shape of pingora-load-balancing's `HealthCheck`):
/// `Some` with the model ids it serves when it is up, `None` when it is down.
#[async_trait]
pub trait HealthCheck: Send + Sync + 'static {
    /// Checks `engine` once.
    async fn check(&self, engine: &Engine) -> Option<Vec<String>>;
}

/// The health check of configured engines: `GET {url}/v1/models` answered 2xx within `timeout`.
pub struct ModelsProbe {
    /// The HTTP client.
    pub client: ProbeClient,
    /// How long one probe may take.
    pub timeout: Duration,
}

#[async_trait]
impl HealthCheck for ModelsProbe {
    async fn check(&self, engine: &Engine) -> Option<Vec<String>> {
        tokio::time::timeout(self.timeout, fetch_models(&self.client, &engine.url))
            .await
            .ok()
            .flatten()
    }
}

/// `GET {url}/v1/models`: the model ids, or `None` when the engine did not answer 2xx.
async fn fetch_models(client: &ProbeClient, url: &str) -> Option<Vec<String>> {
    let uri = format!("{}/v1/models", url.trim_end_matches('/'))
        .parse()
        .ok()?;
    let resp = client.get(uri).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some(parse_model_list(&body))
}

/// The HTTP client used for probes and model lists (`http://` and `https://`).
pub type ProbeClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Empty<Bytes>,
>;

/// A client for probes, verifying `https://` engines and peers with `[upstream]`'s CA bundle
/// and presenting its client certificate in force. Should the CA file have become unusable
/// since the configuration was checked, the error is logged and `https://` probes fail (no
/// roots).
pub fn probe_client(upstream: &crate::tls::UpstreamTls) -> ProbeClient {
    let tls = upstream.client_config().unwrap_or_else(|e| {
        tracing::error!(error = %e, "upstream TLS files unusable: https:// probes will fail");
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("ring supports rustls' default protocol versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
    });
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    Client::builder(TokioExecutor::new()).build(connector)
}

/// `{"data":[{"id":..},..]}` -> ids; anything else -> empty. Blank ids are dropped: no request
/// can name them (`model` must not be empty), and they would only clutter `/v1/models`.
pub fn parse_model_list(body: &[u8]) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    v.get("data")
        .and_then(|d| d.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|m| m.get("id").and_then(|i| i.as_str()))
                .filter(|id| !id.trim().is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// A request's claim on an engine's load counters; released when dropped, however the request
/// ends (success, error, client disconnect, cancelled stream, retry elsewhere).
pub struct Dispatch {
    fleet: Arc<Fleet>,
    engine: Arc<Engine>,
    prefill_bytes: u64,
}

impl Dispatch {
    /// The engine this request went to.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The engine started answering: its prefill for this request is over.
    pub fn prefill_done(&mut self) {
        let b = std::mem::take(&mut self.prefill_bytes);
        self.engine.pending_prefill.fetch_sub(b, Ordering::Relaxed);
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        self.prefill_done();
        self.engine.inflight.fetch_sub(1, Ordering::Relaxed);
        self.fleet.total_inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::engine_addr;

    /// An engine's `/v1/models` answer: ids kept in order, blank ones and non-strings dropped,
    /// anything that is not the list shape read as no models.
    #[test]
    fn model_lists_keep_only_usable_ids() {
        let body = br#"{"data":[{"id":"a"},{"id":""},{"id":"  "},{"id":7},{},{"id":"b"}]}"#;
        assert_eq!(parse_model_list(body), vec!["a", "b"]);
        for bad in [&b"not json"[..], br#"{"data":{"id":"a"}}"#, b"[]", b""] {
            assert!(parse_model_list(bad).is_empty());
        }
    }

    /// A resolved engine address serving `models`.
    fn fleet() -> Arc<Fleet> {
        Fleet::new(
            vec![
                engine_addr("a", "http://127.0.0.1:1", "127.0.0.1:1", &["m"]),
                engine_addr("b", "http://127.0.0.1:2", "127.0.0.1:2", &["m"]),
            ],
            Duration::from_secs(5),
        )
    }

    #[test]
    fn guards_release_counts_on_drop() {
        let f = fleet();
        let e = f.engines()[0].clone();
        let mut g = f.dispatch(&e, 100);
        assert_eq!(
            (e.inflight(), e.pending_prefill(), f.total_inflight()),
            (1, 100, 1)
        );
        g.prefill_done();
        assert_eq!(e.pending_prefill(), 0);
        let g2 = f.dispatch(&e, 50);
        drop(g);
        drop(g2);
        assert_eq!(
            (e.inflight(), e.pending_prefill(), f.total_inflight()),
            (0, 0, 0)
        );
    }

    #[test]
    fn candidates_need_health_and_model() {
        let f = fleet();
        assert_eq!(f.candidates("m", false).unwrap_err(), NoRoute::NoneHealthy);
        assert_eq!(
            f.candidates("other", false).unwrap_err(),
            NoRoute::UnknownModel
        );
        f.engines()[1].healthy.store(true, Ordering::Relaxed);
        let c = f.candidates("m", false).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].node, NodeId(1));
    }

    /// Up with `["x"]` on port 1, down elsewhere.
    struct FakeHealth;

    #[async_trait]
    impl HealthCheck for FakeHealth {
        async fn check(&self, engine: &Engine) -> Option<Vec<String>> {
            (engine.addr().port() == 1).then(|| vec!["x".to_string()])
        }
    }

    #[tokio::test]
    async fn probes_apply_the_health_check() {
        let f = Fleet::new(
            vec![
                engine_addr("a", "http://127.0.0.1:1", "127.0.0.1:1", &[]),
                engine_addr("b", "http://127.0.0.1:2", "127.0.0.1:2", &[]),
            ],
            Duration::from_secs(5),
        );
        f.engines()[1].healthy.store(true, Ordering::Relaxed);
        let health: Arc<dyn HealthCheck> = Arc::new(FakeHealth);
        f.probe_all(&health).await;
        let e = f.engines();
        assert!(e[0].healthy() && !e[1].healthy());
        assert_eq!(e[0].models().as_deref(), Some(&vec!["x".to_string()]));
        assert_eq!(e[1].models(), None);
        assert_eq!(f.candidates("x", false).unwrap()[0].node, NodeId(0));
    }

    #[tokio::test]
    async fn names_are_resolved_again_and_an_unresolved_engine_stays_down() {
        // "localhost" resolves (to 127.0.0.1, ::1 or both); the stale address is replaced.
        // ".invalid" never resolves (RFC 2606): down, whatever the health check would say.
        let f = Fleet::new(
            vec![
                engine_addr("moved", "http://localhost:1", "192.0.2.1:1", &[]),
                EngineAddr {
                    unresolved: Some("does not resolve".into()),
                    ..engine_addr(
                        "missing",
                        "http://kvmesh-engine.invalid:1",
                        "0.0.0.0:1",
                        &[],
                    )
                },
            ],
            Duration::from_secs(5),
        );
        let health: Arc<dyn HealthCheck> = Arc::new(FakeHealth);
        f.probe_all(&health).await;
        let e = f.engines();
        assert!(e[0].addr().ip().is_loopback(), "{}", e[0].addr());
        assert!(e[0].healthy());
        assert!(e[1].unresolved.load(Ordering::Relaxed));
        assert!(
            !e[1].healthy(),
            "port 1 would pass FakeHealth: never probed"
        );
    }

    /// Peer `c`, through its proxy at 127.0.0.1:3, serving `m`, with the load given.
    fn peer_c(inflight: u64, pending_prefill_bytes: u64) -> PeerEngine {
        crate::testing::peer_engine("c", 3, inflight, pending_prefill_bytes)
    }

    #[test]
    fn peers_come_and_go_and_a_refusing_peer_stays_down() {
        let f = fleet();
        let peer = peer_c(7, 0);
        let id = f.upsert_peer(&peer);
        assert_eq!(id, NodeId(2));
        assert_eq!(f.candidates("m", false).unwrap().len(), 1);
        assert!(
            f.candidates("m", true).is_err(),
            "local_only excludes peers"
        );
        let e = f.get(id).unwrap();
        assert_eq!((e.inflight(), e.via_peer()), (7, true));
        f.mark_down(&e);
        assert_eq!(f.upsert_peer(&peer), id, "same peer, same id");
        assert!(
            !e.healthy(),
            "gossip does not revive a peer that refused a connection"
        );
        f.remove_peer("c");
        assert!(f.get(id).is_none());
        assert_ne!(f.upsert_peer(&peer), id, "a returning peer gets a fresh id");
    }

    /// A peer that refused a connection is skipped for `peer_down`, then used again on the
    /// record it last published: an idle peer publishes no new one, so waiting for one would
    /// keep it out for good. A record that says it is not ready keeps it out.
    #[test]
    fn a_refusing_peer_comes_back_after_peer_down_without_a_new_record() {
        let f = Fleet::new(Vec::new(), Duration::from_millis(100));
        let mut peer = peer_c(0, 0);
        let id = f.upsert_peer(&peer);
        let e = f.get(id).unwrap();
        assert!(e.healthy());
        f.mark_down(&e);
        assert!(!e.healthy());
        assert!(
            f.candidates("m", false).is_err(),
            "a down peer is no candidate"
        );
        std::thread::sleep(Duration::from_millis(150));
        assert!(e.healthy(), "still down after peer_down with no new record");
        assert_eq!(f.candidates("m", false).unwrap().len(), 1);
        peer.ready = false;
        f.upsert_peer(&peer);
        assert!(!e.healthy(), "a peer that says it is not ready");
    }

    /// A beacon's load stands for the peer's report while fresh, whatever older records gossip
    /// says meanwhile; once beacons stop, the latest record's load counts again. An unknown
    /// peer's beacon changes nothing.
    #[test]
    fn a_beacon_load_stands_against_older_gossiped_records() {
        let f = fleet();
        let mut peer = peer_c(7, 700);
        let id = f.upsert_peer(&peer);
        let e = f.get(id).unwrap();
        peer.inflight = 1;
        f.upsert_peer(&peer);
        assert_eq!(e.inflight(), 1, "without beacons the record sets the load");
        let load = kvmesh_cluster::Load {
            inflight: 4,
            pending_prefill_bytes: 90_000,
        };
        assert!(f.peer_load("c", load));
        assert!(!f.peer_load("nobody", load));
        assert_eq!((e.inflight(), e.pending_prefill()), (4, 90_000));
        peer.inflight = 2;
        f.upsert_peer(&peer);
        assert_eq!(
            (e.inflight(), e.pending_prefill()),
            (4, 90_000),
            "an older record overrode a fresh beacon"
        );
        std::thread::sleep(kvmesh_cluster::beacon::FRESH + Duration::from_millis(50));
        assert_eq!(
            (e.inflight(), e.pending_prefill()),
            (2, 700),
            "beacons stopped: the latest record counts"
        );
    }
}
