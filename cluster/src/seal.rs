//! Authenticated, encrypted gossip frames: every datagram sealed with XChaCha20-Poly1305 under
//! the cluster key, bound to its destination, replays refused, large messages split into
//! fragments that fit a datagram.
//!
//! chitchat itself trusts every UDP sender (its cluster id is only checked on `Syn`); this
//! layer sits under it (see [`crate::transport`]) so that nothing unauthenticated reaches it.
//!
//! A frame:
//!
//! ```text
//! magic "kv" | version 3 | fragment index | fragment count | key id [4] | session u64 |
//! counter u64 | timestamp_ms u64 | destination [18] | source [18] | nonce [24] |
//! ciphertext | tag [16]
//! ```
//!
//! Everything before the nonce, and the cluster id, is authenticated as associated data, so a
//! frame sealed for another cluster, or with any header byte changed, does not open.
//! - The destination (IPv6-mapped address and port the sender sent to) must be one of the
//!   receiver's own addresses: a frame captured on its way to one node is refused by every
//!   other (`misdirected`).
//! - The session is random per socket (a restart is a new session), the counter grows by one
//!   per frame; the receiver keeps a 128-frame window per session and refuses a counter it has
//!   seen, or one older than the window (`replayed`). A session keeps the source address of
//!   its newest frame: from another address only a frame newer than every one of the session
//!   is taken (and moves it), so a replay from elsewhere is refused and cannot lock the sender
//!   out.
//! - Every frame's timestamp must be within `max_clock_skew` of the receiver's clock
//!   (`stale`), which bounds how old a replayed capture can be once its session is forgotten.
//! - The source is the address the sender gossips from, as it advertises it. A frame that
//!   arrives from another IP still opens (a replay carries nothing its sender did not say),
//!   but [`Opened::from_named_source`] is false: only frames that come from the IP they name
//!   make a host one this node has heard from, which peer URLs and the hop header are checked
//!   against. Version 2 frames named no source, so a capture replayed from any host made that
//!   host count as a member.
//! - The key id (a hash of the key) picks the one key to try, so a forged frame costs one
//!   authentication, not one per installed key.
//! - Nonces are 24 random bytes (XChaCha20): no practical risk of reuse under a key shared by
//!   the whole fleet.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};

/// Bytes a key has.
pub const KEY_LEN: usize = 32;
/// The largest UDP payload over IPv4.
pub const MAX_DATAGRAM: usize = 65_507;
const MAGIC: [u8; 2] = *b"kv";
const VERSION: u8 = 3;
/// Earlier frame versions: a node of an earlier release, refused as [`Rejection::Version`].
const EARLIER_VERSIONS: std::ops::RangeInclusive<u8> = 1..=2;
const KEY_ID_LEN: usize = 4;
/// An address as [`encode_addr`] writes it (the destination and the source).
const ADDR_LEN: usize = 18;
const HEADER_LEN: usize = 2 + 1 + 1 + 1 + KEY_ID_LEN + 8 + 8 + 8 + 2 * ADDR_LEN;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
/// Bytes a frame adds to the plaintext it carries.
pub const OVERHEAD: usize = HEADER_LEN + NONCE_LEN + TAG_LEN;
/// The most plaintext one frame carries.
pub const MAX_FRAGMENT_PLAINTEXT: usize = MAX_DATAGRAM - OVERHEAD;
/// The most fragments one message may be split into (chitchat's messages are at most one
/// datagram, so two always suffice; the bound keeps a hostile count from mattering).
pub const MAX_FRAGMENTS: usize = 4;
const WINDOW: u64 = 128;
/// How long the pieces of a fragmented message wait for the rest.
const REASSEMBLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Messages being reassembled at once, in all (each at most [`MAX_FRAGMENTS`] datagrams).
pub const MAX_PARTIAL: usize = 64;
/// Messages being reassembled at once per sender session.
const MAX_PARTIAL_PER_SESSION: usize = 4;

// Header field offsets.
const AT_INDEX: usize = 3;
const AT_COUNT: usize = 4;
const AT_KEY_ID: usize = 5;
const AT_SESSION: usize = AT_KEY_ID + KEY_ID_LEN;
const AT_COUNTER: usize = AT_SESSION + 8;
const AT_TIMESTAMP: usize = AT_COUNTER + 8;
const AT_DEST: usize = AT_TIMESTAMP + 8;
const AT_SOURCE: usize = AT_DEST + ADDR_LEN;

/// Errors reading keys.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Not base64, or not 32 bytes once decoded.
    #[error("gossip key #{index} is not base64 of {KEY_LEN} bytes")]
    Malformed {
        /// Its position in the keyring (0 = primary).
        index: usize,
    },
    /// No key at all.
    #[error("the gossip keyring is empty")]
    Empty,
}

/// The cluster's keys: the first (primary) seals, every one opens. Rotation, as memberlist and
/// Serf do it: install the new key as a secondary on every node, then make it primary on
/// every node, then remove the old one.
#[derive(Clone)]
pub struct Keyring {
    keys: Vec<([u8; KEY_ID_LEN], XChaCha20Poly1305)>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        write!(f, "Keyring({} keys)", self.keys.len())
    }
}

