//! Engine-fed residency: the blocks an engine reports holding become its `engine_feed`
//! residency (the most trusted source: blocks the engine wrote, which it can reuse).
//!
//! Two feeds, one per engine at most:
//! - [`kvagent`]: the engine's kvagent `WatchResidency` stream (`[[engines]] kvagent`).
//! - [`kv_events`]: vLLM's or SGLang's ZeroMQ KV events publisher (`[[engines]] kv_events`),
//!   whose token ids are hashed into the proxy's own token-mode chain.
//!
//! Feeds follow configuration reloads: an engine whose `[[engines]]` entry gains a feed starts
//! it, one that loses it, changes it (any key of its entry) or leaves the fleet stops it, and
//! what the stopped feed recorded is withdrawn before a replacement starts.
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

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use kvmesh_filters::residency::{NodeId, ResidencyIndex, Source};
use lru::LruCache;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::ProxyConfig;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::service::Live;

/// First reconnect delay; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(200);
/// Longest reconnect delay.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How often the configuration in force is checked for a reload.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

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
    /// KV events: a gap not replayed because the replay allowance (four at once, then one a
    /// second) was spent; what the feed holds is withdrawn (`resync`).
    pub const REPLAY_LIMITED: &str = "replay_limited";
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
    /// KV events: removed block hashes the feed holds no mapping for (never mapped: stored
    /// before it subscribed, or skipped when stored; or pushed out of its bounded map, or
    /// forgotten at a resync), counted per hash; nothing to withdraw. Steady in a large
    /// engine, not a fault by itself.
    pub const REMOVED_UNKNOWN: &str = "removed_unknown";
    /// KV events: a batch under a topic that only starts with the configured one, which
    /// ZeroMQ's prefix subscription lets through (skipped).
    pub const OTHER_TOPIC: &str = "other_topic";
    /// Digests listed while the engine had no entry in the fleet (not recorded).
    pub const NO_ENGINE: &str = "no_engine";
    /// The events of a kvagent feed, to export them from start.
    pub const KVAGENT: [&str; 7] = [
        CONNECTED, LOST, RESET, EPOCH, MALFORMED, OVER_CAP, NO_ENGINE,
    ];
    /// The events of a KV events feed.
    pub const KV_EVENTS: [&str; 17] = [
        CONNECTED,
        RESTART,
        LOST,
        MALFORMED,
        OVER_CAP,
        GAP,
        REPLAYED,
        REPLAY_LIMITED,
        RESYNC,
        DUPLICATE,
        CLEARED,
        UNMAPPED,
        UNSUPPORTED,
        BLOCK_SIZE,
        REMOVED_UNKNOWN,
        OTHER_TOPIC,
        NO_ENGINE,
    ];
}

/// The feeds of every engine with a `kvagent` or `kv_events`, as a Pingora background service.
pub struct Feeds {
    /// The feeds configured at start.
    initial: Vec<FeedSpec>,
    shared: Shared,
    /// Where a configuration reload puts the configuration in force, and what was in force
    /// when the feeds were made ([`Feeds::follow_reloads`]).
    live: Option<(Arc<ArcSwap<Live>>, Arc<Live>)>,
}

/// One engine's feed as configured.
#[derive(Clone)]
struct FeedSpec {
    /// The engine and the kind of feed: at most one of each kind per engine.
    id: (String, &'static str),
    /// The engine's whole `[[engines]]` entry: a feed whose entry changed is restarted.
    entry: String,
    /// The feed, or why it cannot be made (a token file that cannot be read).
    feed: Result<FeedKind, String>,
}

#[derive(Clone)]
enum FeedKind {
    Kvagent(kvagent::Feed),
    KvEvents(kv_events::Feed),
}

/// A feed's task, and the entry it was made from.
struct Running {
    entry: String,
    task: tokio::task::JoinHandle<()>,
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

    /// The feeds `cfg` configures; their events are exported from now on.
    fn specs(&self, cfg: &ProxyConfig) -> Vec<FeedSpec> {
        let mut specs = Vec::new();
        for e in &cfg.engines {
            let entry = serde_json::to_string(e).unwrap_or_default();
            let mut add = |kind: &'static str, events: &[&str], feed: Result<FeedKind, String>| {
                for ev in events {
                    self.metrics
                        .engine_feed
                        .with_label_values(&[e.name.as_str(), ev]);
                }
                specs.push(FeedSpec {
                    id: (e.name.clone(), kind),
                    entry: entry.clone(),
                    feed,
                });
            };
            if !e.kvagent.is_empty() {
                let feed = kvagent::Feed::new(e, &cfg.upstream).map(FeedKind::Kvagent);
                add("kvagent", &event::KVAGENT, feed);
            }
            if !e.kv_events.is_empty() {
                let feed = kv_events::Feed::new(e, &cfg.tokenizers).map(FeedKind::KvEvents);
                add("kv_events", &event::KV_EVENTS, feed);
            }
        }
        specs
    }

