//! The KV events feed: the proxy subscribes to a vLLM (or SGLang) engine's ZeroMQ KV events
//! publisher and records the blocks it reports stored as the engine's `engine_feed` residency.
//!
//! Each message is `[topic, seq (u64 big-endian, from 0), msgpack batch]` ([`schema`]). vLLM's
//! block hashes are not reproducible outside vLLM (a seeded SHA-256 over a pickle), so the
//! feed hashes the tokens each `BlockStored` carries into the proxy's own token-mode chain
//! (continued from the digest it mapped the parent hash to) and remembers vLLM hash -> digest
//! to resolve later parents and `BlockRemoved`. Blocks whose contents their tokens do not name
//! alone (a LoRA, extra keys: images, a cache salt) are skipped, as are their descendants
//! (their parent is unknown: `unmapped`). A `BlockStored` of hashes alone (no tokens, no
//! parent: vLLM's offloading connector copying blocks to CPU) adds that medium to blocks
//! already mapped. A mapping goes when its block is held in no medium, and a mapping the
//! bounded map pushes out takes its block's claim with it (its removal could not be heard).
//!
//! Sequence: a batch seen before is skipped; a gap is filled from the replay socket when one
//! is configured (`[empty, start seq]` to its ROUTER; batches back until seq -1); a gap nothing
//! fills, and an unreadable batch, withdraw what the feed recorded (`resync`): the engine may
//! have removed blocks the proxy did not hear of. On connect the feed replays what the
//! publisher still buffers. A lost connection withdraws everything and forgets the hash map
//! (a restarted engine hashes with a new seed), and so does a live sequence that goes back (a
//! publisher restarted behind a forwarder: `restart`). A replay is abandoned after 30 s or
//! 100,000 batches, or at a batch numbered more than 100,000 past the live one that asked
//! for it; a whole replay after a live restart starts at most once a second (a restart
//! meanwhile goes on from the live stream); what the replay at connect gave is withdrawn when the live stream turns out to be
//! that far behind it (both counted `malformed`). With a topic set, only batches under exactly
//! that topic count.
//!
//! A block is resident while any medium (GPU, CPU, storage) holds it.

pub mod schema;

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use kvmesh_filters::chain::{token_chain_from, Digest, Namespace};
use lru::LruCache;

use super::zmtp::{Limits, SocketType, Zmtp, ZmtpError};
use super::{event, FedSet, Follow};
use crate::config::{zmq_tcp_addr, EngineConfig, TokenizerConfig};
use schema::{Batch, Event, Removed, Stored};

/// What a publisher may send: a batch of at most 8 MiB (vLLM's are KBs to a few MBs: the token
/// ids of one scheduler step's new full blocks) in messages of at most 4 frames.
const LIMITS: Limits = Limits {
    max_frame: 8 << 20,
    max_parts: 4,
    // 8 MiB in 30 s is 280 KB/s: slower than that, the publisher is stalled, not sending.
    max_frame_time: Duration::from_secs(30),
};
/// A silent publisher is pinged after this long (vLLM publishes only when blocks change).
const IDLE: Duration = Duration::from_secs(10);
/// Longest wait for the next replayed batch.
const REPLAY_IDLE: Duration = Duration::from_secs(5);
/// Most batches one replay may send (vLLM buffers 10,000 by default) ...
const MAX_REPLAY_BATCHES: usize = 100_000;
/// ... and longest it may take: past either, the replay is abandoned (the gap stays a gap), so
/// that a publisher cannot hold the feed in replay.
const REPLAY_DEADLINE: Duration = Duration::from_secs(30);
/// Least time between two whole replays after a live restart: a stream that keeps going back
/// must not cost a replay of the publisher's whole buffer per message. A restart meanwhile
/// goes on from the live stream. Gaps' replays (each asks only for what it missed) earn one
/// more of [`GAP_REPLAY_BURST`] per spacing.
const REPLAY_SPACING: Duration = Duration::from_secs(1);
/// Gap replays allowed back to back: a stream with a gap at every batch must not cost a replay
/// connection per batch. A gap past them is lost (withdrawn, as when the replay cannot fill it).
const GAP_REPLAY_BURST: u32 = 4;
/// The replay end marker: seq -1.
const END_SEQ: u64 = u64::MAX;
/// How far past the live stream's number a replayed batch may be numbered (batches published
/// while the replay runs). Past it, the replay socket lied or belongs to another publisher:
/// taken at its word, every live batch after would look old and be dropped.
const REPLAY_AHEAD: u64 = MAX_REPLAY_BATCHES as u64;
/// How far below the connect replay's last batch the first live one may be numbered and still
/// be the same stream: the batches published while the replay ran (vLLM publishes at most one
/// per scheduler step, ~3,000 in the replay's 30 s at 10 ms steps). Further below, the
/// publisher restarted.
const RESTART_SKEW: u64 = 10_000;

