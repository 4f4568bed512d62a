//! KV blocks written through to kvagent and paged back in from it, sealed with a MAC.
//!
//! kvagent stores payloads it cannot check, and any local process may put blocks into it. A
//! block this engine writes carries, after the KV payload, a 32-byte MAC: a keyed BLAKE3 over
//! the block's digest, model, token count and payload ([`seal`]). On page-in every block is
//! checked ([`verify`]): the digest kvagent returns, the model, the token count, the size and the
//! MAC; a block that fails any check is not used (the rest of the chain is a miss), is counted in
//! `engine_shim_kv_pagein_rejected_total{reason}` and is logged at warn.
//!
//! The MAC key comes from the configuration (`kv_mac_key` or `kv_mac_key_file`) or is random per
//! start: then blocks spilled by an earlier run (or by another engine) are rejected, not reused.
//! Either way it is bound to the engine's weights ([`MacKey::for_weights`]): engines that share
//! a key but not a model file and weight type do not take each other's blocks.
//!
//! Every kvagent call is bounded: a page-in waits at most `kvagent_fetch_timeout_ms` (then it is
//! a miss, counted in `engine_shim_kv_pagein_timeouts_total`), and write-through batches in
//! flight hold at most `kvagent_put_max_blocks` blocks: a write-through that does not fit is
//! dropped (counted in `engine_shim_kv_writethrough_dropped_blocks_total`), never waited for.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_filters::chain::Digest;
use tokio::sync::Semaphore;

use crate::cache::BLOCK_TOKENS;
use crate::engine::{BlockStore, Stats};

/// Bytes of the MAC appended to every payload written to kvagent.
pub const MAC_BYTES: usize = 32;

/// Namespace (key derivation context) of the block MAC: keeps it apart from the prefix chain.
const MAC_CONTEXT: &str = "engine-shim kv block mac v1";

/// Blocks per `PutBlocks` call: batches well under kvagent's 64 MiB message bound.
const PUT_BATCH: usize = 16;

/// Why a MAC key cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key is not 64 hexadecimal characters.
    #[error("a kv MAC key must be 64 hexadecimal characters (32 bytes)")]
    Format,
    /// The key file cannot be read.
    #[error("reading the kv MAC key file {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// The secret that seals blocks written to kvagent.
#[derive(Clone)]
pub struct MacKey {
    /// The keyed-BLAKE3 key, derived from the secret under [`MAC_CONTEXT`].
    key: [u8; 32],
}

impl std::fmt::Debug for MacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MacKey(..)")
    }
}

impl MacKey {
    /// A key from 32 secret bytes.
    pub fn from_bytes(secret: &[u8; 32]) -> Self {
        MacKey {
            key: blake3::derive_key(MAC_CONTEXT, secret),
        }
    }

    /// A key from 64 hexadecimal characters (surrounding whitespace ignored).
    pub fn from_hex(hex: &str) -> Result<Self, KeyError> {
        let mut secret = [0u8; 32];
        hex::decode_to_slice(hex.trim(), &mut secret).map_err(|_| KeyError::Format)?;
        Ok(MacKey::from_bytes(&secret))
    }

    /// A key from a file holding 64 hexadecimal characters.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::File {
            path: path.display().to_string(),
            source,
        })?;
        MacKey::from_hex(&text)
    }

    /// This key bound to the weights an engine computes KV with (`fingerprint`, from
    /// [`weights_fingerprint`]): blocks sealed by an engine with the same secret but other
    /// weights (another model file under the same name, another weight type) fail the MAC,
    /// since their KV is not what this engine would compute.
    pub fn for_weights(&self, fingerprint: &[u8; 32]) -> MacKey {
        MacKey {
            key: *blake3::keyed_hash(&self.key, fingerprint).as_bytes(),
        }
    }

    /// A random key (a CSPRNG seeded by the OS): blocks sealed by any other key are rejected.
    pub fn random() -> Self {
        use rand::RngCore;
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        MacKey::from_bytes(&secret)
    }
}

