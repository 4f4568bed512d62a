//! kvmesh-cluster: peer membership and residency gossip between kvmesh proxies, on chitchat (UDP).
//!
//! Each proxy publishes, under its chitchat node state:
//! - `node`: its [`NodeRecord`] as JSON (engine, load, `kv_epoch`, readiness);
//! - `r.000` .. `r.127`: the residency of the engine it fronts, in compact shards ([`shards`]),
//!   re-sent whole when removals make it due ([`FullPublication`]);
//! - `r.128` .. `r.143`: what that residency gained since the shards were last sent, each
//!   publication's gains in a key of their own ([`shards::RECENT`]).
//!
//! [`ResidencySync::sync`] reads what peers published and applies the changes to the proxy's
//! [`ResidencyIndex`] (source [`Source::Gossip`]) and to its view of the fleet (through
//! [`Membership`]): a peer that leaves (chitchat's failure detector) or changes `kv_epoch` loses
//! every entry.
//!
//! A node that (re)joins also pulls the whole published state from a seed over TCP ([`bulk`]),
//! so it routes with the cluster's residency within about a second instead of the many gossip
//! rounds that chitchat's one-datagram deltas take to deliver it.
//!
//! Between rounds, a node that fronts an engine sends its load straight to its peers as it
//! changes ([`beacon`]), so that their routing sees its queue within milliseconds.
//!
//! Every datagram is sealed under the cluster key ([`seal`], [`transport`]): a sender without
//! the key can neither join nor inject state. chitchat's server task is watched: if it ever
//! stops (a panic on a delta it could not apply), [`Cluster::ensure_running`] starts a new
//! incarnation and counts it, so gossip never freezes silently.

pub mod beacon;
pub mod bulk;
pub mod record;
pub mod seal;
pub mod shards;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod transport;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chitchat::{spawn_chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig};
use kvmesh_filters::residency::{NodeId, ResidencyIndex, Source};
use tokio::sync::{Mutex, RwLock};

pub use beacon::{Load, LoadBeacon, LoadReport};
pub use bulk::BulkStats;
pub use record::NodeRecord;
pub use seal::{Keyring, Rejection};
use transport::lock;
pub use transport::{GossipSecurity, GossipStats};

/// The gossip key of the node record.
pub const RECORD_KEY: &str = "node";

/// Errors joining the cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The gossip socket could not be opened.
    #[error("cannot start gossip on {addr}: {message}")]
    Start {
        /// The UDP address.
        addr: SocketAddr,
        /// Why.
        message: String,
    },
}

/// The default [`FullPublication::min_interval`].
pub const DEFAULT_RESIDENCY_FULL_INTERVAL: Duration = Duration::from_secs(2);
/// The default [`FullPublication::max_interval`].
pub const DEFAULT_RESIDENCY_FULL_MAX_INTERVAL: Duration = Duration::from_secs(10);
/// The default [`FullPublication::stale_ratio`].
pub const DEFAULT_RESIDENCY_STALE_RATIO: f64 = 0.05;

/// When a node publishes its residency whole ([`Cluster::publish_residency_of`]): the shards
/// that changed, the recent keys emptied. In between it writes only recent keys, which carry
/// gains; a removal reaches peers with the next full publication. A full publication re-sends
/// nearly every shard (a request's digests fall in nearly all of them), so it is made only
/// when peers' views have gone stale enough to pay for it:
/// - at once when more than half of what was published went (a dropped or restarted engine),
///   or when the gains no longer fit the recent keys;
/// - after `min_interval`, when the removals since the last one reach `stale_ratio` of what
///   was published;
/// - after `max_interval`, on any change.
///
/// Once every recent key is used, the last one takes later gains beside its own until it
/// overflows (measured on the Mooncake trace at 320,000 blocks per engine: 0.71x the bytes of
/// a full publication as soon as the keys are used, with the same hit ratio).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FullPublication {
    /// Least time between two full publications, but for the first two cases above. Zero:
    /// every publication is full.
    pub min_interval: Duration,
    /// Longest a change waits for a full publication (at least `min_interval`).
    pub max_interval: Duration,
    /// The removals, as a share of the digests published, that make a full publication due
    /// after `min_interval`.
    pub stale_ratio: f64,
}

impl FullPublication {
    /// Whether a full publication is due by time, `since_full` after the last one: past
    /// `max_interval`, or past `min_interval` once removals made the published set `stale`.
    fn due(&self, since_full: Duration, stale: bool) -> bool {
        since_full >= self.max_interval || (stale && since_full >= self.min_interval)
    }

    /// Full publications every `interval` whenever anything changed.
    pub fn every(interval: Duration) -> Self {
        FullPublication {
            min_interval: interval,
            max_interval: interval,
            stale_ratio: 0.0,
        }
    }
}

impl Default for FullPublication {
    fn default() -> Self {
        FullPublication {
            min_interval: DEFAULT_RESIDENCY_FULL_INTERVAL,
            max_interval: DEFAULT_RESIDENCY_FULL_MAX_INTERVAL,
            stale_ratio: DEFAULT_RESIDENCY_STALE_RATIO,
        }
    }
}

/// How this node joins the cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Nodes gossip only with nodes of the same cluster id.
    pub cluster_id: String,
    /// This node's id, unique in the cluster.
    pub node_id: String,
    /// UDP address to bind.
    pub listen: SocketAddr,
    /// UDP address peers reach this node at.
    pub advertise: SocketAddr,
    /// `host:port` of nodes to contact first.
    pub seeds: Vec<String>,
    /// Time between gossip rounds.
    pub gossip_interval: Duration,
    /// chitchat's phi-accrual threshold: higher declares nodes dead later but more surely.
    pub phi_threshold: f64,
    /// How long a dead node's state is kept before it is forgotten.
    pub dead_node_grace: Duration,
    /// Keys and switches for sealing datagrams.
    pub security: GossipSecurity,
    /// The most peers tracked; more are ignored (and counted) until some leave.
    pub max_peers: usize,
    /// Serve bulk state transfers on TCP at `listen`, and pull one from a seed at join and
    /// after a gossip restart ([`bulk`]).
    pub bulk_sync: bool,
    /// The most bytes of state one transfer may carry, sent or pulled.
    pub bulk_max_bytes: usize,
    /// When the residency is published whole; in between only recent keys are written
    /// (additions), so removals wait for it.
    pub residency_full: FullPublication,
}

