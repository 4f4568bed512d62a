//! The residency index: which node holds which prefix digest, from which source, until when.
//!
//! Keys are [`Digest::short`], the first 8 bytes of each digest: that is the form peers gossip
//! (docs/architecture.md), and it quarters the key memory. Two different prefixes share a key
//! with probability about n^2 / 2^65 (10^-8 for a million digests); a collision can only make
//! one routing decision over-estimate an overlap, never change what an engine computes.
//!
//! Shape (DESIGN section 3): `digest -> [(node, source, expiry)]`, plus one LRU per node that
//! bounds how many digests a node may hold in the index. Reads ([`ResidencyIndex::overlap`]) touch
//! only the concurrent map; writes take the node's LRU lock first, then map shards, always in that
//! order. A write holds a node's lock for at most [`LOCK_CHUNK`] keys and releases it in between,
//! so a long chain never blocks other writers (or readers of the node's set) for long.
//!
//! Dropping a node marks its LRU dropped under the lock before emptying it, and unlists it only
//! when it is empty. A write that got hold of that LRU before or during the drop sees the mark
//! and stops: it is ordered before the drop, whose emptying has removed (or will remove) what it
//! wrote. So no entry outlives its node (a write that started after the drop starts a new set).
//!
//! The per-node bound also adapts: when an engine reports fewer cached tokens than the index
//! predicted (it evicted what the index still lists), that node's bound shrinks by 10%; each
//! confirmed prediction on a full node grows it by 1%, up to the configured capacity. The index
//! thereby learns roughly how much each engine really keeps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use lru::LruCache;
use parking_lot::Mutex;

use crate::chain::Digest;

/// A node (an engine, directly or behind a peer proxy), numbered by the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// Where a residency entry came from, from least to most trustworthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    /// Recorded for the chosen node at dispatch; not confirmed yet.
    Optimistic,
    /// Published by the peer proxy that fronts the node (gossip); removed when the peer
    /// withdraws it, leaves, or changes `kv_epoch`.
    Gossip,
    /// Confirmed by `usage.prompt_tokens_details.cached_tokens` in an engine response.
    Reported,
    /// From the node's own feed of resident digests.
    EngineFeed,
}

impl Source {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Source::Optimistic => "optimistic",
            Source::Gossip => "gossip",
            Source::Reported => "reported",
            Source::EngineFeed => "engine_feed",
        }
    }
}

/// Bounds and lifetimes of the index.
#[derive(Debug, Clone)]
pub struct ResidencyConfig {
    /// Most digests one node may hold in the index (the LRU bound; it adapts downwards).
    pub capacity_per_node: usize,
    /// The adaptive bound never drops below this.
    pub min_capacity_per_node: usize,
    /// Lifetime of an optimistic entry.
    pub optimistic_ttl: Duration,
    /// Lifetime of an entry confirmed by an engine response.
    pub reported_ttl: Duration,
    /// Lifetime of an entry from an engine feed.
    pub feed_ttl: Duration,
    /// Lifetime of an entry learnt by gossip (a backstop: peers withdraw entries themselves).
    pub gossip_ttl: Duration,
}

impl Default for ResidencyConfig {
    fn default() -> Self {
        ResidencyConfig {
            capacity_per_node: 100_000,
            min_capacity_per_node: 64,
            optimistic_ttl: Duration::from_secs(60),
            reported_ttl: Duration::from_secs(600),
            feed_ttl: Duration::from_secs(600),
            gossip_ttl: Duration::from_secs(3600),
        }
    }
}

