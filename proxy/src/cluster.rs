//! Gossip glue: publishes this proxy's node record and its engine's residency, applies peers'
//! to the fleet and the residency index, and tracks the local engine's `kv_epoch`.
//!
//! A peer's published URL becomes an upstream only once it is admitted ([`PeerAdmission`]):
//! resolved off the gossip task, inside the allowed networks (by default: the IP the peer
//! advertises for gossip, and only once this node has received authenticated gossip from that
//! IP itself), and answering a health probe.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use http_body_util::BodyExt;
use kvmesh_cluster::{Cluster, Membership, NodeRecord, PeerOrigin, Rejection, ResidencySync};
use kvmesh_filters::residency::{NodeId, ResidencyIndex};
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::{engine_url_host, Mode, ProxyConfig};
use crate::fleet::{self, Engine, Fleet, PeerEngine};
use crate::metrics::Metrics;

/// How long a refused peer URL waits before it is checked again.
const REFUSED_RETRY: Duration = Duration::from_secs(10);
/// How long a peer whose gossip address has not been heard from waits before it is asked
/// again (direct contact usually follows within a few gossip rounds).
const UNVERIFIED_RETRY: Duration = Duration::from_secs(1);

/// Most peer-URL checks resolving a host name at once, and one per gossip address. Each
/// lookup holds one of tokio's blocking threads until the system resolver answers or gives up,
/// which may be long after the check's own timeout: a key holder that publishes a new
/// unanswerable host name every round must not be able to take the whole blocking pool, nor
/// every slot (a URL with an IP address needs none).
const MAX_LOOKUPS: usize = 16;

/// A lookup of [`MAX_LOOKUPS`] for a peer gossiping from an address, held until the lookup
/// has returned (not merely timed out).
struct LookupSlot {
    held: Arc<parking_lot::Mutex<HashSet<IpAddr>>>,
    by: IpAddr,
}

impl LookupSlot {
    fn take(held: &Arc<parking_lot::Mutex<HashSet<IpAddr>>>, by: IpAddr) -> Option<LookupSlot> {
        let mut h = held.lock();
        if h.len() >= MAX_LOOKUPS || !h.insert(by) {
            return None;
        }
        Some(LookupSlot {
            held: held.clone(),
            by,
        })
    }
}

impl Drop for LookupSlot {
    fn drop(&mut self) {
        self.held.lock().remove(&self.by);
    }
}

/// What this proxy decided about a peer's published URL.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// Being resolved and probed.
    Pending,
    /// Checked: requests may go to this address.
    Admitted(SocketAddr),
    /// Refused; checked again after this instant.
    Refused(Instant),
}

/// Checks peers' published URLs before they are used as upstreams.
pub struct PeerAdmission {
    /// (node id, URL, advertised gossip address) -> verdict; one entry per node id.
    verdicts: parking_lot::Mutex<HashMap<(String, String, SocketAddr), Verdict>>,
    networks: Vec<ipnet::IpNet>,
    client: fleet::ProbeClient,
    timeout: Duration,
    metrics: Arc<Metrics>,
    max_entries: usize,
    /// Gossip addresses whose peer URL's host name is being looked up ([`MAX_LOOKUPS`]).
    lookups: Arc<parking_lot::Mutex<HashSet<IpAddr>>>,
}

impl PeerAdmission {
    fn new(
        cfg: &ProxyConfig,
        metrics: Arc<Metrics>,
        upstream_tls: &crate::tls::UpstreamTls,
    ) -> Arc<Self> {
        Arc::new(PeerAdmission {
            verdicts: parking_lot::Mutex::new(HashMap::new()),
            // Validated at load time; an error here cannot happen, and an empty list is the
            // strict default anyway.
            networks: cfg.peer_networks().unwrap_or_default(),
            client: fleet::probe_client(upstream_tls),
            timeout: Duration::from_millis(cfg.health.timeout_ms),
            metrics,
            max_entries: cfg.cluster.max_peers.saturating_mul(2),
            lookups: Arc::default(),
        })
    }