/// A joined cluster.
pub struct Cluster {
    cfg: ClusterConfig,
    handle: RwLock<Incarnation>,
    stats: Arc<GossipStats>,
    node_id: String,
    restarts: AtomicU64,
    published: Mutex<Published>,
    /// The chitchat instance the bulk server reads (replaced on restart).
    current: bulk::CurrentChitchat,
    bulk: bulk::Endpoint,
    /// A pulled transfer, until [`ResidencySync::sync`] takes it.
    delivered: Arc<std::sync::Mutex<Option<bulk::Snapshot>>>,
    beacon: LoadBeacon,
    tasks: Tasks,
}

/// Background tasks of a cluster, stopped with it.
#[derive(Default)]
struct Tasks {
    server: Option<tokio::task::JoinHandle<()>>,
    pull: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Tasks {
    fn drop(&mut self) {
        if let Some(t) = &self.server {
            t.abort();
        }
        if let Some(t) = lock(&self.pull).take() {
            t.abort();
        }
    }
}

/// One run of chitchat's server task.
struct Incarnation {
    handle: ChitchatHandle,
    /// Set when the server task ended without being asked to.
    stopped: Arc<AtomicBool>,
}

#[derive(Default)]
struct Published {
    record: String,
    /// Per slot ([`shards::SLOTS`]), the value set.
    shards: Vec<String>,
    /// The shorts of the last full publication, sorted.
    full: Vec<u64>,
    /// The shorts given then that did not fit their shard ([`shards::MAX_PER_SHARD`]), sorted:
    /// not gains since, so never in a recent key.
    truncated: Vec<u64>,
    /// The shorts published in recent keys since then, sorted.
    recent: Vec<u64>,
    /// Recent keys written since then.
    recent_used: usize,
    /// The shorts of the last recent key written, sorted.
    last_recent: Vec<u64>,
    /// When it was made.
    full_at: Option<Instant>,
    /// Removals since then: the next full publication is owed.
    owed: bool,
    /// They reach [`FullPublication::stale_ratio`]: it is due once `min_interval` has passed.
    stale: bool,
    /// The index version last published by [`Cluster::publish_residency_of`].
    version: Option<Option<u64>>,
}

impl Cluster {
    /// Opens the gossip socket and starts gossiping.
    pub async fn join(cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        Self::join_with_stats(cfg, Arc::new(GossipStats::default())).await
    }

    /// [`Self::join`], counting into `stats` (shared with whoever needs to know, for
    /// example, which hosts gossip with us).
    pub async fn join_with_stats(
        cfg: ClusterConfig,
        stats: Arc<GossipStats>,
    ) -> Result<Cluster, ClusterError> {
        let beacon = LoadBeacon::new(&cfg.node_id, cfg.max_peers);
        let incarnation = Self::spawn(&cfg, &stats, &beacon).await?;
        let current: bulk::CurrentChitchat =
            Arc::new(std::sync::Mutex::new(incarnation.handle.chitchat()));
        let endpoint = bulk::Endpoint {
            security: cfg.security.clone(),
            cluster_id: cfg.cluster_id.clone(),
            stats: Arc::new(BulkStats::default()),
            gossip_stats: stats.clone(),
            max_bytes: cfg.bulk_max_bytes,
        };
        let mut tasks = Tasks::default();
        if cfg.bulk_sync {
            let listener = tokio::net::TcpListener::bind(cfg.listen)
                .await
                .map_err(|e| ClusterError::Start {
                    addr: cfg.listen,
                    message: format!("bulk transfers need TCP on the gossip port too: {e}"),
                })?;
            tasks.server = Some(tokio::spawn(bulk::serve(
                listener,
                endpoint.clone(),
                vec![cfg.advertise, cfg.listen],
                current.clone(),
            )));
        }
        let cluster = Cluster {
            node_id: cfg.node_id.clone(),
            cfg,
            handle: RwLock::new(incarnation),
            stats,
            restarts: AtomicU64::new(0),
            published: Mutex::new(Published {
                record: String::new(),
                shards: vec![String::new(); shards::SLOTS],
                full: Vec::new(),
                truncated: Vec::new(),
                recent: Vec::new(),
                recent_used: 0,
                last_recent: Vec::new(),
                full_at: None,
                owed: false,
                stale: false,
                version: None,
            }),
            current,
            bulk: endpoint,
            delivered: Arc::new(std::sync::Mutex::new(None)),
            beacon,
            tasks,
        };
        cluster.start_pull();
        Ok(cluster)
    }

