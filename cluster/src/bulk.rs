//! Bulk state transfer: a node that (re)joins pulls the whole cluster's published state from
//! one peer over TCP, instead of waiting for chitchat to deliver it one datagram of deltas per
//! peer exchange per round (16 nodes with 100,000 digests each is about 17 MB: many seconds of
//! gossip, a second over TCP).
//!
//! The transfer runs on TCP at the gossip address (same IP and port number as the UDP socket).
//! It carries what chitchat would have delivered (node records and residency shards with their
//! chitchat versions), and [`crate::ResidencySync`] applies it beside gossip's view, each key
//! at the newer of the two versions, until gossip has caught up or [`OVERLAY_TTL`] passes.
//!
//! Protocol, every frame a big-endian `u32` length and a body of at most
//! [`seal::MAX_DATAGRAM`] bytes:
//!
//! ```text
//! client -> server   request: "kvmesh bulk v1" | challenge [32]
//! server -> client   chunk*:  challenge [32] | sequence u32 | last u8 | up to ~64 KB of JSON
//! ```
//!
//! With a keyring, each frame is one [`seal`] frame (the cluster key, the destination as the
//! sender sees it, the timestamp window, a fresh session per side), so a sender without the key
//! gets nothing and can inject nothing. Every chunk repeats the client's random challenge and
//! its sequence number: a recorded reply does not answer a new request, and chunks cannot be
//! reordered, dropped or spliced from another reply. A sealed request is served once: its
//! challenge is remembered, so a captured request replayed gets nothing. A serve slot (at most
//! [`MAX_CONCURRENT_SERVES`]) is taken only once the request has authenticated; at most
//! [`MAX_PENDING_HANDSHAKES`] connections may be sending theirs ([`MAX_PENDING_PER_SOURCE`]
//! from one IPv4 address, [`MAX_PENDING_PER_V6_PREFIX`] from one IPv6 /64), and one more
//! closes the oldest (of its source, else of all); everything
//! is bounded in time and bytes, on both sides. A node that seals its gossip never answers in plaintext; only a
//! plaintext-gossip node does, and a node that verifies incoming gossip refuses plaintext
//! replies.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::seal::{self, Opener, Rejection, Sealer};
use crate::shards;
use crate::transport::{lock, GossipSecurity};

/// The default bound on one transfer's JSON ([`crate::ClusterConfig::bulk_max_bytes`]).
pub const DEFAULT_MAX_BYTES: usize = 64 << 20;
/// How long what a transfer delivered is used beside gossip before gossip alone counts.
pub const OVERLAY_TTL: Duration = Duration::from_secs(30);
/// Transfers served at once; further requests are refused (and counted).
pub const MAX_CONCURRENT_SERVES: usize = 2;
/// Connections that may be sending their request at once. One more closes the oldest of
/// them (counted as evicted): a host that opens connections and sends nothing can hold every
/// slot only by opening them faster than a joiner sends its request, not by keeping them.
pub const MAX_PENDING_HANDSHAKES: usize = 16;
/// Connections from one IPv4 address that may be sending their request at once; one more
/// from it closes its oldest (counted as evicted), so a neighbour behind the same NAT address
/// cannot lock the others out by holding two.
pub const MAX_PENDING_PER_SOURCE: usize = 2;
/// The same for one IPv6 /64, which one host may hold whole, and which a cluster's pods may
/// share (one /80 each): more at once, so that nodes joining together do not close each
/// other's requests.
pub const MAX_PENDING_PER_V6_PREFIX: usize = 8;
/// Challenges of served requests remembered against replays.
const MAX_SEEN_CHALLENGES: usize = 4096;
/// How long a serialised snapshot serves further transfers: building one copies the whole
/// state under chitchat's lock, and a key holder asking again and again (each request with a
/// fresh challenge) must not keep a node doing that. A joiner gets state this much older at
/// most, which gossip then brings up to date.
pub const SNAPSHOT_REUSE: Duration = Duration::from_secs(1);