impl Keyring {
    /// A keyring from base64 keys, primary first.
    pub fn from_base64<S: AsRef<str>>(keys: &[S]) -> Result<Keyring, KeyError> {
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        let keys = keys
            .iter()
            .enumerate()
            .map(|(index, k)| {
                let raw = base64::engine::general_purpose::STANDARD
                    .decode(k.as_ref().trim())
                    .map_err(|_| KeyError::Malformed { index })?;
                if raw.len() != KEY_LEN {
                    return Err(KeyError::Malformed { index });
                }
                let mut id = [0u8; KEY_ID_LEN];
                id.copy_from_slice(
                    &blake3::derive_key("kvmesh gossip key id v1", &raw)[..KEY_ID_LEN],
                );
                Ok((id, XChaCha20Poly1305::new(Key::from_slice(&raw))))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Keyring { keys })
    }

    /// A fresh random key, base64 (what `kvmesh-proxy gossip-keygen` prints).
    pub fn generate_base64() -> String {
        let mut k = [0u8; KEY_LEN];
        fill_random(&mut k);
        base64::engine::general_purpose::STANDARD.encode(k)
    }

    /// Number of installed keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is installed (never, for a keyring built by [`Self::from_base64`]).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn fill_random(buf: &mut [u8]) {
    use rand::RngCore;
    // ThreadRng is a CSPRNG reseeded from the OS.
    rand::rng().fill_bytes(buf);
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// An address as 16 bytes (IPv4 mapped into IPv6) and a port.
fn encode_addr(a: SocketAddr) -> [u8; ADDR_LEN] {
    let ip = match a.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mut out = [0u8; ADDR_LEN];
    out[..16].copy_from_slice(&ip.octets());
    out[16..].copy_from_slice(&a.port().to_be_bytes());
    out
}

/// The IP of an address [`encode_addr`] wrote, IPv4 as IPv4.
fn decode_ip(bytes: &[u8]) -> Option<IpAddr> {
    let octets: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
    Some(IpAddr::from(octets).to_canonical())
}

/// Why an incoming datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Not a frame at all (too short, wrong magic or version, bad fragment fields).
    Malformed,
    /// A frame that no installed key opens: forged, altered, another cluster, or a wrong key.
    Forged,
    /// A frame already received, older than the replay window of its session, or from another
    /// source address than the session's and not newer than all of its frames.
    Replayed,
    /// A frame whose timestamp is too far from this node's clock.
    Stale,
    /// Plaintext while incoming frames must be sealed.
    Plaintext,
    /// A frame sealed for another node's address.
    Misdirected,
    /// Pieces of a fragmented message dropped before the rest arrived (timeout, or too many
    /// messages in reassembly at once).
    Incomplete,
    /// A datagram on one of the internal loopback sockets from anyone but their owner.
    Local,
    /// A frame of an earlier frame version: a node that runs an earlier kvmesh release.
    Version,
}

impl Rejection {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Rejection::Malformed => "malformed",
            Rejection::Forged => "forged",
            Rejection::Replayed => "replayed",
            Rejection::Stale => "stale",
            Rejection::Plaintext => "plaintext",
            Rejection::Misdirected => "misdirected",
            Rejection::Incomplete => "incomplete",
            Rejection::Local => "local",
            Rejection::Version => "version",
        }
    }

    /// Every reason, for metrics.
    pub const ALL: [Rejection; 9] = [
        Rejection::Malformed,
        Rejection::Forged,
        Rejection::Replayed,
        Rejection::Stale,
        Rejection::Plaintext,
        Rejection::Misdirected,
        Rejection::Incomplete,
        Rejection::Local,
        Rejection::Version,
    ];
}

/// Seals outgoing messages for one socket.
pub struct Sealer {
    keyring: Keyring,
    aad_suffix: Vec<u8>,
    source: SocketAddr,
    session: u64,
    counter: u64,
}

impl Sealer {
    /// A sealer for a new session (random id) of a node that sends from `source` (the gossip
    /// address it advertises, or a connection's local address): receivers count it as heard
    /// from only when its frames come from that IP.
    pub fn new(keyring: Keyring, cluster_id: &str, source: SocketAddr) -> Sealer {
        let mut s = [0u8; 8];
        fill_random(&mut s);
        Sealer {
            keyring,
            aad_suffix: cluster_id.as_bytes().to_vec(),
            source,
            session: u64::from_le_bytes(s),
            counter: 0,
        }
    }

