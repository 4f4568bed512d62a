//! Engine-fed residency: for each engine configured with a `kvagent`, the proxy follows that
//! agent's `WatchResidency` stream and records the digests it holds as `engine_feed` residency
//! of the engine (the most trusted source: blocks the engine wrote, which it can page in).
//!
//! The agent sends a snapshot first (`reset`), then changes; its `kv_epoch` names one lifetime
//! of its store. What the feed recorded is withdrawn from the index when a snapshot starts over,
//! when the epoch changes (the agent restarted or was cleared), and when the stream is lost:
//! residency the proxy can no longer hear about is not claimed. The feed reconnects with
//! backoff (0.2 s doubling to 5 s) and re-records what it holds every quarter of the feed TTL,
//! so entries the agent still holds never expire.
//!
//! The stream is hostile input: a digest that is not 32 bytes is skipped and counted, the feed
//! holds at most half of `residency.capacity_per_node` digests per engine (the newest: an
//! addition past the bound replaces the oldest, counted as `over_cap`), leaving the rest of the
//! engine's index to the proxy's own predictions, and the agent can withdraw only what its
//! feed recorded. A connection is given up after 5 s, and an idle stream is pinged every 10 s
//! (a dead agent or path is noticed within 15 s).
//!
//! A digest the feed lists and the proxy also confirmed (`reported`) becomes `engine_feed`;
//! withdrawing it (the agent evicted it, or the stream was lost) removes the entry, also where
//! the engine's own cache may still hold it: the index errs towards claiming less.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kvmesh_filters::chain::Digest;
use kvmesh_filters::residency::{NodeId, ResidencyIndex, Source};
use lru::LruCache;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::config::{ProxyConfig, UpstreamConfig};
use crate::fleet::Fleet;
use crate::metrics::Metrics;

/// Largest `WatchResidency` message accepted (the agent sends at most ~2.3 MB).
const MAX_MESSAGE_BYTES: usize = 8 << 20;
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
    /// The agent started a snapshot over.
    pub const RESET: &str = "reset";
    /// The agent's `kv_epoch` changed.
    pub const EPOCH: &str = "epoch";
    /// A digest was not 32 bytes.
    pub const MALFORMED: &str = "malformed";
    /// The feed held its bound: an added digest replaced the oldest one.
    pub const OVER_CAP: &str = "over_cap";
    /// Every event, to export them from start.
    pub const ALL: [&str; 6] = [CONNECTED, LOST, RESET, EPOCH, MALFORMED, OVER_CAP];
}

/// One engine's feed.
#[derive(Clone)]
struct Feed {
    engine: String,
    url: String,
    token: Option<String>,
    tls: Option<kvagent::ClientTls>,
}

/// The feeds of every engine with a `kvagent`, as a Pingora background service.
pub struct Feeds {
    feeds: Vec<Feed>,
    fleet: Arc<Fleet>,
    index: Arc<ResidencyIndex>,
    metrics: Arc<Metrics>,
    /// Most digests tracked per engine.
    cap: usize,
    /// How often held digests are recorded again (a quarter of the feed TTL).
    refresh: Duration,
}

/// The TLS an `https://` agent is reached with: `[upstream]`'s CA and client certificate.
fn client_tls(url: &str, up: &UpstreamConfig) -> Option<kvagent::ClientTls> {
    url.starts_with("https://").then(|| kvagent::ClientTls {
        ca_file: up.ca_file.clone(),
        cert_file: up.client_cert_file.clone(),
        key_file: up.client_key_file.clone(),
    })
}

impl Feeds {
    /// The feeds `cfg` configures (none when no engine has a `kvagent`); token files are read
    /// now, and an unreadable one is an error naming it.
    pub fn new(
        cfg: &ProxyConfig,
        fleet: Arc<Fleet>,
        index: Arc<ResidencyIndex>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let mut feeds = Vec::new();
        for e in cfg.engines.iter().filter(|e| !e.kvagent.is_empty()) {
            let token = match e.kvagent_token_file.as_str() {
                "" => None,
                path => {
                    let text = std::fs::read_to_string(path).map_err(|err| {
                        format!("engine {:?}: kvagent_token_file {path}: {err}", e.name)
                    })?;
                    let first = text.lines().next().unwrap_or("").trim().to_string();
                    if first.is_empty() {
                        return Err(format!(
                            "engine {:?}: kvagent_token_file {path} has no token on its first line",
                            e.name
                        ));
                    }
                    Some(first)
                }
            };
            for ev in event::ALL {
                metrics.engine_feed.with_label_values(&[&e.name, ev]);
            }
            feeds.push(Feed {
                engine: e.name.clone(),
                url: e.kvagent.clone(),
                token,
                tls: client_tls(&e.kvagent, &cfg.upstream),
            });
        }
        let feed_ttl = cfg.residency_config().feed_ttl;
        Ok(Feeds {
            feeds,
            fleet,
            index,
            metrics,
            cap: (cfg.residency.capacity_per_node / 2).max(1),
            refresh: feed_ttl / 4,
        })
    }