/// One engine's KV events feed.
#[derive(Clone)]
pub struct Feed {
    /// The engine's name.
    pub engine: String,
    endpoint: String,
    publisher: String,
    replay: Option<String>,
    topic: Vec<u8>,
    /// The chain's namespace: the engine's one model, no cache salt.
    ns: Namespace,
    block_tokens: usize,
}

impl Feed {
    /// The feed of `e` (which has `kv_events`, validated: one model, in token mode).
    pub fn new(e: &EngineConfig, tokenizers: &[TokenizerConfig]) -> Result<Self, String> {
        let bad = |m: String| format!("engine {:?}: {m}", e.name);
        let model = match e.models.as_slice() {
            [m] => m,
            _ => return Err(bad("`kv_events` needs exactly one model in `models`".into())),
        };
        let block_tokens = tokenizers
            .iter()
            .find(|t| &t.model == model)
            .map(|t| t.block_tokens)
            .ok_or_else(|| {
                bad(format!(
                    "`kv_events`: model {model:?} has no [[tokenizers]]"
                ))
            })?;
        let replay = match e.kv_events_replay.as_str() {
            "" => None,
            r => Some(zmq_tcp_addr(r).map_err(bad)?),
        };
        Ok(Feed {
            engine: e.name.clone(),
            endpoint: e.kv_events.clone(),
            publisher: zmq_tcp_addr(&e.kv_events).map_err(bad)?,
            replay,
            topic: e.kv_events_topic.as_bytes().to_vec(),
            ns: Namespace::new(model, b""),
            block_tokens,
        })
    }
}

/// A medium's bit in the feed's set (names it does not know share one bit).
fn medium_bit(m: Option<&str>) -> u8 {
    match m {
        None => 1,
        Some(m) if m.eq_ignore_ascii_case("GPU") => 1,
        // SGLang's host tier is CPU_PINNED.
        Some(m) if m.eq_ignore_ascii_case("CPU") || m.eq_ignore_ascii_case("CPU_PINNED") => 2,
        Some(m) if m.eq_ignore_ascii_case("STORAGE") || m.eq_ignore_ascii_case("DISK") => 4,
        Some(_) => 8,
    }
}

/// One KV events feed's state.
pub(crate) struct Subscriber {
    feed: Feed,
    set: FedSet,
    /// vLLM block hash key -> the proxy's digest of that block.
    hashes: LruCache<u128, Digest>,
    /// The last sequence number applied on this connection.
    last: Option<u64>,
    /// The last sequence number the subscription itself delivered: a publisher's live stream
    /// only goes forward, so going back means it restarted.
    live_last: Option<u64>,
    /// When the last replay after a live restart started ([`REPLAY_SPACING`]).
    last_replay: Option<tokio::time::Instant>,
    /// Gap replays allowed now ([`GAP_REPLAY_BURST`]), and when the last was earned.
    gap_replays: u32,
    gap_earned_at: tokio::time::Instant,
}

#[async_trait]
impl Follow for Subscriber {
    async fn follow(&mut self) -> String {
        match self.connection().await {
            Ok(never) => match never {},
            Err(e) => e.to_string(),
        }
    }

    fn lost(&mut self) {
        self.forget();
        self.set.count(event::LOST, 1);
    }

    fn names(&self) -> (&str, &str) {
        (&self.feed.engine, &self.feed.endpoint)
    }
}