    /// The frames that carry `plaintext` to `dest` (one, or a few fragments when it does not
    /// fit); empty only if the message is too large for [`MAX_FRAGMENTS`].
    pub fn seal(&mut self, plaintext: &[u8], dest: SocketAddr) -> Vec<Vec<u8>> {
        let Some((key_id, cipher)) = self.keyring.keys.first() else {
            return Vec::new();
        };
        let pieces: Vec<&[u8]> = if plaintext.is_empty() {
            vec![plaintext]
        } else {
            plaintext.chunks(MAX_FRAGMENT_PLAINTEXT).collect()
        };
        if pieces.len() > MAX_FRAGMENTS {
            return Vec::new();
        }
        let count = pieces.len() as u8;
        let ts = now_ms();
        let mut frames = Vec::with_capacity(pieces.len());
        for (i, piece) in pieces.into_iter().enumerate() {
            self.counter = self.counter.wrapping_add(1);
            let header = FrameHeader {
                index: i as u8,
                count,
                session: self.session,
                counter: self.counter,
                timestamp_ms: ts,
                dest,
                source: self.source,
            };
            let Some(frame) = seal_frame(key_id, cipher, &self.aad_suffix, &header, piece) else {
                return Vec::new();
            };
            frames.push(frame);
        }
        frames
    }
}

/// The header fields of one frame, as its sender chose them.
#[derive(Debug, Clone, Copy)]
pub struct FrameHeader {
    /// Which fragment of its message this frame is (from 0).
    pub index: u8,
    /// How many fragments the message has.
    pub count: u8,
    /// The sender's session id (random per process start).
    pub session: u64,
    /// The frame's number in its session (replay window).
    pub counter: u64,
    /// When it was sealed, ms since the Unix epoch (clock-skew check).
    pub timestamp_ms: u64,
    /// The address it is meant for.
    pub dest: SocketAddr,
    /// The address its sender sends from.
    pub source: SocketAddr,
}

/// One frame carrying `piece` under `header`; `None` only if encryption fails.
pub(crate) fn seal_frame(
    key_id: &[u8; KEY_ID_LEN],
    cipher: &XChaCha20Poly1305,
    aad_suffix: &[u8],
    header: &FrameHeader,
    piece: &[u8],
) -> Option<Vec<u8>> {
    let mut frame = Vec::with_capacity(OVERHEAD + piece.len());
    frame.extend_from_slice(&MAGIC);
    frame.push(VERSION);
    frame.push(header.index);
    frame.push(header.count);
    frame.extend_from_slice(key_id);
    frame.extend_from_slice(&header.session.to_le_bytes());
    frame.extend_from_slice(&header.counter.to_le_bytes());
    frame.extend_from_slice(&header.timestamp_ms.to_le_bytes());
    frame.extend_from_slice(&encode_addr(header.dest));
    frame.extend_from_slice(&encode_addr(header.source));
    let mut nonce = [0u8; NONCE_LEN];
    fill_random(&mut nonce);
    let mut aad = frame.clone();
    aad.extend_from_slice(aad_suffix);
    let ct = cipher
        .encrypt(
            XNonce::from_slice(&nonce),
            Payload {
                msg: piece,
                aad: &aad,
            },
        )
        .ok()?;
    frame.extend_from_slice(&nonce);
    frame.extend_from_slice(&ct);
    Some(frame)
}

/// A frame with every header field chosen by the caller, sealed with `keyring`'s primary key.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn sealed_frame_for_test(
    keyring: &Keyring,
    cluster_id: &str,
    header: &FrameHeader,
    piece: &[u8],
) -> Option<Vec<u8>> {
    let (key_id, cipher) = keyring.keys.first()?;
    seal_frame(key_id, cipher, cluster_id.as_bytes(), header, piece)
}

/// Whether a datagram looks like a sealed frame (rather than chitchat's own plaintext format),
/// of this version or an earlier one ([`Opener::open`] refuses those as
/// [`Rejection::Version`]).
pub fn is_sealed(datagram: &[u8]) -> bool {
    frame_version(datagram).is_some_and(|v| v == VERSION || EARLIER_VERSIONS.contains(&v))
}

/// The version byte of a datagram that starts with the frames' magic.
fn frame_version(datagram: &[u8]) -> Option<u8> {
    match datagram {
        [m0, m1, version, ..] if [*m0, *m1] == MAGIC => Some(*version),
        _ => None,
    }
}

/// What [`Opener::open_from`] made of an authentic frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    /// The whole message, once every fragment of it is in (`None` for a fragment kept for
    /// later).
    pub message: Option<Vec<u8>>,
    /// Whether the frame came from the IP its sender named as its own. Only then does it show
    /// that a key holder sends from that host: a frame captured elsewhere and replayed from
    /// another host opens too, within the clock skew of a restart.
    pub from_named_source: bool,
    /// The IP its sender named.
    pub source: IpAddr,
}

struct SessionWindow {
    top: u64,
    seen: u128,
    last_seen: Instant,
    from: SocketAddr,
    partials: usize,
}

impl SessionWindow {
    /// Records `counter`; false when it was seen before or is older than the window.
    fn accept(&mut self, counter: u64) -> bool {
        if counter > self.top {
            let shift = counter - self.top;
            self.seen = if shift >= WINDOW {
                0
            } else {
                self.seen << shift
            };
            self.seen |= 1;
            self.top = counter;
            return true;
        }
        let back = self.top - counter;
        if back >= WINDOW {
            return false;
        }
        let bit = 1u128 << back;
        if self.seen & bit != 0 {
            return false;
        }
        self.seen |= bit;
        true
    }
}