    /// The checked address for `node_id` at `url`, or `None` (a check is started when none is
    /// running and the last refusal is old enough).
    fn admitted(
        self: &Arc<Self>,
        node_id: &str,
        url: &str,
        origin: &PeerOrigin,
        via_peer: bool,
    ) -> Option<SocketAddr> {
        let gossip_addr = origin.gossip_addr;
        let key = (node_id.to_string(), url.to_string(), gossip_addr);
        let mut verdicts = self.verdicts.lock();
        match verdicts.get(&key) {
            Some(Verdict::Admitted(a)) => return Some(*a),
            Some(Verdict::Pending) => return None,
            Some(Verdict::Refused(at)) if Instant::now() < *at => return None,
            _ => {}
        }
        // A node publishes one URL from one address: drop what we held for earlier ones.
        verdicts.retain(|(n, u, g), _| n != node_id || (u == url && *g == gossip_addr));
        if verdicts.len() >= self.max_entries {
            self.refuse_count("over_cap");
            return None;
        }
        if self.networks.is_empty() && !origin.heard_from && !gossip_addr.ip().is_loopback() {
            // Its gossip address is only a claim until that host has gossiped with us.
            verdicts.insert(key, Verdict::Refused(Instant::now() + UNVERIFIED_RETRY));
            self.refuse_count("unverified");
            return None;
        }
        let named = engine_url_host(url).is_ok_and(|(host, _)| host.parse::<IpAddr>().is_err());
        let slot = match named.then(|| LookupSlot::take(&self.lookups, gossip_addr.ip())) {
            Some(None) => {
                // Asked again at the next pass.
                self.refuse_count("busy");
                return None;
            }
            Some(slot) => slot,
            None => None,
        };
        verdicts.insert(key.clone(), Verdict::Pending);
        drop(verdicts);
        let this = self.clone();
        tokio::spawn(async move {
            let verdict = match this.check(&key.1, gossip_addr, via_peer, slot).await {
                Ok(addr) => {
                    tracing::info!(peer = %key.0, url = %key.1, %addr, "peer admitted");
                    Verdict::Admitted(addr)
                }
                Err(reason) => {
                    tracing::warn!(peer = %key.0, url = %key.1, %gossip_addr, reason, "peer URL refused");
                    this.refuse_count(reason);
                    Verdict::Refused(Instant::now() + REFUSED_RETRY)
                }
            };
            let mut verdicts = this.verdicts.lock();
            // Only if the peer is still there and still publishes this URL.
            if let Some(v) = verdicts.get_mut(&key) {
                *v = verdict;
            }
        });
        None
    }

    fn refuse_count(&self, reason: &str) {
        self.metrics
            .gossip_peers_refused
            .with_label_values(&[reason])
            .inc();
    }