/// What the KV of an engine depends on beyond the prompt: BLAKE3 of the model file's bytes
/// (`model_file`, as the engine loaded it), then the weight type's name (`f32`, `bf16`,
/// `q8_0`).
pub fn weights_fingerprint(model_file: &[u8], weights: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(model_file);
    h.update(&(weights.len() as u64).to_le_bytes());
    h.update(weights.as_bytes());
    *h.finalize().as_bytes()
}

/// The MAC of a block: keyed BLAKE3 (the key derived from the secret under its own context) over
/// `digest ‖ len(model) as u64 LE ‖ model ‖ token_count as u32 LE ‖ payload`.
pub fn block_mac(
    key: &MacKey,
    digest: &Digest,
    model: &str,
    token_count: u32,
    payload: &[u8],
) -> blake3::Hash {
    blake3::Hasher::new_keyed(&key.key)
        .update(&digest.0)
        .update(&(model.len() as u64).to_le_bytes())
        .update(model.as_bytes())
        .update(&token_count.to_le_bytes())
        .update(payload)
        .finalize()
}

/// `payload ‖ MAC`: what is written to kvagent.
pub fn seal(
    key: &MacKey,
    digest: &Digest,
    model: &str,
    token_count: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + MAC_BYTES);
    out.extend_from_slice(payload);
    out.extend_from_slice(block_mac(key, digest, model, token_count, payload).as_bytes());
    out
}

/// Why a block from kvagent was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// kvagent returned a block under another digest than the one asked for.
    Digest,
    /// The block belongs to another model.
    Model,
    /// The block covers another number of tokens than the engine's block size.
    TokenCount,
    /// The payload is not the size of this model's block plus its MAC.
    Size,
    /// The MAC does not match (forged, corrupted, or sealed under another key).
    Mac,
}

impl RejectReason {
    /// Every reason, in the order of [`Stats::pagein_rejected`].
    pub const ALL: [RejectReason; 5] = [
        RejectReason::Digest,
        RejectReason::Model,
        RejectReason::TokenCount,
        RejectReason::Size,
        RejectReason::Mac,
    ];

    /// The `reason` label of `engine_shim_kv_pagein_rejected_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Digest => "digest",
            RejectReason::Model => "model",
            RejectReason::TokenCount => "token_count",
            RejectReason::Size => "size",
            RejectReason::Mac => "mac",
        }
    }

    /// Index into [`Stats::pagein_rejected`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What a page-in expects of a block.
#[derive(Debug, Clone)]
pub struct Expect<'a> {
    /// The key blocks are sealed with.
    pub key: &'a MacKey,
    /// The served model name.
    pub model: &'a str,
    /// Bytes of one block's KV payload (without the MAC).
    pub payload_bytes: usize,
}

/// Checks a block kvagent returned for `want`; returns its KV payload (the MAC stripped).
pub fn verify<'b>(
    expect: &Expect<'_>,
    want: &Digest,
    block: &'b kvagent::pb::Block,
) -> Result<&'b [u8], RejectReason> {
    if block.digest.as_ref() != want.0.as_slice() {
        return Err(RejectReason::Digest);
    }
    if block.model != expect.model {
        return Err(RejectReason::Model);
    }
    if block.token_count as usize != BLOCK_TOKENS {
        return Err(RejectReason::TokenCount);
    }
    let Some(mac_at) = expect.payload_bytes.checked_add(MAC_BYTES) else {
        return Err(RejectReason::Size);
    };
    if block.payload.len() != mac_at {
        return Err(RejectReason::Size);
    }
    let (payload, mac) = block.payload.split_at(expect.payload_bytes);
    let want_mac = block_mac(expect.key, want, expect.model, block.token_count, payload);
    // blake3::Hash compares in constant time.
    let mac = <[u8; MAC_BYTES]>::try_from(mac).map_err(|_| RejectReason::Size)?;
    if want_mac != blake3::Hash::from(mac) {
        return Err(RejectReason::Mac);
    }
    Ok(payload)
}

/// Bounds of the kvagent calls.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest wait for one page-in (`GetBlocks`, all its blocks).
    pub fetch_timeout: Duration,
    /// Longest wait for one write-through `PutBlocks` call.
    pub put_timeout: Duration,
    /// Most blocks in write-through batches in flight; more are dropped.
    pub put_max_blocks: usize,
}

