//! Engine-fed residency: the blocks an engine reports holding become its `engine_feed`
//! residency (the most trusted source: blocks the engine wrote, which it can reuse).
//!
//! Two feeds, one per engine at most:
//! - [`kvagent`]: the engine's kvagent `WatchResidency` stream (`[[engines]] kvagent`).
//! - [`kv_events`]: vLLM's or SGLang's ZeroMQ KV events publisher (`[[engines]] kv_events`),
//!   whose token ids are hashed into the proxy's own token-mode chain.
//!
//! What a feed recorded is withdrawn from the index when its source starts over or can no
//! longer be heard (a lost stream, a new kvagent epoch, a gap in the event sequence nothing can
//! replay): residency the proxy cannot follow is not claimed. Feeds reconnect with backoff
//! (0.2 s doubling to 5 s) and re-record what they hold every quarter of the feed TTL, so
//! entries the engine still holds never expire.
//!
//! What a feed sends is hostile input. Each holds at most half of
//! `residency.capacity_per_node` digests per engine (the newest: an addition past the bound
//! replaces the oldest, counted as `over_cap`), leaving the rest of the engine's index to the
//! proxy's own predictions, and can withdraw only what it recorded itself.
//!
//! A digest a feed lists and the proxy also confirmed (`reported`) becomes `engine_feed`;
//! withdrawing it removes the entry, also where the engine's own cache may still hold it: the
//! index errs towards claiming less.

pub mod kv_events;
pub mod kvagent;
pub mod zmtp;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kvmesh_filters::residency::{NodeId, ResidencyIndex, Source};
use lru::LruCache;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::ProxyConfig;
use crate::fleet::Fleet;
use crate::metrics::Metrics;

/// First reconnect delay; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);
/// Longest reconnect delay.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What happened on a feed, for `kvmesh_engine_feed_events_total{event}`.
pub mod event {
    /// The stream was opened.
    pub const CONNECTED: &str = "connected";
    /// The stream failed, ended or could not be opened.
    pub const LOST: &str = "lost";
    /// kvagent started a snapshot over.
    pub const RESET: &str = "reset";
    /// kvagent's `kv_epoch` changed.
    pub const EPOCH: &str = "epoch";
    /// A digest, message or event could not be read (skipped).
    pub const MALFORMED: &str = "malformed";
    /// The feed held its bound: an added digest replaced the oldest one.
    pub const OVER_CAP: &str = "over_cap";
    /// KV events: a sequence number was skipped.
    pub const GAP: &str = "gap";
    /// KV events: a batch fetched from the replay socket.
    pub const REPLAYED: &str = "replayed";
    /// KV events: what the feed recorded was withdrawn because events were lost for good.
    pub const RESYNC: &str = "resync";
    /// KV events: a batch seen already (at-least-once delivery, replay overlap).
    pub const DUPLICATE: &str = "duplicate";
    /// KV events: the live sequence went back (a publisher behind a forwarder restarted): the
    /// feed starts over.
    pub const RESTART: &str = "restart";
    /// KV events: `AllBlocksCleared`.
    pub const CLEARED: &str = "cleared";
    /// KV events: stored blocks whose parent block the feed does not know (skipped).
    pub const UNMAPPED: &str = "unmapped";
    /// KV events: blocks not named by their tokens alone (LoRA, extra keys such as images or a
    /// cache salt, another KV cache group), or an unknown event type (skipped).
    pub const UNSUPPORTED: &str = "unsupported";
    /// KV events: stored blocks of another size than the model's `block_tokens` (skipped).
    pub const BLOCK_SIZE: &str = "block_size";
    /// The events of a kvagent feed, to export them from start.
    pub const KVAGENT: [&str; 6] = [CONNECTED, LOST, RESET, EPOCH, MALFORMED, OVER_CAP];
    /// The events of a KV events feed.
    pub const KV_EVENTS: [&str; 13] = [
        CONNECTED,
        RESTART,
        LOST,
        MALFORMED,
        OVER_CAP,
        GAP,
        REPLAYED,
        RESYNC,
        DUPLICATE,
        CLEARED,
        UNMAPPED,
        UNSUPPORTED,
        BLOCK_SIZE,
    ];
}

/// The feeds of every engine with a `kvagent` or `kv_events`, as a Pingora background service.
pub struct Feeds {
    kvagent: Vec<kvagent::Feed>,
    kv_events: Vec<kv_events::Feed>,
    shared: Shared,
}