    /// Pulls the cluster's state from the first seed that answers (else, a little later,
    /// from live peers gossip has found), in the background; [`ResidencySync::sync`] applies it.
    fn start_pull(&self) {
        if !self.cfg.bulk_sync {
            return;
        }
        let ep = self.bulk.clone();
        let seeds = self.cfg.seeds.clone();
        let own = [self.cfg.listen, self.cfg.advertise];
        let own_id = self.node_id.clone();
        let (delivered, current) = (self.delivered.clone(), self.current.clone());
        let max = self.cfg.bulk_max_bytes;
        let retry_after = self.cfg.gossip_interval.saturating_mul(10);
        let task = tokio::spawn(async move {
            for attempt in 0..2 {
                let mut targets = Vec::new();
                for seed in &seeds {
                    if let Ok(addrs) = tokio::net::lookup_host(seed.as_str()).await {
                        targets.extend(addrs);
                    }
                }
                if attempt > 0 {
                    let chitchat = lock(&current).clone();
                    let chitchat = chitchat.lock().await;
                    targets.extend(
                        chitchat
                            .live_nodes()
                            .filter(|id| *id.node_id != *own_id)
                            .take(3)
                            .map(|id| id.gossip_advertise_addr),
                    );
                }
                targets.retain(|a| !own.contains(a));
                targets.dedup();
                for target in targets {
                    match bulk::pull(&ep, target, max).await {
                        Ok(snapshot) => {
                            ep.stats.pulled.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(%target, nodes = snapshot.nodes.len(), "cluster state pulled");
                            // Even a nearly empty one ends the pull: asking more peers while a
                            // whole cluster starts at once (no one has much to share yet) would
                            // only take CPU from gossip.
                            *lock(&delivered) = Some(snapshot);
                            return;
                        }
                        Err(e) => {
                            ep.stats.pull_failed.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(%target, error = %e, "bulk transfer failed; trying the next peer");
                        }
                    }
                }
                tokio::time::sleep(retry_after).await;
            }
            tracing::info!("no peer served the cluster state; gossip alone will deliver it");
        });
        if let Some(old) = lock(&self.tasks.pull).replace(task) {
            old.abort();
        }
    }

    /// Bulk transfer counters.
    pub fn bulk_stats(&self) -> &Arc<BulkStats> {
        &self.bulk.stats
    }

    /// A transfer pulled since the last call, if any.
    fn take_delivered(&self) -> Option<bulk::Snapshot> {
        lock(&self.delivered).take()
    }

    async fn spawn(
        cfg: &ClusterConfig,
        stats: &Arc<GossipStats>,
        beacon: &LoadBeacon,
    ) -> Result<Incarnation, ClusterError> {
        // A new generation per start: peers then see a restarted node as a new incarnation.
        let generation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let self_id = ChitchatId::new(cfg.node_id.clone(), generation, cfg.advertise);
        let failure_detector_config = FailureDetectorConfig {
            phi_threshold: cfg.phi_threshold,
            initial_interval: cfg.gossip_interval * 4,
            dead_node_grace_period: cfg.dead_node_grace,
            ..Default::default()
        };
        let config = ChitchatConfig {
            chitchat_id: self_id.clone(),
            cluster_id: cfg.cluster_id.clone(),
            gossip_interval: cfg.gossip_interval,
            listen_addr: cfg.listen,
            seed_nodes: cfg.seeds.clone(),
            failure_detector_config,
            marked_for_deletion_grace_period: cfg.dead_node_grace,
            catchup_callback: None,
            extra_liveness_predicate: None,
            // V1 compresses the per-round digest of every node's version: less steady-state traffic.
            protocol_version: chitchat::ProtocolVersion::V1,
        };
        let transport = transport::SecureUdp {
            stats: stats.clone(),
            security: cfg.security.clone(),
            cluster_id: cfg.cluster_id.clone(),
            advertise: cfg.advertise,
            // Seeds and peers, with room for peers that moved.
            max_relays: cfg
                .max_peers
                .saturating_mul(2)
                .saturating_add(cfg.seeds.len()),
            beacon: beacon.inner.clone(),
        };
        let handle = spawn_chitchat(config, Vec::new(), &transport)
            .await
            .map_err(|e| ClusterError::Start {
                addr: cfg.listen,
                message: format!("{e:#}"),
            })?;
        let stopped = Arc::new(AtomicBool::new(false));
        let watcher = handle.termination_watcher();
        let flag = stopped.clone();
        tokio::spawn(async move {
            let result = watcher.await;
            flag.store(true, Ordering::Relaxed);
            if let Err(e) = result {
                tracing::error!(error = %e, "the gossip server task stopped");
            }
        });
        Ok(Incarnation { handle, stopped })
    }

    /// Restarts gossip (a new generation, everything published again) if chitchat's server
    /// task has stopped. Returns whether it did. Call it periodically.
    pub async fn ensure_running(&self) -> Result<bool, ClusterError> {
        if !self.handle.read().await.stopped.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let mut current = self.handle.write().await;
        if !current.stopped.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let fresh = Self::spawn(&self.cfg, &self.stats, &self.beacon).await?;
        {
            let published = self.published.lock().await;
            let chitchat = fresh.handle.chitchat();
            let mut chitchat = chitchat.lock().await;
            let state = chitchat.self_node_state();
            if !published.record.is_empty() {
                state.set(RECORD_KEY, &published.record);
            }
            for (i, v) in published.shards.iter().enumerate() {
                if !v.is_empty() {
                    state.set(shards::key(i), v);
                }
            }
        }
        *lock(&self.current) = fresh.handle.chitchat();
        *current = fresh;
        self.restarts.fetch_add(1, Ordering::Relaxed);
        // The new incarnation knows no peer yet: pull their state rather than route blind.
        self.start_pull();
        tracing::warn!(node = %self.node_id, "gossip restarted after its server task stopped");
        Ok(true)
    }

    /// This node's current gossip identity (node id, generation, advertised address).
    pub async fn chitchat_id(&self) -> ChitchatId {
        self.handle.read().await.handle.chitchat_id().clone()
    }

    /// Times gossip was restarted by [`Self::ensure_running`].
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    async fn chitchat(&self) -> Arc<Mutex<chitchat::Chitchat>> {
        self.handle.read().await.handle.chitchat()
    }

    /// This node's load beacon: send its load to peers, receive theirs ([`beacon`]).
    pub fn load_beacon(&self) -> LoadBeacon {
        self.beacon.clone()
    }