impl ResidencyConfig {
    fn ttl(&self, source: Source) -> Duration {
        match source {
            Source::Optimistic => self.optimistic_ttl,
            Source::Reported => self.reported_ttl,
            Source::EngineFeed => self.feed_ttl,
            Source::Gossip => self.gossip_ttl,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    node: NodeId,
    source: Source,
    expires: Instant,
}

/// The key of a digest in the index.
type Key = u64;

/// Most keys written, evicted or dropped per hold of a node's lock.
pub const LOCK_CHUNK: usize = 1024;

struct NodeLru {
    lru: LruCache<Key, ()>,
    capacity: usize,
    /// Changes whenever a key joins or leaves this node's set (see [`ResidencyIndex::node_version`]).
    version: u64,
    /// Set (under the lock) by [`ResidencyIndex::drop_node`]: this set is being emptied and is no
    /// longer the node's; writes that hold it stop.
    dropped: bool,
}

/// What an engine's `cached_tokens` said about a prediction, see [`ResidencyIndex::confirm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The engine had at least what the index predicted.
    Confirmed,
    /// The engine had less than predicted: the index listed blocks the engine had evicted.
    Refuted,
    /// The engine had less than predicted, but other prefills were running there at dispatch
    /// (perhaps of this very prefix, not cached until computed): no conclusion is drawn.
    Inconclusive,
}

impl Verdict {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Verdict::Confirmed => "confirmed",
            Verdict::Refuted => "refuted",
            Verdict::Inconclusive => "inconclusive",
        }
    }
}

/// The concurrent residency index. Cheap to share behind an `Arc`.
pub struct ResidencyIndex {
    cfg: ResidencyConfig,
    map: DashMap<Key, Vec<Holder>>,
    nodes: DashMap<NodeId, Arc<Mutex<NodeLru>>>,
    /// Source of node set versions: unique across nodes and node lifetimes.
    versions: std::sync::atomic::AtomicU64,
    /// Test hook: called with the chunk number before each lock hold of a write, so a test can
    /// interleave a `drop_node` deterministically.
    #[cfg(test)]
    before_chunk: Mutex<Option<ChunkHook>>,
}

/// See `ResidencyIndex::before_chunk`.
#[cfg(test)]
type ChunkHook = Arc<dyn Fn(usize) + Send + Sync>;