/// The [`BlockStore`] on a kvagent: sealed write-through, verified and bounded page-in.
pub struct KvagentStore {
    rt: tokio::runtime::Handle,
    client: kvagent::Client,
    model: String,
    key: MacKey,
    payload_bytes: usize,
    limits: Limits,
    put_permits: Arc<Semaphore>,
    stats: Arc<Stats>,
    /// The `kv_epoch`s kvagent answered writes with: a new one means it restarted or was
    /// cleared since.
    epoch: Arc<EpochWatch>,
    /// No page-in is asked for before then: the last one timed out.
    pagein_paused_until: Option<std::time::Instant>,
}

/// How long page-ins pause after one timed out. Each waits on the engine loop, so a kvagent
/// that accepts connections but never answers would otherwise cost every admission a whole
/// timeout while every running stream waits; paused, it costs one timeout per pause.
pub const PAGEIN_PAUSE: Duration = Duration::from_secs(10);

/// Epochs remembered, so that one seen again (answers arriving out of order, two agents
/// behind one address) is no news.
const EPOCHS_REMEMBERED: usize = 8;

/// Least time between two resyncs: a flapping epoch (two agents behind one address, or a
/// hostile one) cannot make the engine rewrite its cache at every request.
const RESYNC_EVERY: Duration = Duration::from_secs(30);

/// What write-through answers say of kvagent's epoch.
#[derive(Default)]
struct EpochWatch {
    state: parking_lot::Mutex<EpochState>,
}

#[derive(Default)]
struct EpochState {
    /// Epochs seen, oldest first.
    seen: std::collections::VecDeque<u64>,
    /// A new epoch came after the first: a resync is due.
    changed: bool,
    /// When the last resync was handed out.
    last_resync: Option<std::time::Instant>,
}

impl EpochWatch {
    fn saw(&self, epoch: u64) {
        // 0 is no epoch (an agent that does not say).
        if epoch == 0 {
            return;
        }
        let mut st = self.state.lock();
        if st.seen.contains(&epoch) {
            return;
        }
        if !st.seen.is_empty() {
            st.changed = true;
        }
        if st.seen.len() == EPOCHS_REMEMBERED {
            st.seen.pop_front();
        }
        st.seen.push_back(epoch);
    }

    /// Whether a resync is due now: once per new epoch, and never sooner than
    /// [`RESYNC_EVERY`] after the last (a change meanwhile waits for that).
    fn take_resync(&self, now: std::time::Instant) -> bool {
        let mut st = self.state.lock();
        let ready = st
            .last_resync
            .is_none_or(|t| now.duration_since(t) >= RESYNC_EVERY);
        if st.changed && ready {
            st.changed = false;
            st.last_resync = Some(now);
            return true;
        }
        false
    }
}

impl KvagentStore {
    /// A store over a connected client. `payload_bytes` is one block's KV payload size
    /// ([`crate::cache::KvBlock::bytes`]); page-in and write-through are counted in `stats`.
    pub fn new(
        rt: tokio::runtime::Handle,
        client: kvagent::Client,
        model: String,
        key: MacKey,
        payload_bytes: usize,
        limits: Limits,
        stats: Arc<Stats>,
    ) -> Self {
        let permits = limits.put_max_blocks.min(Semaphore::MAX_PERMITS);
        KvagentStore {
            rt,
            client,
            model,
            key,
            payload_bytes,
            put_permits: Arc::new(Semaphore::new(permits)),
            limits,
            stats,
            epoch: Arc::default(),
            pagein_paused_until: None,
        }
    }
}

