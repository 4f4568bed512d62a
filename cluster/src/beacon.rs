//! Load beacons: a node's load sent straight to each peer, sealed like gossip, as soon as it
//! changes, instead of riding gossip rounds inside the node record.
//!
//! A node's record reaches a peer a publication tick, one or two gossip rounds and the peer's
//! sync tick later: 200 to 600 ms at the default 200 ms interval. An uncached prompt prefills
//! in tens of milliseconds, so a sidecar that sees the other sidecars' dispatches only that way
//! routes by a view several prefills old (docs/sidecar.md). A beacon is one datagram to each
//! peer that accepts them ([`crate::NodeRecord::load_beacons`]), sent from the gossip socket
//! and sealed under the cluster key like every gossip frame ([`crate::seal`], in a session of
//! its own); the receiver takes it only from the address the named node advertises for gossip
//! (IP and port: the socket beacons leave from), and, where a key is set, only sealed.
//!
//! The plaintext inside the frame:
//!
//! ```text
//! magic "kL" | version 1 | session u64 | seq u64 | inflight u64 | pending_prefill_bytes u64 |
//! node id length u8 | node id (UTF-8)
//! ```
//!
//! chitchat's messages begin with their own magic number, so the transport tells the two
//! apart by the first two bytes. `session` is random per process and `seq` grows by one per
//! beacon, so a beacon that arrives after a newer one from the same session is ignored (for
//! [`FRESH`] at most: a held beacon older than that gives way to any).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::seal::Rejection;
use crate::transport::{lock, Shared};

/// The first bytes of a beacon's plaintext.
const MAGIC: [u8; 2] = *b"kL";
const VERSION: u8 = 1;
/// Bytes before the node id.
const FIXED_LEN: usize = 2 + 1 + 8 * 4 + 1;
/// The longest node id a beacon carries.
pub const MAX_NODE_ID: usize = u8::MAX as usize;

/// A node sends a beacon at least this often, changed or not, so that its peers keep
/// preferring beacons over the (older) load in its gossiped record.
pub const HEARTBEAT: Duration = Duration::from_millis(250);

/// How long a received beacon stands against the load in the sender's gossiped record: while
/// beacons keep coming (every [`HEARTBEAT`] at least), the record's load is older than the
/// last beacon's; after this, the record is all there is.
pub const FRESH: Duration = Duration::from_secs(1);

/// Beacons go only to peers whose gossip address sent this node authenticated datagrams within
/// this long: a key holder cannot aim the cluster's beacons at a host that is not a member.
pub const HEARD_WITHIN: Duration = Duration::from_secs(10);

/// A node's load, as its proxy counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Requests in flight on the node's engine.
    pub inflight: u64,
    /// Uncached prompt bytes dispatched to the engine and not yet answered.
    pub pending_prefill_bytes: u64,
}

/// One peer's latest load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadReport {
    /// The peer's node id.
    pub node_id: String,
    /// Its load.
    pub load: Load,
}

/// Beacon counters.
#[derive(Debug, Default)]
pub struct BeaconStats {
    sent: AtomicU64,
    received: AtomicU64,
    refused: AtomicU64,
    unknown: AtomicU64,
}

impl BeaconStats {
    /// Beacons sent (one per peer per change).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Beacons taken: authenticated, well-formed, newer than the last from their sender.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Authenticated beacons refused: from an address other than the one the named node
    /// advertises for gossip, or beyond the bound on senders.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Authenticated beacons naming a node that is not a tracked peer (yet: a node that just
    /// joined may send before this one has taken it in), dropped.
    pub fn unknown(&self) -> u64 {
        self.unknown.load(Ordering::Relaxed)
    }
}

struct Frame<'a> {
    session: u64,
    seq: u64,
    load: Load,
    node_id: &'a str,
}

/// Whether `plaintext` (an opened frame, or an accepted plaintext datagram) is a beacon rather
/// than a chitchat message.
pub(crate) fn is_beacon(plaintext: &[u8]) -> bool {
    plaintext.starts_with(&MAGIC)
}

/// A beacon's plaintext (`None` for a node id over [`MAX_NODE_ID`] bytes).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn plaintext(node_id: &str, session: u64, seq: u64, load: Load) -> Option<Vec<u8>> {
    encode(&Frame {
        session,
        seq,
        load,
        node_id,
    })
}