    /// Whether any engine has a feed.
    pub fn is_empty(&self) -> bool {
        self.feeds.is_empty()
    }
}

#[async_trait]
impl BackgroundService for Feeds {
    async fn start(&self, shutdown: ShutdownWatch) {
        let mut tasks = tokio::task::JoinSet::new();
        for f in &self.feeds {
            let mut follower = Follower {
                feed: f.clone(),
                fleet: self.fleet.clone(),
                index: self.index.clone(),
                metrics: self.metrics.clone(),
                cap: self.cap,
                refresh: self.refresh,
                held: LruCache::unbounded(),
                node: None,
            };
            let mut shutdown = shutdown.clone();
            tasks.spawn(async move {
                tokio::select! {
                    _ = follower.run() => {}
                    _ = shutdown.changed() => {}
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
enum FeedError {
    #[error(transparent)]
    Connect(#[from] kvagent::ConnectError),
    #[error("{0}")]
    Status(#[from] tonic::Status),
    #[error("the agent ended the stream")]
    Ended,
}

/// One feed's state: what it recorded, for which node.
struct Follower {
    feed: Feed,
    fleet: Arc<Fleet>,
    index: Arc<ResidencyIndex>,
    metrics: Arc<Metrics>,
    cap: usize,
    refresh: Duration,
    /// Short digests recorded from this feed, least recently added first.
    held: LruCache<u64, ()>,
    /// The node they were recorded for.
    node: Option<NodeId>,
}

impl Follower {
    fn count(&self, ev: &str) {
        self.metrics
            .engine_feed
            .with_label_values(&[&self.feed.engine, ev])
            .inc();
    }

    /// Follows the stream, reconnecting with backoff, forever.
    async fn run(&mut self) {
        let mut backoff = MIN_BACKOFF;
        loop {
            let opened = Instant::now();
            let e = self.follow().await;
            self.withdraw();
            self.count(event::LOST);
            tracing::warn!(engine = %self.feed.engine, kvagent = %self.feed.url, error = %e, "residency feed lost; its residency is withdrawn");
            // A stream that lived a while starts the backoff over.
            if opened.elapsed() > MAX_BACKOFF {
                backoff = MIN_BACKOFF;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One stream, until it fails.
    async fn follow(&mut self) -> FeedError {
        let client = kvagent::connect_with(
            self.feed.url.clone(),
            MAX_MESSAGE_BYTES,
            self.feed.token.as_deref(),
            self.feed.tls.as_ref(),
        )
        .await;
        let mut client = match client {
            Ok(c) => c,
            Err(e) => return e.into(),
        };
        let mut stream = match client
            .watch_residency(kvagent::pb::WatchResidencyRequest {})
            .await
        {
            Ok(s) => s.into_inner(),
            Err(e) => return e.into(),
        };
        self.count(event::CONNECTED);
        tracing::info!(engine = %self.feed.engine, kvagent = %self.feed.url, "residency feed connected");
        let mut epoch = None;
        let mut refresh = tokio::time::interval(self.refresh);
        refresh.tick().await;
        loop {
            let msg = tokio::select! {
                m = stream.message() => m,
                _ = refresh.tick() => {
                    self.rerecord();
                    continue;
                }
            };
            match msg {
                Ok(Some(u)) => self.on_update(&mut epoch, u),
                Ok(None) => return FeedError::Ended,
                Err(e) => return e.into(),
            }
        }
    }

    /// The engine's node now (a reload may have replaced it): what was recorded for the old
    /// node moves to the new one (the agent's set did not change).
    fn node(&mut self) -> Option<NodeId> {
        let now = self
            .fleet
            .engines()
            .iter()
            .find(|e| e.peer.is_none() && e.name == self.feed.engine)
            .map(|e| e.id);
        if now != self.node {
            if let Some(old) = self.node {
                self.index
                    .remove_keys(old, self.held.iter().map(|(k, _)| *k));
            }
            if let Some(new) = now {
                self.index.record_keys(
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

    /// One message of the stream, whose agent has been at `epoch` so far.
    fn on_update(&mut self, epoch: &mut Option<u64>, u: kvagent::pb::ResidencyUpdate) {
        if epoch.is_some_and(|e| e != u.kv_epoch) {
            self.count(event::EPOCH);
            self.withdraw();
        }
        *epoch = Some(u.kv_epoch);
        self.apply(u);
    }

    /// Applies one update.
    fn apply(&mut self, u: kvagent::pb::ResidencyUpdate) {
        let Some(node) = self.node() else {
            return;
        };
        if u.reset {
            self.count(event::RESET);
            self.withdraw();
        }
        let mut malformed = 0u64;
        let mut short = |b: &[u8]| match <[u8; 32]>::try_from(b) {
            Ok(d) => Some(Digest(d).short()),
            Err(_) => {
                malformed += 1;
                None
            }
        };
        // Removals first: they free room for this update's additions. Only what this feed
        // recorded is withdrawn: entries from other sources are not the agent's to remove.
        let removed: Vec<u64> = u
            .removed
            .iter()
            .filter_map(|b| short(b))
            .filter(|k| self.held.pop(k).is_some())
            .collect();
        self.index.remove_keys(node, removed);
        let mut added = Vec::with_capacity(u.added.len());
        let mut over = 0u64;
        let mut evicted = Vec::new();
        for k in u.added.iter().filter_map(|b| short(b)) {
            if self.held.put(k, ()).is_none() && self.held.len() > self.cap {
                // Full: the oldest addition makes room for the newest.
                if let Some((old, ())) = self.held.pop_lru() {
                    evicted.push(old);
                    over += 1;
                }
            }
            added.push(k);
        }
        // An addition this update already replaced is not recorded.
        added.retain(|k| self.held.contains(k));
        self.index.remove_keys(node, evicted);
        self.index
            .record_keys(node, added, Source::EngineFeed, Instant::now());
        let by = |ev: &str, n: u64| {
            if n > 0 {
                self.metrics
                    .engine_feed
                    .with_label_values(&[&self.feed.engine, ev])
                    .inc_by(n);
            }
        };
        by(event::MALFORMED, malformed);
        by(event::OVER_CAP, over);
    }

    /// Records what is held again, oldest first, so that its TTL does not run out while the
    /// agent holds it.
    fn rerecord(&mut self) {
        if let Some(node) = self.node() {
            self.index.record_keys(
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
            self.index
                .remove_keys(node, self.held.iter().map(|(k, _)| *k));
        }
        self.held.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineAddr;
    use kvmesh_filters::residency::ResidencyConfig;

    fn follower(cap: usize) -> Follower {
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
        Follower {
            feed: Feed {
                engine: "e".into(),
                url: "http://127.0.0.1:2".into(),
                token: None,
                tls: None,
            },
            fleet,
            index: Arc::new(ResidencyIndex::new(ResidencyConfig::default())),
            metrics: Arc::new(Metrics::new().unwrap()),
            cap,
            refresh: Duration::from_secs(150),
            held: LruCache::unbounded(),
            node: None,
        }
    }

    fn digest(i: u8) -> bytes::Bytes {
        bytes::Bytes::from(vec![i; 32])
    }

    fn update(
        epoch: u64,
        reset: bool,
        added: Vec<bytes::Bytes>,
        removed: Vec<bytes::Bytes>,
    ) -> kvagent::pb::ResidencyUpdate {
        kvagent::pb::ResidencyUpdate {
            kv_epoch: epoch,
            reset,
            added,
            removed,
        }
    }

    fn feed_entries(f: &Follower) -> usize {
        f.index
            .count_by_source()
            .iter()
            .find(|(s, _)| *s == Source::EngineFeed)
            .map_or(0, |(_, n)| *n)
    }

    fn events(f: &Follower, ev: &str) -> u64 {
        f.metrics.engine_feed.with_label_values(&["e", ev]).get()
    }

    #[test]
    fn hostile_updates_are_bounded_and_counted() {
        let mut f = follower(2);
        let mut epoch = None;
        let short = bytes::Bytes::from_static(b"short");
        let long = bytes::Bytes::from(vec![7u8; 33]);
        f.on_update(
            &mut epoch,
            update(
                1,
                true,
                vec![digest(1), short, long, digest(2), digest(3)],
                vec![],
            ),
        );
        // At the bound the newest replace the oldest: 2 and 3 are held.
        assert_eq!(feed_entries(&f), 2);
        assert_eq!(events(&f, event::MALFORMED), 2);
        assert_eq!(events(&f, event::OVER_CAP), 1);
        let node = f.node.unwrap();
        let key = |i: u8| Digest([i; 32]).short();
        assert_eq!(f.index.overlap(&[Digest([1; 32])], Instant::now()), vec![]);
        // The proxy's own entry for 9: the agent cannot remove it, only what it listed.
        f.index
            .record_keys(node, [key(9)], Source::Reported, Instant::now());
        f.on_update(
            &mut epoch,
            update(1, false, vec![], vec![digest(9), digest(2)]),
        );
        assert_eq!(feed_entries(&f), 1);
        assert_eq!(f.index.node_usage(node).0, 2);
        // A new epoch withdraws what the feed recorded first.
        f.on_update(&mut epoch, update(2, false, vec![digest(4)], vec![]));
        assert_eq!(events(&f, event::EPOCH), 1);
        assert_eq!(feed_entries(&f), 1);
        assert_eq!(
            f.index.overlap(&[Digest([4; 32])], Instant::now()),
            vec![(node, 1)]
        );
        // A snapshot starts over.
        f.on_update(
            &mut epoch,
            update(2, true, vec![digest(5), digest(6)], vec![]),
        );
        assert_eq!(events(&f, event::RESET), 2);
        assert_eq!(feed_entries(&f), 2);
        f.withdraw();
        assert_eq!(feed_entries(&f), 0);
        assert_eq!(f.index.node_usage(node).0, 1, "the reported entry stays");
    }
}
