//! The gossip socket: chitchat over UDP, with every datagram sealed and checked by [`seal`]
//! before chitchat sees it, and its traffic counted.
//!
//! chitchat 0.13 serialises its messages inside its own UDP socket and exposes no public
//! (de)serialiser, so the sealing cannot wrap its messages directly. Instead chitchat runs on
//! a plaintext socket bound to loopback, and this module relays between it and the real
//! gossip socket:
//!
//! ```text
//!  peer P  <--sealed UDP-->  outer socket (gossip_listen)
//!                                |  open / seal
//!                           relay socket for P (127.0.0.1:ephemeral)
//!                                |  plaintext, loopback only
//!                           chitchat's socket (127.0.0.1:ephemeral)
//! ```
//!
//! One relay socket per peer address (bounded, least recently used evicted): chitchat sends
//! to P's relay instead of P, the relay seals and sends from the outer socket; what P sends is
//! opened and handed to chitchat from P's relay, whose address [`Socket::recv`] maps back to
//! P. Only authenticated datagrams ever create a relay. Datagrams on the loopback sockets
//! from anyone but the matching peer (another local process) are dropped and counted. Load
//! beacons ([`crate::beacon`]) come and go on the same outer socket, sealed the same way, but
//! never reach chitchat.
//!
//! [`seal`]: crate::seal

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_trait::async_trait;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket, Transport, UdpTransport};
use chitchat::ChitchatEnvelope;
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

use crate::seal::{self, Keyring, Opener, Rejection, Sealer};

/// How gossip datagrams are protected.
#[derive(Debug, Clone)]
pub struct GossipSecurity {
    /// The cluster keys (primary first); `None` runs plaintext gossip.
    pub keyring: Option<Keyring>,
    /// Seal outgoing datagrams (turn off only while a cluster migrates to encryption).
    pub encrypt_outgoing: bool,
    /// Refuse plaintext incoming datagrams (turn off only while a cluster migrates).
    pub verify_incoming: bool,
    /// How far a new sender's clock may be from ours (bounds replays of old captures).
    pub max_clock_skew: Duration,
}

impl GossipSecurity {
    /// Plaintext gossip: no key, nothing checked (trusted networks only).
    pub fn plaintext() -> Self {
        GossipSecurity {
            keyring: None,
            encrypt_outgoing: false,
            verify_incoming: false,
            max_clock_skew: Duration::from_secs(60),
        }
    }

    /// Sealed both ways under `keyring`.
    pub fn sealed(keyring: Keyring) -> Self {
        GossipSecurity {
            keyring: Some(keyring),
            encrypt_outgoing: true,
            verify_incoming: true,
            max_clock_skew: Duration::from_secs(60),
        }
    }
}

/// Gossip traffic of one node since it joined, and who it has heard from.
#[derive(Debug, Default)]
pub struct GossipStats {
    sent: AtomicU64,
    received: AtomicU64,
    rejected: [AtomicU64; Rejection::ALL.len()],
    /// Source IPs of datagrams that opened (or were accepted as plaintext), last time seen.
    senders: Mutex<HashMap<IpAddr, Instant>>,
    /// Authenticated frames that came from another IP than the one their sender named.
    other_source: AtomicU64,
    /// The last of those: the IP named, and the IP it came from.
    last_other_source: Mutex<Option<(IpAddr, IpAddr)>>,
}

/// Source IPs remembered in [`GossipStats::has_heard_from`].
const MAX_SENDERS: usize = 4096;

impl GossipStats {
    /// Bytes sent on the gossip socket.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes received on the gossip socket.
    pub fn bytes_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Datagrams dropped for `reason`.
    pub fn rejected(&self, reason: Rejection) -> u64 {
        self.rejected[reason as usize].load(Ordering::Relaxed)
    }

    /// Authenticated frames that came from another IP than the one their sender named as its
    /// own: opened, but their host is not counted as heard from. A replay from another host,
    /// or a node whose datagrams leave from another address than the one it advertises.
    pub fn from_other_source(&self) -> u64 {
        self.other_source.load(Ordering::Relaxed)
    }

    /// The last frame [`Self::from_other_source`] counted: the IP it named, the IP it came from.
    pub fn last_from_other_source(&self) -> Option<(IpAddr, IpAddr)> {
        *lock(&self.last_other_source)
    }