    /// Resolves `url` (a host name on a blocking thread, holding `slot` until the resolver
    /// returns: never on the gossip loop), checks the address against the allowed networks,
    /// and probes it.
    async fn check(
        &self,
        url: &str,
        gossip_addr: SocketAddr,
        via_peer: bool,
        slot: Option<LookupSlot>,
    ) -> Result<SocketAddr, &'static str> {
        let (host, port) = engine_url_host(url).map_err(|_| "url")?;
        let addrs = match (host.parse::<IpAddr>(), slot) {
            (Ok(ip), _) => vec![SocketAddr::new(ip, port)],
            (Err(_), None) => return Err("url"),
            (Err(_), Some(slot)) => {
                let name = host.clone();
                let lookup = tokio::task::spawn_blocking(move || {
                    let _slot = slot;
                    std::net::ToSocketAddrs::to_socket_addrs(&(name.as_str(), port))
                        .map(|a| a.collect::<Vec<SocketAddr>>())
                });
                tokio::time::timeout(self.timeout, lookup)
                    .await
                    .map_err(|_| "url")?
                    .map_err(|_| "url")?
                    .map_err(|_| "url")?
            }
        };
        let addr = addrs
            .into_iter()
            .find(|a| self.allowed(a.ip(), gossip_addr.ip()))
            .ok_or("network")?;
        // A kvmesh peer answers /health; an engine (gateway mode) answers /v1/models.
        let path = if via_peer { "/health" } else { "/v1/models" };
        // Plain HTTP goes to the checked address itself. HTTPS must name the URL's host, whose
        // certificate it verifies (the data path then connects to the checked address with that
        // name as SNI, so a host that resolves elsewhere later gains nothing).
        let target = if crate::config::url_is_tls(url) {
            let host = if host.contains(':') {
                format!("[{host}]")
            } else {
                host
            };
            format!("https://{host}:{port}{path}")
        } else {
            format!("http://{addr}{path}")
        };
        let uri: http::Uri = target.parse().map_err(|_| "url")?;
        let resp = tokio::time::timeout(self.timeout, self.client.get(uri))
            .await
            .map_err(|_| "probe")?
            .map_err(|_| "probe")?;
        if !resp.status().is_success() {
            return Err("probe");
        }
        Ok(addr)
    }

    /// Whether a peer gossiping from `gossip_ip` may send us to `ip`.
    fn allowed(&self, ip: std::net::IpAddr, gossip_ip: std::net::IpAddr) -> bool {
        if self.networks.is_empty() {
            ip == gossip_ip || (ip.is_loopback() && gossip_ip.is_loopback())
        } else {
            self.networks.iter().any(|n| n.contains(&ip))
        }
    }

    fn forget(&self, node_id: &str) {
        self.verdicts.lock().retain(|(n, _, _), _| n != node_id);
    }

    /// Drops verdicts of nodes no longer live (refused and pending ones included).
    fn retain_live(&self, live: &[&str]) {
        let live: std::collections::HashSet<&str> = live.iter().copied().collect();
        self.verdicts
            .lock()
            .retain(|(n, _, _), _| live.contains(n.as_str()));
    }
}

/// The background service that runs the gossip.
pub struct ClusterService {
    /// Configuration in force.
    pub cfg: ProxyConfig,
    /// The engines (peers' are added and removed here).
    pub fleet: Arc<Fleet>,
    /// The residency index (peers' residency enters it).
    pub index: Arc<ResidencyIndex>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// TLS towards `https://` peers (their probes).
    pub upstream_tls: Arc<crate::tls::UpstreamTls>,
    /// Gossip counters and who gossips with us (shared with the hop trust check).
    pub stats: Arc<kvmesh_cluster::GossipStats>,
}

/// Adds peers' engines to the fleet: through their proxy in sidecar mode, directly otherwise.
struct FleetMembership<'a> {
    fleet: &'a Fleet,
    via_peer: bool,
    admission: &'a Arc<PeerAdmission>,
    metrics: &'a Metrics,
}

/// Most models a peer's record may list, and the longest model name it may hold: each model
/// of each peer has its own metric series, so a record past either is not used (`models`).
pub const MAX_PEER_MODELS: usize = 64;
/// See [`MAX_PEER_MODELS`].
pub const MAX_PEER_MODEL_NAME_BYTES: usize = 256;