const MAGIC: &[u8] = b"kvmesh bulk v1";
/// Bytes of the random challenge a request carries and every chunk repeats.
pub const CHALLENGE_LEN: usize = 32;
/// Bytes before a chunk's data: challenge, sequence number, last flag.
pub const CHUNK_HEADER: usize = CHALLENGE_LEN + 4 + 1;
const MAX_CHUNK: usize = seal::MAX_FRAGMENT_PLAINTEXT - CHUNK_HEADER;
/// A request is one small frame.
const MAX_REQUEST_FRAME: usize = 4096;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);
/// Nodes one transfer may describe (a bound on hostile input beside the byte bound).
pub const MAX_NODES: usize = 4096;
/// The longest node record accepted (a published record is a few hundred bytes).
pub const MAX_RECORD_BYTES: usize = 64 * 1024;
/// The longest shard value accepted: [`shards::MAX_PER_SHARD`] 8-byte shorts in base64.
pub const MAX_SHARD_CHARS: usize = (shards::MAX_PER_SHARD * 8).div_ceil(3) * 4;

/// The cluster state one peer published, as a transfer carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// One entry per live node the serving peer knew, itself included.
    pub nodes: Vec<NodeSnapshot>,
}

/// One node's published state, with chitchat's versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSnapshot {
    /// The node's id.
    pub node_id: String,
    /// Its chitchat generation (one per start).
    pub generation: u64,
    /// The gossip address it advertises.
    pub gossip_addr: SocketAddr,
    /// The version of its record.
    pub record_version: u64,
    /// Its record, JSON as published.
    pub record: String,
    /// Its residency shards.
    pub shards: Vec<ShardSnapshot>,
}

/// One residency shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSnapshot {
    /// The shard's index (`r.000` is 0).
    pub index: usize,
    /// Its chitchat version.
    pub version: u64,
    /// Its value, as [`shards::encode`] made it.
    pub value: String,
}

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum BulkError {
    /// Connecting, reading or writing failed.
    #[error("bulk transfer I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer took longer than the transfer's bound.
    #[error("bulk transfer timed out")]
    Timeout,
    /// Newer connections took this one's handshake slot before its request came.
    #[error("bulk transfer request not sent before newer connections took its slot")]
    Evicted,
    /// A frame did not authenticate.
    #[error("bulk transfer frame refused: {}", .0.label())]
    Refused(Rejection),
    /// The peer broke the protocol.
    #[error("bulk transfer protocol error: {0}")]
    Protocol(&'static str),
    /// The reply is larger than this node accepts.
    #[error("bulk transfer larger than {max} bytes (cluster.bulk_sync_max_bytes)")]
    TooLarge {
        /// The bound.
        max: usize,
    },
    /// The reply is not a valid snapshot.
    #[error("bulk transfer is not a valid snapshot: {0}")]
    Malformed(String),
}

/// Counts of transfers, both ways.
#[derive(Debug, Default)]
pub struct BulkStats {
    pub(crate) pulled: AtomicU64,
    pub(crate) pull_failed: AtomicU64,
    served: AtomicU64,
    refused: AtomicU64,
    evicted: AtomicU64,
    built: AtomicU64,
}

impl BulkStats {
    /// Transfers this node pulled and applied.
    pub fn pulled(&self) -> u64 {
        self.pulled.load(Ordering::Relaxed)
    }
    /// Transfers this node tried to pull from a peer and could not.
    pub fn pull_failed(&self) -> u64 {
        self.pull_failed.load(Ordering::Relaxed)
    }
    /// Transfers this node served.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }
    /// Requests this node refused (unauthenticated, malformed, or too many transfers at once).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
    /// Connections closed before their request came, to make room for newer ones
    /// ([`MAX_PENDING_PER_SOURCE`], [`MAX_PENDING_HANDSHAKES`]).
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }
    /// Snapshots of the state this node built to serve transfers (one serves every transfer
    /// within [`SNAPSHOT_REUSE`] of it).
    pub fn snapshots_built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }
}

/// What transfer frames authenticate beside their header, in place of gossip's cluster id
/// (what a [`Sealer`] or [`Opener`] for them is made with): the cluster id and a label of
/// their own, so that a transfer frame captured on TCP cannot pass as gossip over UDP, nor
/// the other way round (the two share keys and frame format).
pub fn transfer_domain(cluster_id: &str) -> String {
    format!("{cluster_id}\0kvmesh-bulk-transfer")
}