impl Subscriber {
    pub(crate) fn new(feed: Feed, set: FedSet) -> Self {
        // Twice the digests the set holds: parents outlive the blocks they lead to.
        let cap = std::num::NonZeroUsize::new(set.shared.cap.saturating_mul(2).max(1))
            .unwrap_or(std::num::NonZeroUsize::MIN);
        Subscriber {
            feed,
            set,
            hashes: LruCache::new(cap),
            last: None,
            live_last: None,
            last_replay: None,
            gap_replays: GAP_REPLAY_BURST,
            gap_earned_at: tokio::time::Instant::now(),
        }
    }

    /// One subscription, until it fails.
    async fn connection(&mut self) -> Result<std::convert::Infallible, ZmtpError> {
        let mut sub = Zmtp::connect(&self.feed.publisher, SocketType::Sub, LIMITS).await?;
        sub.subscribe(&self.feed.topic).await?;
        self.set.count(event::CONNECTED, 1);
        tracing::info!(engine = %self.feed.engine, publisher = %self.feed.endpoint, "KV events feed connected");
        // Subscribed first, so nothing published from here on is missed: what the publisher
        // still buffers comes by replay, the rest live (overlap skipped by sequence).
        self.replay(0, None).await;
        let mut refresh = tokio::time::interval(self.set.shared.refresh);
        refresh.tick().await;
        loop {
            let parts = tokio::select! {
                p = sub.recv(IDLE) => p?,
                _ = refresh.tick() => {
                    self.set.rerecord();
                    continue;
                }
            };
            let [topic, seq, payload] = parts.as_slice() else {
                self.set.count(event::MALFORMED, 1);
                continue;
            };
            if !self.ours(topic) {
                continue;
            }
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
                self.set.count(event::MALFORMED, 1);
                continue;
            };
            self.on_live(seq, payload).await;
        }
    }

    /// Whether a batch under `topic` is this feed's. The subscription matches topics by prefix
    /// (ZeroMQ's rule): `eng1` also gets `eng10`'s batches, whose numbers are another
    /// stream's; those are counted and skipped. (No topic set: all.)
    fn ours(&self, topic: &[u8]) -> bool {
        let ours = self.feed.topic.is_empty() || topic == self.feed.topic.as_slice();
        if !ours {
            self.set.count(event::OTHER_TOPIC, 1);
        }
        ours
    }

    /// Forgets everything this connection learnt, and withdraws what it recorded.
    fn forget(&mut self) {
        self.set.withdraw();
        self.hashes.clear();
        self.last = None;
        self.live_last = None;
    }

    /// A batch from the subscription.
    async fn on_live(&mut self, seq: u64, payload: &Bytes) {
        if seq == END_SEQ {
            // The replay end marker, never a batch's number.
            self.set.count(event::MALFORMED, 1);
            return;
        }
        if self.live_last.is_none()
            && self
                .last
                .is_some_and(|l| l > seq.saturating_add(REPLAY_AHEAD))
        {
            // Only the replay at connect can have numbered batches this far ahead (a gap's
            // replay stops at REPLAY_AHEAD past the live batch): a lying replay socket, or a
            // long-lived publisher that restarted since. Either way what it gave goes, and the
            // buffer is replayed again as for a restart (bounded by this batch's number).
            tracing::warn!(engine = %self.feed.engine, seq, last = ?self.last, "KV events replay numbered its batches far past the live stream; withdrawing what it gave");
            self.set.count(event::MALFORMED, 1);
            self.forget();
            self.replay(0, Some(seq)).await;
        }
        let restarted = match self.live_last {
            // Back to an earlier (or the same) number on the same stream: a publisher behind
            // a forwarder restarted, and its hashes are a new lifetime's. One subscription
            // never gets a message twice, so a repeat is a restart too.
            Some(l) => seq <= l,
            // The first live batch since the connect's replay: a little below the replay's
            // last is what was published while it ran; far below, the publisher restarted
            // after it (the connection, to a forwarder, survived).
            None => self
                .last
                .is_some_and(|l| seq.saturating_add(RESTART_SKEW) < l),
        };
        if restarted {
            self.set.count(event::RESTART, 1);
            self.forget();
            self.replay(0, Some(seq)).await;
        }
        self.live_last = Some(seq);
        match self.last {
            Some(l) if seq <= l => {
                self.set.count(event::DUPLICATE, 1);
                return;
            }
            Some(l) if seq > l.saturating_add(1) => {
                self.set.count(event::GAP, 1);
                if self.feed.replay.is_some() {
                    if self.take_gap_replay() {
                        self.replay(l.saturating_add(1), Some(seq)).await;
                    } else {
                        self.set.count(event::REPLAY_LIMITED, 1);
                    }
                }
                // Still short of `seq`: those batches are gone for good.
                if self.last.is_some_and(|l| seq > l.saturating_add(1)) {
                    self.resync();
                }
                if self.last.is_some_and(|l| seq <= l) {
                    return;
                }
            }
            _ => {}
        }
        self.apply(seq, payload);
    }

    /// Fetches the batches from `from` on from the replay socket, if there is one, applying
    /// those past the last one applied; `live`: the live batch that asked for it (a batch
    /// numbered more than [`REPLAY_AHEAD`] past it ends the replay). A failed replay leaves
    /// the gap to the caller.
    async fn replay(&mut self, from: u64, live: Option<u64>) {
        let Some(addr) = self.feed.replay.clone() else {
            return;
        };
        if live.is_some() && from == 0 {
            let now = tokio::time::Instant::now();
            if self
                .last_replay
                .is_some_and(|t| now.duration_since(t) < REPLAY_SPACING)
            {
                return;
            }
            self.last_replay = Some(now);
        }
        let upto = live.map(|l| l.saturating_add(REPLAY_AHEAD));
        let replayed =
            tokio::time::timeout(REPLAY_DEADLINE, self.replay_from(&addr, from, upto)).await;
        let e = match replayed {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => ZmtpError::Timeout("the replay took longer than 30 s"),
        };
        tracing::warn!(engine = %self.feed.engine, replay = %addr, error = %e, "KV events replay failed");
    }

    async fn replay_from(
        &mut self,
        addr: &str,
        from: u64,
        upto: Option<u64>,
    ) -> Result<(), ZmtpError> {
        let mut d = Zmtp::connect(addr, SocketType::Dealer, LIMITS).await?;
        d.send(&[b"", &from.to_be_bytes()]).await?;
        for _ in 0..=MAX_REPLAY_BATCHES {
            let parts = tokio::time::timeout(REPLAY_IDLE, d.recv(REPLAY_IDLE))
                .await
                .map_err(|_| ZmtpError::Timeout("replay"))??;
            let [empty, seq, payload] = parts.as_slice() else {
                return Err(ZmtpError::Protocol(format!(
                    "a replay message of {} frames (3 expected)",
                    parts.len()
                )));
            };
            let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
                return Err(ZmtpError::Protocol("a replay seq not 8 bytes".into()));
            };
            if !empty.is_empty() {
                return Err(ZmtpError::Protocol(
                    "a replay message without its delimiter".into(),
                ));
            }
            if seq == END_SEQ {
                return Ok(());
            }
            if upto.is_some_and(|u| seq > u) {
                self.set.count(event::MALFORMED, 1);
                return Err(ZmtpError::Protocol(format!(
                    "a replayed batch numbered {seq}, far past the live stream"
                )));
            }
            match self.last {
                Some(l) if seq <= l => continue,
                // The publisher's buffer no longer has what came between.
                Some(l) if seq > l.saturating_add(1) => self.resync(),
                _ => {}
            }
            self.set.count(event::REPLAYED, 1);
            self.apply(seq, payload);
        }
        Err(ZmtpError::TooLarge(format!(
            "a replay of more than {MAX_REPLAY_BATCHES} batches"
        )))
    }

    /// Whether a gap may be replayed now ([`GAP_REPLAY_BURST`]); takes the allowance.
    fn take_gap_replay(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let spacing = REPLAY_SPACING.as_millis().max(1);
        let earned = now.duration_since(self.gap_earned_at).as_millis() / spacing;
        if earned > 0 {
            let earned = u32::try_from(earned).unwrap_or(u32::MAX);
            self.gap_replays = self
                .gap_replays
                .saturating_add(earned)
                .min(GAP_REPLAY_BURST);
            // The part of a second already waited counts towards the next, unless the
            // allowance is full (then fewer than GAP_REPLAY_BURST were earned).
            self.gap_earned_at = if self.gap_replays == GAP_REPLAY_BURST {
                now
            } else {
                self.gap_earned_at + REPLAY_SPACING * earned
            };
        }
        let allowed = self.gap_replays > 0;
        self.gap_replays = self.gap_replays.saturating_sub(1);
        allowed
    }

    /// Withdraws what was recorded: some events are lost for good.
    fn resync(&mut self) {
        self.set.count(event::RESYNC, 1);
        self.set.withdraw();
    }

    /// Applies batch `seq`.
    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.last = Some(seq);
        let batch: Batch = match schema::decode(payload) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(engine = %self.feed.engine, seq, error = %e, "unreadable KV events batch");
                self.set.count(event::MALFORMED, 1);
                self.resync();
                return;
            }
        };
        for ev in batch.events {
            match ev {
                Event::BlockStored(s) => self.stored(*s),
                Event::BlockRemoved(r) => self.removed(*r),
                Event::AllBlocksCleared => {
                    self.set.count(event::CLEARED, 1);
                    self.set.withdraw();
                }
                Event::Unknown(_) => self.set.count(event::UNSUPPORTED, 1),
            }
        }
    }

    fn stored(&mut self, s: Stored) {
        // Only the first (or only) KV cache group; LoRA and extra keys change what a block's
        // hash names beyond its tokens.
        if s.group_idx.is_some_and(|g| g != 0)
            || s.lora_id.is_some()
            || s.lora_name.is_some()
            || s.has_extra_keys
        {
            self.set.count(event::UNSUPPORTED, 1);
            return;
        }
        let bit = medium_bit(s.medium.as_deref());
        if s.token_ids.is_empty() && s.parent_block_hash.is_none() {
            // A copy to another medium of blocks stored before (vLLM's offloading connector
            // names them by hash alone): they are held there too.
            let known: Option<Vec<Digest>> = s
                .block_hashes
                .iter()
                .map(|h| self.hashes.get(&h.key()).copied())
                .collect();
            match known {
                Some(ds) => self.set.add(ds.iter().map(|d| (d.short(), bit))),
                None => self.set.count(event::UNMAPPED, 1),
            }
            return;
        }
        if usize::try_from(s.block_size).ok() != Some(self.feed.block_tokens) {
            self.set.count(event::BLOCK_SIZE, 1);
            return;
        }
        if s.block_hashes.len().checked_mul(self.feed.block_tokens) != Some(s.token_ids.len()) {
            self.set.count(event::MALFORMED, 1);
            return;
        }
        let parent = match &s.parent_block_hash {
            None => None,
            Some(h) => match self.hashes.get(&h.key()) {
                Some(d) => Some(*d),
                None => {
                    self.set.count(event::UNMAPPED, 1);
                    return;
                }
            },
        };
        let digests = token_chain_from(
            &self.feed.ns,
            parent.as_ref(),
            &s.token_ids,
            self.feed.block_tokens,
        );
        self.set.add(digests.iter().map(|d| (d.short(), bit)));
        let mut dropped = Vec::new();
        for (h, d) in s.block_hashes.iter().zip(&digests) {
            // A mapping pushed out, or replaced by another digest for the same hash, is a
            // block whose removal could no longer be resolved: its claim goes with it (a hash
            // given twice in one batch costs the first digest's claim, never leaves one).
            if let Some((k, old)) = self.hashes.push(h.key(), *d) {
                if k != h.key() || old != *d {
                    dropped.push((old.short(), u8::MAX));
                }
            }
        }
        self.set.remove(dropped);
    }

    fn removed(&mut self, r: Removed) {
        if r.group_idx.is_some_and(|g| g != 0) {
            self.set.count(event::UNSUPPORTED, 1);
            return;
        }
        let bit = medium_bit(r.medium.as_deref());
        let found: Vec<(u128, u64)> = r
            .block_hashes
            .iter()
            .filter_map(|h| Some((h.key(), self.hashes.peek(&h.key())?.short())))
            .collect();
        self.set.count(
            event::REMOVED_UNKNOWN,
            (r.block_hashes.len() - found.len()) as u64,
        );
        self.set.remove(found.iter().map(|&(_, d)| (d, bit)));
        // Held in no medium now: the mapping goes too (the engine would store it again first).
        for (k, d) in found {
            if !self.set.holds(d) {
                self.hashes.pop(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::tests::{events, feed_entries, set};
    use kvmesh_filters::chain::token_chain;
    use serde_json::json;

    fn subscriber() -> Subscriber {
        let feed = Feed {
            engine: "e".into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            publisher: "127.0.0.1:1".into(),
            replay: None,
            topic: Vec::new(),
            ns: Namespace::new("m", b""),
            block_tokens: 2,
        };
        Subscriber::new(feed, set(100))
    }

    fn batch(events: serde_json::Value) -> Vec<u8> {
        rmp_serde::to_vec_named(&json!({"ts": 0.0, "events": events})).unwrap()
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> serde_json::Value {
        json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
               "token_ids": tokens, "block_size": 2, "lora_id": null, "medium": "GPU"})
    }

    #[test]
    fn stored_blocks_map_to_the_proxys_chain_and_are_removed_by_hash() {
        let mut s = subscriber();
        let whole = token_chain(&Namespace::new("m", b""), &[1, 2, 3, 4, 5, 6], 2);
        s.apply(0, &batch(json!([stored(&[10, 11], None, &[1, 2, 3, 4])])));
        s.apply(1, &batch(json!([stored(&[12], Some(11), &[5, 6])])));
        assert_eq!(feed_entries(&s.set), 3);
        assert_eq!(
            s.hashes.peek(&12),
            Some(&whole[2]),
            "continued from the parent"
        );
        // An unknown parent, a LoRA block, another group, another block size, a token count
        // that is not the blocks': skipped, each counted.
        s.apply(
            2,
            &batch(json!([
                stored(&[20], Some(99), &[7, 8]),
                {"type": "BlockStored", "block_hashes": [21], "parent_block_hash": null,
                 "token_ids": [7, 8], "block_size": 2, "lora_id": 3, "medium": null},
                {"type": "BlockStored", "block_hashes": [22], "parent_block_hash": null,
                 "token_ids": [7, 8], "block_size": 2, "lora_id": null, "medium": null, "group_idx": 1},
                {"type": "BlockStored", "block_hashes": [23], "parent_block_hash": null,
                 "token_ids": [7, 8, 9, 10], "block_size": 4, "lora_id": null, "medium": null},
                stored(&[24, 25], None, &[7, 8, 9]),
            ])),
        );
        assert_eq!(feed_entries(&s.set), 3);
        assert_eq!(events(&s.set, event::UNMAPPED), 1);
        assert_eq!(events(&s.set, event::UNSUPPORTED), 2);
        assert_eq!(events(&s.set, event::BLOCK_SIZE), 1);
        assert_eq!(events(&s.set, event::MALFORMED), 1);
        // Offloaded to CPU, then evicted from GPU: still resident; then from CPU too.
        let cpu = json!({"type": "BlockStored", "block_hashes": [12], "parent_block_hash": 11,
                         "token_ids": [5, 6], "block_size": 2, "lora_id": null, "medium": "CPU"});
        s.apply(
            3,
            &batch(
                json!([cpu, {"type": "BlockRemoved", "block_hashes": [12, 999], "medium": "GPU"}]),
            ),
        );
        assert_eq!(feed_entries(&s.set), 3);
        s.apply(
            4,
            &batch(json!([{"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU"}])),
        );
        assert_eq!(feed_entries(&s.set), 2);
        s.apply(5, &batch(json!([{"type": "AllBlocksCleared"}])));
        assert_eq!(feed_entries(&s.set), 0);
        assert_eq!(events(&s.set, event::CLEARED), 1);
    }

    #[test]
    fn an_unreadable_batch_withdraws_and_a_gap_without_replay_resyncs() {
        let mut s = subscriber();
        s.apply(0, &batch(json!([stored(&[10], None, &[1, 2])])));
        assert_eq!(feed_entries(&s.set), 1);
        s.apply(1, b"\xc1garbage");
        assert_eq!(events(&s.set, event::MALFORMED), 1);
        assert_eq!(events(&s.set, event::RESYNC), 1);
        assert_eq!(feed_entries(&s.set), 0);
        // The map survives: a child of block 10 still maps.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(s.on_live(
            2,
            &Bytes::from(batch(json!([stored(&[11], Some(10), &[3, 4])]))),
        ));
        assert_eq!(feed_entries(&s.set), 1);
        // Applied ahead by a replay, then delivered live: a duplicate.
        s.apply(3, &batch(json!([])));
        rt.block_on(s.on_live(3, &Bytes::from(batch(json!([])))));
        assert_eq!(events(&s.set, event::DUPLICATE), 1);
        rt.block_on(s.on_live(
            9,
            &Bytes::from(batch(json!([stored(&[12], Some(11), &[5, 6])]))),
        ));
        assert_eq!(events(&s.set, event::GAP), 1);
        assert_eq!(events(&s.set, event::RESYNC), 2);
        assert_eq!(feed_entries(&s.set), 1, "withdrawn, then batch 9 applied");
        assert_eq!(s.last, Some(9));
        // The end marker is never a batch; the live stream going back is a restart.
        rt.block_on(s.on_live(END_SEQ, &Bytes::from(batch(json!([])))));
        assert_eq!(events(&s.set, event::MALFORMED), 2);
        assert_eq!(s.last, Some(9));
        rt.block_on(s.on_live(
            0,
            &Bytes::from(batch(json!([stored(&[13], Some(12), &[7, 8])]))),
        ));
        assert_eq!(events(&s.set, event::RESTART), 1);
        assert_eq!(
            feed_entries(&s.set),
            0,
            "the old lifetime's claims and hashes are gone"
        );
        assert_eq!(events(&s.set, event::UNMAPPED), 1);
    }

    /// A publisher behind a forwarder that restarts after the connect's replay and before any
    /// live batch came: its new stream's first batch, far below the replay's last, is a
    /// restart (before, 50,000 batches of the new lifetime were dropped as duplicates while
    /// the old lifetime's claims stayed). A live batch a little below the replay's last is
    /// overlap.
    #[test]
    fn a_restart_before_the_first_live_batch_is_noticed() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let live = |s: &mut Subscriber, seq: u64, v: serde_json::Value| {
            rt.block_on(s.on_live(seq, &Bytes::from(batch(v))))
        };
        // A feed whose connect replay gave batches up to `last`, the last storing one block.
        let replayed_to = |last: u64| {
            let mut s = subscriber();
            s.apply(last, &batch(json!([stored(&[10], None, &[1, 2])])));
            s
        };
        let mut s = replayed_to(50_000);
        live(&mut s, 49_990, json!([]));
        assert_eq!(events(&s.set, event::RESTART), 0);
        assert_eq!(events(&s.set, event::DUPLICATE), 1);
        assert_eq!(feed_entries(&s.set), 1);
        let mut s = replayed_to(50_000);
        live(&mut s, 0, json!([stored(&[20], None, &[3, 4])]));
        assert_eq!(events(&s.set, event::RESTART), 1);
        assert_eq!(feed_entries(&s.set), 1, "only the new lifetime's block");
        assert_eq!(s.last, Some(0));
        live(&mut s, 1, json!([]));
        assert_eq!(events(&s.set, event::RESTART), 1);
        assert_eq!(feed_entries(&s.set), 1);
        // A connect replay numbered past REPLAY_AHEAD is a lying replay socket, not a restart.
        let mut s = replayed_to(1 << 40);
        live(&mut s, 0, json!([]));
        assert_eq!(events(&s.set, event::MALFORMED), 1);
        assert_eq!(events(&s.set, event::RESTART), 0);
        assert_eq!(feed_entries(&s.set), 0);
        // A stream older than REPLAY_AHEAD that goes back is a restart, counted once.
        let mut s = replayed_to(200_000);
        live(&mut s, 200_001, json!([]));
        live(&mut s, 0, json!([]));
        assert_eq!(events(&s.set, event::RESTART), 1);
        assert_eq!(events(&s.set, event::MALFORMED), 0);
    }

    #[test]
    fn offloads_add_a_medium_and_mappings_go_with_their_blocks() {
        let mut s = subscriber();
        s.apply(0, &batch(json!([stored(&[10, 11], None, &[1, 2, 3, 4])])));
        // vLLM's offloading connector: hashes only, no tokens, no parent.
        let offload = json!({"type": "BlockStored", "block_hashes": [10, 11], "parent_block_hash": null,
                             "token_ids": [], "block_size": 32, "lora_id": null, "medium": "CPU"});
        let unknown = json!({"type": "BlockStored", "block_hashes": [77], "parent_block_hash": null,
                             "token_ids": [], "block_size": 32, "lora_id": null, "medium": "CPU"});
        s.apply(1, &batch(json!([offload, unknown])));
        assert_eq!(events(&s.set, event::UNMAPPED), 1);
        s.apply(
            2,
            &batch(json!([{"type": "BlockRemoved", "block_hashes": [10, 11], "medium": "GPU"}])),
        );
        assert_eq!(feed_entries(&s.set), 2, "still on CPU");
        assert_eq!(s.hashes.len(), 2);
        s.apply(
            3,
            &batch(json!([{"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"}])),
        );
        assert_eq!(feed_entries(&s.set), 1);
        assert_eq!(
            s.hashes.len(),
            1,
            "the mapping of a block held nowhere is dropped"
        );
    }

    #[test]
    fn a_mapping_pushed_out_takes_its_claim() {
        let mut s = subscriber();
        s.set = set(2);
        s.hashes = LruCache::new(std::num::NonZeroUsize::new(3).unwrap());
        for (i, h) in (100u64..106).enumerate() {
            s.apply(
                i as u64,
                &batch(json!([stored(&[h], None, &[h as u32, 1])])),
            );
        }
        assert_eq!(s.hashes.len(), 3);
        // Every held digest still has its mapping: a claim no removal could reach is gone.
        assert_eq!(feed_entries(&s.set), 2);
        assert!(s
            .set
            .held
            .iter()
            .all(|(k, _)| s.hashes.iter().any(|(_, d)| d.short() == *k)));
    }

    /// Removals of hashes the feed never mapped, and batches under a longer topic that the
    /// prefix subscription let through, are counted (they change nothing).
    #[test]
    fn unknown_removals_and_other_topics_are_counted() {
        let mut s = subscriber();
        s.apply(0, &batch(json!([stored(&[10], None, &[1, 2])])));
        s.apply(
            1,
            &batch(
                json!([{"type": "BlockRemoved", "block_hashes": [10, 77, 78], "medium": "GPU"}]),
            ),
        );
        assert_eq!(feed_entries(&s.set), 0);
        assert_eq!(events(&s.set, event::REMOVED_UNKNOWN), 2);
        assert!(s.ours(b"anything"), "no topic set: every batch");
        s.feed.topic = b"eng1".to_vec();
        assert!(s.ours(b"eng1"));
        assert!(!s.ours(b"eng10"));
        assert_eq!(events(&s.set, event::OTHER_TOPIC), 1);
    }

    /// A hash stored again as other tokens (or given twice in one batch) maps to the new
    /// digest; the old one's claim goes with its mapping instead of being re-recorded for
    /// good with no removal able to reach it.
    #[test]
    fn a_hash_stored_again_as_other_tokens_takes_the_old_claim() {
        let mut s = subscriber();
        s.apply(0, &batch(json!([stored(&[10], None, &[1, 2])])));
        s.apply(1, &batch(json!([stored(&[10], None, &[3, 4])])));
        assert_eq!(feed_entries(&s.set), 1);
        s.apply(2, &batch(json!([stored(&[11, 11], None, &[5, 6, 7, 8])])));
        assert!(s
            .set
            .held
            .iter()
            .all(|(k, _)| s.hashes.iter().any(|(_, d)| d.short() == *k)));
        // Removing the hashes leaves nothing claimed.
        s.apply(
            3,
            &batch(json!([{"type": "BlockRemoved", "block_hashes": [10, 11], "medium": "GPU"}])),
        );
        assert_eq!(feed_entries(&s.set), 0);
    }
}