/// What every feed shares.
#[derive(Clone)]
struct Shared {
    fleet: Arc<Fleet>,
    index: Arc<ResidencyIndex>,
    metrics: Arc<Metrics>,
    /// Most digests tracked per engine.
    cap: usize,
    /// How often held digests are recorded again (a quarter of the feed TTL).
    refresh: Duration,
}

impl Shared {
    fn set(&self, engine: &str) -> FedSet {
        FedSet {
            engine: engine.to_string(),
            shared: self.clone(),
            held: LruCache::unbounded(),
            node: None,
        }
    }
}

impl Feeds {
    /// The feeds `cfg` configures (none when no engine has one); token files are read now,
    /// and an unreadable one is an error naming it.
    pub fn new(
        cfg: &ProxyConfig,
        fleet: Arc<Fleet>,
        index: Arc<ResidencyIndex>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let mut kvagent = Vec::new();
        let mut kv_events = Vec::new();
        for e in &cfg.engines {
            if !e.kvagent.is_empty() {
                kvagent.push(kvagent::Feed::new(e, &cfg.upstream)?);
                for ev in event::KVAGENT {
                    metrics.engine_feed.with_label_values(&[&e.name, ev]);
                }
            }
            if !e.kv_events.is_empty() {
                kv_events.push(kv_events::Feed::new(e, &cfg.tokenizers)?);
                for ev in event::KV_EVENTS {
                    metrics.engine_feed.with_label_values(&[&e.name, ev]);
                }
            }
        }
        let feed_ttl = cfg.residency_config().feed_ttl;
        Ok(Feeds {
            kvagent,
            kv_events,
            shared: Shared {
                fleet,
                index,
                metrics,
                cap: (cfg.residency.capacity_per_node / 2).max(1),
                refresh: feed_ttl / 4,
            },
        })
    }

    /// Whether any engine has a feed.
    pub fn is_empty(&self) -> bool {
        self.kvagent.is_empty() && self.kv_events.is_empty()
    }
}

