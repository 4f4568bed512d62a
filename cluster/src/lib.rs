//! kvmesh-cluster: peer membership and residency gossip between kvmesh proxies, on chitchat (UDP).
//!
//! Each proxy publishes, under its chitchat node state:
//! - `node`: its [`NodeRecord`] as JSON (engine, load, `kv_epoch`, readiness);
//! - `r.000` .. `r.127`: the residency of the engine it fronts, in compact shards ([`shards`]).
//!
//! [`ResidencySync::sync`] reads what peers published and applies the changes to the proxy's
//! [`ResidencyIndex`] (source [`Source::Gossip`]) and to its view of the fleet (through
//! [`Membership`]): a peer that leaves (chitchat's failure detector) or changes `kv_epoch` loses
//! every entry.
//!
//! Every datagram is sealed under the cluster key ([`seal`], [`transport`]): a sender without
//! the key can neither join nor inject state. chitchat's server task is watched: if it ever
//! stops (a panic on a delta it could not apply), [`Cluster::ensure_running`] starts a new
//! incarnation and counts it, so gossip never freezes silently.

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

pub use record::NodeRecord;
pub use seal::{Keyring, Rejection};
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
}

/// A joined cluster.
pub struct Cluster {
    cfg: ClusterConfig,
    handle: RwLock<Incarnation>,
    stats: Arc<GossipStats>,
    node_id: String,
    restarts: AtomicU64,
    published: Mutex<Published>,
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
    shards: Vec<String>,
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
        let incarnation = Self::spawn(&cfg, &stats).await?;
        Ok(Cluster {
            node_id: cfg.node_id.clone(),
            cfg,
            handle: RwLock::new(incarnation),
            stats,
            restarts: AtomicU64::new(0),
            published: Mutex::new(Published {
                record: String::new(),
                shards: vec![String::new(); shards::SHARDS],
            }),
        })
    }

    async fn spawn(
        cfg: &ClusterConfig,
        stats: &Arc<GossipStats>,
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
        let fresh = Self::spawn(&self.cfg, &self.stats).await?;
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
        *current = fresh;
        self.restarts.fetch_add(1, Ordering::Relaxed);
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

    /// Publishes this node's residency (shorts, most important first). Only shards that changed
    /// since the last call are set, so an unchanged shard costs no gossip.
    pub async fn publish_residency(&self, shorts: &[u64]) {
        let encoded: Vec<String> = shards::split(shorts)
            .iter()
            .map(|s| shards::encode(s))
            .collect();
        let mut published = self.published.lock().await;
        let chitchat = self.chitchat().await;
        let mut chitchat = chitchat.lock().await;
        let state = chitchat.self_node_state();
        for (i, value) in encoded.into_iter().enumerate() {
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
        let _ = self.handle.into_inner().handle.shutdown().await;
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
}

struct PeerSnapshot {
    node_id: String,
    origin: PeerOrigin,
    generation: u64,
    record_version: u64,
    record: Option<NodeRecord>,
    /// Shards whose version changed (or all, for a new peer or epoch): index, version, value.
    shards: Vec<(usize, u64, String)>,
}

/// Applies peers' published state to the residency index and the fleet.
#[derive(Default)]
pub struct ResidencySync {
    peers: HashMap<String, PeerState>,
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
        let snapshots = self.snapshot(cluster).await;
        let live_ids: Vec<&str> = snapshots.iter().map(|s| s.node_id.as_str()).collect();
        membership.live(&live_ids);
        let mut report = SyncReport::default();
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
                report.removed += p.shards.iter().map(Vec::len).sum::<usize>();
                report.dropped += 1;
                index.drop_node(p.node);
                membership.remove(&id, p.node);
                tracing::info!(peer = %id, "peer left: its residency is dropped");
            }
        }
        for snap in snapshots {
            let Some(record) = snap.record.as_ref() else {
                // Record unchanged: only shards may have moved.
                if let Some(p) = self.peers.get_mut(&snap.node_id) {
                    apply_shards(p, snap.shards, index, now, &mut report);
                    report.peers += 1;
                }
                continue;
            };
            if !record.has_engine() {
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
                if let Some(old) = self.peers.get(&snap.node_id) {
                    report.removed += old.shards.iter().map(Vec::len).sum::<usize>();
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
                        generation: snap.generation,
                        kv_epoch: record.kv_epoch,
                        record_version: snap.record_version,
                        shard_versions: vec![0; shards::SHARDS],
                        shards: vec![Vec::new(); shards::SHARDS],
                    },
                );
            }
            if let Some(p) = self.peers.get_mut(&snap.node_id) {
                p.record_version = snap.record_version;
                apply_shards(p, snap.shards, index, now, &mut report);
            }
        }
        report
    }

    async fn snapshot(&self, cluster: &Cluster) -> Vec<PeerSnapshot> {
        let chitchat = cluster.chitchat().await;
        let chitchat = chitchat.lock().await;
        // A node id seen under several incarnations (it restarted, or moved to another
        // address): only the newest counts, so the old one's state is dropped now rather than
        // when the failure detector gives up on it.
        let mut newest: HashMap<&str, &ChitchatId> = HashMap::new();
        for id in chitchat.live_nodes() {
            if *id.node_id == *cluster.node_id {
                continue;
            }
            let e = newest.entry(&*id.node_id).or_insert(id);
            if (id.generation_id, id.gossip_advertise_addr)
                > (e.generation_id, e.gossip_advertise_addr)
            {
                *e = id;
            }
        }
        let mut out = Vec::new();
        for id in newest.into_values() {
            let Some(state) = chitchat.node_state(id) else {
                continue;
            };
            let Some(rec) = state.get_versioned(RECORD_KEY) else {
                continue;
            };
            let known = self.peers.get(&*id.node_id);
            let record_changed = known.is_none_or(|k| {
                k.generation != id.generation_id || k.record_version != rec.version
            });
            let record = if record_changed {
                match serde_json::from_str::<NodeRecord>(&rec.value) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::debug!(peer = %id.node_id, error = %e, "unreadable node record");
                        continue;
                    }
                }
            } else {
                None
            };
            // All shards for a new peer, a new generation or a new epoch; else those that moved.
            let fresh = match (known, record.as_ref()) {
                (None, _) => true,
                (Some(k), Some(r)) => k.generation != id.generation_id || k.kv_epoch != r.kv_epoch,
                (Some(_), None) => false,
            };
            let mut shard_values = Vec::new();
            for i in 0..shards::SHARDS {
                let Some(v) = state.get_versioned(&shards::key(i)) else {
                    continue;
                };
                let seen = known.map_or(0, |k| k.shard_versions[i]);
                if fresh || v.version != seen {
                    shard_values.push((i, v.version, v.value.clone()));
                }
            }
            out.push(PeerSnapshot {
                node_id: id.node_id.to_string(),
                origin: PeerOrigin {
                    gossip_addr: id.gossip_advertise_addr,
                    heard_from: cluster.stats.has_heard_from(id.gossip_advertise_addr.ip()),
                },
                generation: id.generation_id,
                record_version: rec.version,
                record,
                shards: shard_values,
            });
        }
        out
    }
}

fn apply_shards(
    p: &mut PeerState,
    changed: Vec<(usize, u64, String)>,
    index: &ResidencyIndex,
    now: Instant,
    report: &mut SyncReport,
) {
    for (i, version, value) in changed {
        let Some(new) = shards::decode(&value) else {
            tracing::debug!(shard = i, "unreadable residency shard ignored");
            p.shard_versions[i] = version;
            continue;
        };
        let (added, removed) = shards::diff(&p.shards[i], &new);
        report.added += added.len();
        report.removed += removed.len();
        index.remove_keys(p.node, removed);
        index.record_keys(p.node, added, Source::Gossip, now);
        p.shards[i] = new;
        p.shard_versions[i] = version;
    }
}