struct Partial {
    pieces: Vec<Option<Vec<u8>>>,
    started: Instant,
}

/// Opens incoming frames: authenticates, refuses replays, reassembles fragments.
pub struct Opener {
    keyring: Keyring,
    aad_suffix: Vec<u8>,
    own: Vec<SocketAddr>,
    max_clock_skew: Duration,
    max_sessions: usize,
    sessions: HashMap<u64, SessionWindow>,
    partial: HashMap<(u64, u64), Partial>,
    incomplete: u64,
}

impl Opener {
    /// An opener for a node reachable at `own` (its advertised and listen addresses, and for a
    /// TCP connection the address it was accepted on). An unspecified IP (`0.0.0.0`, `::`)
    /// matches nothing: taking it for any IP on its port would let a frame sealed for another
    /// node on the same port be replayed here. `max_sessions` bounds the senders remembered
    /// for replay checks.
    pub fn new(
        keyring: Keyring,
        cluster_id: &str,
        own: Vec<SocketAddr>,
        max_clock_skew: Duration,
        max_sessions: usize,
    ) -> Opener {
        Opener {
            keyring,
            aad_suffix: cluster_id.as_bytes().to_vec(),
            own,
            max_clock_skew,
            max_sessions: max_sessions.max(1),
            sessions: HashMap::new(),
            partial: HashMap::new(),
            incomplete: 0,
        }
    }

    fn addressed_to_us(&self, dest: &[u8]) -> bool {
        self.own
            .iter()
            .any(|a| !a.ip().is_unspecified() && dest == encode_addr(*a))
    }

    /// Opens one datagram that came from `from`. `Ok(Some(message))` when a whole message is
    /// complete, `Ok(None)` for a fragment kept for later.
    pub fn open(
        &mut self,
        datagram: &[u8],
        from: SocketAddr,
    ) -> Result<Option<Vec<u8>>, Rejection> {
        self.open_from(datagram, from).map(|o| o.message)
    }

    /// [`Opener::open`], also saying whether the frame came from the IP its sender named.
    pub fn open_from(&mut self, datagram: &[u8], from: SocketAddr) -> Result<Opened, Rejection> {
        if frame_version(datagram).is_some_and(|v| EARLIER_VERSIONS.contains(&v)) {
            return Err(Rejection::Version);
        }
        if datagram.len() < OVERHEAD || !is_sealed(datagram) {
            return Err(Rejection::Malformed);
        }
        let (index, count) = (datagram[AT_INDEX] as usize, datagram[AT_COUNT] as usize);
        if count == 0 || count > MAX_FRAGMENTS || index >= count {
            return Err(Rejection::Malformed);
        }
        if !self.addressed_to_us(&datagram[AT_DEST..AT_DEST + ADDR_LEN]) {
            return Err(Rejection::Misdirected);
        }
        let field = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&datagram[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let (session, counter, ts) = (field(AT_SESSION), field(AT_COUNTER), field(AT_TIMESTAMP));
        let key_id = &datagram[AT_KEY_ID..AT_KEY_ID + KEY_ID_LEN];
        let header = &datagram[..HEADER_LEN];
        let nonce = XNonce::from_slice(&datagram[HEADER_LEN..HEADER_LEN + NONCE_LEN]);
        let ct = &datagram[HEADER_LEN + NONCE_LEN..];
        let mut aad = Vec::with_capacity(HEADER_LEN + self.aad_suffix.len());
        aad.extend_from_slice(header);
        aad.extend_from_slice(&self.aad_suffix);
        let plaintext = self
            .keyring
            .keys
            .iter()
            .filter(|(id, _)| id == key_id)
            .find_map(|(_, k)| k.decrypt(nonce, Payload { msg: ct, aad: &aad }).ok())
            .ok_or(Rejection::Forged)?;
        // Authentic from here on: the header fields can be trusted as the sender wrote them.
        if u128::from(now_ms().abs_diff(ts)) > self.max_clock_skew.as_millis() {
            return Err(Rejection::Stale);
        }
        let now = Instant::now();
        match self.sessions.get_mut(&session) {
            Some(w) => {
                // From another address, only a frame newer than any of the session moves it
                // there (a sender whose address changed). Were the session pinned to the first
                // address for good, one captured frame replayed from elsewhere just after this
                // node restarted would lock the sender out until it restarted too; this way its
                // next frame takes its session back, and replays from elsewhere stay refused.
                let moved = w.from != from;
                if (moved && counter <= w.top) || !w.accept(counter) {
                    return Err(Rejection::Replayed);
                }
                w.from = from;
                w.last_seen = now;
            }
            None => {
                if self.sessions.len() >= self.max_sessions {
                    if let Some(oldest) = self
                        .sessions
                        .iter()
                        .min_by_key(|(_, w)| w.last_seen)
                        .map(|(k, _)| *k)
                    {
                        self.sessions.remove(&oldest);
                    }
                }
                self.sessions.insert(
                    session,
                    SessionWindow {
                        top: counter,
                        seen: 1,
                        last_seen: now,
                        from,
                        partials: 0,
                    },
                );
            }
        }
        let source = decode_ip(&datagram[AT_SOURCE..AT_SOURCE + ADDR_LEN])
            .unwrap_or(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED));
        let from_named_source = source == from.ip().to_canonical();
        let message = if count == 1 {
            Some(plaintext)
        } else {
            self.reassemble(session, counter, index, count, plaintext, now)?
        };
        Ok(Opened {
            message,
            from_named_source,
            source,
        })
    }