    /// Gossip traffic counters.
    pub fn stats(&self) -> &Arc<GossipStats> {
        &self.stats
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Publishes this node's record; a no-op when it did not change.
    pub async fn publish_record(&self, record: &NodeRecord) {
        let record_json = serde_json::to_string(record).unwrap_or_default();
        let mut published = self.published.lock().await;
        if published.record != record_json {
            let chitchat = self.chitchat().await;
            chitchat
                .lock()
                .await
                .self_node_state()
                .set(RECORD_KEY, &record_json);
            published.record = record_json;
        }
    }

    /// Publishes the residency `index` holds for `node` (this node's engine; `None`: no
    /// engine, nothing resident) when its version changed since the last call, or when a
    /// full publication owed by removals is due ([`FullPublication`]).
    pub async fn publish_residency_of(&self, index: &ResidencyIndex, node: Option<NodeId>) {
        let mut published = self.published.lock().await;
        let version = node.and_then(|n| index.node_version(n));
        let changed = published.version != Some(version);
        let due = self
            .cfg
            .residency_full
            .due(self.since_full(&published), published.stale);
        if changed || (published.owed && due) {
            let shorts = node.map_or_else(Vec::new, |n| {
                index.node_keys(n, shards::SHARDS * shards::MAX_PER_SHARD)
            });
            self.publish_shorts(&mut published, &shorts).await;
            published.version = Some(version);
        }
    }

    /// Time since the last full publication (forever before the first).
    fn since_full(&self, published: &Published) -> Duration {
        published.full_at.map_or(Duration::MAX, |at| at.elapsed())
    }

    /// Publishes `shorts` (distinct, most important first): whole when [`FullPublication`]
    /// says so (the shards that changed set, the recent keys emptied), else only a recent key,
    /// the next unused one, with the shorts gained since the last publication (the last key,
    /// once all are used, takes them beside its own); a removal waits. An unchanged key costs
    /// no gossip.
    async fn publish_shorts(&self, published: &mut Published, shorts: &[u64]) {
        let mut values: Vec<(usize, String)> = Vec::new();
        let policy = self.cfg.residency_full;
        let since_full = self.since_full(published);
        let mut full = since_full >= policy.max_interval || policy.min_interval.is_zero();
        if !full {
            let (mut kept, mut kept_recent) = (0usize, 0usize);
            let mut added: Vec<u64> = shorts
                .iter()
                .copied()
                .filter(|s| {
                    if published.full.binary_search(s).is_ok() {
                        kept += 1;
                        return false;
                    }
                    if published.recent.binary_search(s).is_ok() {
                        kept_recent += 1;
                        return false;
                    }
                    // A short that did not fit its shard then is no gain (nor, gone, a loss).
                    published.truncated.binary_search(s).is_err()
                })
                .collect();
            added.sort_unstable();
            added.dedup();
            let lost = published.full.len().saturating_sub(kept)
                + published.recent.len().saturating_sub(kept_recent);
            let held = published.full.len() + published.recent.len();
            published.owed |= lost > 0;
            let stale = lost > 0 && lost as f64 >= policy.stale_ratio * held as f64;
            published.stale = stale;
            // Counting what went from the recent keys too: a sidecar that started cold has
            // all its residency there.
            full = lost > held / 2 || policy.due(since_full, stale);
            if !full && !added.is_empty() {
                let (slot, value) = if published.recent_used < shards::RECENT_SLOTS {
                    published.recent_used += 1;
                    (shards::RECENT + published.recent_used - 1, added.clone())
                } else {
                    (shards::SLOTS - 1, merged(&published.last_recent, &added))
                };
                if value.len() > shards::MAX_PER_SHARD {
                    full = true;
                } else {
                    values.push((slot, shards::encode(&value)));
                    published.recent = merged(&published.recent, &added);
                    published.last_recent = value;
                }
            }
        }
        if full {
            values.clear();
            let split = shards::split(shorts);
            values.extend(split.iter().map(|s| shards::encode(s)).enumerate());
            // Set after the shards (higher versions): a peer that sees them emptied has them.
            values.extend(shards::recent_slots().map(|i| (i, String::new())));
            let mut full: Vec<u64> = split.into_iter().flatten().collect();
            full.sort_unstable();
            let mut truncated: Vec<u64> = shorts
                .iter()
                .copied()
                .filter(|s| full.binary_search(s).is_err())
                .collect();
            truncated.sort_unstable();
            published.full = full;
            published.truncated = truncated;
            published.recent = Vec::new();
            published.recent_used = 0;
            published.last_recent = Vec::new();
            published.full_at = Some(Instant::now());
            published.owed = false;
            published.stale = false;
        }
        let chitchat = self.chitchat().await;
        let mut chitchat = chitchat.lock().await;
        let state = chitchat.self_node_state();
        for (i, value) in values {
            if published.shards[i] != value {
                state.set(shards::key(i), &value);
                published.shards[i] = value;
            }
        }
    }

    /// Number of live peers (not counting this node).
    pub async fn live_peers(&self) -> usize {
        let chitchat = self.chitchat().await;
        let chitchat = chitchat.lock().await;
        let mut ids: Vec<&str> = chitchat
            .live_nodes()
            .filter(|id| *id.node_id != *self.node_id)
            .map(|id| &*id.node_id)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// Leaves the cluster (peers notice through their failure detector).
    pub async fn shutdown(self) {
        let Cluster { handle, tasks, .. } = self;
        // No more transfers served or pulled for a node that is leaving.
        drop(tasks);
        let _ = handle.into_inner().handle.shutdown().await;
    }
}

/// How [`ResidencySync`] tells the proxy about peers.
pub trait Membership: Sync {
    /// A live peer with an engine published (or updated) its record. Returns the node its
    /// residency is indexed under, or `None` to ignore the peer for now (asked again on the
    /// next pass).
    fn upsert(&self, record: &NodeRecord, origin: &PeerOrigin) -> Option<NodeId>;
    /// The node ids of every live peer, once per pass (forget what is kept about others).
    fn live(&self, _node_ids: &[&str]) {}
    /// The peer left (dead, or no longer publishing an engine).
    fn remove(&self, node_id: &str, node: NodeId);
}

/// Where a peer's gossip identity says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerOrigin {
    /// The gossip address the peer advertises (its own claim, relayed by any node).
    pub gossip_addr: SocketAddr,
    /// Whether this node has received authenticated gossip from that IP itself: the claim is
    /// then backed by a host that holds the key and really is there.
    pub heard_from: bool,
}

struct PeerState {
    node: NodeId,
    /// Where it gossips from, and whether its record says it takes load beacons.
    beacon: beacon::BeaconPeer,
    generation: u64,
    kv_epoch: u64,
    record_version: u64,
    shard_versions: Vec<u64>,
    shards: Vec<Vec<u64>>,
}

/// What one sync pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncReport {
    /// Live peers with an engine.
    pub peers: usize,
    /// Digests added to the index.
    pub added: usize,
    /// Digests removed from the index (withdrawn, or their node left or changed epoch).
    pub removed: usize,
    /// Peers dropped (left or changed epoch).
    pub dropped: usize,
    /// Live peers ignored because `max_peers` were already tracked.
    pub over_cap: usize,
    /// Live peers ignored because their record names another node than the one gossip says
    /// published it.
    pub misnamed: usize,
    /// Peers whose state came, wholly or partly, from a bulk transfer rather than gossip.
    pub from_bulk: usize,
    /// Residency shards copied out of gossip's state (only peers' are).
    pub shards_read: usize,
}

struct PeerSnapshot {
    node_id: String,
    origin: PeerOrigin,
    generation: u64,
    record_version: u64,
    record: Option<NodeRecord>,
    /// Shards whose version changed (or all, for a new generation or epoch): index, version,
    /// value. Empty for a node that is not a peer yet: its shards are read only once it has
    /// been admitted ([`ResidencySync::sync`]).
    shards: Vec<(usize, u64, String)>,
}

/// Applies peers' published state to the residency index and the fleet.
#[derive(Default)]
pub struct ResidencySync {
    peers: HashMap<String, PeerState>,
    /// What a bulk transfer delivered, per node id, used beside gossip's view until gossip has
    /// caught up with it, the node is seen dead, or the deadline passes.
    overlay: HashMap<String, Overlaid>,
}

/// A node's state as a bulk transfer delivered it.
struct Overlaid {
    node: bulk::NodeSnapshot,
    until: Instant,
    /// Gossip has listed the node live since: only then does its listing it dead mean the
    /// node died (chitchat also lists a node it has no heartbeats from yet as dead).
    seen_live: bool,
}

/// The live nodes of `chitchat` but `except`, one incarnation per node id: a node id seen
/// under several (it restarted, or moved to another address) counts only as its newest, so the
/// old one's state is dropped now rather than when the failure detector gives up on it.
pub(crate) fn newest_live<'a>(
    chitchat: &'a chitchat::Chitchat,
    except: Option<&str>,
) -> HashMap<&'a str, &'a ChitchatId> {
    let mut newest: HashMap<&str, &ChitchatId> = HashMap::new();
    for id in chitchat.live_nodes() {
        if except == Some(&*id.node_id) {
            continue;
        }
        let e = newest.entry(&*id.node_id).or_insert(id);
        if (id.generation_id, id.gossip_advertise_addr) > (e.generation_id, e.gossip_advertise_addr)
        {
            *e = id;
        }
    }
    newest
}