    /// Whether a datagram from `ip` has passed authentication (the host really gossips with
    /// us, rather than being an address some node claims).
    pub fn has_heard_from(&self, ip: IpAddr) -> bool {
        lock(&self.senders).contains_key(&ip.to_canonical())
    }

    /// Whether a datagram from `ip` passed authentication within the last `window`: a host
    /// holding the cluster key gossips with us from there now.
    pub fn heard_within(&self, ip: IpAddr, window: std::time::Duration) -> bool {
        lock(&self.senders)
            .get(&ip.to_canonical())
            .is_some_and(|t| t.elapsed() <= window)
    }

    pub(crate) fn heard_from(&self, ip: IpAddr) {
        let ip = ip.to_canonical();
        let mut senders = lock(&self.senders);
        if senders.len() >= MAX_SENDERS && !senders.contains_key(&ip) {
            if let Some(oldest) = senders.iter().min_by_key(|(_, t)| **t).map(|(i, _)| *i) {
                senders.remove(&oldest);
            }
        }
        senders.insert(ip, Instant::now());
    }

    fn reject(&self, reason: Rejection, from: SocketAddr) {
        self.rejected[reason as usize].fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%from, reason = reason.label(), "gossip datagram dropped");
    }
}

/// chitchat's transport: sealed UDP on `listen`, through per-peer loopback relays.
pub struct SecureUdp {
    /// Where the counts go.
    pub stats: Arc<GossipStats>,
    /// Keys and switches.
    pub security: GossipSecurity,
    /// Bound into every seal, so frames of another cluster never open.
    pub cluster_id: String,
    /// The address peers send to (frames for any other address are refused).
    pub advertise: SocketAddr,
    /// The most peer addresses relayed at once.
    pub max_relays: usize,
    /// Load beacons arriving on the socket go here, and are sent from it
    /// ([`crate::beacon`]).
    pub(crate) beacon: Arc<crate::beacon::Inner>,
}

struct Relay {
    socket: Arc<UdpSocket>,
    task: JoinHandle<()>,
    last_used: Instant,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Default)]
struct Relays {
    by_peer: HashMap<SocketAddr, Relay>,
    /// Relay socket address -> peer.
    by_relay: HashMap<SocketAddr, SocketAddr>,
}

pub(crate) struct Shared {
    outer: Arc<UdpSocket>,
    inner_addr: SocketAddr,
    relays: Mutex<Relays>,
    sealer: Option<Mutex<Sealer>>,
    /// Seals load beacons whenever a key is set (also while `encrypt_outgoing` is off during a
    /// migration: every node then holds the key). A session of their own, so that a round of
    /// beacons to every peer does not move chitchat's session counter past the receivers'
    /// replay windows.
    beacon_sealer: Option<Mutex<Sealer>>,
    opener: Option<Mutex<Opener>>,
    verify_incoming: bool,
    stats: Arc<GossipStats>,
    max_relays: usize,
    beacon: Arc<crate::beacon::Inner>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding one of these leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// The relay socket for `peer`, made on first use.
    fn relay_for(self: &Arc<Self>, peer: SocketAddr) -> anyhow::Result<Arc<UdpSocket>> {
        let mut relays = lock(&self.relays);
        if let Some(r) = relays.by_peer.get_mut(&peer) {
            r.last_used = Instant::now();
            return Ok(r.socket.clone());
        }
        if relays.by_peer.len() >= self.max_relays {
            let oldest = relays
                .by_peer
                .iter()
                .min_by_key(|(_, r)| r.last_used)
                .map(|(p, _)| *p);
            if let Some(p) = oldest {
                if let Some(r) = relays.by_peer.remove(&p) {
                    if let Ok(a) = r.socket.local_addr() {
                        relays.by_relay.remove(&a);
                    }
                }
            }
        }
        let std_socket = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
            .context("cannot bind a loopback gossip relay")?;
        std_socket.set_nonblocking(true)?;
        let socket = Arc::new(UdpSocket::from_std(std_socket)?);
        let relay_addr = socket.local_addr()?;
        let task = tokio::spawn(outbound(self.clone(), socket.clone(), peer));
        relays.by_relay.insert(relay_addr, peer);
        relays.by_peer.insert(
            peer,
            Relay {
                socket: socket.clone(),
                task,
                last_used: Instant::now(),
            },
        );
        Ok(socket)
    }