impl Membership for FleetMembership<'_> {
    fn upsert(&self, r: &NodeRecord, origin: &PeerOrigin) -> Option<NodeId> {
        let held = self.fleet.peer_models(&r.node_id);
        if r.models.len() > MAX_PEER_MODELS
            || r.models.iter().any(|m| m.len() > MAX_PEER_MODEL_NAME_BYTES)
        {
            self.admission.refuse_count("models");
            if let Some(held) = held {
                self.metrics.per_engine.forget(&r.node_id, &held);
                self.fleet.remove_peer(&r.node_id);
            }
            return None;
        }
        // Series of models the peer no longer lists go (a peer that renames its models every
        // round must not grow /metrics).
        let dropped: Vec<String> = held
            .unwrap_or_default()
            .into_iter()
            .filter(|m| !r.models.contains(m))
            .collect();
        if !dropped.is_empty() {
            self.metrics.per_engine.forget_models(&r.node_id, &dropped);
        }
        let url = if self.via_peer {
            &r.proxy_url
        } else {
            &r.engine_url
        };
        let Some(addr) = self
            .admission
            .admitted(&r.node_id, url, origin, self.via_peer)
        else {
            // Not (yet) checked: whatever we held for this node at another URL goes now.
            if self.fleet.has_peer_elsewhere(&r.node_id, url) {
                self.fleet.remove_peer(&r.node_id);
            }
            return None;
        };
        Some(self.fleet.upsert_peer(&PeerEngine {
            node_id: r.node_id.clone(),
            addr,
            url: url.clone(),
            via_peer: self.via_peer,
            models: r.models.clone(),
            ready: r.ready,
            inflight: r.inflight,
            pending_prefill_bytes: r.pending_prefill_bytes,
        }))
    }

    fn live(&self, node_ids: &[&str]) {
        self.admission.retain_live(node_ids);
    }

    fn remove(&self, node_id: &str, _node: NodeId) {
        let models = self.fleet.peer_models(node_id).unwrap_or_default();
        self.metrics.per_engine.forget(node_id, &models);
        self.fleet.remove_peer(node_id);
        self.admission.forget(node_id);
        for reason in crate::placement::reason::ALL {
            let _ = self
                .metrics
                .forwards
                .remove_label_values(&[node_id, reason]);
        }
    }
}

/// The local engine's cache generation, as this proxy knows it.
struct LocalEpoch {
    /// From the engine's `/server_info` (`kv_epoch`), when it reports one.
    reported: Option<u64>,
    /// Otherwise a value this proxy draws anew whenever the engine comes back from down.
    derived: u64,
    was_healthy: bool,
}

impl LocalEpoch {
    fn current(&self) -> u64 {
        self.reported.unwrap_or(self.derived)
    }
}