    /// Stops the feeds `desired` no longer lists as they run, withdrawing what they recorded,
    /// then starts those it lists that do not run.
    async fn reconcile(
        &self,
        desired: Vec<FeedSpec>,
        running: &mut HashMap<(String, &'static str), Running>,
    ) {
        let stale: Vec<_> = running
            .iter()
            .filter(|(id, r)| !desired.iter().any(|d| &d.id == *id && d.entry == r.entry))
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            if let Some(r) = running.remove(&id) {
                r.task.abort();
                // Returns once the task is dropped, its recorded digests withdrawn
                // (`FedSet`'s drop): a replacement must not have its digests removed after it.
                let _ = r.task.await;
                if !desired.iter().any(|d| d.id == id) {
                    let events: &[&str] = match id.1 {
                        "kvagent" => &event::KVAGENT,
                        _ => &event::KV_EVENTS,
                    };
                    for ev in events {
                        let _ = self
                            .metrics
                            .engine_feed
                            .remove_label_values(&[id.0.as_str(), ev]);
                    }
                }
                tracing::info!(engine = %id.0, feed = id.1, "residency feed stopped by a configuration reload; its residency is withdrawn");
            }
        }
        for d in desired {
            if running.contains_key(&d.id) {
                continue;
            }
            let follower: Box<dyn Follow> = match d.feed {
                Ok(FeedKind::Kvagent(f)) => {
                    let set = self.set(&f.engine);
                    Box::new(kvagent::Follower::new(f, set))
                }
                Ok(FeedKind::KvEvents(f)) => {
                    let set = self.set(&f.engine);
                    Box::new(kv_events::Subscriber::new(f, set))
                }
                Err(why) => {
                    tracing::error!(engine = %d.id.0, feed = d.id.1, error = %why, "residency feed not started (the next applied reload tries again)");
                    continue;
                }
            };
            let task = tokio::spawn(follow_forever(follower));
            running.insert(
                d.id,
                Running {
                    entry: d.entry,
                    task,
                },
            );
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
        let feed_ttl = cfg.residency_config().feed_ttl;
        let shared = Shared {
            fleet,
            index,
            metrics,
            cap: (cfg.residency.capacity_per_node / 2).max(1),
            refresh: feed_ttl / 4,
        };
        let initial = shared.specs(cfg);
        if let Some(why) = initial.iter().find_map(|s| s.feed.as_ref().err()) {
            return Err(why.clone());
        }
        Ok(Feeds {
            initial,
            shared,
            live: None,
        })
    }

    /// Follows the configuration a reload puts in `live` (checked every second): feeds start,
    /// stop and restart with their engines' `[[engines]]` entries.
    ///
    /// Call it before the reloader starts: a reload from then on is not missed.
    pub fn follow_reloads(mut self, live: Arc<ArcSwap<Live>>) -> Self {
        let in_force = live.load_full();
        self.live = Some((live, in_force));
        self
    }

    /// Whether there is nothing to run: no engine has a feed, and no reload can add one.
    pub fn is_empty(&self) -> bool {
        self.initial.is_empty() && self.live.is_none()
    }

    /// Runs the feeds until `shutdown`.
    async fn run(&self, mut shutdown: ShutdownWatch) {
        let mut running = HashMap::new();
        self.shared
            .reconcile(self.initial.clone(), &mut running)
            .await;
        let mut in_force = self.live.as_ref().map(|(_, at_start)| at_start.clone());
        let mut tick = tokio::time::interval(RELOAD_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tick.tick(), if self.live.is_some() => {
                    let (Some((live, _)), Some(old)) = (self.live.as_ref(), in_force.as_ref()) else {
                        continue;
                    };
                    let now = live.load_full();
                    if Arc::ptr_eq(&now, old) {
                        continue;
                    }
                    self.shared.reconcile(self.shared.specs(&now.cfg), &mut running).await;
                    in_force = Some(now);
                }
            }
        }
        // The tasks are left to end with the runtime, not aborted: residency stays claimed
        // while the proxy drains (aborting would withdraw it as each `FedSet` drops).
        drop(running);
    }
}

#[async_trait]
impl BackgroundService for Feeds {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.run(shutdown).await;
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
            self.count(event::NO_ENGINE, keys.into_iter().count() as u64);
            return;
        };
        let mut added = Vec::new();
        let mut evicted = Vec::new();
        // Keys new in this call: if the cap pushes one out before the call ends, it was never
        // recorded, so it is not this feed's to withdraw (the index may hold it from the
        // proxy's own routing).
        let mut new_here = std::collections::HashSet::new();
        for (k, bits) in keys {
            let media = self.held.peek(&k).copied().unwrap_or(0) | bits;
            if self.held.put(k, media).is_none() {
                new_here.insert(k);
                if self.held.len() > self.shared.cap {
                    if let Some((old, _)) = self.held.pop_lru() {
                        evicted.push(old);
                    }
                }
            }
            added.push(k);
        }
        // An addition this call already replaced is not recorded.
        added.retain(|k| self.held.contains(k));
        self.count(event::OVER_CAP, evicted.len() as u64);
        evicted.retain(|k| !new_here.contains(k));
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

impl Drop for FedSet {
    /// A feed stopped by a reload claims nothing it can no longer follow.
    fn drop(&mut self) {
        self.withdraw();
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

    /// Digests listed while the engine has no entry in the fleet are not recorded, and they
    /// are counted rather than dropped unseen.
    #[test]
    fn digests_of_an_engine_the_fleet_lacks_are_counted() {
        let mut s = set(10);
        s.engine = "gone".into();
        s.add([(1, 1), (2, 1)]);
        assert_eq!(feed_entries(&s), 0);
        let counted = s
            .shared
            .metrics
            .engine_feed
            .with_label_values(&["gone", event::NO_ENGINE])
            .get();
        assert_eq!(counted, 2);
    }
}