    fn reassemble(
        &mut self,
        session: u64,
        counter: u64,
        index: usize,
        count: usize,
        piece: Vec<u8>,
        now: Instant,
    ) -> Result<Option<Vec<u8>>, Rejection> {
        self.expire_partials(now);
        let first = counter.wrapping_sub(index as u64);
        let key = (session, first);
        if !self.partial.contains_key(&key) {
            let per_session = self.sessions.get(&session).map_or(0, |w| w.partials);
            // Full: the oldest message in reassembly (of this session, when it is the one
            // over its share) makes room; it is counted as incomplete.
            if per_session >= MAX_PARTIAL_PER_SESSION || self.partial.len() >= MAX_PARTIAL {
                let oldest = self
                    .partial
                    .iter()
                    .filter(|((s, _), _)| per_session < MAX_PARTIAL_PER_SESSION || *s == session)
                    .min_by_key(|(_, p)| p.started)
                    .map(|(k, _)| *k);
                if let Some(k) = oldest {
                    self.drop_partial(k);
                }
            }
            if let Some(w) = self.sessions.get_mut(&session) {
                w.partials += 1;
            }
            self.partial.insert(
                key,
                Partial {
                    pieces: vec![None; count],
                    started: now,
                },
            );
        }
        let Some(entry) = self.partial.get_mut(&key) else {
            return Ok(None);
        };
        if entry.pieces.len() != count {
            return Err(Rejection::Malformed);
        }
        entry.pieces[index] = Some(piece);
        if entry.pieces.iter().all(Option::is_some) {
            let whole = self.partial.remove(&key).map(|p| {
                p.pieces
                    .into_iter()
                    .flatten()
                    .flatten()
                    .collect::<Vec<u8>>()
            });
            if let Some(w) = self.sessions.get_mut(&session) {
                w.partials = w.partials.saturating_sub(1);
            }
            return Ok(whole);
        }
        Ok(None)
    }

    fn expire_partials(&mut self, now: Instant) {
        let expired: Vec<(u64, u64)> = self
            .partial
            .iter()
            .filter(|(_, p)| now.duration_since(p.started) >= REASSEMBLY_TIMEOUT)
            .map(|(k, _)| *k)
            .collect();
        for k in expired {
            self.drop_partial(k);
        }
    }

    fn drop_partial(&mut self, key: (u64, u64)) {
        if self.partial.remove(&key).is_some() {
            self.incomplete += 1;
            if let Some(w) = self.sessions.get_mut(&key.0) {
                w.partials = w.partials.saturating_sub(1);
            }
        }
    }

    /// Senders remembered for replay checks.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Fragmented messages dropped incomplete so far.
    pub fn incomplete(&self) -> u64 {
        self.incomplete
    }

    /// Messages whose fragments are being reassembled now.
    pub fn reassembling(&self) -> usize {
        self.partial.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ring(keys: &[&str]) -> Keyring {
        Keyring::from_base64(keys).expect("valid keys")
    }

    fn key(byte: u8) -> String {
        base64::engine::general_purpose::STANDARD.encode([byte; KEY_LEN])
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// This node (B) is at :2; frames come from A at :1.
    const B: u16 = 2;
    const A: u16 = 1;

    fn opener(keys: &[&str], cluster: &str, max_sessions: usize) -> Opener {
        Opener::new(
            ring(keys),
            cluster,
            vec![addr(B)],
            Duration::from_secs(60),
            max_sessions,
        )
    }

    fn pair(cluster: &str) -> (Sealer, Opener) {
        let k = key(7);
        (
            Sealer::new(ring(&[&k]), cluster, addr(A)),
            opener(&[&k], cluster, 16),
        )
    }

    fn one(s: &mut Sealer, msg: &[u8]) -> Vec<u8> {
        s.seal(msg, addr(B)).remove(0)
    }

    #[test]
    fn round_trip_and_replay_refused() {
        let (mut s, mut o) = pair("c");
        let frames = s.seal(b"hello", addr(B));
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].len(), 5 + OVERHEAD);
        assert_eq!(o.open(&frames[0], addr(A)), Ok(Some(b"hello".to_vec())));
        assert_eq!(o.open(&frames[0], addr(A)), Err(Rejection::Replayed));
        // Out of order within the window is fine, once.
        let a = one(&mut s, b"a");
        let b = one(&mut s, b"b");
        assert_eq!(o.open(&b, addr(A)), Ok(Some(b"b".to_vec())));
        assert_eq!(o.open(&a, addr(A)), Ok(Some(b"a".to_vec())));
        assert_eq!(o.open(&a, addr(A)), Err(Rejection::Replayed));
        // Older than the window: refused.
        let old = one(&mut s, b"old");
        for _ in 0..WINDOW {
            let f = one(&mut s, b"x");
            assert!(o.open(&f, addr(A)).is_ok());
        }
        assert_eq!(o.open(&old, addr(A)), Err(Rejection::Replayed));
        // From another source, a frame of the session no newer than its last is refused,
        // even unseen (within the window, out of order)...
        let early = one(&mut s, b"early");
        let late = one(&mut s, b"late");
        assert!(o.open(&late, addr(A)).is_ok());
        assert_eq!(o.open(&early, addr(9)), Err(Rejection::Replayed));
        // ...and a newer one moves the session there; the old source's older frames are then
        // refused, its newer ones take the session back.
        let (x, y, z) = (one(&mut s, b"x"), one(&mut s, b"y"), one(&mut s, b"z"));
        assert_eq!(o.open(&y, addr(9)), Ok(Some(b"y".to_vec())));
        assert_eq!(o.open(&x, addr(A)), Err(Rejection::Replayed));
        assert_eq!(o.open(&z, addr(A)), Ok(Some(b"z".to_vec())));
        assert_eq!(o.open(&early, addr(A)), Ok(Some(b"early".to_vec())));
    }