impl ResidencyIndex {
    /// An empty index.
    pub fn new(cfg: ResidencyConfig) -> Self {
        ResidencyIndex {
            cfg,
            map: DashMap::new(),
            nodes: DashMap::new(),
            versions: std::sync::atomic::AtomicU64::new(1),
            #[cfg(test)]
            before_chunk: Mutex::new(None),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &ResidencyConfig {
        &self.cfg
    }

    fn node_lru(&self, node: NodeId) -> Arc<Mutex<NodeLru>> {
        self.nodes
            .entry(node)
            .or_insert_with(|| {
                Arc::new(Mutex::new(NodeLru {
                    lru: LruCache::unbounded(),
                    capacity: self.cfg.capacity_per_node.max(1),
                    version: self.next_version(),
                    dropped: false,
                }))
            })
            .clone()
    }

    /// The node's LRU if it has one, cloned out so the `nodes` shard is not held while the LRU
    /// is locked.
    fn existing_lru(&self, node: NodeId) -> Option<Arc<Mutex<NodeLru>>> {
        self.nodes.get(&node).map(|l| l.clone())
    }

    #[cfg(test)]
    fn pause(&self, chunk: usize) {
        let hook = self.before_chunk.lock().clone();
        if let Some(h) = hook {
            h(chunk);
        }
    }

    #[cfg(not(test))]
    fn pause(&self, _chunk: usize) {}

    fn next_version(&self) -> u64 {
        self.versions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    fn remove_holder(&self, key: &Key, node: NodeId) {
        self.map.remove_if_mut(key, |_, holders| {
            holders.retain(|h| h.node != node);
            holders.is_empty()
        });
    }

    /// Records that `node` holds every digest of `chain` (a whole prefix), from `source`.
    /// An entry keeps the most trustworthy unexpired source and the latest expiry.
    pub fn record(&self, node: NodeId, chain: &[Digest], source: Source, now: Instant) {
        // Tail first, so that a chain's head ends up most recently used: it is what other
        // prompts share, and what an engine evicts last.
        self.record_keys(node, chain.iter().rev().map(Digest::short), source, now);
    }

    /// Records digests by their short form ([`Digest::short`]), in the given order (the last is
    /// most recently used): how residency learnt from a peer enters the index.
    pub fn record_keys(
        &self,
        node: NodeId,
        keys: impl IntoIterator<Item = u64>,
        source: Source,
        now: Instant,
    ) {
        let expires = now + self.cfg.ttl(source);
        let lru = self.node_lru(node);
        let mut keys = keys.into_iter();
        let mut chunk = Vec::with_capacity(LOCK_CHUNK);
        for n in 0.. {
            chunk.clear();
            chunk.extend(keys.by_ref().take(LOCK_CHUNK));
            if chunk.is_empty() {
                return;
            }
            self.pause(n);
            let mut lru = lru.lock();
            if lru.dropped {
                // The node was dropped since this write began: the write is ordered before the
                // drop, which removes what its earlier chunks wrote.
                return;
            }
            let mut changed = false;
            for &k in &chunk {
                changed |= lru.lru.put(k, ()).is_none();
                let mut holders = self.map.entry(k).or_default();
                match holders.iter_mut().find(|h| h.node == node) {
                    Some(h) => {
                        if h.expires <= now || source >= h.source {
                            h.source = source;
                        }
                        h.expires = h.expires.max(expires);
                    }
                    None => holders.push(Holder {
                        node,
                        source,
                        expires,
                    }),
                }
            }
            // Trimmed per chunk: this chunk's excess, and as much again of any excess left by a
            // shrinking bound ([`Self::confirm`] trims that in chunks too).
            changed |=
                Self::trim_at_most(&mut lru, 2 * LOCK_CHUNK, |d| self.remove_holder(&d, node));
            if changed {
                lru.version = self.next_version();
            }
        }
    }

    /// Forgets that `node` holds these digests (short form): a peer withdrew them.
    pub fn remove_keys(&self, node: NodeId, keys: impl IntoIterator<Item = u64>) {
        let Some(lru) = self.existing_lru(node) else {
            return;
        };
        let mut keys = keys.into_iter();
        let mut chunk = Vec::with_capacity(LOCK_CHUNK);
        loop {
            chunk.clear();
            chunk.extend(keys.by_ref().take(LOCK_CHUNK));
            if chunk.is_empty() {
                return;
            }
            let mut lru = lru.lock();
            if lru.dropped {
                return;
            }
            let mut changed = false;
            for k in &chunk {
                if lru.lru.pop(k).is_some() {
                    self.remove_holder(k, node);
                    changed = true;
                }
            }
            if changed {
                lru.version = self.next_version();
            }
        }
    }

    /// A number that changes whenever `node`'s set of digests changes (not on mere use), so a
    /// publisher can skip unchanged sets; `None` when the node has no entries.
    pub fn node_version(&self, node: NodeId) -> Option<u64> {
        let lru = self.existing_lru(node)?;
        let lru = lru.lock();
        (!lru.dropped).then_some(lru.version)
    }

    /// The digests (short form) the index holds for `node`, most recently used first, at most
    /// `limit`: what a sidecar publishes about its own engine.
    pub fn node_keys(&self, node: NodeId, limit: usize) -> Vec<u64> {
        let Some(lru) = self.existing_lru(node) else {
            return Vec::new();
        };
        let lru = lru.lock();
        if lru.dropped {
            return Vec::new();
        }
        lru.lru.iter().take(limit).map(|(k, ())| *k).collect()
    }

    /// Evicts down to the bound, at most `budget` keys; true when anything was evicted.
    fn trim_at_most(lru: &mut NodeLru, budget: usize, mut evict: impl FnMut(Key)) -> bool {
        let mut evicted = false;
        for _ in 0..budget {
            if lru.lru.len() <= lru.capacity {
                break;
            }
            match lru.lru.pop_lru() {
                Some((d, ())) => {
                    evict(d);
                    evicted = true;
                }
                None => break,
            }
        }
        evicted
    }

    /// For each node, how many leading digests of `chain` it holds (unexpired). Nodes holding
    /// none are absent. Stops at the first digest that no node continues.
    pub fn overlap(&self, chain: &[Digest], now: Instant) -> Vec<(NodeId, usize)> {
        let mut runs: Vec<(NodeId, usize)> = Vec::new();
        for (i, d) in chain.iter().enumerate() {
            let Some(holders) = self.map.get(&d.short()) else {
                break;
            };
            let mut extended = false;
            for h in holders.iter().filter(|h| h.expires > now) {
                if i == 0 {
                    runs.push((h.node, 1));
                    extended = true;
                } else if let Some(run) = runs.iter_mut().find(|r| r.0 == h.node && r.1 == i) {
                    run.1 += 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
        runs
    }

    /// An engine answered a request routed to `node` and reported (an estimate of) how many
    /// leading blocks of `chain` it already had cached; `predicted` is the overlap the index
    /// claimed at dispatch, and `settled` says whether the node had no other prefill in flight
    /// then (only then can a shortfall refute the index). The engine now holds the whole chain,
    /// so all of it is recorded as [`Source::Reported`]; the node's bound adapts (module docs).
    pub fn confirm(
        &self,
        node: NodeId,
        chain: &[Digest],
        predicted: usize,
        cached_blocks: usize,
        settled: bool,
        now: Instant,
    ) -> Verdict {
        // One block of slack: text-mode block counts are estimated from token counts.
        let verdict = match (cached_blocks + 1 < predicted, settled) {
            (false, _) => Verdict::Confirmed,
            (true, true) => Verdict::Refuted,
            (true, false) => Verdict::Inconclusive,
        };
        {
            let arc = self.node_lru(node);
            let mut lru = arc.lock();
            match verdict {
                _ if lru.dropped => {}
                Verdict::Refuted => {
                    let shrunk = lru.lru.len().min(lru.capacity) * 9 / 10;
                    lru.capacity = shrunk.max(self.cfg.min_capacity_per_node);
                    // Down to the new bound, a chunk per lock hold.
                    loop {
                        if Self::trim_at_most(&mut lru, LOCK_CHUNK, |d| {
                            self.remove_holder(&d, node)
                        }) {
                            lru.version = self.next_version();
                        }
                        if lru.lru.len() <= lru.capacity {
                            break;
                        }
                        drop(lru);
                        lru = arc.lock();
                        if lru.dropped {
                            break;
                        }
                    }
                }
                Verdict::Confirmed if lru.lru.len() >= lru.capacity => {
                    lru.capacity =
                        (lru.capacity + lru.capacity / 100 + 1).min(self.cfg.capacity_per_node);
                }
                Verdict::Confirmed | Verdict::Inconclusive => {}
            }
        }
        self.record(node, chain, Source::Reported, now);
        verdict
    }

    /// Drops every entry of `node` (it left, or its `kv_epoch` changed). A write to `node` that
    /// runs concurrently is ordered before the drop (none of it survives); one that starts after
    /// this returns starts a new set.
    pub fn drop_node(&self, node: NodeId) {
        let Some(arc) = self.existing_lru(node) else {
            return;
        };
        loop {
            let mut lru = arc.lock();
            // Marked first, under the lock: a write holding this set stops at its next chunk.
            lru.dropped = true;
            for _ in 0..LOCK_CHUNK {
                let Some((d, ())) = lru.lru.pop_lru() else {
                    break;
                };
                self.remove_holder(&d, node);
            }
            if lru.lru.is_empty() {
                break;
            }
        }
        // Unlisted only now that it is empty, and only this set: until here writes to `node`
        // found it (marked) rather than creating a new set the emptying could have raced with.
        self.nodes.remove_if(&node, |_, l| Arc::ptr_eq(l, &arc));
    }

    /// Removes expired entries, oldest first, at most `budget` per node; returns how many.
    pub fn sweep(&self, now: Instant, budget: usize) -> usize {
        let nodes: Vec<(NodeId, Arc<Mutex<NodeLru>>)> = self
            .nodes
            .iter()
            .map(|e| (*e.key(), e.value().clone()))
            .collect();
        let mut removed = 0;
        for (node, lru) in nodes {
            let mut lru = lru.lock();
            if lru.dropped {
                continue;
            }
            for _ in 0..budget {
                let Some((d, ())) = lru.lru.peek_lru() else {
                    break;
                };
                let d = *d;
                let expired = self
                    .map
                    .get(&d)
                    .and_then(|hs| hs.iter().find(|h| h.node == node).map(|h| h.expires <= now))
                    .unwrap_or(true);
                if !expired {
                    break;
                }
                lru.lru.pop_lru();
                self.remove_holder(&d, node);
                removed += 1;
                lru.version = self.next_version();
            }
        }
        removed
    }

    /// Entries (digest, node) by their current source. Walks the whole index: for metrics
    /// scrapes, not the request path.
    pub fn count_by_source(&self) -> [(Source, usize); 4] {
        let mut counts = [
            (Source::Optimistic, 0),
            (Source::Gossip, 0),
            (Source::Reported, 0),
            (Source::EngineFeed, 0),
        ];
        for entry in self.map.iter() {
            for h in entry.value() {
                if let Some(c) = counts.iter_mut().find(|c| c.0 == h.source) {
                    c.1 += 1;
                }
            }
        }
        counts
    }

    /// Nodes that have entries in the index.
    pub fn nodes(&self) -> Vec<NodeId> {
        self.nodes.iter().map(|e| *e.key()).collect()
    }

    /// Number of distinct digests in the index.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Number of digests `node` holds in the index, and its current (adaptive) bound.
    pub fn node_usage(&self, node: NodeId) -> (usize, usize) {
        self.existing_lru(node)
            .map(|l| {
                let l = l.lock();
                (l.lru.len(), l.capacity)
            })
            .unwrap_or((0, self.cfg.capacity_per_node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{text_chain, Namespace};

    fn chain(text: &[u8]) -> Vec<Digest> {
        text_chain(&Namespace::new("m", b""), text, 4)
    }

    fn index(cap: usize) -> ResidencyIndex {
        ResidencyIndex::new(ResidencyConfig {
            capacity_per_node: cap,
            min_capacity_per_node: 2,
            ..Default::default()
        })
    }

    #[test]
    fn overlap_counts_leading_blocks_per_node() {
        let idx = index(100);
        let now = Instant::now();
        idx.record(NodeId(1), &chain(b"aaaabbbbcccc"), Source::Optimistic, now);
        idx.record(NodeId(2), &chain(b"aaaabbbb"), Source::Optimistic, now);
        let mut o = idx.overlap(&chain(b"aaaabbbbccccdddd"), now);
        o.sort();
        assert_eq!(o, vec![(NodeId(1), 3), (NodeId(2), 2)]);
        assert!(idx.overlap(&chain(b"xxxxbbbb"), now).is_empty());
    }

    #[test]
    fn ttl_expires_entries_and_sweep_removes_them() {
        let idx = index(100);
        let now = Instant::now();
        idx.record(NodeId(1), &chain(b"aaaabbbb"), Source::Optimistic, now);
        let later = now + idx.config().optimistic_ttl + Duration::from_millis(1);
        assert!(idx.overlap(&chain(b"aaaa"), later).is_empty());
        assert_eq!(idx.sweep(later, 100), 2);
        assert!(idx.is_empty());
    }

    #[test]
    fn reported_outlives_optimistic() {
        let idx = index(100);
        let now = Instant::now();
        idx.record(NodeId(1), &chain(b"aaaa"), Source::Reported, now);
        idx.record(NodeId(1), &chain(b"aaaa"), Source::Optimistic, now);
        let later = now + idx.config().optimistic_ttl + Duration::from_secs(1);
        assert_eq!(idx.overlap(&chain(b"aaaa"), later), vec![(NodeId(1), 1)]);
    }

    #[test]
    fn per_node_lru_bound_evicts_oldest() {
        let idx = index(3);
        let now = Instant::now();
        idx.record(NodeId(1), &chain(b"aaaabbbb"), Source::Optimistic, now);
        idx.record(NodeId(1), &chain(b"ccccdddd"), Source::Optimistic, now);
        assert_eq!(idx.node_usage(NodeId(1)).0, 3);
        // The oldest chain lost its tail block first; its head survives.
        assert_eq!(idx.overlap(&chain(b"aaaabbbb"), now), vec![(NodeId(1), 1)]);
        assert_eq!(idx.overlap(&chain(b"ccccdddd"), now), vec![(NodeId(1), 2)]);
        assert_eq!(idx.len(), 3);
    }

    #[test]
    fn keys_learnt_by_gossip_match_chains_and_can_be_withdrawn() {
        let idx = index(100);
        let now = Instant::now();
        let c = chain(b"aaaabbbbcccc");
        idx.record(NodeId(1), &c, Source::Reported, now);
        // What node 1's proxy would publish, learnt by another proxy for its node 7.
        let published = idx.node_keys(NodeId(1), 10);
        assert_eq!(published.len(), 3);
        assert_eq!(
            published[0],
            c[0].short(),
            "the chain's head is most recent"
        );
        let other = index(100);
        other.record_keys(
            NodeId(7),
            published.iter().rev().copied(),
            Source::Gossip,
            now,
        );
        assert_eq!(other.overlap(&c, now), vec![(NodeId(7), 3)]);
        other.remove_keys(NodeId(7), [c[1].short()]);
        assert_eq!(other.overlap(&c, now), vec![(NodeId(7), 1)]);
        assert_eq!(idx.node_keys(NodeId(1), 2).len(), 2, "limit applies");
        // The set's version moves on adds and removals, not on re-recording the same chain.
        let v = idx.node_version(NodeId(1));
        idx.record(NodeId(1), &c, Source::Reported, now);
        assert_eq!(idx.node_version(NodeId(1)), v);
        idx.remove_keys(NodeId(1), [c[2].short()]);
        assert_ne!(idx.node_version(NodeId(1)), v);
        assert_eq!(idx.node_version(NodeId(9)), None);
    }

    #[test]
    fn drop_node_removes_only_that_node() {
        let idx = index(100);
        let now = Instant::now();
        idx.record(NodeId(1), &chain(b"aaaa"), Source::Optimistic, now);
        idx.record(NodeId(2), &chain(b"aaaa"), Source::Optimistic, now);
        idx.drop_node(NodeId(1));
        assert_eq!(idx.overlap(&chain(b"aaaa"), now), vec![(NodeId(2), 1)]);
    }

    /// Sets the hook run before each lock hold of a write (chunk number as argument).
    fn on_chunk(
        idx: &Arc<ResidencyIndex>,
        f: impl Fn(&ResidencyIndex, usize) + Send + Sync + 'static,
    ) {
        let weak = Arc::downgrade(idx);
        *idx.before_chunk.lock() = Some(Arc::new(move |n| {
            if let Some(idx) = weak.upgrade() {
                f(&idx, n);
            }
        }));
    }

    /// Every holder in the map belongs to a listed node and is in that node's LRU, and back.
    fn assert_consistent(idx: &ResidencyIndex) {
        let listed: usize = idx.nodes().into_iter().map(|n| idx.node_usage(n).0).sum();
        let holders: usize = idx.count_by_source().iter().map(|c| c.1).sum();
        assert_eq!(
            holders, listed,
            "map holders vs. LRU entries of listed nodes"
        );
        for e in idx.map.iter() {
            for h in e.value() {
                let keys = idx.node_keys(h.node, usize::MAX);
                assert!(
                    keys.contains(e.key()),
                    "entry for node {:?} outside its set",
                    h.node
                );
            }
        }
    }

    #[test]
    fn a_record_racing_drop_node_leaves_nothing_behind() {
        // The record has found the node's set but not locked it yet when the node is dropped.
        let idx = Arc::new(index(100));
        let now = Instant::now();
        idx.record(NodeId(1), &chain(b"aaaa"), Source::Optimistic, now);
        on_chunk(&idx, |idx, n| {
            if n == 0 {
                idx.drop_node(NodeId(1));
            }
        });
        idx.record(NodeId(1), &chain(b"bbbbcccc"), Source::Optimistic, now);
        assert!(
            idx.is_empty(),
            "{} digests left for a dropped node",
            idx.len()
        );
        assert!(idx.nodes().is_empty());
        assert_eq!(idx.count_by_source().iter().map(|c| c.1).sum::<usize>(), 0);
        assert_consistent(&idx);
        // A record after the drop starts a new set.
        *idx.before_chunk.lock() = None;
        idx.record(NodeId(1), &chain(b"bbbb"), Source::Optimistic, now);
        assert_eq!(idx.overlap(&chain(b"bbbb"), now), vec![(NodeId(1), 1)]);
        assert_consistent(&idx);
    }

    #[test]
    fn a_drop_between_chunks_of_a_long_record_leaves_nothing_behind() {
        let idx = Arc::new(index(100_000));
        let now = Instant::now();
        on_chunk(&idx, |idx, n| {
            if n == 2 {
                idx.drop_node(NodeId(3));
            }
        });
        idx.record_keys(NodeId(3), 0..(5 * LOCK_CHUNK as u64), Source::Gossip, now);
        assert!(
            idx.is_empty(),
            "{} digests left for a dropped node",
            idx.len()
        );
        assert_eq!(idx.node_usage(NodeId(3)).0, 0);
        assert_eq!(idx.node_version(NodeId(3)), None);
        assert_consistent(&idx);
    }

    #[test]
    fn a_long_record_releases_the_lock_between_chunks_and_keeps_lru_semantics() {
        let idx = Arc::new(index(1500));
        let now = Instant::now();
        idx.record_keys(NodeId(1), [u64::MAX], Source::Gossip, now);
        let holds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = holds.clone();
        on_chunk(&idx, move |idx, n| {
            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // The lock is free between chunks: other writers and readers of the set get in.
            let lru = idx.existing_lru(NodeId(1)).expect("node listed");
            assert!(lru.try_lock().is_some(), "lock held across chunk {n}");
            assert!(idx.node_keys(NodeId(1), 1).len() == 1);
        });
        let n = 131_072u64;
        idx.record_keys(NodeId(1), 0..n, Source::Gossip, now);
        assert_eq!(
            holds.load(std::sync::atomic::Ordering::Relaxed),
            (n as usize).div_ceil(LOCK_CHUNK)
        );
        // The same result as one big hold: the 1500 most recent keys, most recent first.
        let want: Vec<u64> = (n - 1500..n).rev().collect();
        assert_eq!(idx.node_keys(NodeId(1), usize::MAX), want);
        assert_eq!(idx.len(), 1500);
        assert_consistent(&idx);
    }

    #[test]
    fn concurrent_records_and_drops_never_leak_entries() {
        let idx = Arc::new(index(10_000));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for t in 0..2u64 {
            let idx = idx.clone();
            writers.push(std::thread::spawn(move || {
                let now = Instant::now();
                for i in 0..3000u64 {
                    let node = NodeId((i % 3) as u32);
                    let base = (t << 40) | (i << 8);
                    idx.record_keys(node, base..base + 40, Source::Gossip, now);
                }
            }));
        }
        let dropper = {
            let (idx, stop) = (idx.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    idx.drop_node(NodeId(i % 3));
                    i = i.wrapping_add(1);
                    std::thread::yield_now();
                }
            })
        };
        for w in writers {
            w.join().expect("writer");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        dropper.join().expect("dropper");
        assert_consistent(&idx);
        for n in 0..3 {
            idx.drop_node(NodeId(n));
        }
        assert!(idx.is_empty(), "{} digests leaked", idx.len());
    }

    #[test]
    fn refutation_shrinks_and_confirmation_grows_the_bound() {
        let idx = index(100);
        let now = Instant::now();
        let c = chain(&[b'a'; 4 * 50]);
        idx.record(NodeId(1), &c, Source::Optimistic, now);
        assert_eq!(
            idx.confirm(NodeId(1), &c, 50, 10, false, now),
            Verdict::Inconclusive
        );
        assert_eq!(
            idx.node_usage(NodeId(1)).1,
            100,
            "an unsettled prediction proves nothing"
        );
        assert_eq!(
            idx.confirm(NodeId(1), &c, 50, 10, true, now),
            Verdict::Refuted
        );
        let (_, cap) = idx.node_usage(NodeId(1));
        assert_eq!(cap, 45);
        assert_eq!(
            idx.confirm(NodeId(1), &c[..40], 40, 40, true, now),
            Verdict::Confirmed
        );
        assert!(idx.node_usage(NodeId(1)).1 > 45);
    }
}