/// What a server and a client need of the node.
#[derive(Clone)]
pub(crate) struct Endpoint {
    pub(crate) security: GossipSecurity,
    pub(crate) cluster_id: String,
    pub(crate) stats: Arc<BulkStats>,
    pub(crate) gossip_stats: Arc<crate::GossipStats>,
    /// The most bytes of state this node sends or accepts in one transfer.
    pub(crate) max_bytes: usize,
}

impl Endpoint {
    fn domain(&self) -> String {
        transfer_domain(&self.cluster_id)
    }

    /// A sealer for frames sent from `local`, this side's address of the connection.
    fn sealer(&self, local: SocketAddr) -> Option<Sealer> {
        let keyring = self.security.keyring.clone()?;
        self.security
            .encrypt_outgoing
            .then(|| Sealer::new(keyring, &self.domain(), local))
    }

    fn opener(&self, own: Vec<SocketAddr>) -> Option<Opener> {
        let keyring = self.security.keyring.clone()?;
        Some(Opener::new(
            keyring,
            &self.domain(),
            own,
            self.security.max_clock_skew,
            1,
        ))
    }

    /// A frame's plaintext: opened when sealed, taken as is only where plaintext is allowed.
    fn open(
        &self,
        opener: &mut Option<Opener>,
        frame: Vec<u8>,
        from: SocketAddr,
    ) -> Result<(Vec<u8>, bool), BulkError> {
        if seal::is_sealed(&frame) {
            let Some(o) = opener.as_mut() else {
                return Err(BulkError::Refused(Rejection::Forged));
            };
            return match o.open(&frame, from) {
                Ok(Some(m)) => Ok((m, true)),
                Ok(None) => Err(BulkError::Protocol("a fragmented frame")),
                Err(r) => Err(BulkError::Refused(r)),
            };
        }
        if self.security.verify_incoming && self.security.keyring.is_some() {
            return Err(BulkError::Refused(Rejection::Plaintext));
        }
        Ok((frame, false))
    }
}

async fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    s.write_all(&len.to_be_bytes()).await?;
    s.write_all(body).await
}

async fn read_frame(s: &mut TcpStream, max: usize) -> Result<Vec<u8>, BulkError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(BulkError::Protocol("a frame over its size bound"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    Ok(body)
}

/// Pulls the cluster's state from the peer at `addr` (its gossip address).
pub(crate) async fn pull(
    ep: &Endpoint,
    addr: SocketAddr,
    max_bytes: usize,
) -> Result<Snapshot, BulkError> {
    tokio::time::timeout(TRANSFER_TIMEOUT, pull_inner(ep, addr, max_bytes))
        .await
        .map_err(|_| BulkError::Timeout)?
}

async fn pull_inner(
    ep: &Endpoint,
    addr: SocketAddr,
    max_bytes: usize,
) -> Result<Snapshot, BulkError> {
    let mut s = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| BulkError::Timeout)??;
    let local = s.local_addr()?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut challenge);
    let mut request = MAGIC.to_vec();
    request.extend_from_slice(&challenge);
    let request = match ep.sealer(local) {
        Some(mut sealer) => sealer
            .seal(&request, addr)
            .pop()
            .ok_or(BulkError::Protocol("the request could not be sealed"))?,
        None => request,
    };
    write_frame(&mut s, &request).await?;
    let mut opener = ep.opener(vec![local]);
    let mut reply = Reply::new(challenge, max_bytes);
    let mut sealed_reply: Option<bool> = None;
    loop {
        let frame = read_frame(&mut s, seal::MAX_DATAGRAM).await?;
        let (chunk, sealed) = ep.open(&mut opener, frame, addr)?;
        if *sealed_reply.get_or_insert(sealed) != sealed {
            return Err(BulkError::Protocol("sealed and plaintext chunks mixed"));
        }
        if reply.accept(&chunk)? {
            break;
        }
    }
    if sealed_reply == Some(true) {
        ep.gossip_stats.heard_from(addr.ip());
    }
    parse_snapshot(&reply.body)
}