/// `GET {url}/server_info` -> `kv_epoch`, if the engine reports one.
async fn fetch_epoch(client: &fleet::ProbeClient, url: &str, timeout: Duration) -> Option<u64> {
    let uri = format!("{}/server_info", url.trim_end_matches('/'))
        .parse()
        .ok()?;
    let resp = tokio::time::timeout(timeout, client.get(uri))
        .await
        .ok()?
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = tokio::time::timeout(timeout, resp.into_body().collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    serde_json::from_slice::<serde_json::Value>(&body)
        .ok()?
        .get("kv_epoch")?
        .as_u64()
}

impl ClusterService {
    fn local_engine(&self) -> Option<Arc<Engine>> {
        (self.cfg.mode == Mode::Sidecar)
            .then(|| {
                self.fleet
                    .engines()
                    .iter()
                    .find(|e| e.peer.is_none())
                    .cloned()
            })
            .flatten()
    }

    /// Notices a restarted local engine (new `kv_epoch`, or back from down when it reports
    /// none) and drops what the index says it held.
    async fn track_epoch(
        &self,
        engine: &Engine,
        epoch: &mut LocalEpoch,
        client: &fleet::ProbeClient,
    ) {
        let healthy = engine.healthy();
        let timeout = Duration::from_millis(self.cfg.health.timeout_ms);
        let reported = if healthy {
            fetch_epoch(client, &engine.url, timeout).await
        } else {
            None
        };
        let changed = match (epoch.reported, reported) {
            (Some(old), Some(new)) => old != new,
            (None, Some(_)) => false,
            // No report: a down -> up transition may have been a restart.
            (_, None) => healthy && !epoch.was_healthy && epoch.reported.is_none(),
        };
        if changed {
            if reported.is_none() {
                epoch.derived = fastrand::u64(1..);
            }
            tracing::info!(engine = %engine.name, "engine restarted (new kv_epoch): dropping its residency");
            self.index.drop_node(engine.id);
        }
        if reported.is_some() {
            epoch.reported = reported;
        }
        epoch.was_healthy = healthy;
    }

    fn record(&self, engine: Option<&Engine>, epoch: u64) -> NodeRecord {
        let mut r = NodeRecord {
            node_id: self.cfg.node_id(),
            proxy_url: self.cfg.proxy_url(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            role: "gateway".into(),
            ..Default::default()
        };
        if let Some(e) = engine {
            r.engine_url = e.url.clone();
            r.models = e.models().map(|m| m.to_vec()).unwrap_or_default();
            r.role = "both".into();
            r.inflight = e.own_inflight();
            r.pending_prefill_bytes = e.own_pending_prefill();
            r.kv_epoch = epoch;
            r.ready = e.healthy();
            r.load_beacons = self.cfg.cluster.load_beacon_interval_ms > 0;
        }
        r
    }
}

#[async_trait]
impl BackgroundService for ClusterService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let joined = match self.cfg.cluster_config() {
            Ok(c) => Cluster::join_with_stats(c, self.stats.clone())
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let cluster = match joined {
            Ok(c) => c,
            Err(e) => {
                // Sidecar mode without gossip would silently be a lone proxy: stop instead.
                tracing::error!(error = %e, "cannot join the cluster; exiting");
                std::process::exit(2);
            }
        };
        tracing::info!(node = %cluster.node_id(), "joined the cluster");
        let client = fleet::probe_client(&self.upstream_tls);
        let interval = Duration::from_millis(self.cfg.cluster.gossip_interval_ms);
        let epoch_every = Duration::from_millis(self.cfg.health.interval_ms);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sync = ResidencySync::new();
        let mut epoch = LocalEpoch {
            reported: None,
            derived: fastrand::u64(1..),
            was_healthy: false,
        };
        let mut last_epoch_check: Option<Instant> = None;
        let (mut sent, mut received) = (0u64, 0u64);
        let admission = PeerAdmission::new(&self.cfg, self.metrics.clone(), &self.upstream_tls);
        let membership = FleetMembership {
            fleet: &self.fleet,
            via_peer: self.cfg.mode == Mode::Sidecar,
            admission: &admission,
            metrics: &self.metrics,
        };
        let mut dropped = [0u64; Rejection::ALL.len()];
        let mut other_source = 0u64;
        let mut bulk_seen = [0u64; 5];
        let beacon = cluster.load_beacon();
        let mut beacons_seen = [0u64; 4];
        let beacon_every = Duration::from_millis(self.cfg.cluster.load_beacon_interval_ms);
        let mut beacon_tasks = Vec::new();
        // Between sidecars only: a gateway fronts no engine of its own, and peers track only
        // nodes that do, so it would neither send nor be sent any.
        if !beacon_every.is_zero() && self.cfg.mode == Mode::Sidecar {
            beacon_tasks.push(tokio::spawn(take_beacons(
                beacon.clone(),
                self.fleet.clone(),
            )));
            beacon_tasks.push(tokio::spawn(send_beacons(
                beacon.clone(),
                self.fleet.clone(),
                beacon_every,
            )));
        }
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => break,
            }
            match cluster.ensure_running().await {
                Ok(true) => self.metrics.gossip_restarts.inc(),
                Ok(false) => {}
                Err(e) => tracing::error!(error = %e, "cannot restart gossip; retrying"),
            }
            let local = self.local_engine();
            if let Some(e) = local.as_deref() {
                if last_epoch_check.is_none_or(|t| t.elapsed() >= epoch_every) {
                    self.track_epoch(e, &mut epoch, &client).await;
                    last_epoch_check = Some(Instant::now());
                }
            }
            cluster
                .publish_record(&self.record(local.as_deref(), epoch.current()))
                .await;
            cluster
                .publish_residency_of(&self.index, local.as_ref().map(|e| e.id))
                .await;
            let report = sync.sync(&cluster, &self.index, &membership).await;
            self.metrics
                .gossip_peers
                .set(cluster.live_peers().await as i64);
            let stats = cluster.stats();
            let (s, r) = (stats.bytes_sent(), stats.bytes_received());
            self.metrics
                .gossip_bytes
                .with_label_values(&["out"])
                .inc_by(s - sent);
            self.metrics
                .gossip_bytes
                .with_label_values(&["in"])
                .inc_by(r - received);
            (sent, received) = (s, r);
            let bulk = cluster.bulk_stats();
            let bulk_now = [
                bulk.pulled(),
                bulk.pull_failed(),
                bulk.served(),
                bulk.refused(),
                bulk.evicted(),
            ];
            count_since(
                &self.metrics.gossip_bulk,
                ["pulled", "pull_failed", "served", "refused", "evicted"],
                bulk_now,
                &mut bulk_seen,
            );
            let b = beacon.stats();
            let beacons_now = [b.sent(), b.received(), b.refused(), b.unknown()];
            count_since(
                &self.metrics.gossip_beacons,
                ["sent", "received", "refused", "unknown"],
                beacons_now,
                &mut beacons_seen,
            );
            for (i, reason) in Rejection::ALL.iter().enumerate() {
                let n = stats.rejected(*reason);
                self.metrics
                    .gossip_dropped
                    .with_label_values(&[reason.label()])
                    .inc_by(n - dropped[i]);
                dropped[i] = n;
            }
            let n = stats.from_other_source();
            if n > other_source {
                self.metrics.gossip_other_source.inc_by(n - other_source);
                if let Some((named, from)) = stats.last_from_other_source() {
                    tracing::warn!(
                        frames = n - other_source,
                        %named,
                        %from,
                        "gossip frames came from another IP than the one their sender names: that host is not taken as a member (a replay, or a node whose packets leave from another address than it advertises)"
                    );
                }
                other_source = n;
            }
            if report.over_cap > 0 {
                self.metrics
                    .gossip_peers_refused
                    .with_label_values(&["over_cap"])
                    .inc_by(report.over_cap as u64);
            }
            if report.misnamed > 0 {
                self.metrics
                    .gossip_peers_refused
                    .with_label_values(&["misnamed"])
                    .inc_by(report.misnamed as u64);
                tracing::warn!(
                    count = report.misnamed,
                    "gossip: a record names another node than the one that published it; not used"
                );
            }
            if report.added + report.removed > 0 {
                tracing::debug!(?report, "gossip sync");
            }
        }
        for t in beacon_tasks {
            t.abort();
        }
        cluster.shutdown().await;
    }
}

