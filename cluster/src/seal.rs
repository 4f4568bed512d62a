//! Authenticated, encrypted gossip frames: every datagram sealed with ChaCha20-Poly1305 under
//! the cluster key, replays refused, large messages split into fragments that fit a datagram.
//!
//! chitchat itself trusts every UDP sender (its cluster id is only checked on `Syn`); this
//! layer sits under it (see [`crate::transport`]) so that nothing unauthenticated reaches it.
//!
//! A frame:
//!
//! ```text
//! magic "kv" | version 1 | fragment index | fragment count | session u64 | counter u64 |
//! timestamp_ms u64 | nonce [12] | ciphertext | tag [16]
//! ```
//!
//! Everything before the nonce, and the cluster id, is authenticated as associated data, so a
//! frame sealed for another cluster, or with any header byte changed, does not open. The
//! session is random per socket (a restart is a new session), the counter grows by one per
//! frame; the receiver keeps a 128-frame window per session and refuses a counter it has seen
//! (a replay) or one older than the window. A session it does not know yet is accepted only
//! when its timestamp is within `max_clock_skew` of the receiver's clock, which bounds how old
//! a replayed capture can be once its session has been forgotten.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

/// Bytes a key has.
pub const KEY_LEN: usize = 32;
/// The largest UDP payload over IPv4.
pub const MAX_DATAGRAM: usize = 65_507;
const MAGIC: [u8; 2] = *b"kv";
const VERSION: u8 = 1;
const HEADER_LEN: usize = 2 + 1 + 1 + 1 + 8 + 8 + 8;
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
/// Bytes a frame adds to the plaintext it carries.
pub const OVERHEAD: usize = HEADER_LEN + NONCE_LEN + TAG_LEN;
/// The most plaintext one frame carries.
pub const MAX_FRAGMENT_PLAINTEXT: usize = MAX_DATAGRAM - OVERHEAD;
/// The most fragments one message may be split into (chitchat's messages are at most one
/// datagram, so two always suffice; the bound keeps a hostile count from mattering).
pub const MAX_FRAGMENTS: usize = 4;
const WINDOW: u64 = 128;

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
    keys: Vec<ChaCha20Poly1305>,
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
                Ok(ChaCha20Poly1305::new(Key::from_slice(&raw)))
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

/// Why an incoming datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Not a frame at all (too short, wrong magic or version, bad fragment fields).
    Malformed,
    /// A frame that no installed key opens: forged, altered, another cluster, or a wrong key.
    Forged,
    /// A frame already received, or older than the replay window of its session.
    Replayed,
    /// A new session whose timestamp is too far from this node's clock.
    Stale,
    /// Plaintext while incoming frames must be sealed.
    Plaintext,
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
        }
    }

    /// Every reason, for metrics.
    pub const ALL: [Rejection; 5] = [
        Rejection::Malformed,
        Rejection::Forged,
        Rejection::Replayed,
        Rejection::Stale,
        Rejection::Plaintext,
    ];
}

/// Seals outgoing messages for one socket.
pub struct Sealer {
    keyring: Keyring,
    aad_suffix: Vec<u8>,
    session: u64,
    counter: u64,
}

impl Sealer {
    /// A sealer for a new session (random id).
    pub fn new(keyring: Keyring, cluster_id: &str) -> Sealer {
        let mut s = [0u8; 8];
        fill_random(&mut s);
        Sealer {
            keyring,
            aad_suffix: cluster_id.as_bytes().to_vec(),
            session: u64::from_le_bytes(s),
            counter: 0,
        }
    }

    /// The frames that carry `plaintext` (one, or a few fragments when it does not fit).
    pub fn seal(&mut self, plaintext: &[u8]) -> Vec<Vec<u8>> {
        let Some(cipher) = self.keyring.keys.first() else {
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
            let mut frame = Vec::with_capacity(OVERHEAD + piece.len());
            frame.extend_from_slice(&MAGIC);
            frame.push(VERSION);
            frame.push(i as u8);
            frame.push(count);
            frame.extend_from_slice(&self.session.to_le_bytes());
            frame.extend_from_slice(&self.counter.to_le_bytes());
            frame.extend_from_slice(&ts.to_le_bytes());
            let mut nonce = [0u8; NONCE_LEN];
            fill_random(&mut nonce);
            let mut aad = frame.clone();
            aad.extend_from_slice(&self.aad_suffix);
            let Ok(ct) = cipher.encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: piece,
                    aad: &aad,
                },
            ) else {
                return Vec::new();
            };
            frame.extend_from_slice(&nonce);
            frame.extend_from_slice(&ct);
            frames.push(frame);
        }
        frames
    }
}

/// Whether a datagram looks like a sealed frame (rather than chitchat's own plaintext format).
pub fn is_sealed(datagram: &[u8]) -> bool {
    datagram.len() >= 3 && datagram[..2] == MAGIC && datagram[2] == VERSION
}