/// A reply being reassembled from its chunks (each already opened).
#[derive(Debug)]
pub struct Reply {
    challenge: [u8; CHALLENGE_LEN],
    max_bytes: usize,
    expected: u32,
    done: bool,
    /// The snapshot's bytes so far.
    pub body: Vec<u8>,
}

impl Reply {
    /// A reply to the request that carried `challenge`, of at most `max_bytes`.
    pub fn new(challenge: [u8; CHALLENGE_LEN], max_bytes: usize) -> Reply {
        Reply {
            challenge,
            max_bytes,
            expected: 0,
            done: false,
            body: Vec::new(),
        }
    }

    /// Takes the next chunk; `Ok(true)` once the last one has arrived.
    pub fn accept(&mut self, chunk: &[u8]) -> Result<bool, BulkError> {
        if self.done {
            return Err(BulkError::Protocol("a chunk after the last"));
        }
        if chunk.len() < CHUNK_HEADER || chunk[..CHALLENGE_LEN] != self.challenge {
            return Err(BulkError::Protocol("a chunk that answers another request"));
        }
        let mut seq = [0u8; 4];
        seq.copy_from_slice(&chunk[CHALLENGE_LEN..CHALLENGE_LEN + 4]);
        if u32::from_be_bytes(seq) != self.expected {
            return Err(BulkError::Protocol("chunks out of sequence"));
        }
        let data = &chunk[CHUNK_HEADER..];
        let last = chunk[CHALLENGE_LEN + 4] == 1;
        if data.is_empty() && !last {
            // Empty chunks would only keep a hostile server's reply going.
            return Err(BulkError::Protocol("an empty chunk before the last"));
        }
        if self.body.len().saturating_add(data.len()) > self.max_bytes {
            return Err(BulkError::TooLarge {
                max: self.max_bytes,
            });
        }
        self.body.extend_from_slice(data);
        match chunk[CHALLENGE_LEN + 4] {
            0 => {
                self.expected = self
                    .expected
                    .checked_add(1)
                    .ok_or(BulkError::Protocol("too many chunks"))?;
                Ok(false)
            }
            1 => {
                self.done = true;
                Ok(true)
            }
            _ => Err(BulkError::Protocol("a chunk flag that is neither 0 nor 1")),
        }
    }
}

/// Reads a reply's JSON into a snapshot, bounding its counts.
pub fn parse_snapshot(body: &[u8]) -> Result<Snapshot, BulkError> {
    let snapshot: Snapshot =
        serde_json::from_slice(body).map_err(|e| BulkError::Malformed(e.to_string()))?;
    validate(&snapshot)?;
    Ok(snapshot)
}

/// Bounds a snapshot's counts (values are checked where they are decoded).
fn validate(s: &Snapshot) -> Result<(), BulkError> {
    if s.nodes.len() > MAX_NODES {
        return Err(BulkError::Malformed(format!(
            "{} nodes (at most {MAX_NODES})",
            s.nodes.len()
        )));
    }
    for n in &s.nodes {
        if n.node_id.is_empty() || n.node_id.len() > 256 {
            return Err(BulkError::Malformed(
                "a node id empty or over 256 bytes".into(),
            ));
        }
        if n.record.len() > MAX_RECORD_BYTES {
            return Err(BulkError::Malformed(format!(
                "node {}: a record over {MAX_RECORD_BYTES} bytes",
                n.node_id
            )));
        }
        if let Some(sh) = n.shards.iter().find(|sh| sh.value.len() > MAX_SHARD_CHARS) {
            return Err(BulkError::Malformed(format!(
                "node {}: shard {} over {MAX_SHARD_CHARS} characters",
                n.node_id, sh.index
            )));
        }
        let mut seen = [false; shards::SLOTS];
        for sh in &n.shards {
            match seen.get_mut(sh.index) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(BulkError::Malformed(format!(
                        "node {}: shard {} out of range or repeated",
                        n.node_id, sh.index
                    )))
                }
            }
        }
    }
    Ok(())
}