/// One node's published state as this pass sees it: gossip's, a bulk transfer's, or per key
/// the newer of both.
pub(crate) struct NodeView<'a> {
    node_id: &'a str,
    generation: u64,
    gossip_addr: SocketAddr,
    record: (u64, &'a str),
    /// Per slot ([`shards::SLOTS`]): version and value.
    shards: Vec<Option<(u64, &'a str)>>,
}

impl<'a> NodeView<'a> {
    /// What gossip holds of `id` (`None` until its record has arrived).
    pub(crate) fn of_gossip(id: &'a ChitchatId, state: &'a chitchat::NodeState) -> Option<Self> {
        let rec = state.get_versioned(RECORD_KEY)?;
        Some(NodeView {
            node_id: &id.node_id,
            generation: id.generation_id,
            gossip_addr: id.gossip_advertise_addr,
            record: (rec.version, &rec.value),
            shards: (0..shards::SLOTS)
                .map(|i| {
                    state
                        .get_versioned(&shards::key(i))
                        .map(|v| (v.version, v.value.as_str()))
                })
                .collect(),
        })
    }

    /// The view as a transfer carries it.
    pub(crate) fn to_snapshot(&self) -> bulk::NodeSnapshot {
        bulk::NodeSnapshot {
            node_id: self.node_id.to_string(),
            generation: self.generation,
            gossip_addr: self.gossip_addr,
            record_version: self.record.0,
            record: self.record.1.to_string(),
            shards: self
                .shards
                .iter()
                .enumerate()
                .filter_map(|(index, s)| {
                    let (version, value) = (*s)?;
                    Some(bulk::ShardSnapshot {
                        index,
                        version,
                        value: value.to_string(),
                    })
                })
                .collect(),
        }
    }

    fn of_bulk(n: &'a bulk::NodeSnapshot) -> Self {
        let mut shards = vec![None; shards::SLOTS];
        for sh in &n.shards {
            if let Some(slot) = shards.get_mut(sh.index) {
                *slot = Some((sh.version, sh.value.as_str()));
            }
        }
        NodeView {
            node_id: &n.node_id,
            generation: n.generation,
            gossip_addr: n.gossip_addr,
            record: (n.record_version, &n.record),
            shards,
        }
    }

    /// Gossip's view merged with a transfer's: the newer incarnation, and within one
    /// incarnation each key at its newer version. The flag says gossip has everything the
    /// transfer had (the overlay entry can go).
    /// `generation` is the incarnation gossip lists live (its state may not have arrived).
    fn merge(
        generation: u64,
        gossip: Option<Self>,
        bulk: Option<&'a bulk::NodeSnapshot>,
    ) -> (Option<Self>, bool) {
        let (g, b) = match (gossip, bulk) {
            (g, None) => return (g, false),
            // Gossip knows a newer incarnation than the transfer did: the transfer's is stale.
            (g, Some(b)) if b.generation < generation => return (g, true),
            (None, Some(b)) => return (Some(Self::of_bulk(b)), false),
            (Some(g), Some(b)) => (g, Self::of_bulk(b)),
        };
        if b.generation != g.generation {
            return if b.generation > g.generation {
                (Some(b), false)
            } else {
                (Some(g), true)
            };
        }
        let mut caught_up = g.record.0 >= b.record.0;
        let record = if b.record.0 > g.record.0 {
            b.record
        } else {
            g.record
        };
        let shards = g
            .shards
            .iter()
            .zip(&b.shards)
            .map(|(gs, bs)| match (gs, bs) {
                (Some(gv), Some(bv)) if bv.0 > gv.0 => {
                    caught_up = false;
                    Some(*bv)
                }
                (None, Some(bv)) => {
                    caught_up = false;
                    Some(*bv)
                }
                (gs, _) => *gs,
            })
            .collect();
        (
            Some(NodeView {
                record,
                shards,
                ..g
            }),
            caught_up,
        )
    }
}

impl ResidencySync {
    /// An empty sync state.
    pub fn new() -> Self {
        Self::default()
    }

    /// One pass: read what changed under the chitchat lock, apply it outside.
    pub async fn sync(
        &mut self,
        cluster: &Cluster,
        index: &ResidencyIndex,
        membership: &dyn Membership,
    ) -> SyncReport {
        if let Some(pulled) = cluster.take_delivered() {
            let until = Instant::now() + bulk::OVERLAY_TTL;
            for n in pulled.nodes {
                if n.node_id == cluster.node_id
                    || (!self.overlay.contains_key(&n.node_id)
                        && self.overlay.len() >= cluster.cfg.max_peers)
                {
                    continue;
                }
                self.overlay.insert(
                    n.node_id.clone(),
                    Overlaid {
                        node: n,
                        until,
                        seen_live: false,
                    },
                );
            }
        }
        let (snapshots, from_bulk) = self.snapshot(cluster, None).await;
        let shards_read = snapshots.iter().map(|s| s.shards.len()).sum();
        let live_ids: Vec<&str> = snapshots.iter().map(|s| s.node_id.as_str()).collect();
        membership.live(&live_ids);
        let mut report = SyncReport {
            from_bulk,
            shards_read,
            ..SyncReport::default()
        };
        let now = Instant::now();
        let live: std::collections::HashSet<&str> =
            snapshots.iter().map(|s| s.node_id.as_str()).collect();
        let gone: Vec<String> = self
            .peers
            .keys()
            .filter(|k| !live.contains(k.as_str()))
            .cloned()
            .collect();
        for id in gone {
            if let Some(p) = self.peers.remove(&id) {
                report.removed += p.published_len();
                report.dropped += 1;
                index.drop_node(p.node);
                membership.remove(&id, p.node);
                tracing::info!(peer = %id, "peer left: its residency is dropped");
            }
        }
        // Peers new or reset in this pass: their shards are read next, whole.
        let mut reread = std::collections::HashSet::new();
        for snap in snapshots {
            let Some(record) = snap.record.as_ref() else {
                // Record unchanged: only shards may have moved.
                if let Some(p) = self.peers.get_mut(&snap.node_id) {
                    apply_shards(p, snap.shards, index, now, &mut report);
                    report.peers += 1;
                }
                continue;
            };
            // A record naming another node than the one gossip says published it would let
            // a key holder take over that node's fleet entry: such a peer is not used.
            let misnamed = record.node_id != snap.node_id;
            report.misnamed += usize::from(misnamed);
            if misnamed || !record.has_engine() {
                if let Some(p) = self.peers.remove(&snap.node_id) {
                    index.drop_node(p.node);
                    membership.remove(&snap.node_id, p.node);
                    report.dropped += 1;
                }
                continue;
            }
            if !self.peers.contains_key(&snap.node_id) && self.peers.len() >= cluster.cfg.max_peers
            {
                report.over_cap += 1;
                continue;
            }
            let Some(node) = membership.upsert(record, &snap.origin) else {
                // Not (or no longer) usable, e.g. its URL changed and is being checked: a peer
                // it was goes, residency and all, so that it costs no shard copies meanwhile
                // and is read whole once it is admitted again.
                if let Some(p) = self.peers.remove(&snap.node_id) {
                    report.removed += p.published_len();
                    index.drop_node(p.node);
                    membership.remove(&snap.node_id, p.node);
                    report.dropped += 1;
                }
                continue;
            };
            report.peers += 1;
            let reset = match self.peers.get(&snap.node_id) {
                Some(p) => {
                    p.generation != snap.generation
                        || p.kv_epoch != record.kv_epoch
                        || p.node != node
                }
                None => true,
            };
            if reset {
                // Its shards are read whole next (this look copied only those that moved
                // when the peer moved without a new generation or epoch, none when new).
                reread.insert(snap.node_id.clone());
                if let Some(old) = self.peers.get(&snap.node_id) {
                    report.removed += old.published_len();
                    report.dropped += 1;
                    // A peer that moved has a new node in the fleet: the old one's entries go.
                    if old.node != node {
                        index.drop_node(old.node);
                    }
                    tracing::info!(peer = %snap.node_id, kv_epoch = record.kv_epoch, "peer restarted, moved or changed kv_epoch: its residency is dropped");
                }
                index.drop_node(node);
                self.peers.insert(
                    snap.node_id.clone(),
                    PeerState {
                        node,
                        beacon: beacon::BeaconPeer {
                            gossip_addr: snap.origin.gossip_addr,
                            accepts: record.load_beacons,
                        },
                        generation: snap.generation,
                        kv_epoch: record.kv_epoch,
                        record_version: snap.record_version,
                        shard_versions: vec![0; shards::SLOTS],
                        shards: vec![Vec::new(); shards::SLOTS],
                    },
                );
            }
            if let Some(p) = self.peers.get_mut(&snap.node_id) {
                p.record_version = snap.record_version;
                p.beacon = beacon::BeaconPeer {
                    gossip_addr: snap.origin.gossip_addr,
                    accepts: record.load_beacons,
                };
                apply_shards(p, snap.shards, index, now, &mut report);
            }
        }
        if !reread.is_empty() {
            // A second, narrower look under the lock: only those peers' shards are copied.
            let (again, _) = self.snapshot(cluster, Some(&reread)).await;
            report.shards_read += again.iter().map(|s| s.shards.len()).sum::<usize>();
            for snap in again {
                if let Some(p) = self
                    .peers
                    .get_mut(&snap.node_id)
                    .filter(|p| p.generation == snap.generation)
                {
                    apply_shards(p, snap.shards, index, now, &mut report);
                }
            }
        }
        cluster.beacon.set_peers(
            self.peers
                .iter()
                .map(|(id, p)| (id.clone(), p.beacon))
                .collect(),
        );
        report
    }

    /// What changed per live node (of `only`, when given), and how many nodes' views used a
    /// bulk transfer. Shards are copied only for nodes that are peers already: a node that is
    /// not (its URL not checked yet, over `max_peers`, misnamed, no engine) costs its record's
    /// parse each pass, not a copy of its residency under chitchat's lock.
    async fn snapshot(
        &mut self,
        cluster: &Cluster,
        only: Option<&std::collections::HashSet<String>>,
    ) -> (Vec<PeerSnapshot>, usize) {
        let now = Instant::now();
        // Only for nodes gossip has not listed live yet: once it has, the transfer's values
        // stay until gossip holds them too (they never override a newer gossip value).
        self.overlay.retain(|_, o| o.seen_live || o.until > now);
        let chitchat = cluster.chitchat().await;
        let chitchat = chitchat.lock().await;
        let newest = newest_live(&chitchat, Some(&cluster.node_id));
        // What gossip has seen live and then die is gone, whatever an earlier transfer said.
        for id in newest.values() {
            if let Some(o) = self.overlay.get_mut(&*id.node_id) {
                o.seen_live |= o.node.generation <= id.generation_id;
            }
        }
        for id in chitchat.dead_nodes() {
            if self
                .overlay
                .get(&*id.node_id)
                .is_some_and(|o| o.seen_live && o.node.generation <= id.generation_id)
                && !newest.contains_key(&*id.node_id)
            {
                self.overlay.remove(&*id.node_id);
            }
        }
        let mut views = Vec::with_capacity(newest.len());
        let mut caught_up = Vec::new();
        let mut from_bulk = 0;
        for id in newest.values() {
            let gossip = chitchat
                .node_state(id)
                .and_then(|state| NodeView::of_gossip(id, state));
            let bulk = self.overlay.get(&*id.node_id).map(|o| &o.node);
            let (view, done) = NodeView::merge(id.generation_id, gossip, bulk);
            if done {
                caught_up.push(id.node_id.to_string());
            } else if bulk.is_some() {
                from_bulk += 1;
            }
            views.extend(view);
        }
        // Nodes only the transfer has told us of yet.
        let before = views.len();
        views.extend(
            self.overlay
                .values()
                .filter(|o| !newest.contains_key(o.node.node_id.as_str()))
                .map(|o| NodeView::of_bulk(&o.node)),
        );
        from_bulk += views.len() - before;
        let mut out = Vec::new();
        if let Some(only) = only {
            views.retain(|v| only.contains(v.node_id));
        }
        for v in views {
            let known = self.peers.get(v.node_id);
            // Versions only grow within an incarnation: an older value (a lagging source)
            // never replaces a newer one.
            let record_changed =
                known.is_none_or(|k| k.generation != v.generation || v.record.0 > k.record_version);
            let record = if record_changed {
                match serde_json::from_str::<NodeRecord>(v.record.1) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::debug!(peer = %v.node_id, error = %e, "unreadable node record");
                        continue;
                    }
                }
            } else {
                None
            };
            // All shards for a new generation or a new epoch; else those that moved; none for
            // a node that is not a peer (yet).
            let fresh = match (known, record.as_ref()) {
                (None, _) => false,
                (Some(k), Some(r)) => k.generation != v.generation || k.kv_epoch != r.kv_epoch,
                (Some(_), None) => false,
            };
            let mut shard_values = Vec::new();
            for (i, shard) in v.shards.iter().enumerate().filter(|_| known.is_some()) {
                let Some((version, value)) = shard else {
                    continue;
                };
                let seen = known.map_or(0, |k| k.shard_versions[i]);
                if fresh || *version > seen {
                    shard_values.push((i, *version, value.to_string()));
                }
            }
            out.push(PeerSnapshot {
                node_id: v.node_id.to_string(),
                origin: PeerOrigin {
                    gossip_addr: v.gossip_addr,
                    heard_from: cluster.stats.has_heard_from(v.gossip_addr.ip()),
                },
                generation: v.generation,
                record_version: v.record.0,
                record,
                shards: shard_values,
            });
        }
        drop(chitchat);
        for id in caught_up {
            self.overlay.remove(&id);
        }
        (out, from_bulk)
    }
}