#[async_trait]
impl BackgroundService for Feeds {
    async fn start(&self, shutdown: ShutdownWatch) {
        let mut tasks = tokio::task::JoinSet::new();
        let mut spawn = |follower: Box<dyn Follow>| {
            let mut shutdown = shutdown.clone();
            tasks.spawn(async move {
                tokio::select! {
                    _ = follow_forever(follower) => {}
                    _ = shutdown.changed() => {}
                }
            });
        };
        for f in &self.kvagent {
            spawn(Box::new(kvagent::Follower::new(
                f.clone(),
                self.shared.set(&f.engine),
            )));
        }
        for f in &self.kv_events {
            spawn(Box::new(kv_events::Subscriber::new(
                f.clone(),
                self.shared.set(&f.engine),
            )));
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// A feed's connection loop.
#[async_trait]
trait Follow: Send {
    /// One connection, until it fails: why.
    async fn follow(&mut self) -> String;
    /// Forgets the connection's state and withdraws what it recorded.
    fn lost(&mut self);
    /// The engine and the source it follows, for logs.
    fn names(&self) -> (&str, &str);
}

/// Follows `f`, reconnecting with backoff, forever.
async fn follow_forever(mut f: Box<dyn Follow>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let opened = Instant::now();
        let e = f.follow().await;
        f.lost();
        let (engine, source) = f.names();
        tracing::warn!(%engine, %source, error = %e, "residency feed lost; its residency is withdrawn");
        // A stream that lived a while starts the backoff over.
        if opened.elapsed() > MAX_BACKOFF {
            backoff = MIN_BACKOFF;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// What one feed recorded for its engine: short digests, each with the set of media (bits)
/// the engine holds it in, least recently added first, and the node they were recorded for.
pub(crate) struct FedSet {
    engine: String,
    shared: Shared,
    held: LruCache<u64, u8>,
    node: Option<NodeId>,
}

impl FedSet {
    /// Counts `n` events `ev` of this feed.
    fn count(&self, ev: &str, n: u64) {
        if n > 0 {
            self.shared
                .metrics
                .engine_feed
                .with_label_values(&[&self.engine, ev])
                .inc_by(n);
        }
    }

    /// The engine's node now (a reload may have replaced it): what was recorded for the old
    /// node moves to the new one (the engine's set did not change).
    fn node(&mut self) -> Option<NodeId> {
        let now = self
            .shared
            .fleet
            .engines()
            .iter()
            .find(|e| e.peer.is_none() && e.name == self.engine)
            .map(|e| e.id);
        if now != self.node {
            if let Some(old) = self.node {
                self.shared
                    .index
                    .remove_keys(old, self.held.iter().map(|(k, _)| *k));
            }
            if let Some(new) = now {
                self.shared.index.record_keys(
                    new,
                    self.held.iter().rev().map(|(k, _)| *k),
                    Source::EngineFeed,
                    Instant::now(),
                );
            }
            self.node = now;
        }
        now
    }

    /// Records `keys`, each held in the media `bits`; past the bound, the oldest make room.
    fn add(&mut self, keys: impl IntoIterator<Item = (u64, u8)>) {
        let Some(node) = self.node() else {
            return;
        };
        let mut added = Vec::new();
        let mut evicted = Vec::new();
        for (k, bits) in keys {
            let media = self.held.peek(&k).copied().unwrap_or(0) | bits;
            if self.held.put(k, media).is_none() && self.held.len() > self.shared.cap {
                if let Some((old, _)) = self.held.pop_lru() {
                    evicted.push(old);
                }
            }
            added.push(k);
        }
        // An addition this call already replaced is not recorded.
        added.retain(|k| self.held.contains(k));
        self.count(event::OVER_CAP, evicted.len() as u64);
        self.shared.index.remove_keys(node, evicted);
        self.shared
            .index
            .record_keys(node, added, Source::EngineFeed, Instant::now());
    }

    /// The engine no longer holds `keys` in the media `bits`: those held in no medium now are
    /// withdrawn. Keys this feed did not record are not its to remove.
    fn remove(&mut self, keys: impl IntoIterator<Item = (u64, u8)>) {
        let Some(node) = self.node() else {
            return;
        };
        let mut gone = Vec::new();
        for (k, bits) in keys {
            if let Some(media) = self.held.peek_mut(&k) {
                *media &= !bits;
                if *media == 0 {
                    self.held.pop(&k);
                    gone.push(k);
                }
            }
        }
        self.shared.index.remove_keys(node, gone);
    }

    /// Whether `key` is held in some medium.
    fn holds(&self, key: u64) -> bool {
        self.held.contains(&key)
    }

    /// Records what is held again, oldest first, so that its TTL does not run out while the
    /// engine holds it.
    fn rerecord(&mut self) {
        if let Some(node) = self.node() {
            self.shared.index.record_keys(
                node,
                self.held.iter().rev().map(|(k, _)| *k),
                Source::EngineFeed,
                Instant::now(),
            );
        }
    }

    /// Withdraws everything this feed recorded.
    fn withdraw(&mut self) {
        if let Some(node) = self.node {
            self.shared
                .index
                .remove_keys(node, self.held.iter().map(|(k, _)| *k));
        }
        self.held.clear();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::EngineAddr;
    use kvmesh_filters::residency::ResidencyConfig;

    /// A feed set of engine `e` (model `m`), holding at most `cap` digests.
    pub(crate) fn set(cap: usize) -> FedSet {
        let fleet = Fleet::new(
            vec![EngineAddr {
                name: "e".into(),
                url: "http://127.0.0.1:1".into(),
                addr: "127.0.0.1:1".parse().unwrap(),
                models: vec!["m".into()],
                unresolved: None,
            }],
            Duration::from_secs(5),
        );
        Shared {
            fleet,
            index: Arc::new(ResidencyIndex::new(ResidencyConfig::default())),
            metrics: Arc::new(Metrics::new().unwrap()),
            cap,
            refresh: Duration::from_secs(150),
        }
        .set("e")
    }

    /// Digests of `s`'s engine recorded as `engine_feed`.
    pub(crate) fn feed_entries(s: &FedSet) -> usize {
        s.shared
            .index
            .count_by_source()
            .iter()
            .find(|(src, _)| *src == Source::EngineFeed)
            .map_or(0, |(_, n)| *n)
    }

    /// How many `ev` events `s`'s engine counted.
    pub(crate) fn events(s: &FedSet, ev: &str) -> u64 {
        s.shared
            .metrics
            .engine_feed
            .with_label_values(&["e", ev])
            .get()
    }

    #[test]
    fn a_digest_stays_while_any_medium_holds_it() {
        let mut s = set(10);
        s.add([(1, 1), (2, 1)]);
        s.add([(1, 2)]);
        s.remove([(1, 1), (2, 1)]);
        assert_eq!(feed_entries(&s), 1, "1 is still in the second medium");
        s.remove([(1, 2), (3, 1)]);
        assert_eq!(feed_entries(&s), 0);
    }
}