/// Adds to `counter`, per label, what the totals `now` grew by since `seen`, which then holds
/// them (the cluster keeps running totals; the metrics count from the proxy's start).
fn count_since<const N: usize>(
    counter: &prometheus::IntCounterVec,
    labels: [&str; N],
    now: [u64; N],
    seen: &mut [u64; N],
) {
    for (i, label) in labels.iter().enumerate() {
        counter
            .with_label_values(&[label])
            .inc_by(now[i].saturating_sub(seen[i]));
    }
    *seen = now;
}

/// Sends the local engine's load to peers whenever it changed, at most once per `every`, and
/// at least once per [`kvmesh_cluster::beacon::HEARTBEAT`] (sidecar mode: the one engine that
/// is not a peer's). With many peers the spacing grows to [`BEACON_SPACING_PER_PEER`] per peer
/// sent to, so a node sends (and each peer receives) beacons at a bounded rate whatever the
/// cluster's size.
async fn send_beacons(beacon: kvmesh_cluster::LoadBeacon, fleet: Arc<Fleet>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<(kvmesh_cluster::Load, Instant)> = None;
    let mut spacing = every;
    loop {
        tick.tick().await;
        let Some(local) = fleet.engines().iter().find(|e| e.peer.is_none()).cloned() else {
            continue;
        };
        let load = kvmesh_cluster::Load {
            inflight: local.own_inflight(),
            pending_prefill_bytes: local.own_pending_prefill(),
        };
        let due = last.is_none_or(|(l, at)| {
            let since = at.elapsed();
            (l != load && since >= spacing) || since >= kvmesh_cluster::beacon::HEARTBEAT
        });
        if due {
            let peers = beacon.send(load).await;
            spacing = every.max(
                BEACON_SPACING_PER_PEER.saturating_mul(u32::try_from(peers).unwrap_or(u32::MAX)),
            );
            last = Some((load, Instant::now()));
        }
    }
}

/// The least spacing of load beacons per peer they go to: at most about 1,000 beacon
/// datagrams a second leave a node (beyond 10 peers at the default interval).
const BEACON_SPACING_PER_PEER: Duration = Duration::from_millis(1);