    fn peer_of(&self, relay_addr: SocketAddr) -> Option<SocketAddr> {
        lock(&self.relays).by_relay.get(&relay_addr).copied()
    }

    /// One datagram from the network: open it (or take it as plaintext when allowed) and
    /// hand it to chitchat from the sender's relay.
    async fn inbound(self: &Arc<Self>, datagram: &[u8], from: SocketAddr) {
        let sealed = seal::is_sealed(datagram);
        // Whether this datagram shows that a host holding the key sends from `from`.
        let mut shows_sender = !sealed && self.opener.is_none();
        let message = if sealed {
            let Some(opener) = &self.opener else {
                return self.stats.reject(Rejection::Forged, from);
            };
            let (result, incomplete) = {
                let mut o = lock(opener);
                let before = o.incomplete();
                let r = o.open_from(datagram, from);
                (r, o.incomplete() - before)
            };
            if incomplete > 0 {
                self.stats.rejected[Rejection::Incomplete as usize]
                    .fetch_add(incomplete, Ordering::Relaxed);
            }
            let opened = match result {
                Ok(o) => o,
                Err(r) => return self.stats.reject(r, from),
            };
            shows_sender = opened.from_named_source;
            if !shows_sender {
                self.stats.other_source.fetch_add(1, Ordering::Relaxed);
                *lock(&self.stats.last_other_source) = Some((opened.source, from.ip()));
            }
            match opened.message {
                Some(m) => m,
                None if shows_sender => return self.stats.heard_from(from.ip()),
                None => return,
            }
        } else if self.verify_incoming {
            return self.stats.reject(Rejection::Plaintext, from);
        } else {
            datagram.to_vec()
        };
        // Plaintext let in during a migration proves nothing about its sender, nor does a
        // sealed frame from another IP than the one it names (a capture replayed from there):
        // only authenticated datagrams from their sender's own IP (or any, where no key is set
        // at all) make a host one this node has heard from, which peer URLs and hops are
        // checked against.
        if shows_sender {
            self.stats.heard_from(from.ip());
        }
        if crate::beacon::is_beacon(&message) {
            // With a key, only sealed beacons, even while plaintext gossip is still accepted.
            let result = if self.opener.is_some() && !sealed {
                Err(Rejection::Plaintext)
            } else {
                self.beacon.offer(&message, from)
            };
            if let Err(r) = result {
                self.stats.reject(r, from);
            }
            return;
        }
        match self.relay_for(from) {
            Ok(relay) => {
                let _ = relay.send_to(&message, self.inner_addr).await;
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "gossip relay unavailable"),
        }
    }

    /// Sends a load beacon's `plaintext` to `peer` from the gossip socket, sealed whenever a
    /// key is set; returns whether it went.
    pub(crate) async fn send_beacon(&self, plaintext: &[u8], peer: SocketAddr) -> bool {
        self.send_with(self.beacon_sealer.as_ref(), plaintext, peer)
            .await
    }

    /// Whether authenticated datagrams came from `ip` within `window`.
    pub(crate) fn heard_within(&self, ip: IpAddr, window: Duration) -> bool {
        self.stats.heard_within(ip, window)
    }

    /// Sends `plaintext` to `peer` from the gossip socket, sealed by `sealer` if any; returns
    /// whether every frame went.
    async fn send_with(
        &self,
        sealer: Option<&Mutex<Sealer>>,
        plaintext: &[u8],
        peer: SocketAddr,
    ) -> bool {
        let frames = match sealer {
            Some(sealer) => lock(sealer).seal(plaintext, peer),
            None => vec![plaintext.to_vec()],
        };
        let mut all = !frames.is_empty();
        for f in frames {
            match self.outer.send_to(&f, peer).await {
                Ok(sent) => {
                    self.stats.sent.fetch_add(sent as u64, Ordering::Relaxed);
                }
                Err(_) => all = false,
            }
        }
        all
    }
}