    // Defect: a session stayed pinned to the address its first frame came from. A frame
    // captured before this node restarted, replayed from elsewhere before the sender's next
    // one, pinned the sender's session there, and its own frames were refused until it
    // restarted too.
    #[test]
    fn a_replay_after_a_restart_does_not_lock_the_sender_out() {
        let (mut s, mut before) = pair("c");
        let captured = one(&mut s, b"captured");
        assert!(before.open(&captured, addr(A)).is_ok());
        let (_, mut restarted) = pair("c");
        assert!(
            restarted.open(&captured, addr(9)).is_ok(),
            "within the clock skew"
        );
        for i in 0..3u8 {
            let next = one(&mut s, &[i]);
            assert_eq!(restarted.open(&next, addr(A)), Ok(Some(vec![i])));
        }
        assert_eq!(restarted.open(&captured, addr(9)), Err(Rejection::Replayed));
    }

    // Defect: a frame did not name its sender, so a capture replayed from another host
    // within the clock skew of a restart made that host count as one this node had heard
    // from (trusted for the hop header under `accept_hop_from = "members"`). It still opens,
    // but only from the IP it names does it count.
    #[test]
    fn only_a_frame_from_the_ip_it_names_shows_its_sender() {
        let node = SocketAddr::from(([10, 0, 0, 1], 7946));
        let other_port = SocketAddr::from(([10, 0, 0, 1], 5000));
        let replayer = SocketAddr::from(([10, 0, 0, 66], 7946));
        let mut s = Sealer::new(ring(&[&key(7)]), "c", node);
        let captured = one(&mut s, b"x");
        let named = |o: Result<Opened, Rejection>| o.map(|o| o.from_named_source);
        assert_eq!(
            named(opener(&[&key(7)], "c", 4).open_from(&captured, replayer)),
            Ok(false)
        );
        assert_eq!(
            named(opener(&[&key(7)], "c", 4).open_from(&captured, node)),
            Ok(true)
        );
        assert_eq!(
            named(opener(&[&key(7)], "c", 4).open_from(&captured, other_port)),
            Ok(true),
            "hosts are told apart by IP"
        );
        let v4_mapped =
            SocketAddr::from((std::net::Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped(), 7946));
        assert_eq!(
            named(opener(&[&key(7)], "c", 4).open_from(&captured, v4_mapped)),
            Ok(true)
        );
        // Every fragment says it, the one that completes the message too.
        let big = vec![1u8; MAX_FRAGMENT_PLAINTEXT + 10];
        let frames = s.seal(&big, addr(B));
        let mut o = opener(&[&key(7)], "c", 4);
        let first = o.open_from(&frames[0], replayer);
        assert_eq!(
            first,
            Ok(Opened {
                message: None,
                from_named_source: false,
                source: node.ip(),
            })
        );
        let last = o.open_from(&frames[1], node);
        assert_eq!(
            last,
            Ok(Opened {
                message: Some(big),
                from_named_source: true,
                source: node.ip(),
            })
        );
    }

    /// A node of an earlier release (frame version 2) is told apart from garbage.
    #[test]
    fn an_earlier_frame_version_is_refused_as_such() {
        let (mut s, mut o) = pair("c");
        let mut frame = one(&mut s, b"x");
        assert!(is_sealed(&frame));
        frame[2] = 2;
        assert!(is_sealed(&frame), "a v2 frame is not plaintext");
        assert_eq!(o.open(&frame, addr(A)), Err(Rejection::Version));
        frame[2] = 9;
        assert!(!is_sealed(&frame));
        assert_eq!(o.open(&frame, addr(A)), Err(Rejection::Malformed));
    }