impl PeerState {
    /// Whether `short` is published in a slot other than `slot`: its own shard, or a recent
    /// key.
    fn held_elsewhere(&self, slot: usize, short: u64) -> bool {
        let own = shards::shard_of(short);
        (own != slot && self.holds(own, short))
            || shards::recent_slots().any(|i| i != slot && self.holds(i, short))
    }

    /// Whether slot `slot` publishes `short`.
    fn holds(&self, slot: usize, short: u64) -> bool {
        self.shards
            .get(slot)
            .is_some_and(|s| s.binary_search(&short).is_ok())
    }

    /// Distinct shorts the peer publishes (its shards and its recent keys).
    fn published_len(&self) -> usize {
        let in_shards: usize = self.shards.iter().take(shards::SHARDS).map(Vec::len).sum();
        // A short counts in the first recent key that holds it, unless its shard does.
        let only_recent: usize = shards::recent_slots()
            .map(|i| {
                self.shards.get(i).map_or(0, |keyed| {
                    keyed
                        .iter()
                        .filter(|&&s| {
                            !self.holds(shards::shard_of(s), s)
                                && !(shards::RECENT..i).any(|j| self.holds(j, s))
                        })
                        .count()
                })
            })
            .sum();
        in_shards + only_recent
    }
}

/// The union of two sorted sets of distinct shorts, sorted.
fn merged(a: &[u64], b: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    out.extend_from_slice(a);
    out.extend_from_slice(b);
    out.sort_unstable();
    out.dedup();
    out
}