/// What this node knows of every live node (itself included), newest incarnation per node id.
pub(crate) fn collect(chitchat: &chitchat::Chitchat) -> Snapshot {
    let nodes = crate::newest_live(chitchat, None)
        .into_values()
        .filter_map(|id| crate::NodeView::of_gossip(id, chitchat.node_state(id)?))
        .map(|v| v.to_snapshot())
        .collect();
    Snapshot { nodes }
}

/// The chitchat instance a server reads (replaced when gossip restarts).
pub(crate) type CurrentChitchat = Arc<Mutex<Arc<tokio::sync::Mutex<chitchat::Chitchat>>>>;

/// Serves transfers on `listener` until the task is aborted (which also stops every
/// connection it serves: they live in its [`tokio::task::JoinSet`]).
pub(crate) async fn serve(
    listener: TcpListener,
    ep: Endpoint,
    own: Vec<SocketAddr>,
    current: CurrentChitchat,
) {
    // Connections still sending their request hold a handshake slot only; a serve permit is
    // taken once the request has authenticated, so unauthenticated hosts cannot hold them.
    let handshakes = Arc::new(Mutex::new(Handshakes::default()));
    let shared = Arc::new(Serving {
        permits: tokio::sync::Semaphore::new(MAX_CONCURRENT_SERVES),
        seen: Mutex::new(SeenChallenges::default()),
        recent: tokio::sync::Mutex::new(None),
    });
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (stream, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, typically: never spin.
                tracing::warn!(error = %e, "bulk transfer accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handshake = Handshakes::admit(&handshakes, from.ip());
        let (ep, own, current, shared) = (ep.clone(), own.clone(), current.clone(), shared.clone());
        conns.spawn(async move {
            let result = serve_one(stream, from, &ep, own, &current, handshake, &shared).await;
            match result {
                Ok(bytes) => {
                    ep.stats.served.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%from, bytes, "bulk transfer served");
                }
                Err(BulkError::Evicted) => {
                    ep.stats.evicted.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%from, "bulk transfer request closed: newer connections took its slot");
                }
                Err(e) => {
                    ep.stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%from, error = %e, "bulk transfer not served");
                }
            }
        });
    }
}

/// The connections still sending their request, oldest first.
#[derive(Default)]
struct Handshakes {
    pending: std::collections::VecDeque<PendingHandshake>,
    next: u64,
}

/// One entry of [`Handshakes`]; `evict` tells its connection to give up.
struct PendingHandshake {
    id: u64,
    source: Source,
    evict: tokio::sync::oneshot::Sender<()>,
}

/// Where a connection comes from, as far as one host can choose: an IPv4 address (an
/// IPv4-mapped IPv6 one included), or an IPv6 /64, of which a host may hold every address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    V4(std::net::Ipv4Addr),
    V6Prefix(u64),
}

impl Source {
    fn of(ip: std::net::IpAddr) -> Source {
        match ip.to_canonical() {
            std::net::IpAddr::V4(v4) => Source::V4(v4),
            std::net::IpAddr::V6(v6) => Source::V6Prefix((v6.to_bits() >> 64) as u64),
        }
    }

    /// Connections it may have sending their request at once.
    fn limit(self) -> usize {
        match self {
            Source::V4(_) => MAX_PENDING_PER_SOURCE,
            Source::V6Prefix(_) => MAX_PENDING_PER_V6_PREFIX,
        }
    }
}

impl Handshakes {
    /// A slot for a connection from `ip`. When its source already has its limit pending
    /// ([`MAX_PENDING_PER_SOURCE`], [`MAX_PENDING_PER_V6_PREFIX`]), the oldest of those is
    /// closed; else, when all [`MAX_PENDING_HANDSHAKES`] are taken, the oldest of all.
    fn admit(this: &Arc<Mutex<Handshakes>>, ip: std::net::IpAddr) -> HandshakeSlot {
        let source = Source::of(ip);
        let mut h = lock(this);
        let of_source = h.pending.iter().filter(|p| p.source == source).count();
        let oldest = if of_source >= source.limit() {
            h.pending.iter().position(|p| p.source == source)
        } else if h.pending.len() >= MAX_PENDING_HANDSHAKES {
            Some(0)
        } else {
            None
        };
        if let Some(old) = oldest.and_then(|i| h.pending.remove(i)) {
            // Gone already if its connection has just ended.
            let _ = old.evict.send(());
        }
        let (evict, evicted) = tokio::sync::oneshot::channel();
        let id = h.next;
        h.next = h.next.wrapping_add(1);
        h.pending.push_back(PendingHandshake { id, source, evict });
        HandshakeSlot {
            table: this.clone(),
            id,
            evicted,
        }
    }
}