/// Applies peers' load beacons to the fleet as they arrive.
async fn take_beacons(beacon: kvmesh_cluster::LoadBeacon, fleet: Arc<Fleet>) {
    loop {
        for r in beacon.recv().await {
            fleet.peer_load(&r.node_id, r.load);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_peers: usize, networks: &[&str]) -> Arc<PeerAdmission> {
        let mut cfg = ProxyConfig::default();
        cfg.cluster.max_peers = max_peers;
        cfg.cluster.peer_networks = networks.iter().map(|s| s.to_string()).collect();
        PeerAdmission::new(
            &cfg,
            Arc::new(Metrics::new().expect("metrics")),
            &crate::tls::UpstreamTls::from_config(&cfg.upstream).expect("no upstream TLS"),
        )
    }

    fn origin(ip: [u8; 4], heard_from: bool) -> PeerOrigin {
        PeerOrigin {
            gossip_addr: SocketAddr::from((ip, 7946)),
            heard_from,
        }
    }

    // Defect: verdicts of peers that left were never removed, so after 2 x max_peers refused
    // or pending peers every new peer was refused as over_cap for good.
    #[test]
    fn verdicts_of_departed_peers_are_forgotten() {
        let a = admission(2, &[]);
        let unheard = origin([10, 0, 0, 9], false);
        for i in 0..4 {
            assert_eq!(
                a.admitted(&format!("n{i}"), "http://10.0.0.9:1", &unheard, true),
                None
            );
        }
        assert_eq!(a.verdicts.lock().len(), 4);
        // The table is full: a fifth is refused without a verdict.
        assert_eq!(a.admitted("n5", "http://10.0.0.9:1", &unheard, true), None);
        assert_eq!(a.verdicts.lock().len(), 4);
        assert_eq!(
            a.metrics
                .gossip_peers_refused
                .with_label_values(&["over_cap"])
                .get(),
            1
        );
        // They leave: their verdicts go, and a new peer gets a verdict again.
        a.retain_live(&["n5"]);
        assert!(a.verdicts.lock().is_empty());
        assert_eq!(a.admitted("n5", "http://10.0.0.9:1", &unheard, true), None);
        assert_eq!(a.verdicts.lock().len(), 1);
    }

    // A key holder may claim any gossip address: by default its URL is checked only once this
    // node has heard authenticated gossip from that address itself.
    #[test]
    fn unverified_gossip_addresses_are_refused_by_default() {
        let a = admission(8, &[]);
        assert_eq!(
            a.admitted(
                "x",
                "http://10.1.2.3:80",
                &origin([10, 1, 2, 3], false),
                true
            ),
            None
        );
        assert!(matches!(
            a.verdicts.lock().values().next(),
            Some(Verdict::Refused(_))
        ));
        assert_eq!(
            a.metrics
                .gossip_peers_refused
                .with_label_values(&["unverified"])
                .get(),
            1
        );
    }

    // A key holder publishing a new host name every round: a check that must look a name up
    // takes a slot (held until the lookup returns), one per gossip address and 16 in all, so
    // lookups cannot take every blocking thread, nor one peer every slot. A URL with an IP
    // address needs none.
    #[tokio::test]
    async fn lookups_in_flight_are_capped_per_gossip_address_and_in_all() {
        let a = admission(64, &["10.0.0.0/8"]);
        let busy = |a: &PeerAdmission| {
            a.metrics
                .gossip_peers_refused
                .with_label_values(&["busy"])
                .get()
        };
        let peer = origin([10, 0, 0, 9], true);
        // This peer's address has a lookup in flight: its next host name waits.
        let in_flight = LookupSlot::take(&a.lookups, peer.gossip_addr.ip()).expect("a slot");
        assert!(LookupSlot::take(&a.lookups, peer.gossip_addr.ip()).is_none());
        assert_eq!(
            a.admitted("n", "http://host-1.invalid:1", &peer, true),
            None
        );
        assert!(a.verdicts.lock().is_empty(), "no check started");
        assert_eq!(busy(&a), 1);
        // Every slot taken, by other addresses: a host name waits, an IP address does not.
        let others: Vec<LookupSlot> = (1..MAX_LOOKUPS)
            .map(|i| {
                LookupSlot::take(&a.lookups, IpAddr::from([10, 1, 0, i as u8])).expect("a slot")
            })
            .collect();
        let other = origin([10, 0, 0, 10], true);
        assert_eq!(
            a.admitted("m", "http://host-2.invalid:1", &other, true),
            None
        );
        assert_eq!(busy(&a), 2);
        assert_eq!(a.admitted("m", "http://10.0.0.10:1", &other, true), None);
        assert!(matches!(
            a.verdicts.lock().values().next(),
            Some(Verdict::Pending)
        ));
        assert_eq!(busy(&a), 2);
        drop((in_flight, others));
        assert!(a.lookups.lock().is_empty(), "slots are given back");
    }

    // A key holder renaming its models every round, or listing thousands: /metrics keeps one
    // set of series per model a peer lists now, and a record past the caps is not used.
    #[test]
    fn a_peers_model_series_follow_its_list_and_its_list_is_capped() {
        let a = admission(8, &[]);
        let url = "http://127.0.0.1:9";
        let from = origin([127, 0, 0, 1], true);
        a.verdicts.lock().insert(
            ("p".into(), url.into(), from.gossip_addr),
            Verdict::Admitted(SocketAddr::from(([127, 0, 0, 1], 9))),
        );
        let fleet = Fleet::new(Vec::new(), Duration::from_secs(5));
        let index = ResidencyIndex::new(Default::default());
        let metrics = a.metrics.clone();
        let m = FleetMembership {
            fleet: &fleet,
            via_peer: true,
            admission: &a,
            metrics: &metrics,
        };
        let series = |model: &str| {
            let text = String::from_utf8(metrics.render(&fleet, &index)).expect("utf-8");
            text.lines()
                .filter(|l| l.contains("engine=\"p\"") && l.contains(&format!("model=\"{model}\"")))
                .count()
        };
        let record = |models: Vec<String>| NodeRecord {
            node_id: "p".into(),
            proxy_url: url.into(),
            engine_url: url.into(),
            models,
            ..NodeRecord::default()
        };
        assert!(m.upsert(&record(vec!["a".into()]), &from).is_some());
        assert!(series("a") > 0);
        assert!(m.upsert(&record(vec!["b".into()]), &from).is_some());
        assert_eq!(
            series("a"),
            0,
            "the series of a model the peer dropped stayed"
        );
        assert!(series("b") > 0);
        for models in [
            (0..=MAX_PEER_MODELS).map(|i| format!("m{i}")).collect(),
            vec!["x".repeat(MAX_PEER_MODEL_NAME_BYTES + 1)],
        ] {
            assert!(m.upsert(&record(models), &from).is_none());
            assert!(
                fleet.peer_models("p").is_none(),
                "the peer stayed in the fleet"
            );
            assert_eq!(series("b"), 0);
            assert!(m.upsert(&record(vec!["b".into()]), &from).is_some());
        }
        assert_eq!(
            metrics
                .gossip_peers_refused
                .with_label_values(&["models"])
                .get(),
            2
        );
    }

    #[test]
    fn network_rule() {
        let same_host = admission(8, &[]);
        let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
        assert!(same_host.allowed(ip("10.0.0.5"), ip("10.0.0.5")));
        assert!(!same_host.allowed(ip("10.0.0.6"), ip("10.0.0.5")));
        assert!(same_host.allowed(ip("127.0.0.1"), ip("127.0.0.2")));
        assert!(!same_host.allowed(ip("127.0.0.1"), ip("10.0.0.5")));
        let listed = admission(8, &["10.0.0.0/24", "192.0.2.7"]);
        assert!(listed.allowed(ip("10.0.0.200"), ip("172.16.0.1")));
        assert!(listed.allowed(ip("192.0.2.7"), ip("172.16.0.1")));
        assert!(!listed.allowed(ip("10.0.1.1"), ip("10.0.1.1")));
    }
}