fn encode(f: &Frame<'_>) -> Option<Vec<u8>> {
    let id = f.node_id.as_bytes();
    let id_len = u8::try_from(id.len()).ok()?;
    let mut out = Vec::with_capacity(FIXED_LEN + id.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    for v in [
        f.session,
        f.seq,
        f.load.inflight,
        f.load.pending_prefill_bytes,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.push(id_len);
    out.extend_from_slice(id);
    Some(out)
}

fn decode(b: &[u8]) -> Option<Frame<'_>> {
    if b.len() < FIXED_LEN || !is_beacon(b) || b[2] != VERSION {
        return None;
    }
    let word = |i: usize| {
        let at = 3 + 8 * i;
        b.get(at..at + 8)
            .and_then(|s| <[u8; 8]>::try_from(s).ok())
            .map(u64::from_le_bytes)
    };
    let id_len = usize::from(b[FIXED_LEN - 1]);
    let id = b.get(FIXED_LEN..)?;
    if id.len() != id_len || id.is_empty() {
        return None;
    }
    Some(Frame {
        session: word(0)?,
        seq: word(1)?,
        load: Load {
            inflight: word(2)?,
            pending_prefill_bytes: word(3)?,
        },
        node_id: std::str::from_utf8(id).ok()?,
    })
}

/// The newest beacon of one sender, until taken.
struct Held {
    session: u64,
    seq: u64,
    load: Load,
    taken: bool,
    at: Instant,
}

/// Where a tracked peer gossips from, and whether it takes beacons.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BeaconPeer {
    pub(crate) gossip_addr: SocketAddr,
    pub(crate) accepts: bool,
}

pub(crate) struct Inner {
    node_id: String,
    session: u64,
    seq: AtomicU64,
    /// The current gossip socket (replaced when gossip restarts).
    pub(crate) socket: Mutex<Weak<Shared>>,
    /// Tracked peers, from the last sync pass: beacons go to those that accept them and are
    /// taken only from those.
    peers: Mutex<HashMap<String, BeaconPeer>>,
    inbox: Mutex<HashMap<String, Held>>,
    arrived: tokio::sync::Notify,
    max_senders: usize,
    stats: BeaconStats,
}

/// Sends this node's load to its peers and hands over theirs. Cheap to clone.
#[derive(Clone)]
pub struct LoadBeacon {
    pub(crate) inner: Arc<Inner>,
}

impl LoadBeacon {
    pub(crate) fn new(node_id: &str, max_senders: usize) -> Self {
        LoadBeacon {
            inner: Arc::new(Inner {
                node_id: node_id.to_string(),
                session: rand::random(),
                seq: AtomicU64::new(0),
                socket: Mutex::new(Weak::new()),
                peers: Mutex::new(HashMap::new()),
                inbox: Mutex::new(HashMap::new()),
                arrived: tokio::sync::Notify::new(),
                max_senders: max_senders.max(1),
                stats: BeaconStats::default(),
            }),
        }
    }

    /// Sends `load` to every tracked peer that accepts beacons and was heard from within
    /// [`HEARD_WITHIN`]; returns how many it went to. A node id longer than [`MAX_NODE_ID`]
    /// bytes sends nothing.
    pub async fn send(&self, load: Load) -> usize {
        let targets: Vec<SocketAddr> = lock(&self.inner.peers)
            .values()
            .filter(|p| p.accepts)
            .map(|p| p.gossip_addr)
            .collect();
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let Some(plaintext) = encode(&Frame {
            session: self.inner.session,
            seq,
            load,
            node_id: &self.inner.node_id,
        }) else {
            return 0;
        };
        let mut sent = 0;
        for to in targets {
            // Held only for one send: a restarted gossip socket must be able to bind again.
            let Some(socket) = lock(&self.inner.socket).upgrade() else {
                break;
            };
            if socket.heard_within(to.ip(), HEARD_WITHIN)
                && socket.send_beacon(&plaintext, to).await
            {
                sent += 1;
            }
        }
        self.inner.stats.sent.fetch_add(sent, Ordering::Relaxed);
        sent as usize
    }