/// A connection's place in [`Handshakes`] while it sends its request; dropped once the
/// request has come (or the connection ends), which frees it.
struct HandshakeSlot {
    table: Arc<Mutex<Handshakes>>,
    id: u64,
    /// Resolves when a newer connection took the slot.
    evicted: tokio::sync::oneshot::Receiver<()>,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        lock(&self.table).pending.retain(|p| p.id != self.id);
    }
}

/// Challenges of requests already served, so a captured request replayed (on any connection,
/// within the clock-skew window its seal allows) is refused rather than served again.
#[derive(Default)]
struct SeenChallenges {
    order: std::collections::VecDeque<[u8; CHALLENGE_LEN]>,
    set: std::collections::HashSet<[u8; CHALLENGE_LEN]>,
}

impl SeenChallenges {
    /// Records `c`; false when it was seen before.
    fn first_time(&mut self, c: [u8; CHALLENGE_LEN]) -> bool {
        if !self.set.insert(c) {
            return false;
        }
        self.order.push_back(c);
        if self.order.len() > MAX_SEEN_CHALLENGES {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }
}

/// What the connections a server serves share.
struct Serving {
    /// Transfers under way ([`MAX_CONCURRENT_SERVES`]).
    permits: tokio::sync::Semaphore,
    seen: Mutex<SeenChallenges>,
    /// The last serialised snapshot and when it was built ([`SNAPSHOT_REUSE`]); held while
    /// one is built, so concurrent transfers wait for it rather than build their own.
    recent: tokio::sync::Mutex<Option<Built>>,
}

/// A serialised snapshot and when it was built.
type Built = (Instant, Arc<Vec<u8>>);

async fn serve_one(
    mut s: TcpStream,
    from: SocketAddr,
    ep: &Endpoint,
    mut own: Vec<SocketAddr>,
    current: &CurrentChitchat,
    mut handshake: HandshakeSlot,
    shared: &Serving,
) -> Result<usize, BulkError> {
    let local = s.local_addr()?;
    own.push(local);
    let frame = tokio::select! {
        // A request already in the socket wins over an eviction that comes with it.
        biased;
        read = tokio::time::timeout(REQUEST_TIMEOUT, read_frame(&mut s, MAX_REQUEST_FRAME)) => {
            read.map_err(|_| BulkError::Timeout)??
        }
        _ = &mut handshake.evicted => return Err(BulkError::Evicted),
    };
    let mut opener = ep.opener(own);
    let (request, sealed) = ep.open(&mut opener, frame, from)?;
    // A node that seals its gossip never answers in plaintext (a migration's middle step
    // accepts plaintext gossip but still sends sealed).
    let mut sealer = ep.sealer(local);
    if !sealed && sealer.is_some() {
        return Err(BulkError::Refused(Rejection::Plaintext));
    }
    if sealed && sealer.is_none() {
        return Err(BulkError::Protocol(
            "sealed request, but this node does not seal",
        ));
    }
    let challenge: [u8; CHALLENGE_LEN] = request
        .strip_prefix(MAGIC)
        .and_then(|c| c.try_into().ok())
        .ok_or(BulkError::Protocol("not a bulk transfer request"))?;
    if sealed && !lock(&shared.seen).first_time(challenge) {
        return Err(BulkError::Refused(Rejection::Replayed));
    }
    drop(handshake);
    let Ok(_permit) = shared.permits.try_acquire() else {
        return Err(BulkError::Protocol("too many transfers at once"));
    };
    tokio::time::timeout(TRANSFER_TIMEOUT, async {
        let body = snapshot_body(ep, current, &shared.recent).await?;
        send_snapshot(&mut s, from, &body, &challenge, sealer.as_mut()).await
    })
    .await
    .map_err(|_| BulkError::Timeout)?
}

/// The serialised state to send: the last one built, if within [`SNAPSHOT_REUSE`], else a new
/// one.
async fn snapshot_body(
    ep: &Endpoint,
    current: &CurrentChitchat,
    recent: &tokio::sync::Mutex<Option<Built>>,
) -> Result<Arc<Vec<u8>>, BulkError> {
    let mut recent = recent.lock().await;
    let body = match recent.as_ref() {
        Some((at, body)) if at.elapsed() < SNAPSHOT_REUSE => body.clone(),
        _ => {
            let chitchat = lock(current).clone();
            let snapshot = collect(&*chitchat.lock().await);
            let body =
                serde_json::to_vec(&snapshot).map_err(|e| BulkError::Malformed(e.to_string()))?;
            ep.stats.built.fetch_add(1, Ordering::Relaxed);
            let body = Arc::new(body);
            *recent = Some((Instant::now(), body.clone()));
            body
        }
    };
    // The server holds what it sends in memory: bounded like what it would accept.
    if body.len() > ep.max_bytes {
        return Err(BulkError::TooLarge { max: ep.max_bytes });
    }
    Ok(body)
}

async fn send_snapshot(
    s: &mut TcpStream,
    from: SocketAddr,
    body: &[u8],
    challenge: &[u8; CHALLENGE_LEN],
    mut sealer: Option<&mut Sealer>,
) -> Result<usize, BulkError> {
    let pieces: Vec<&[u8]> = if body.is_empty() {
        vec![body]
    } else {
        body.chunks(MAX_CHUNK).collect()
    };
    let last = pieces.len() - 1;
    for (i, piece) in pieces.into_iter().enumerate() {
        let seq = u32::try_from(i).map_err(|_| BulkError::TooLarge { max: usize::MAX })?;
        let mut chunk = Vec::with_capacity(CHUNK_HEADER + piece.len());
        chunk.extend_from_slice(challenge);
        chunk.extend_from_slice(&seq.to_be_bytes());
        chunk.push(u8::from(i == last));
        chunk.extend_from_slice(piece);
        let frame = match sealer.as_mut() {
            Some(sealer) => sealer
                .seal(&chunk, from)
                .pop()
                .ok_or(BulkError::Protocol("a chunk could not be sealed"))?,
            None => chunk,
        };
        write_frame(s, &frame).await?;
    }
    s.shutdown().await?;
    Ok(body.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, shards: Vec<usize>) -> NodeSnapshot {
        NodeSnapshot {
            node_id: id.into(),
            generation: 1,
            gossip_addr: "127.0.0.1:7946".parse().unwrap(),
            record_version: 1,
            record: "{}".into(),
            shards: shards
                .into_iter()
                .map(|index| ShardSnapshot {
                    index,
                    version: 2,
                    value: String::new(),
                })
                .collect(),
        }
    }

    fn chunk(challenge: [u8; CHALLENGE_LEN], seq: u32, last: bool, data: &[u8]) -> Vec<u8> {
        let mut c = challenge.to_vec();
        c.extend_from_slice(&seq.to_be_bytes());
        c.push(u8::from(last));
        c.extend_from_slice(data);
        c
    }

    /// Transfer frames and gossip share keys and frame format but not what they authenticate:
    /// a transfer request captured on TCP and sent as a gossip datagram (or a gossip frame
    /// sent to the transfer port) opens nowhere but where it belongs.
    #[test]
    fn transfer_frames_and_gossip_frames_do_not_open_as_each_other() {
        use crate::seal::Keyring;
        use base64::Engine as _;
        let key = base64::engine::general_purpose::STANDARD.encode([9u8; 32]);
        let ring = || Keyring::from_base64(&[key.as_str()]).expect("a valid key");
        let ep = Endpoint {
            security: GossipSecurity::sealed(ring()),
            cluster_id: "c".into(),
            stats: Arc::new(BulkStats::default()),
            gossip_stats: Arc::new(crate::GossipStats::default()),
            max_bytes: 1 << 20,
        };
        let to: SocketAddr = "10.0.0.4:7946".parse().unwrap();
        let from: SocketAddr = "10.0.0.1:7946".parse().unwrap();
        let mut request = MAGIC.to_vec();
        request.extend_from_slice(&[7u8; CHALLENGE_LEN]);
        let transfer = ep.sealer(from).unwrap().seal(&request, to).remove(0);
        let gossip = Sealer::new(ring(), "c", from).seal(b"gossip", to).remove(0);
        let gossip_opener = || Opener::new(ring(), "c", vec![to], Duration::from_secs(60), 4);
        assert_eq!(
            gossip_opener().open(&transfer, from),
            Err(Rejection::Forged)
        );
        let mut transfer_opener = ep.opener(vec![to]);
        assert!(matches!(
            ep.open(&mut transfer_opener, gossip, from),
            Err(BulkError::Refused(Rejection::Forged))
        ));
        let mut transfer_opener = ep.opener(vec![to]);
        let (opened, sealed) = ep.open(&mut transfer_opener, transfer, from).unwrap();
        assert_eq!((opened, sealed), (request, true));
    }

    #[test]
    fn a_reply_takes_its_own_chunks_in_order_and_nothing_else() {
        let ours = [1u8; CHALLENGE_LEN];
        let theirs = [2u8; CHALLENGE_LEN];
        let mut r = Reply::new(ours, 1024);
        assert!(!r.accept(&chunk(ours, 0, false, b"ab")).unwrap());
        assert!(r.accept(&chunk(ours, 1, true, b"cd")).unwrap());
        assert_eq!(r.body, b"abcd");
        assert!(
            r.accept(&chunk(ours, 2, true, b"ef")).is_err(),
            "after the last"
        );
        let refused = |chunks: &[Vec<u8>]| {
            let mut r = Reply::new(ours, 1024);
            chunks.iter().any(|c| r.accept(c).is_err())
        };
        // Another request's chunk (a recorded reply, or one spliced in).
        assert!(refused(&[chunk(theirs, 0, true, b"x")]));
        assert!(refused(&[
            chunk(ours, 0, false, b"a"),
            chunk(theirs, 1, true, b"b")
        ]));
        // Reordered, repeated or skipped.
        assert!(refused(&[chunk(ours, 1, true, b"b")]));
        assert!(refused(&[
            chunk(ours, 0, false, b"a"),
            chunk(ours, 0, true, b"a")
        ]));
        assert!(refused(&[
            chunk(ours, 0, false, b"a"),
            chunk(ours, 2, true, b"c")
        ]));
        // Empty chunks that would keep a reply going, a bad flag, a short chunk, too much.
        assert!(refused(&[chunk(ours, 0, false, b"")]));
        assert!(!refused(&[chunk(ours, 0, true, b"")]));
        let mut bad_flag = chunk(ours, 0, true, b"a");
        bad_flag[CHALLENGE_LEN + 4] = 2;
        assert!(refused(&[bad_flag]));
        assert!(refused(&[ours[..10].to_vec()]));
        let mut small = Reply::new(ours, 3);
        assert!(matches!(
            small.accept(&chunk(ours, 0, true, b"abcd")),
            Err(BulkError::TooLarge { max: 3 })
        ));
    }

    #[test]
    fn snapshots_with_bad_counts_are_refused() {
        let ok = Snapshot {
            nodes: vec![node("a", vec![0, 127, shards::RECENT])],
        };
        assert!(validate(&ok).is_ok());
        for bad in [
            vec![node("a", vec![shards::SLOTS])],
            vec![node("a", vec![3, 3])],
            vec![node("", vec![])],
            vec![node(&"x".repeat(257), vec![])],
            vec![NodeSnapshot {
                record: "x".repeat(MAX_RECORD_BYTES + 1),
                ..node("a", vec![])
            }],
            vec![{
                let mut n = node("a", vec![0]);
                n.shards[0].value = "A".repeat(MAX_SHARD_CHARS + 1);
                n
            }],
        ] {
            let err = validate(&Snapshot { nodes: bad }).unwrap_err();
            assert!(matches!(err, BulkError::Malformed(_)), "{err}");
        }
        let many = Snapshot {
            nodes: (0..=MAX_NODES)
                .map(|i| node(&format!("n{i}"), vec![]))
                .collect(),
        };
        assert!(validate(&many).is_err());
    }
}