    #[test]
    fn a_frame_sealed_for_another_node_is_misdirected() {
        // A seals to B, then to C, then to B; a sniffer replays the A->C frame to B.
        let (mut s, mut o) = pair("c");
        let to_b = s.seal(b"to b", addr(B)).remove(0);
        let to_c = s.seal(b"to c", addr(3)).remove(0);
        let to_b2 = s.seal(b"to b again", addr(B)).remove(0);
        assert!(o.open(&to_b, addr(A)).is_ok());
        assert!(o.open(&to_b2, addr(A)).is_ok());
        assert_eq!(o.open(&to_c, addr(A)), Err(Rejection::Misdirected));
    }

    /// A node listening on `0.0.0.0:7946` and advertising `10.0.0.4:7946` takes only frames
    /// sealed for the address it advertises: one captured on its way to another node on the
    /// same port, replayed here from anywhere, is misdirected, and does not pin the sender's
    /// session to the replaying host (the sender's own frames still open afterwards).
    #[test]
    fn an_unspecified_listen_address_takes_no_frame_sealed_for_another_node() {
        let port = 7946;
        let here = SocketAddr::from(([10, 0, 0, 4], port));
        let mut o = Opener::new(
            ring(&[&key(7)]),
            "c",
            vec![here, SocketAddr::from(([0, 0, 0, 0], port))],
            Duration::from_secs(60),
            4,
        );
        let sender = SocketAddr::from(([10, 0, 0, 1], port));
        let mut a = Sealer::new(ring(&[&key(7)]), "c", sender);
        let to_other = a
            .seal(b"to 10.0.0.2", SocketAddr::from(([10, 0, 0, 2], port)))
            .remove(0);
        let to_here = a.seal(b"to 10.0.0.4", here).remove(0);
        let attacker = SocketAddr::from(([10, 0, 0, 66], 4000));
        assert_eq!(o.open(&to_other, attacker), Err(Rejection::Misdirected));
        assert_eq!(o.open(&to_here, sender), Ok(Some(b"to 10.0.0.4".to_vec())));
    }

    #[test]
    fn wrong_key_cluster_or_tampering_is_forged() {
        let (mut s, _) = pair("c");
        let frame = one(&mut s, b"payload");
        assert_eq!(
            opener(&[&key(8)], "c", 4).open(&frame, addr(A)),
            Err(Rejection::Forged)
        );
        assert_eq!(
            opener(&[&key(7)], "d", 4).open(&frame, addr(A)),
            Err(Rejection::Forged)
        );
        let (_, mut o) = pair("c");
        for at in [
            3,
            6,
            AT_SESSION + 1,
            AT_TIMESTAMP + 1,
            HEADER_LEN + 1,
            frame.len() - 1,
        ] {
            let mut bad = frame.clone();
            bad[at] ^= 1;
            let r = o.open(&bad, addr(A));
            assert!(
                r == Err(Rejection::Forged) || r == Err(Rejection::Malformed),
                "byte {at}: {r:?}"
            );
        }
        assert_eq!(o.open(&frame, addr(A)), Ok(Some(b"payload".to_vec())));
        assert_eq!(o.open(b"junk", addr(A)), Err(Rejection::Malformed));
    }

    #[test]
    fn rotation_secondary_keys_open() {
        let (old, new) = (key(1), key(2));
        // Step 1: the new key installed as secondary; old primary still seals.
        let mut sender = Sealer::new(ring(&[&old]), "c", addr(A));
        let mut receiver = opener(&[&old, &new], "c", 4);
        assert!(receiver.open(&one(&mut sender, b"1"), addr(A)).is_ok());
        // Step 2: new primary; nodes still holding the old key as secondary open it.
        let mut sender = Sealer::new(ring(&[&new, &old]), "c", addr(A));
        assert!(receiver.open(&one(&mut sender, b"2"), addr(A)).is_ok());
        // Step 3: old removed; its frames no longer open.
        let mut receiver = opener(&[&new], "c", 4);
        let mut stale_sender = Sealer::new(ring(&[&old]), "c", addr(A));
        assert_eq!(
            receiver.open(&one(&mut stale_sender, b"3"), addr(A)),
            Err(Rejection::Forged)
        );
    }

    #[test]
    fn large_messages_fragment_under_the_datagram_limit() {
        let (mut s, mut o) = pair("c");
        let big: Vec<u8> = (0..MAX_DATAGRAM).map(|i| (i % 251) as u8).collect();
        let frames = s.seal(&big, addr(B));
        assert_eq!(frames.len(), 2);
        assert!(frames.iter().all(|f| f.len() <= MAX_DATAGRAM));
        // Arrival order does not matter.
        assert_eq!(o.open(&frames[1], addr(A)), Ok(None));
        assert_eq!(o.open(&frames[0], addr(A)), Ok(Some(big)));
        let exact = vec![9u8; MAX_FRAGMENT_PLAINTEXT];
        assert_eq!(s.seal(&exact, addr(B)).len(), 1);
    }