    /// Waits for beacons, then returns the newest load of each peer heard from since the last
    /// call (never an empty list).
    pub async fn recv(&self) -> Vec<LoadReport> {
        loop {
            let notified = self.inner.arrived.notified();
            let reports = self.take();
            if !reports.is_empty() {
                return reports;
            }
            notified.await;
        }
    }

    fn take(&self) -> Vec<LoadReport> {
        let mut inbox = lock(&self.inner.inbox);
        inbox
            .iter_mut()
            .filter(|(_, h)| !h.taken)
            .map(|(id, h)| {
                h.taken = true;
                LoadReport {
                    node_id: id.clone(),
                    load: h.load,
                }
            })
            .collect()
    }

    /// Beacon counters.
    pub fn stats(&self) -> &BeaconStats {
        &self.inner.stats
    }

    /// Replaces the tracked peers (each sync pass); beacons of peers no longer tracked go.
    pub(crate) fn set_peers(&self, peers: HashMap<String, BeaconPeer>) {
        lock(&self.inner.inbox).retain(|id, _| peers.contains_key(id));
        *lock(&self.inner.peers) = peers;
    }
}

impl Inner {
    /// An authenticated beacon from `from`: kept if it is the newest of a tracked peer sending
    /// from the address it advertises. `Err` for a datagram that is not a well-formed beacon.
    pub(crate) fn offer(&self, plaintext: &[u8], from: SocketAddr) -> Result<(), Rejection> {
        let f = decode(plaintext).ok_or(Rejection::Malformed)?;
        let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
        let advertised = lock(&self.peers)
            .get(f.node_id)
            .map(|p| canonical(p.gossip_addr));
        match advertised {
            None => {
                self.stats.unknown.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            Some(addr) if addr != canonical(from) => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            Some(_) => {}
        }
        let mut inbox = lock(&self.inbox);
        if !inbox.contains_key(f.node_id) && inbox.len() >= self.max_senders {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let now = Instant::now();
        let held = inbox.entry(f.node_id.to_string()).or_insert(Held {
            session: f.session,
            seq: 0,
            load: f.load,
            taken: true,
            at: now,
        });
        // A new session is a restarted sender; within one, only a newer beacon counts, but
        // not for long (a held `seq` near the top cannot silence the sender for good).
        if held.session == f.session && held.seq >= f.seq && now.duration_since(held.at) <= FRESH {
            return Ok(());
        }
        *held = Held {
            session: f.session,
            seq: f.seq,
            load: f.load,
            taken: false,
            at: now,
        };
        drop(inbox);
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        self.arrived.notify_one();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: &str) -> Frame<'_> {
        Frame {
            session: 7,
            seq: 9,
            load: Load {
                inflight: 3,
                pending_prefill_bytes: u64::MAX,
            },
            node_id: id,
        }
    }

    /// What is encoded decodes to the same fields; every truncation, a wrong version or magic,
    /// a length byte that disagrees with the rest, and a non-UTF-8 id do not decode.
    #[test]
    fn beacons_round_trip_and_malformed_ones_do_not_decode() {
        let b = encode(&frame("node-a")).expect("short id");
        let d = decode(&b).expect("decodes");
        assert_eq!((d.session, d.seq, d.node_id), (7, 9, "node-a"));
        assert_eq!(d.load, frame("x").load);
        for n in 0..b.len() {
            assert!(decode(&b[..n]).is_none(), "prefix of {n} bytes decoded");
        }
        let mut longer = b.clone();
        longer.push(b'x');
        assert!(decode(&longer).is_none());
        let mut wrong_version = b.clone();
        wrong_version[2] = 2;
        assert!(decode(&wrong_version).is_none());
        let mut not_utf8 = b.clone();
        let last = not_utf8.len() - 1;
        not_utf8[last] = 0xff;
        assert!(decode(&not_utf8).is_none());
        assert!(!is_beacon(&45_139u16.to_le_bytes()), "chitchat's magic");
        assert!(encode(&frame(&"n".repeat(MAX_NODE_ID + 1))).is_none());
        assert!(encode(&frame("")).is_some_and(|b| decode(&b).is_none()));
    }

    fn peer(ip: [u8; 4]) -> BeaconPeer {
        BeaconPeer {
            gossip_addr: SocketAddr::from((ip, 7946)),
            accepts: true,
        }
    }

    fn beacon_of(id: &str, session: u64, seq: u64, inflight: u64) -> Vec<u8> {
        encode(&Frame {
            session,
            seq,
            load: Load {
                inflight,
                pending_prefill_bytes: 0,
            },
            node_id: id,
        })
        .expect("short id")
    }

    /// Only a tracked peer's beacons from its advertised IP are taken, the newest per session
    /// wins, a new session (restart) starts over, and senders are bounded.
    #[test]
    fn the_inbox_keeps_the_newest_beacon_of_tracked_peers_only() {
        let b = LoadBeacon::new("me", 2);
        b.set_peers(HashMap::from([
            ("a".to_string(), peer([10, 0, 0, 1])),
            ("b".to_string(), peer([10, 0, 0, 2])),
            ("c".to_string(), peer([10, 0, 0, 3])),
        ]));
        let from = |ip: [u8; 4]| SocketAddr::from((ip, 7946));
        let offer = |bytes: &[u8], ip| b.inner.offer(bytes, from(ip));
        assert_eq!(offer(b"kL\x01", [10, 0, 0, 1]), Err(Rejection::Malformed));
        // Another node's address, a's IP from another port: refused; an untracked node: unknown.
        offer(&beacon_of("a", 1, 1, 5), [10, 0, 0, 2]).expect("well-formed");
        let other_port = SocketAddr::from(([10, 0, 0, 1], 7947));
        b.inner
            .offer(&beacon_of("a", 1, 1, 5), other_port)
            .expect("well-formed");
        offer(&beacon_of("z", 1, 1, 5), [10, 0, 0, 1]).expect("well-formed");
        assert_eq!((b.stats().refused(), b.stats().unknown()), (2, 1));
        assert!(b.take().is_empty());
        offer(&beacon_of("a", 1, 2, 5), [10, 0, 0, 1]).expect("well-formed");
        offer(&beacon_of("a", 1, 1, 9), [10, 0, 0, 1]).expect("well-formed");
        offer(&beacon_of("a", 1, 2, 9), [10, 0, 0, 1]).expect("well-formed");
        assert_eq!(b.take(), vec![report("a", 5)], "older or equal seq ignored");
        assert!(b.take().is_empty(), "taken once");
        // A seq at the top silences its sender only until it is FRESH old.
        offer(&beacon_of("a", 1, u64::MAX, 6), [10, 0, 0, 1]).expect("well-formed");
        offer(&beacon_of("a", 1, 3, 7), [10, 0, 0, 1]).expect("well-formed");
        assert_eq!(b.take(), vec![report("a", 6)]);
        if let Some(h) = lock(&b.inner.inbox).get_mut("a") {
            h.at = Instant::now().checked_sub(FRESH * 2).unwrap_or(h.at);
        }
        offer(&beacon_of("a", 1, 3, 7), [10, 0, 0, 1]).expect("well-formed");
        assert_eq!(b.take(), vec![report("a", 7)]);
        offer(&beacon_of("a", 2, 1, 4), [10, 0, 0, 1]).expect("well-formed");
        assert_eq!(
            b.take(),
            vec![report("a", 4)],
            "a restarted sender starts over"
        );
        offer(&beacon_of("b", 1, 1, 1), [10, 0, 0, 2]).expect("well-formed");
        offer(&beacon_of("c", 1, 1, 1), [10, 0, 0, 3]).expect("well-formed");
        assert_eq!(b.take(), vec![report("b", 1)], "at most 2 senders held");
        assert_eq!(b.stats().refused(), 3);
        // A peer no longer tracked loses its slot.
        b.set_peers(HashMap::from([("c".to_string(), peer([10, 0, 0, 3]))]));
        offer(&beacon_of("c", 1, 1, 1), [10, 0, 0, 3]).expect("well-formed");
        assert_eq!(b.take(), vec![report("c", 1)]);
        assert_eq!(b.stats().received(), 6);
    }

    fn report(id: &str, inflight: u64) -> LoadReport {
        LoadReport {
            node_id: id.into(),
            load: Load {
                inflight,
                pending_prefill_bytes: 0,
            },
        }
    }
}