/// Applies changed slots to the peer's entries in the index, which hold the union of its
/// slots: a short leaves only when no slot holds it any more.
fn apply_shards(
    p: &mut PeerState,
    changed: Vec<(usize, u64, String)>,
    index: &ResidencyIndex,
    now: Instant,
    report: &mut SyncReport,
) {
    for (i, version, value) in changed {
        let Some(mut new) = shards::decode(&value) else {
            tracing::debug!(shard = i, "unreadable residency shard ignored");
            p.shard_versions[i] = version;
            continue;
        };
        // A short in another shard than its own is not honest: dropped, so that the union
        // rule's one look at a short's own shard is exact.
        if i < shards::SHARDS {
            new.retain(|&s| shards::shard_of(s) == i);
        }
        let (mut added, mut removed) = shards::diff(&p.shards[i], &new);
        added.retain(|&s| !p.held_elsewhere(i, s));
        removed.retain(|&s| !p.held_elsewhere(i, s));
        report.added += added.len();
        report.removed += removed.len();
        index.remove_keys(p.node, removed);
        index.record_keys(p.node, added, Source::Gossip, now);
        p.shards[i] = new;
        p.shard_versions[i] = version;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk_node(
        generation: u64,
        record_version: u64,
        shards: &[(usize, u64)],
    ) -> bulk::NodeSnapshot {
        bulk::NodeSnapshot {
            node_id: "p".into(),
            generation,
            gossip_addr: "127.0.0.1:1".parse().unwrap(),
            record_version,
            record: "bulk".into(),
            shards: shards
                .iter()
                .map(|&(index, version)| bulk::ShardSnapshot {
                    index,
                    version,
                    value: format!("bulk-{version}"),
                })
                .collect(),
        }
    }

    fn gossip_view(
        generation: u64,
        record_version: u64,
        shards: &[(usize, u64)],
    ) -> NodeView<'static> {
        let mut v = vec![None; shards::SLOTS];
        for &(i, version) in shards {
            v[i] = Some((version, "gossip"));
        }
        NodeView {
            node_id: "p",
            generation,
            gossip_addr: "127.0.0.1:1".parse().unwrap(),
            record: (record_version, "gossip"),
            shards: v,
        }
    }

    #[test]
    fn merge_takes_each_key_at_its_newer_version_and_retires_when_gossip_has_it_all() {
        // Gossip lags on shard 1 and lacks shard 2; it is ahead on shard 0 and the record.
        let b = bulk_node(7, 10, &[(0, 5), (1, 9), (2, 8)]);
        let (v, caught_up) =
            NodeView::merge(7, Some(gossip_view(7, 12, &[(0, 6), (1, 3)])), Some(&b));
        let v = v.unwrap();
        assert!(!caught_up);
        assert_eq!(v.record, (12, "gossip"));
        assert_eq!(
            v.shards[0],
            Some((6, "gossip")),
            "an older transfer value never wins"
        );
        assert_eq!(v.shards[1], Some((9, "bulk-9")));
        assert_eq!(v.shards[2], Some((8, "bulk-8")));
        // Gossip at or past every version the transfer had: the transfer's view can go.
        let (v, caught_up) = NodeView::merge(
            7,
            Some(gossip_view(7, 10, &[(0, 5), (1, 9), (2, 8)])),
            Some(&b),
        );
        assert!(caught_up);
        assert_eq!(v.unwrap().shards[1], Some((9, "gossip")));
        // Not yet in gossip: the transfer alone.
        let (v, caught_up) = NodeView::merge(7, None, Some(&b));
        assert!(!caught_up);
        assert_eq!(v.unwrap().record, (10, "bulk"));
    }

    #[test]
    fn merge_never_revives_an_older_incarnation() {
        let old = bulk_node(7, 10, &[(0, 5)]);
        // Gossip lists generation 8 live but has not delivered its state yet.
        let (v, caught_up) = NodeView::merge(8, None, Some(&old));
        assert!(v.is_none() && caught_up);
        let (v, caught_up) = NodeView::merge(8, Some(gossip_view(8, 1, &[])), Some(&old));
        assert!(caught_up);
        assert_eq!(v.unwrap().generation, 8);
        // A transfer that knows a newer incarnation than gossip does wins until gossip learns it.
        let newer = bulk_node(9, 1, &[(0, 1)]);
        let (v, caught_up) = NodeView::merge(8, Some(gossip_view(8, 50, &[(0, 50)])), Some(&newer));
        assert!(!caught_up);
        assert_eq!(v.unwrap().generation, 9);
    }
}