/// chitchat -> relay for `peer` -> sealed -> `peer`.
async fn outbound(shared: Arc<Shared>, relay: Arc<UdpSocket>, peer: SocketAddr) {
    let mut buf = vec![0u8; seal::MAX_DATAGRAM];
    loop {
        let Ok((n, from)) = relay.recv_from(&mut buf).await else {
            // Never spin on a failing socket.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if from != shared.inner_addr {
            // Only chitchat's own socket may speak to a relay.
            shared.stats.reject(Rejection::Local, from);
            continue;
        }
        shared
            .send_with(shared.sealer.as_ref(), &buf[..n], peer)
            .await;
    }
}

#[async_trait]
impl Transport for SecureUdp {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let outer = Arc::new(
            UdpSocket::bind(listen_addr)
                .await
                .with_context(|| format!("failed to bind {listen_addr}/UDP for gossip"))?,
        );
        let inner = UdpTransport
            .open((Ipv4Addr::LOCALHOST, 0).into())
            .await
            .context("cannot bind chitchat's loopback socket")?;
        let inner_addr = inner.local_addr()?;
        let keyring = self.security.keyring.clone();
        let cluster_id = self.cluster_id.as_str();
        let shared = Arc::new(Shared {
            outer: outer.clone(),
            inner_addr,
            relays: Mutex::new(Relays::default()),
            sealer: keyring
                .clone()
                .filter(|_| self.security.encrypt_outgoing)
                .map(|k| Mutex::new(Sealer::new(k, cluster_id, self.advertise))),
            beacon_sealer: keyring
                .clone()
                .map(|k| Mutex::new(Sealer::new(k, cluster_id, self.advertise))),
            opener: keyring.map(|k| {
                Mutex::new(Opener::new(
                    k,
                    cluster_id,
                    vec![self.advertise, listen_addr],
                    self.security.max_clock_skew,
                    self.max_relays.saturating_mul(2),
                ))
            }),
            verify_incoming: self.security.verify_incoming && self.security.keyring.is_some(),
            stats: self.stats.clone(),
            max_relays: self.max_relays.max(1),
            beacon: self.beacon.clone(),
        });
        *lock(&self.beacon.socket) = Arc::downgrade(&shared);
        let receiver = shared.clone();
        let inbound = tokio::spawn(async move {
            let mut buf = vec![0u8; seal::MAX_DATAGRAM];
            loop {
                match outer.recv_from(&mut buf).await {
                    Ok((n, from)) => {
                        receiver
                            .stats
                            .received
                            .fetch_add(n as u64, Ordering::Relaxed);
                        receiver.inbound(&buf[..n], from).await;
                    }
                    Err(e) => {
                        // ICMP-induced errors (a peer's port closed) are transient on UDP.
                        tracing::debug!(error = %e, "gossip recv error");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
        Ok(Box::new(SecureSocket {
            inner,
            shared,
            inbound,
            listen_addr,
        }))
    }
}

struct SecureSocket {
    inner: Box<dyn Socket>,
    shared: Arc<Shared>,
    inbound: JoinHandle<()>,
    listen_addr: SocketAddr,
}

impl Drop for SecureSocket {
    fn drop(&mut self) {
        self.inbound.abort();
        let mut relays = lock(&self.shared.relays);
        relays.by_peer.clear();
        relays.by_relay.clear();
    }
}

#[async_trait]
impl Socket for SecureSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.shared.outer.local_addr().unwrap_or(self.listen_addr))
    }

    async fn send(
        &mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> anyhow::Result<SendOutcome> {
        // chitchat stops its server on a send error, so a relay that cannot be made costs this
        // one message, not the gossip task.
        let relay_addr = match self.shared.relay_for(to).and_then(|r| Ok(r.local_addr()?)) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(%to, error = %format!("{e:#}"), "gossip relay unavailable");
                return Ok(SendOutcome { num_bytes_sent: 0 });
            }
        };
        self.inner.send(relay_addr, envelope).await
    }

    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            let out = self.inner.recv().await?;
            match self.shared.peer_of(out.from_addr) {
                Some(peer) => {
                    return Ok(RecvOutcome {
                        from_addr: peer,
                        ..out
                    })
                }
                None => self.shared.stats.reject(Rejection::Local, out.from_addr),
            }
        }
    }
}