struct SessionWindow {
    top: u64,
    seen: u128,
    last_seen: Instant,
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
    max_clock_skew: Duration,
    max_sessions: usize,
    sessions: HashMap<u64, SessionWindow>,
    partial: HashMap<(u64, u64), Partial>,
}

/// How long the pieces of a fragmented message wait for the rest.
const REASSEMBLY_TIMEOUT: Duration = Duration::from_secs(5);
/// Messages being reassembled at once (each at most [`MAX_FRAGMENTS`] datagrams).
const MAX_PARTIAL: usize = 64;

impl Opener {
    /// An opener; `max_sessions` bounds the senders remembered for replay checks.
    pub fn new(
        keyring: Keyring,
        cluster_id: &str,
        max_clock_skew: Duration,
        max_sessions: usize,
    ) -> Opener {
        Opener {
            keyring,
            aad_suffix: cluster_id.as_bytes().to_vec(),
            max_clock_skew,
            max_sessions: max_sessions.max(1),
            sessions: HashMap::new(),
            partial: HashMap::new(),
        }
    }

    /// Opens one datagram. `Ok(Some(message))` when a whole message is complete, `Ok(None)`
    /// for a fragment kept for later.
    pub fn open(&mut self, datagram: &[u8]) -> Result<Option<Vec<u8>>, Rejection> {
        if datagram.len() < OVERHEAD || !is_sealed(datagram) {
            return Err(Rejection::Malformed);
        }
        let (index, count) = (datagram[3] as usize, datagram[4] as usize);
        if count == 0 || count > MAX_FRAGMENTS || index >= count {
            return Err(Rejection::Malformed);
        }
        let field = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&datagram[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let (session, counter, ts) = (field(5), field(13), field(21));
        let header = &datagram[..HEADER_LEN];
        let nonce = Nonce::from_slice(&datagram[HEADER_LEN..HEADER_LEN + NONCE_LEN]);
        let ct = &datagram[HEADER_LEN + NONCE_LEN..];
        let mut aad = Vec::with_capacity(HEADER_LEN + self.aad_suffix.len());
        aad.extend_from_slice(header);
        aad.extend_from_slice(&self.aad_suffix);
        let plaintext = self
            .keyring
            .keys
            .iter()
            .find_map(|k| k.decrypt(nonce, Payload { msg: ct, aad: &aad }).ok())
            .ok_or(Rejection::Forged)?;
        // Authentic from here on: the header fields can be trusted as the sender wrote them.
        let now = Instant::now();
        match self.sessions.get_mut(&session) {
            Some(w) => {
                if !w.accept(counter) {
                    return Err(Rejection::Replayed);
                }
                w.last_seen = now;
            }
            None => {
                let skew = now_ms().abs_diff(ts);
                if u128::from(skew) > self.max_clock_skew.as_millis() {
                    return Err(Rejection::Stale);
                }
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
                    },
                );
            }
        }
        if count == 1 {
            return Ok(Some(plaintext));
        }
        self.partial
            .retain(|_, p| now.duration_since(p.started) < REASSEMBLY_TIMEOUT);
        let first = counter.wrapping_sub(index as u64);
        if !self.partial.contains_key(&(session, first)) && self.partial.len() >= MAX_PARTIAL {
            return Ok(None);
        }
        let entry = self.partial.entry((session, first)).or_insert(Partial {
            pieces: vec![None; count],
            started: now,
        });
        if entry.pieces.len() != count {
            return Err(Rejection::Malformed);
        }
        entry.pieces[index] = Some(plaintext);
        if entry.pieces.iter().all(Option::is_some) {
            let whole = self
                .partial
                .remove(&(session, first))
                .map(|p| p.pieces.into_iter().flatten().flatten().collect());
            return Ok(whole);
        }
        Ok(None)
    }

    /// Senders remembered for replay checks.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
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

    fn pair(cluster: &str) -> (Sealer, Opener) {
        let k = key(7);
        (
            Sealer::new(ring(&[&k]), cluster),
            Opener::new(ring(&[&k]), cluster, Duration::from_secs(60), 16),
        )
    }

    #[test]
    fn round_trip_and_replay_refused() {
        let (mut s, mut o) = pair("c");
        let frames = s.seal(b"hello");
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].len(), 5 + OVERHEAD);
        assert_eq!(o.open(&frames[0]), Ok(Some(b"hello".to_vec())));
        assert_eq!(o.open(&frames[0]), Err(Rejection::Replayed));
        // Out of order within the window is fine, once.
        let a = s.seal(b"a").remove(0);
        let b = s.seal(b"b").remove(0);
        assert_eq!(o.open(&b), Ok(Some(b"b".to_vec())));
        assert_eq!(o.open(&a), Ok(Some(b"a".to_vec())));
        assert_eq!(o.open(&a), Err(Rejection::Replayed));
        // Older than the window: refused.
        let old = s.seal(b"old").remove(0);
        for _ in 0..WINDOW {
            let f = s.seal(b"x").remove(0);
            assert!(o.open(&f).is_ok());
        }
        assert_eq!(o.open(&old), Err(Rejection::Replayed));
    }

    #[test]
    fn wrong_key_cluster_or_tampering_is_forged() {
        let (mut s, _) = pair("c");
        let frame = s.seal(b"payload").remove(0);
        let mut other_key = Opener::new(ring(&[&key(8)]), "c", Duration::from_secs(60), 4);
        assert_eq!(other_key.open(&frame), Err(Rejection::Forged));
        let mut other_cluster = Opener::new(ring(&[&key(7)]), "d", Duration::from_secs(60), 4);
        assert_eq!(other_cluster.open(&frame), Err(Rejection::Forged));
        let (_, mut o) = pair("c");
        for at in [3, 6, 14, 22, HEADER_LEN + 1, frame.len() - 1] {
            let mut bad = frame.clone();
            bad[at] ^= 1;
            let r = o.open(&bad);
            assert!(
                r == Err(Rejection::Forged) || r == Err(Rejection::Malformed),
                "byte {at}: {r:?}"
            );
        }
        assert_eq!(o.open(&frame), Ok(Some(b"payload".to_vec())));
        assert_eq!(o.open(b"junk"), Err(Rejection::Malformed));
    }

    #[test]
    fn rotation_secondary_keys_open() {
        let (old, new) = (key(1), key(2));
        // Step 1: the new key installed as secondary; old primary still seals.
        let mut sender = Sealer::new(ring(&[&old]), "c");
        let mut receiver = Opener::new(ring(&[&old, &new]), "c", Duration::from_secs(60), 4);
        assert!(receiver.open(&sender.seal(b"1").remove(0)).is_ok());
        // Step 2: new primary; nodes still holding the old key as secondary open it.
        let mut sender = Sealer::new(ring(&[&new, &old]), "c");
        assert!(receiver.open(&sender.seal(b"2").remove(0)).is_ok());
        // Step 3: old removed; its frames no longer open.
        let mut receiver = Opener::new(ring(&[&new]), "c", Duration::from_secs(60), 4);
        let mut stale_sender = Sealer::new(ring(&[&old]), "c");
        assert_eq!(
            receiver.open(&stale_sender.seal(b"3").remove(0)),
            Err(Rejection::Forged)
        );
    }

    #[test]
    fn large_messages_fragment_under_the_datagram_limit() {
        let (mut s, mut o) = pair("c");
        let big: Vec<u8> = (0..MAX_DATAGRAM).map(|i| (i % 251) as u8).collect();
        let frames = s.seal(&big);
        assert_eq!(frames.len(), 2);
        assert!(frames.iter().all(|f| f.len() <= MAX_DATAGRAM));
        // Arrival order does not matter.
        assert_eq!(o.open(&frames[1]), Ok(None));
        assert_eq!(o.open(&frames[0]), Ok(Some(big)));
        let exact = vec![9u8; MAX_FRAGMENT_PLAINTEXT];
        assert_eq!(s.seal(&exact).len(), 1);
    }

    #[test]
    fn stale_new_session_refused_and_sessions_bounded() {
        let k = key(3);
        let mut o = Opener::new(ring(&[&k]), "c", Duration::from_secs(60), 2);
        let mut s = Sealer::new(ring(&[&k]), "c");
        let mut frame = s.seal(b"x").remove(0);
        // Rewrite the timestamp to an hour ago and reseal by hand: only the key holder can,
        // which is the point; the opener must still refuse a session that old.
        let ts = (now_ms() - 3_600_000).to_le_bytes();
        frame[21..29].copy_from_slice(&ts);
        let cipher = &ring(&[&k]).keys[0];
        let mut aad = frame[..HEADER_LEN].to_vec();
        aad.extend_from_slice(b"c");
        let nonce = [5u8; NONCE_LEN];
        let ct = cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: b"x",
                    aad: &aad,
                },
            )
            .expect("seal");
        frame.truncate(HEADER_LEN);
        frame.extend_from_slice(&nonce);
        frame.extend_from_slice(&ct);
        assert_eq!(o.open(&frame), Err(Rejection::Stale));
        for _ in 0..5 {
            let mut s = Sealer::new(ring(&[&k]), "c");
            assert!(o.open(&s.seal(b"y").remove(0)).is_ok());
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
            prop_assert!(o.open(&bytes).is_err());
        }

        // A real frame with any byte flipped does not open.
        #[test]
        fn open_refuses_any_single_bit_flip(at in 0usize..(40 + OVERHEAD), bit in 0u8..8) {
            let (mut s, mut o) = pair("c");
            let mut frame = s.seal(&[0x5a; 40]).remove(0);
            frame[at] ^= 1 << bit;
            prop_assert!(o.open(&frame).is_err());
        }

        // Arbitrary header fields on an otherwise valid frame (count 0, index past count, huge
        // counts) are handled without panicking.
        #[test]
        fn open_survives_hostile_fragment_fields(index in any::<u8>(), count in any::<u8>()) {
            let (mut s, mut o) = pair("c");
            let mut frame = s.seal(b"z").remove(0);
            frame[3] = index;
            frame[4] = count;
            let _ = o.open(&frame);
        }
    }
}