    #[test]
    fn reassembly_is_bounded_and_evicts_oldest_counting_it() {
        let (mut s, mut o) = pair("c");
        let big = vec![1u8; MAX_FRAGMENT_PLAINTEXT + 10];
        // One session leaves many first halves: only its share is kept, oldest evicted.
        let mut seconds = Vec::new();
        for _ in 0..10 {
            let mut f = s.seal(&big, addr(B));
            assert_eq!(o.open(&f[0], addr(A)), Ok(None));
            seconds.push(f.remove(1));
        }
        assert_eq!(o.incomplete(), 10 - MAX_PARTIAL_PER_SESSION as u64);
        // The most recent messages still complete.
        let last = seconds.pop().expect("ten");
        assert_eq!(
            o.open(&last, addr(A)).map(|m| m.map(|m| m.len())),
            Ok(Some(big.len()))
        );
        // Another sender is not locked out by the first one's leftovers.
        let mut other = Sealer::new(ring(&[&key(7)]), "c", addr(A));
        let f = other.seal(&big, addr(B));
        assert_eq!(
            o.open(&f[0], SocketAddr::from(([127, 0, 0, 1], 5))),
            Ok(None)
        );
        assert_eq!(
            o.open(&f[1], SocketAddr::from(([127, 0, 0, 1], 5)))
                .map(|m| m.map(|m| m.len())),
            Ok(Some(big.len()))
        );
    }

    /// `frame` with its timestamp set to `ts`, resealed (only a key holder can do this).
    fn with_timestamp(frame: &[u8], ts: u64, k: &str) -> Vec<u8> {
        let mut out = frame[..HEADER_LEN].to_vec();
        out[AT_TIMESTAMP..AT_TIMESTAMP + 8].copy_from_slice(&ts.to_le_bytes());
        let cipher = &ring(&[k]).keys[0].1;
        let mut aad = out.clone();
        aad.extend_from_slice(b"c");
        let nonce = [5u8; NONCE_LEN];
        let ct = cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: b"x",
                    aad: &aad,
                },
            )
            .expect("seal");
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        out
    }

    #[test]
    fn stale_frames_refused_and_sessions_bounded() {
        let k = key(3);
        let mut o = opener(&[&k], "c", 2);
        let mut s = Sealer::new(ring(&[&k]), "c", addr(A));
        let hour_ago = now_ms() - 3_600_000;
        // A new session an hour old, and a known session's frame an hour old: both stale.
        assert_eq!(
            o.open(&with_timestamp(&one(&mut s, b"x"), hour_ago, &k), addr(A)),
            Err(Rejection::Stale)
        );
        assert!(o.open(&one(&mut s, b"y"), addr(A)).is_ok());
        assert_eq!(
            o.open(&with_timestamp(&one(&mut s, b"x"), hour_ago, &k), addr(A)),
            Err(Rejection::Stale)
        );
        for _ in 0..5 {
            let mut s = Sealer::new(ring(&[&k]), "c", addr(A));
            assert!(o.open(&one(&mut s, b"y"), addr(A)).is_ok());
        }
        assert_eq!(o.sessions(), 2);
    }

    #[test]
    fn keys_are_checked() {
        assert!(matches!(
            Keyring::from_base64::<&str>(&[]),
            Err(KeyError::Empty)
        ));
        assert!(matches!(
            Keyring::from_base64(&["not base64!"]),
            Err(KeyError::Malformed { index: 0 })
        ));
        let short = base64::engine::general_purpose::STANDARD.encode([1u8; 16]);
        assert!(matches!(
            Keyring::from_base64(&[key(1), short]),
            Err(KeyError::Malformed { index: 1 })
        ));
        let generated = Keyring::generate_base64();
        assert_eq!(
            Keyring::from_base64(&[&generated]).map(|r| r.len()).ok(),
            Some(1)
        );
        assert_ne!(generated, Keyring::generate_base64());
    }

    proptest! {
        // The decoder faces the network: arbitrary bytes must be refused, never panic.
        #[test]
        fn open_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let (_, mut o) = pair("c");
            prop_assert!(o.open(&bytes, addr(A)).is_err());
        }

        // Arbitrary bytes behind a valid-looking header (magic, version, destination) too.
        #[test]
        fn open_never_panics_behind_a_valid_header(tail in proptest::collection::vec(any::<u8>(), 0..512), index in any::<u8>(), count in any::<u8>()) {
            let (mut s, mut o) = pair("c");
            let mut frame = one(&mut s, b"z")[..HEADER_LEN].to_vec();
            frame[AT_INDEX] = index;
            frame[AT_COUNT] = count;
            frame.extend_from_slice(&tail);
            prop_assert!(o.open(&frame, addr(A)).is_err());
        }

        // A real frame with any bit flipped does not open.
        #[test]
        fn open_refuses_any_single_bit_flip(at in 0usize..(40 + OVERHEAD), bit in 0u8..8) {
            let (mut s, mut o) = pair("c");
            let mut frame = one(&mut s, &[0x5a; 40]);
            frame[at] ^= 1 << bit;
            prop_assert!(o.open(&frame, addr(A)).is_err());
        }
    }
}