impl BlockStore for KvagentStore {
    fn put(&mut self, blocks: Vec<(Digest, Vec<u8>)>) {
        let n = blocks.len();
        // Never wait here (this is the engine loop): a write-through that does not fit is dropped.
        let permit = u32::try_from(n)
            .ok()
            .and_then(|n| self.put_permits.clone().try_acquire_many_owned(n).ok());
        let Some(permit) = permit else {
            self.stats
                .writethrough_dropped_blocks
                .fetch_add(n as u64, Ordering::Relaxed);
            tracing::debug!(
                blocks = n,
                "kvagent write-through dropped: too many in flight"
            );
            return;
        };
        let token_count = BLOCK_TOKENS as u32;
        let sealed: Vec<kvagent::pb::Block> = blocks
            .iter()
            .map(|(d, p)| kvagent::pb::Block {
                digest: bytes::Bytes::copy_from_slice(&d.0),
                model: self.model.clone(),
                token_count,
                payload: bytes::Bytes::from(seal(&self.key, d, &self.model, token_count, p)),
            })
            .collect();
        drop(blocks);
        let mut client = self.client.clone();
        let timeout = self.limits.put_timeout;
        let stats = self.stats.clone();
        let epoch = self.epoch.clone();
        self.rt.spawn(async move {
            let _permit = permit;
            let mut rest = sealed;
            while !rest.is_empty() {
                let tail = rest.split_off(rest.len().min(PUT_BATCH));
                let req = kvagent::pb::PutBlocksRequest { blocks: rest };
                let failed = match tokio::time::timeout(timeout, client.put_blocks(req)).await {
                    Ok(Ok(r)) => {
                        epoch.saw(r.into_inner().kv_epoch);
                        None
                    }
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no answer within {} ms", timeout.as_millis())),
                };
                if let Some(error) = failed {
                    stats.writethrough_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%error, "kvagent PutBlocks failed");
                    return;
                }
                rest = tail;
            }
        });
    }

    fn lost(&mut self) -> Option<usize> {
        // Half the write-through bound: new blocks keep the rest.
        self.epoch
            .take_resync(std::time::Instant::now())
            .then_some(self.limits.put_max_blocks / 2)
    }

    fn get_leading(&mut self, digests: &[Digest]) -> Vec<Vec<u8>> {
        if let Some(until) = self.pagein_paused_until {
            if std::time::Instant::now() < until {
                self.stats.pagein_skipped.fetch_add(1, Ordering::Relaxed);
                return Vec::new();
            }
            self.pagein_paused_until = None;
        }
        let mut client = self.client.clone();
        let req = kvagent::pb::GetBlocksRequest {
            digests: digests
                .iter()
                .map(|d| bytes::Bytes::copy_from_slice(&d.0))
                .collect(),
        };
        let expect = Expect {
            key: &self.key,
            model: &self.model,
            payload_bytes: self.payload_bytes,
        };
        let stats = &self.stats;
        let fetch = async {
            let mut out = Vec::new();
            let resp = client.get_blocks(req).await?;
            let mut stream = resp.into_inner();
            for want in digests {
                let Some(m) = stream.message().await? else {
                    break;
                };
                // Unset: kvagent does not hold it; the rest of the chain is a miss.
                let Some(block) = m.block else {
                    break;
                };
                match verify(&expect, want, &block) {
                    Ok(payload) => out.push(payload.to_vec()),
                    Err(reason) => {
                        stats.pagein_rejected[reason.index()].fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            digest = %want.to_hex(),
                            reason = reason.as_str(),
                            "block from kvagent rejected on page-in; computing it instead"
                        );
                        break;
                    }
                }
            }
            Ok::<_, tonic::Status>(out)
        };
        let timeout = self.limits.fetch_timeout;
        // The timer is made inside the runtime (it needs its time driver).
        match self
            .rt
            .block_on(async { tokio::time::timeout(timeout, fetch).await })
        {
            Ok(Ok(out)) => out,
            Ok(Err(status)) => {
                stats.pagein_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %status, "kvagent GetBlocks failed; computing instead");
                Vec::new()
            }
            Err(_) => {
                stats.pagein_timeouts.fetch_add(1, Ordering::Relaxed);
                self.pagein_paused_until = Some(std::time::Instant::now() + PAGEIN_PAUSE);
                tracing::warn!(
                    timeout_ms = self.limits.fetch_timeout.as_millis() as u64,
                    pause_s = PAGEIN_PAUSE.as_secs(),
                    "kvagent GetBlocks timed out; computing instead, and asking for no page-in meanwhile"
                );
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(d: &Digest, model: &str, tc: u32, payload: Vec<u8>) -> kvagent::pb::Block {
        kvagent::pb::Block {
            digest: bytes::Bytes::copy_from_slice(&d.0),
            model: model.into(),
            token_count: tc,
            payload: payload.into(),
        }
    }

    #[test]
    fn a_new_epoch_is_one_resync_and_a_flapping_one_is_rate_limited() {
        let w = EpochWatch::default();
        let t0 = std::time::Instant::now();
        w.saw(5);
        w.saw(5);
        w.saw(0);
        assert!(!w.take_resync(t0), "the first epoch is no change");
        w.saw(9);
        assert!(w.take_resync(t0));
        assert!(!w.take_resync(t0), "once");
        // Back and forth between two agents: old epochs are no news.
        for e in [5, 9, 5, 9] {
            w.saw(e);
        }
        assert!(!w.take_resync(t0 + RESYNC_EVERY));
        // A really new one within the interval waits for it.
        w.saw(11);
        assert!(!w.take_resync(t0 + RESYNC_EVERY / 2));
        assert!(w.take_resync(t0 + RESYNC_EVERY));
    }

    #[test]
    fn sealed_blocks_verify_and_every_tampering_is_rejected() {
        let key = MacKey::from_bytes(&[7; 32]);
        let other = MacKey::from_bytes(&[8; 32]);
        let (d, d2) = (Digest([1; 32]), Digest([2; 32]));
        let payload = vec![3u8; 64];
        let expect = Expect {
            key: &key,
            model: "m",
            payload_bytes: 64,
        };
        let good = block(&d, "m", 16, seal(&key, &d, "m", 16, &payload));
        assert_eq!(verify(&expect, &d, &good), Ok(payload.as_slice()));
        // Asked for d2, got d's block.
        assert_eq!(verify(&expect, &d2, &good), Err(RejectReason::Digest));
        // A valid MAC moved to another digest.
        let moved = block(&d2, "m", 16, seal(&key, &d, "m", 16, &payload));
        assert_eq!(verify(&expect, &d2, &moved), Err(RejectReason::Mac));
        let wrong_model = block(&d, "x", 16, seal(&key, &d, "x", 16, &payload));
        assert_eq!(verify(&expect, &d, &wrong_model), Err(RejectReason::Model));
        let wrong_tc = block(&d, "m", 8, seal(&key, &d, "m", 8, &payload));
        assert_eq!(
            verify(&expect, &d, &wrong_tc),
            Err(RejectReason::TokenCount)
        );
        assert_eq!(
            verify(&expect, &d, &block(&d, "m", 16, payload.clone())),
            Err(RejectReason::Size)
        );
        let mut flipped = seal(&key, &d, "m", 16, &payload);
        flipped[5] ^= 1;
        assert_eq!(
            verify(&expect, &d, &block(&d, "m", 16, flipped)),
            Err(RejectReason::Mac)
        );
        let foreign = block(&d, "m", 16, seal(&other, &d, "m", 16, &payload));
        assert_eq!(verify(&expect, &d, &foreign), Err(RejectReason::Mac));
    }

    #[test]
    fn keys_parse_from_hex_only() {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF\n";
        let a = MacKey::from_hex(hex).map(|k| block_mac(&k, &Digest([0; 32]), "m", 16, b""));
        let b = MacKey::from_bytes(&[
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb,
            0xcc, 0xdd, 0xee, 0xff,
        ]);
        assert_eq!(a.ok(), Some(block_mac(&b, &Digest([0; 32]), "m", 16, b"")));
        assert!(MacKey::from_hex("abc").is_err());
        assert!(MacKey::from_hex(&"zz".repeat(32)).is_err());
        let r1 = block_mac(&MacKey::random(), &Digest([0; 32]), "m", 16, b"");
        let r2 = block_mac(&MacKey::random(), &Digest([0; 32]), "m", 16, b"");
        assert_ne!(r1, r2);
    }
}
