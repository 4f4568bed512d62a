//! The tiered block store: a RAM tier with watermarks that spills its least recently used blocks
//! to the SSD tier ([`crate::disk`]), which has its own capacity and TTL. A read from SSD
//! promotes the block back to RAM. Tiers are exclusive: a block is in one of them.
//!
//! Concurrency: one short `parking_lot` lock guards both tier indexes (no I/O under it). Every
//! file-system mutation (spill writes, unlinks) happens in [`BlockStore::maintain`], which one
//! async mutex serialises; requests queue unlinks instead of doing them. So a spill's write and
//! an unlink of the same file never race. SSD reads happen outside both locks and tolerate a
//! file vanishing underneath them (a miss).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvmesh_filters::chain::Digest;
use lru::LruCache;
use parking_lot::Mutex;
use tokio::sync::{broadcast, Notify};

use crate::config::AgentConfig;
use crate::disk::{self, BlockDir, DiskError};
use crate::metrics::Metrics;

/// Which tier holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// In memory.
    Ram,
    /// In the block directory.
    Ssd,
}

/// A block as clients see it.
#[derive(Debug, Clone)]
pub struct Block {
    /// Prefix-chain digest naming the block.
    pub digest: Digest,
    /// Model (namespace) of the block.
    pub model: Arc<str>,
    /// Tokens covered.
    pub token_count: u32,
    /// Opaque payload.
    pub payload: Bytes,
}

impl Block {
    /// What this block counts against the RAM tier's capacity: see [`ram_charge`].
    pub fn ram_charge(&self) -> u64 {
        ram_charge(self.model.len(), self.payload.len() as u64)
    }
}

/// Bytes every block in RAM is charged on top of its payload and model name: its LRU node
/// (digest, links and the block record, about 120 bytes), its hash-table slot (17 bytes, up to
/// twice that just after the table grows), and the allocation headers of the model name and the
/// payload (the allocator's own rounding included). A unit test holds it above the sizes of those
/// structures. It is what keeps a flood of empty blocks bounded: `ram.capacity_bytes / 256`
/// blocks at most.
pub const RAM_BLOCK_OVERHEAD_BYTES: u64 = 256;

/// The SSD tier charges each block its file's length rounded up to this many bytes (a file-system
/// block: a file of 1 byte still occupies 4 KiB on ext4 or xfs), so it holds at most
/// `ssd.capacity_bytes / 4096` blocks.
pub const SSD_ALLOCATION_UNIT_BYTES: u64 = 4096;

/// What a block with a `model_len`-byte model name and a `payload_len`-byte payload counts against
/// the RAM tier's capacity: payload + model name + [`RAM_BLOCK_OVERHEAD_BYTES`].
pub fn ram_charge(model_len: usize, payload_len: u64) -> u64 {
    payload_len
        .saturating_add(model_len as u64)
        .saturating_add(RAM_BLOCK_OVERHEAD_BYTES)
}

/// What such a block counts against the SSD tier's capacity: its file's length (header, model
/// name, payload, checksum) rounded up to [`SSD_ALLOCATION_UNIT_BYTES`].
pub fn ssd_charge(model_len: usize, payload_len: u64) -> u64 {
    disk::file_len(model_len, payload_len)
        .div_ceil(SSD_ALLOCATION_UNIT_BYTES)
        .saturating_mul(SSD_ALLOCATION_UNIT_BYTES)
}

/// What [`BlockStore::lookup`] reports for a stored digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The tier.
    pub tier: Tier,
    /// Payload bytes.
    pub size: u64,
    /// Tokens covered.
    pub token_count: u32,
    /// Milliseconds since the Unix epoch of the last put or read.
    pub last_access_unix_ms: u64,
}

/// One change of the node's resident set, broadcast to `WatchResidency` subscribers.
#[derive(Debug, Clone, Default)]
pub struct ResidencyChange {
    /// The epoch the change belongs to.
    pub epoch: u64,
    /// The resident set was replaced wholesale (`added` is then the new set).
    pub reset: bool,
    /// Digests that became resident.
    pub added: Vec<Digest>,
    /// Digests that are no longer resident.
    pub removed: Vec<Digest>,
}

/// Errors a request can get from the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request is malformed or over a bound.
    #[error("{0}")]
    Invalid(String),
}

/// Sizes the store works with, in charged bytes ([`ram_charge`], [`ssd_charge`]).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// RAM tier capacity.
    pub ram_capacity: u64,
    /// Spill starts above this.
    pub ram_high: u64,
    /// Spill stops at this.
    pub ram_low: u64,
    /// SSD tier capacity (0: no SSD tier).
    pub ssd_capacity: u64,
    /// SSD time to live since the last write or read.
    pub ssd_ttl: Duration,
    /// Largest block payload.
    pub max_block_bytes: u64,
}

impl StoreConfig {
    /// Derives the store's sizes from the agent configuration.
    pub fn from_agent(cfg: &AgentConfig) -> Self {
        let cap = cfg.ram.capacity_bytes;
        StoreConfig {
            ram_capacity: cap,
            ram_high: (cap as f64 * cfg.ram.high_watermark) as u64,
            ram_low: (cap as f64 * cfg.ram.low_watermark) as u64,
            ssd_capacity: cfg.ssd.capacity_bytes,
            ssd_ttl: cfg.ssd.ttl(),
            max_block_bytes: cfg.limits.max_block_bytes,
        }
    }
}

#[derive(Clone)]
struct RamBlock {
    model: Arc<str>,
    token_count: u32,
    payload: Bytes,
    last_access_ms: u64,
    /// Changes on every put, so a spill can tell whether the block it wrote is still current.
    generation: u64,
}

impl RamBlock {
    fn charge(&self) -> u64 {
        ram_charge(self.model.len(), self.payload.len() as u64)
    }
}

struct SsdBlock {
    token_count: u32,
    /// Payload bytes.
    size: u64,
    /// What the block counts against the SSD capacity ([`ssd_charge`]).
    charge: u64,
    last_access_ms: u64,
}

/// Digests are hashed with foldhash (fast, seeded per process) rather than SipHash: a lookup of
/// 1,000 digests is two hash probes each, on the `Lookup` RPC's latency path.
type DigestMap<V> = LruCache<Digest, V, foldhash::fast::RandomState>;

struct State {
    epoch: u64,
    ram: DigestMap<RamBlock>,
    /// Sum of the RAM blocks' [`ram_charge`].
    ram_bytes: u64,
    ssd: DigestMap<SsdBlock>,
    /// Sum of the SSD blocks' [`ssd_charge`].
    ssd_bytes: u64,
    /// Block files to delete in the next maintenance pass.
    unlink: Vec<Digest>,
    next_generation: u64,
}

impl State {
    /// Takes the least recently used SSD blocks out of the index until the tier is within
    /// `capacity`; returns their digests (their files are the caller's to delete).
    fn pop_ssd_over(&mut self, capacity: u64) -> Vec<Digest> {
        let mut over = Vec::new();
        while self.ssd_bytes > capacity {
            let Some((d, old)) = self.ssd.pop_lru() else {
                break;
            };
            self.ssd_bytes = self.ssd_bytes.saturating_sub(old.charge);
            over.push(d);
        }
        over
    }
}

/// Spill batches: enough blocks per directory fsync to amortise it, few enough to keep the
/// lock hold and the memory of one batch small.
const SPILL_BATCH_BLOCKS: usize = 256;
const SPILL_BATCH_BYTES: u64 = 64 << 20;

/// The store. Cheap to share behind an `Arc`.
pub struct BlockStore {
    cfg: StoreConfig,
    disk: Option<BlockDir>,
    state: Mutex<State>,
    maintenance: tokio::sync::Mutex<()>,
    wake: Notify,
    events: broadcast::Sender<Arc<ResidencyChange>>,
    /// Counters and gauges (shared with `/metrics`).
    pub metrics: Arc<Metrics>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn new_epoch() -> u64 {
    // Random, so a restarted agent never reuses an epoch its watchers saw before.
    fastrand::u64(1..i64::MAX as u64)
}

impl BlockStore {
    /// Opens the store: the SSD directory is scanned and its blocks indexed (oldest first in LRU
    /// order); corrupt files are dropped and counted. A new epoch starts.
    pub fn open(
        cfg: StoreConfig,
        ssd_dir: Option<(&std::path::Path, bool)>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Self>, DiskError> {
        let mut state = State {
            epoch: new_epoch(),
            ram: LruCache::unbounded_with_hasher(Default::default()),
            ram_bytes: 0,
            ssd: LruCache::unbounded_with_hasher(Default::default()),
            ssd_bytes: 0,
            unlink: Vec::new(),
            next_generation: 0,
        };
        let disk = match ssd_dir {
            Some((root, fsync)) if cfg.ssd_capacity > 0 => {
                let dir = BlockDir::open(root, fsync, cfg.max_block_bytes)?;
                let mut scan = dir.scan()?;
                scan.blocks.sort_by_key(|b| b.modified);
                for b in scan.blocks {
                    let last = b
                        .modified
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or(0);
                    let charge = ssd_charge(b.model.len(), b.size);
                    state.ssd_bytes = state.ssd_bytes.saturating_add(charge);
                    state.ssd.put(
                        b.digest,
                        SsdBlock {
                            token_count: b.token_count,
                            size: b.size,
                            charge,
                            last_access_ms: last,
                        },
                    );
                }
                // A smaller `ssd.capacity_bytes` than the last run's: the oldest go now, not
                // at the first spill (which a store with room in RAM may never make).
                let over = state.pop_ssd_over(cfg.ssd_capacity);
                for d in &over {
                    if let Err(e) = dir.remove(d) {
                        tracing::warn!(error = %e, "cannot remove a block over the SSD capacity");
                    }
                }
                metrics
                    .evicted
                    .with_label_values(&["ssd"])
                    .inc_by(over.len() as u64);
                metrics.corrupt_dropped.inc_by(scan.corrupt_dropped);
                tracing::info!(
                    blocks = state.ssd.len(),
                    bytes = state.ssd_bytes,
                    corrupt_dropped = scan.corrupt_dropped,
                    temp_removed = scan.temp_removed,
                    dir = %root.display(),
                    "SSD tier indexed"
                );
                Some(dir)
            }
            _ => None,
        };
        metrics
            .capacity_bytes
            .with_label_values(&["ram"])
            .set(cfg.ram_capacity as i64);
        metrics
            .capacity_bytes
            .with_label_values(&["ssd"])
            .set(cfg.ssd_capacity as i64);
        let (events, _) = broadcast::channel(1024);
        let store = Arc::new(BlockStore {
            cfg,
            disk,
            state: Mutex::new(state),
            maintenance: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            events,
            metrics,
        });
        store.sync_gauges(&store.state.lock());
        Ok(store)
    }

    /// The store's sizes.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    fn sync_gauges(&self, st: &State) {
        let m = &self.metrics;
        m.blocks
            .with_label_values(&["ram"])
            .set(st.ram.len() as i64);
        m.blocks
            .with_label_values(&["ssd"])
            .set(st.ssd.len() as i64);
        m.bytes.with_label_values(&["ram"]).set(st.ram_bytes as i64);
        m.bytes.with_label_values(&["ssd"]).set(st.ssd_bytes as i64);
        m.kv_epoch.set(st.epoch as i64);
    }

    fn publish(&self, st: &State, added: Vec<Digest>, removed: Vec<Digest>) {
        self.sync_gauges(st);
        if added.is_empty() && removed.is_empty() {
            return;
        }
        // No subscriber is not an error.
        let _ = self.events.send(Arc::new(ResidencyChange {
            epoch: st.epoch,
            reset: false,
            added,
            removed,
        }));
    }

    fn is_live(&self, last_access_ms: u64, now: u64) -> bool {
        now.saturating_sub(last_access_ms) <= self.cfg.ssd_ttl.as_millis() as u64
    }

    /// Stores blocks in RAM, waiting for a spill first when they would not fit under the RAM
    /// capacity (blocks are charged [`ram_charge`]). A digest given twice is stored once, with
    /// its last copy. Returns the number of blocks given and the epoch.
    pub async fn put(self: &Arc<Self>, blocks: Vec<Block>) -> Result<(u32, u64), StoreError> {
        if let Some(b) = blocks
            .iter()
            .find(|b| b.payload.len() as u64 > self.cfg.max_block_bytes)
        {
            return Err(StoreError::Invalid(format!(
                "block {} has {} payload bytes; the limit is {}",
                b.digest.to_hex(),
                b.payload.len(),
                self.cfg.max_block_bytes
            )));
        }
        let count = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        // Each digest once: a repeated digest would otherwise have its old copy counted as freed
        // once per repetition, and the batch would be admitted past the capacity.
        let blocks = last_of_each(blocks);
        let need = blocks
            .iter()
            .map(Block::ram_charge)
            .fold(0u64, u64::saturating_add);
        if need > self.cfg.ram_capacity {
            return Err(StoreError::Invalid(format!(
                "batch of {} blocks is charged {need} bytes (payloads + model names + \
                 {RAM_BLOCK_OVERHEAD_BYTES} per block), more than the RAM tier's capacity ({})",
                blocks.len(),
                self.cfg.ram_capacity
            )));
        }
        let mut blocks = Some(blocks);
        loop {
            {
                let mut st = self.state.lock();
                // Replaced blocks free their charge, so count only what is new.
                let freed = blocks
                    .iter()
                    .flatten()
                    .filter_map(|b| st.ram.peek(&b.digest).map(RamBlock::charge))
                    .fold(0u64, u64::saturating_add);
                if st.ram_bytes.saturating_sub(freed).saturating_add(need) <= self.cfg.ram_capacity
                {
                    let epoch = st.epoch;
                    self.insert_locked(&mut st, blocks.take().into_iter().flatten());
                    if st.ram_bytes > self.cfg.ram_high {
                        self.wake.notify_one();
                    }
                    return Ok((count, epoch));
                }
            }
            let target = self
                .cfg
                .ram_low
                .min(self.cfg.ram_capacity.saturating_sub(need));
            self.maintain(target).await;
        }
    }

    fn insert_locked(&self, st: &mut State, blocks: impl Iterator<Item = Block>) {
        let now = now_ms();
        let mut added = Vec::new();
        for b in blocks {
            let size = b.payload.len() as u64;
            let charge = b.ram_charge();
            self.metrics.put_blocks.inc();
            self.metrics.put_bytes.inc_by(size);
            st.next_generation += 1;
            let generation = st.next_generation;
            let fresh = RamBlock {
                model: b.model,
                token_count: b.token_count,
                payload: b.payload,
                last_access_ms: now,
                generation,
            };
            let mut was_resident = false;
            if let Some(old) = st.ram.put(b.digest, fresh) {
                st.ram_bytes = st.ram_bytes.saturating_sub(old.charge());
                was_resident = true;
            }
            if let Some(old) = st.ssd.pop(&b.digest) {
                st.ssd_bytes = st.ssd_bytes.saturating_sub(old.charge);
                st.unlink.push(b.digest);
                was_resident = true;
            }
            st.ram_bytes = st.ram_bytes.saturating_add(charge);
            if !was_resident {
                added.push(b.digest);
            }
        }
        self.publish(st, added, Vec::new());
    }

    /// Reads one block: from RAM, or from SSD (verifying its checksum and promoting it to RAM when
    /// it fits under the RAM capacity). `None` when absent, expired or corrupt.
    pub async fn get(self: &Arc<Self>, digest: Digest) -> Option<(Block, Tier)> {
        let now = now_ms();
        {
            let mut st = self.state.lock();
            if let Some(b) = st.ram.get_mut(&digest) {
                b.last_access_ms = now;
                let block = Block {
                    digest,
                    model: b.model.clone(),
                    token_count: b.token_count,
                    payload: b.payload.clone(),
                };
                self.metrics.hits.with_label_values(&["ram"]).inc();
                return Some((block, Tier::Ram));
            }
            match st.ssd.peek(&digest).map(|s| s.last_access_ms) {
                None => {
                    self.metrics.misses.inc();
                    return None;
                }
                Some(last) if !self.is_live(last, now) => {
                    self.drop_ssd_locked(&mut st, &digest);
                    self.metrics.expired.inc();
                    self.metrics.misses.inc();
                    return None;
                }
                Some(_) => {}
            }
        }
        let dir = self.disk.clone()?;
        let read = tokio::task::spawn_blocking(move || dir.read(&digest)).await;
        if let Ok(Ok(Some(disk))) = &read {
            // Make room so the read can promote (a put would wait the same way).
            let need = ram_charge(disk.model.len(), disk.payload.len() as u64);
            let full = self.state.lock().ram_bytes.saturating_add(need) > self.cfg.ram_capacity;
            if full {
                let target = self
                    .cfg
                    .ram_low
                    .min(self.cfg.ram_capacity.saturating_sub(need));
                self.maintain(target).await;
            }
        }
        let mut st = self.state.lock();
        match read {
            Ok(Ok(Some(disk))) => {
                let size = disk.payload.len() as u64;
                let charge = ram_charge(disk.model.len(), size);
                let model: Arc<str> = disk.model.into();
                let block = Block {
                    digest,
                    model: model.clone(),
                    token_count: disk.token_count,
                    payload: disk.payload,
                };
                self.metrics.hits.with_label_values(&["ssd"]).inc();
                let in_ssd = st.ssd.peek(&digest).is_some();
                let fits = st.ram_bytes.saturating_add(charge) <= self.cfg.ram_capacity;
                if in_ssd && fits && !st.ram.contains(&digest) {
                    if let Some(old) = st.ssd.pop(&digest) {
                        st.ssd_bytes = st.ssd_bytes.saturating_sub(old.charge);
                    }
                    st.unlink.push(digest);
                    st.next_generation += 1;
                    let generation = st.next_generation;
                    st.ram.put(
                        digest,
                        RamBlock {
                            model,
                            token_count: block.token_count,
                            payload: block.payload.clone(),
                            last_access_ms: now,
                            generation,
                        },
                    );
                    st.ram_bytes = st.ram_bytes.saturating_add(charge);
                    self.metrics.promoted_blocks.inc();
                    self.metrics.promoted_bytes.inc_by(size);
                    self.sync_gauges(&st);
                    self.wake.notify_one();
                } else if let Some(s) = st.ssd.get_mut(&digest) {
                    s.last_access_ms = now;
                }
                Some((block, Tier::Ssd))
            }
            Ok(Ok(None)) => {
                // Removed by maintenance while we read; the index entry (if any) is stale.
                if st.ssd.peek(&digest).is_some() {
                    self.drop_ssd_locked(&mut st, &digest);
                }
                self.metrics.misses.inc();
                None
            }
            Ok(Err(DiskError::Corrupt { path, why })) => {
                tracing::warn!(path = %path.display(), why, "dropping corrupt block file");
                self.drop_ssd_locked(&mut st, &digest);
                self.metrics.corrupt_dropped.inc();
                self.metrics.misses.inc();
                None
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "reading a block file failed");
                self.metrics.disk_errors.inc();
                self.metrics.misses.inc();
                None
            }
            Err(e) => {
                tracing::error!(error = %e, "block read task failed");
                self.metrics.misses.inc();
                None
            }
        }
    }

    fn drop_ssd_locked(&self, st: &mut State, digest: &Digest) {
        if let Some(old) = st.ssd.pop(digest) {
            st.ssd_bytes = st.ssd_bytes.saturating_sub(old.charge);
            st.unlink.push(*digest);
            self.publish(st, Vec::new(), vec![*digest]);
            self.wake.notify_one();
        }
    }

    /// Where each digest is, without touching LRU order or reading payloads.
    pub fn lookup(&self, digests: &[Digest]) -> Vec<Option<Location>> {
        let now = now_ms();
        let st = self.state.lock();
        digests
            .iter()
            .map(|d| {
                if let Some(b) = st.ram.peek(d) {
                    return Some(Location {
                        tier: Tier::Ram,
                        size: b.payload.len() as u64,
                        token_count: b.token_count,
                        last_access_unix_ms: b.last_access_ms,
                    });
                }
                st.ssd
                    .peek(d)
                    .filter(|s| self.is_live(s.last_access_ms, now))
                    .map(|s| Location {
                        tier: Tier::Ssd,
                        size: s.size,
                        token_count: s.token_count,
                        last_access_unix_ms: s.last_access_ms,
                    })
            })
            .collect()
    }

    /// Deletes the listed digests, or everything (which starts a new epoch). Block files are
    /// removed before this returns. Returns the number deleted and the epoch.
    pub async fn delete(self: &Arc<Self>, digests: &[Digest], all: bool) -> (u32, u64) {
        let (deleted, epoch) = {
            let mut st = self.state.lock();
            if all {
                let n = st.ram.len() + st.ssd.len();
                let files: Vec<Digest> = st.ssd.iter().map(|(d, _)| *d).collect();
                st.unlink.extend(files);
                st.ram.clear();
                st.ssd.clear();
                st.ram_bytes = 0;
                st.ssd_bytes = 0;
                st.epoch = new_epoch();
                self.sync_gauges(&st);
                let _ = self.events.send(Arc::new(ResidencyChange {
                    epoch: st.epoch,
                    reset: true,
                    ..Default::default()
                }));
                (u32::try_from(n).unwrap_or(u32::MAX), st.epoch)
            } else {
                let mut removed = Vec::new();
                for d in digests {
                    if let Some(old) = st.ram.pop(d) {
                        st.ram_bytes = st.ram_bytes.saturating_sub(old.charge());
                        removed.push(*d);
                    }
                    if let Some(old) = st.ssd.pop(d) {
                        st.ssd_bytes = st.ssd_bytes.saturating_sub(old.charge);
                        st.unlink.push(*d);
                        removed.push(*d);
                    }
                }
                removed.dedup();
                let n = u32::try_from(removed.len()).unwrap_or(u32::MAX);
                self.publish(&st, Vec::new(), removed);
                (n, st.epoch)
            }
        };
        let target = self.cfg.ram_capacity;
        self.maintain(target).await;
        (deleted, epoch)
    }

    /// Subscribes to residency changes and returns the current resident set with it, taken under
    /// the same lock so no change falls between the snapshot and the first event.
    pub fn subscribe(&self) -> (broadcast::Receiver<Arc<ResidencyChange>>, ResidencyChange) {
        let now = now_ms();
        let st = self.state.lock();
        let rx = self.events.subscribe();
        let mut added: Vec<Digest> = st.ram.iter().map(|(d, _)| *d).collect();
        added.extend(
            st.ssd
                .iter()
                .filter(|(_, s)| self.is_live(s.last_access_ms, now))
                .map(|(d, _)| *d),
        );
        let snapshot = ResidencyChange {
            epoch: st.epoch,
            reset: true,
            added,
            removed: Vec::new(),
        };
        (rx, snapshot)
    }

    /// Occupancy now: (ram blocks, ram bytes, ssd blocks, ssd bytes).
    pub fn occupancy(&self) -> (u64, u64, u64, u64) {
        let st = self.state.lock();
        (
            st.ram.len() as u64,
            st.ram_bytes,
            st.ssd.len() as u64,
            st.ssd_bytes,
        )
    }

    /// One maintenance pass, serialised with every other: delete queued files, spill RAM down to
    /// `ram_target` bytes, hold the SSD tier to its capacity.
    ///
    /// The pass runs on a task of its own and always to its end, whether or not the caller
    /// still waits: a gRPC handler that waits here is dropped when its client gives up, and a
    /// pass dropped between writing a batch of block files and indexing them would leave files
    /// that no index holds (never deleted, over the SSD capacity, served again after a
    /// restart).
    pub async fn maintain(self: &Arc<Self>, ram_target: u64) {
        let store = Arc::clone(self);
        if let Err(e) = tokio::spawn(async move { store.maintain_pass(ram_target).await }).await {
            // A panic is a bug: it reaches the caller as it did when the pass ran inline.
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }

    async fn maintain_pass(&self, ram_target: u64) {
        let _only_one = self.maintenance.lock().await;
        self.drain_unlinks().await;
        loop {
            let victims = {
                let st = self.state.lock();
                if st.ram_bytes <= ram_target {
                    break;
                }
                let excess = st.ram_bytes - ram_target;
                let mut picked = Vec::new();
                let mut bytes = 0u64;
                for (d, b) in st.ram.iter().rev() {
                    if bytes >= excess
                        || picked.len() >= SPILL_BATCH_BLOCKS
                        || bytes >= SPILL_BATCH_BYTES
                    {
                        break;
                    }
                    bytes = bytes.saturating_add(b.charge());
                    picked.push((*d, b.clone()));
                }
                picked
            };
            if victims.is_empty() {
                break;
            }
            let written = match self.disk.clone() {
                None => vec![false; victims.len()],
                Some(dir) => {
                    let batch: Vec<(Digest, Arc<str>, u32, Bytes)> = victims
                        .iter()
                        .map(|(d, b)| (*d, b.model.clone(), b.token_count, b.payload.clone()))
                        .collect();
                    let metrics = self.metrics.clone();
                    tokio::task::spawn_blocking(move || write_batch(&dir, &batch, &metrics))
                        .await
                        .unwrap_or_else(|_| vec![false; victims.len()])
                }
            };
            self.settle_spill(victims, written);
            self.drain_unlinks().await;
        }
    }

    /// Moves the spilled blocks that are still current from the RAM index to the SSD index, then
    /// holds the SSD tier to its capacity.
    fn settle_spill(&self, victims: Vec<(Digest, RamBlock)>, written: Vec<bool>) {
        let mut st = self.state.lock();
        let mut removed = Vec::new();
        {
            for ((d, b), ok) in victims.into_iter().zip(written) {
                let current = st.ram.peek(&d).map(|r| r.generation) == Some(b.generation);
                if !current {
                    // Replaced or deleted while we wrote it: the file is stale.
                    if ok {
                        st.unlink.push(d);
                    }
                    continue;
                }
                st.ram.pop(&d);
                let size = b.payload.len() as u64;
                st.ram_bytes = st.ram_bytes.saturating_sub(b.charge());
                if ok {
                    // Its file is the one just written: an unlink queued for an earlier file
                    // of the block (a read promoted it meanwhile) would delete this one.
                    st.unlink.retain(|u| *u != d);
                    let charge = ssd_charge(b.model.len(), size);
                    st.ssd_bytes = st.ssd_bytes.saturating_add(charge);
                    st.ssd.put(
                        d,
                        SsdBlock {
                            token_count: b.token_count,
                            size,
                            charge,
                            last_access_ms: now_ms(),
                        },
                    );
                    self.metrics.spilled_blocks.inc();
                    self.metrics.spilled_bytes.inc_by(size);
                } else {
                    self.metrics.evicted.with_label_values(&["ram"]).inc();
                    removed.push(d);
                }
            }
            let over = st.pop_ssd_over(self.cfg.ssd_capacity);
            self.metrics
                .evicted
                .with_label_values(&["ssd"])
                .inc_by(over.len() as u64);
            st.unlink.extend_from_slice(&over);
            removed.extend(over);
            self.publish(&st, Vec::new(), removed);
        }
    }

    /// Deletes SSD blocks idle for longer than the TTL. Returns how many.
    pub async fn sweep_expired(&self) -> u64 {
        let now = now_ms();
        let expired = {
            let mut st = self.state.lock();
            let mut removed = Vec::new();
            while let Some((_, s)) = st.ssd.peek_lru() {
                if self.is_live(s.last_access_ms, now) {
                    break;
                }
                if let Some((d, old)) = st.ssd.pop_lru() {
                    st.ssd_bytes = st.ssd_bytes.saturating_sub(old.charge);
                    st.unlink.push(d);
                    removed.push(d);
                }
            }
            let n = removed.len() as u64;
            self.publish(&st, Vec::new(), removed);
            n
        };
        self.metrics.expired.inc_by(expired);
        if expired > 0 {
            let _only_one = self.maintenance.lock().await;
            self.drain_unlinks().await;
        }
        expired
    }

    async fn drain_unlinks(&self) {
        let files = std::mem::take(&mut self.state.lock().unlink);
        let Some(dir) = self.disk.clone() else {
            return;
        };
        if files.is_empty() {
            return;
        }
        let metrics = self.metrics.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for d in &files {
                if let Err(e) = dir.remove(d) {
                    tracing::error!(error = %e, "removing a block file failed");
                    metrics.disk_errors.inc();
                }
            }
        })
        .await;
    }

    /// Runs maintenance whenever RAM passes its high watermark, and TTL sweeps every
    /// `sweep_interval`, until the returned future is dropped.
    pub async fn run_maintenance(self: Arc<Self>, sweep_interval: Duration) {
        let mut sweep = tokio::time::interval(sweep_interval);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = sweep.tick() => {
                    self.sweep_expired().await;
                }
            }
            let over = self.state.lock().ram_bytes > self.cfg.ram_high;
            if over {
                self.maintain(self.cfg.ram_low).await;
            } else {
                self.maintain(u64::MAX).await;
            }
        }
    }

    /// Spills every RAM block to SSD (as far as the SSD capacity allows), for a graceful stop.
    pub async fn flush(self: &Arc<Self>) {
        self.maintain(0).await;
    }
}

/// The last copy of each digest, in the order of those last copies (so LRU order is what storing
/// the blocks one by one would give).
fn last_of_each(blocks: Vec<Block>) -> Vec<Block> {
    if blocks.len() < 2 {
        return blocks;
    }
    let mut seen: std::collections::HashSet<Digest, foldhash::fast::RandomState> =
        std::collections::HashSet::with_capacity_and_hasher(blocks.len(), Default::default());
    let mut out: Vec<Block> = blocks
        .into_iter()
        .rev()
        .filter(|b| seen.insert(b.digest))
        .collect();
    out.reverse();
    out
}

fn write_batch(dir: &BlockDir, batch: &[(Digest, Arc<str>, u32, Bytes)], m: &Metrics) -> Vec<bool> {
    let blocks: Vec<(&Digest, &str, u32, &[u8])> = batch
        .iter()
        .map(|(d, model, tokens, payload)| (d, &**model, *tokens, &payload[..]))
        .collect();
    dir.write_batch(&blocks)
        .into_iter()
        .map(|r| match r {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "spilling a block failed; it is dropped");
                m.disk_errors.inc();
                false
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::Poll;

    fn cfg(ram: u64, ssd: u64) -> StoreConfig {
        StoreConfig {
            ram_capacity: ram,
            ram_high: ram * 9 / 10,
            ram_low: ram / 2,
            ssd_capacity: ssd,
            ssd_ttl: Duration::from_secs(3600),
            max_block_bytes: ram,
        }
    }

    fn block(i: u32, size: usize) -> Block {
        Block {
            digest: Digest(*blake3::hash(&i.to_le_bytes()).as_bytes()),
            model: "m".into(),
            token_count: 16,
            payload: Bytes::from(vec![i as u8; size]),
        }
    }

    /// A store with an SSD tier in `dir`.
    fn with_ssd(c: StoreConfig, dir: &std::path::Path) -> Arc<BlockStore> {
        BlockStore::open(c, Some((dir, false)), Arc::new(Metrics::new())).expect("open")
    }

    #[tokio::test]
    async fn ram_overflow_spills_coldest_first_and_reads_promote() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = with_ssd(cfg(10_000, 1 << 20), dir.path());
        for i in 0..20 {
            s.put(vec![block(i, 1000)]).await.expect("put");
        }
        s.maintain(s.cfg.ram_low).await;
        let (ram_blocks, ram_bytes, ssd_blocks, _) = s.occupancy();
        assert!(ram_bytes <= 10_000 / 2, "{ram_bytes}");
        assert_eq!(ram_blocks + ssd_blocks, 20);
        // The oldest went to SSD, the newest stayed.
        let loc = s.lookup(&[block(0, 0).digest, block(19, 0).digest]);
        assert_eq!(loc[0].map(|l| l.tier), Some(Tier::Ssd));
        assert_eq!(loc[1].map(|l| l.tier), Some(Tier::Ram));
        let (b, tier) = s.get(block(0, 0).digest).await.expect("served");
        assert_eq!((tier, &b.payload[..]), (Tier::Ssd, &[0u8; 1000][..]));
        assert_eq!(s.lookup(&[b.digest])[0].map(|l| l.tier), Some(Tier::Ram));
    }

    /// Reopened with a smaller SSD capacity, the store holds to it at once: the oldest blocks
    /// and their files go before it serves.
    #[tokio::test]
    async fn a_smaller_ssd_capacity_at_start_is_held_to_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = with_ssd(cfg(10_000, 1 << 20), dir.path());
            for i in 0..20 {
                s.put(vec![block(i, 1000)]).await.expect("put");
            }
            s.maintain(0).await;
            assert_eq!(s.occupancy().2, 20, "all spilled");
        }
        let s = with_ssd(cfg(10_000, 5 * SSD_ALLOCATION_UNIT_BYTES), dir.path());
        let (_, _, ssd_blocks, ssd_bytes) = s.occupancy();
        assert!(ssd_bytes <= 5 * SSD_ALLOCATION_UNIT_BYTES, "{ssd_bytes}");
        assert_eq!(ssd_blocks, 5);
        let files = std::fs::read_dir(dir.path().join("blocks"))
            .unwrap()
            .count();
        assert_eq!(files, 5, "a trimmed block's file stayed");
    }

    /// A put that waits for a spill and is dropped mid-write (its gRPC client gave up) still
    /// indexes the files the spill writes: every file on disk is in the SSD index, and a
    /// Delete(all) leaves none behind.
    #[tokio::test]
    async fn a_put_dropped_while_its_spill_writes_leaves_no_file_unindexed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = with_ssd(cfg(10_000, 1 << 20), dir.path());
        for i in 0..7 {
            s.put(vec![block(i, 1000)]).await.expect("put");
        }
        assert_eq!(s.occupancy().2, 0, "nothing spilled yet");
        // RAM is full: this put must spill first. Polled once, it reaches the spill's file
        // writes (on a blocking thread) and is dropped there.
        let mut put = Box::pin(s.put(vec![block(100, 2000)]));
        let first = std::future::poll_fn(|cx| Poll::Ready(put.as_mut().poll(cx))).await;
        assert!(
            first.is_pending(),
            "the put had to wait for a spill: {first:?}"
        );
        drop(put);
        // Wait for that spill's writes to land: files staged under tmp/, renamed into blocks/.
        let list = |sub: &str| -> Vec<String> {
            std::fs::read_dir(dir.path().join(sub))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        let files = || list("blocks");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = files();
            if !now.is_empty() && list("tmp").is_empty() && now == seen {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the spill wrote nothing"
            );
            seen = now;
        }
        s.maintain(u64::MAX).await;
        assert_eq!(
            files().len() as u64,
            s.occupancy().2,
            "files on disk: {:?}",
            files()
        );
        s.delete(&[], true).await;
        assert_eq!(
            files(),
            Vec::<String>::new(),
            "Delete(all) left files behind"
        );
    }

    /// A block read back from SSD (its old file queued for unlinking) and spilled again before
    /// the queue drains keeps its new file: the queued unlink is for the old one.
    #[tokio::test]
    async fn a_block_spilled_again_keeps_the_file_it_was_spilled_to() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = with_ssd(cfg(10_000, 1 << 20), dir.path());
        let b = block(1, 1000);
        s.put(vec![b.clone()]).await.expect("put");
        s.maintain(0).await;
        let (got, tier) = s.get(b.digest).await.expect("served");
        assert_eq!((tier, got.payload.clone()), (Tier::Ssd, b.payload.clone()));
        // Promoted: back in RAM, its file queued for unlinking. A spill pass writes it again
        // before the queue drains (as when the read lands between a pass's drain and its
        // write).
        let victims: Vec<(Digest, RamBlock)> = {
            let st = s.state.lock();
            assert_eq!(st.unlink, vec![b.digest]);
            vec![(b.digest, st.ram.peek(&b.digest).expect("in RAM").clone())]
        };
        let disk = s.disk.clone().expect("an SSD tier");
        let batch = vec![(b.digest, Arc::from("m"), 16, b.payload.clone())];
        let written = write_batch(&disk, &batch, &s.metrics);
        s.settle_spill(victims, written);
        s.drain_unlinks().await;
        assert_eq!(s.lookup(&[b.digest])[0].map(|l| l.tier), Some(Tier::Ssd));
        let (got, tier) = s.get(b.digest).await.expect("its file is still there");
        assert_eq!((tier, got.payload), (Tier::Ssd, b.payload));
    }

    #[tokio::test]
    async fn without_ssd_overflow_is_dropped_and_reported_removed() {
        let s = BlockStore::open(cfg(4000, 0), None, Arc::new(Metrics::new())).expect("open");
        let (mut rx, snap) = s.subscribe();
        assert!(snap.reset && snap.added.is_empty());
        for i in 0..8 {
            s.put(vec![block(i, 1000)]).await.expect("put");
        }
        let mut added = 0;
        let mut removed = 0;
        while let Ok(c) = rx.try_recv() {
            added += c.added.len();
            removed += c.removed.len();
        }
        let (ram_blocks, _, _, _) = s.occupancy();
        assert_eq!(added, 8);
        assert_eq!(removed as u64, 8 - ram_blocks);
        assert!(removed > 0);
    }

    fn empty(i: u32) -> Block {
        block(i, 0)
    }

    #[test]
    fn the_per_block_overhead_covers_the_structures_a_block_costs() {
        // LRU node (key, value, two links), hash slot (key pointer, node pointer, control byte,
        // twice that just after growth), the model name's Arc header, and one allocator header
        // (16 bytes on glibc) for the node, the model name and the payload each.
        let node = std::mem::size_of::<(Digest, RamBlock)>() + 2 * std::mem::size_of::<usize>();
        let slot = 2 * (2 * std::mem::size_of::<usize>() + 1);
        let arc_header = 2 * std::mem::size_of::<usize>();
        let measured = node + slot + arc_header + 3 * 16;
        assert!(
            measured as u64 <= RAM_BLOCK_OVERHEAD_BYTES,
            "{measured} bytes per block > RAM_BLOCK_OVERHEAD_BYTES"
        );
        assert_eq!(ram_charge(7, 0), 263);
        assert_eq!(ssd_charge(7, 0), 4096);
        assert_eq!(ssd_charge(7, 4096), 8192);
    }

    #[tokio::test]
    async fn empty_blocks_are_charged_so_their_number_is_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = with_ssd(cfg(64 << 10, 64 << 10), dir.path());
        for batch in 0..40u32 {
            s.put((0..50).map(|i| empty(batch * 50 + i)).collect())
                .await
                .expect("put");
        }
        s.maintain(s.cfg.ram_low).await;
        let (ram_blocks, ram_bytes, ssd_blocks, ssd_bytes) = s.occupancy();
        assert!(ram_bytes <= 64 << 10 && ssd_bytes <= 64 << 10);
        assert!(
            ram_bytes >= ram_blocks * RAM_BLOCK_OVERHEAD_BYTES,
            "{ram_bytes}"
        );
        assert!(
            ssd_bytes >= ssd_blocks * SSD_ALLOCATION_UNIT_BYTES,
            "{ssd_bytes}"
        );
        assert!(
            ram_blocks <= (64 << 10) / RAM_BLOCK_OVERHEAD_BYTES
                && ssd_blocks <= (64 << 10) / SSD_ALLOCATION_UNIT_BYTES,
            "{ram_blocks} + {ssd_blocks} of 2000 empty blocks kept"
        );
        // A batch whose overhead alone passes the capacity is refused whole.
        let e = s
            .put((0..300).map(|i| empty(10_000 + i)).collect())
            .await
            .expect_err("refused");
        assert!(e.to_string().contains("capacity"), "{e}");
    }

    #[tokio::test]
    async fn a_digest_repeated_in_a_batch_is_not_counted_as_freed_twice() {
        // No maintenance task runs: what `put` admits is what stays.
        let s = BlockStore::open(cfg(65_536, 0), None, Arc::new(Metrics::new())).expect("open");
        s.put(vec![block(1, 30_000), block(2, 30_000)])
            .await
            .expect("put");
        // Block 1 three times (empty) plus two new 20,000-byte blocks: counting block 1's
        // 30,000 bytes as freed three times would admit 70,000+ bytes into 65,536.
        let batch = vec![
            empty(1),
            empty(1),
            empty(1),
            block(3, 20_000),
            block(4, 20_000),
        ];
        let (stored, _) = s.put(batch).await.expect("put");
        assert_eq!(stored, 5);
        let (ram_blocks, ram_bytes, _, _) = s.occupancy();
        assert!(ram_bytes <= 65_536, "RAM over capacity: {ram_bytes}");
        assert!(ram_blocks <= 4, "{ram_blocks}");
        // The last copy of a repeated digest wins.
        let mut last = block(9, 10);
        last.payload = Bytes::from_static(b"last");
        s.put(vec![block(9, 10), last]).await.expect("put");
        let (b, _) = s.get(block(9, 0).digest).await.expect("stored");
        assert_eq!(&b.payload[..], b"last");
    }

    #[tokio::test]
    async fn oversize_blocks_and_batches_are_rejected() {
        let s = BlockStore::open(cfg(4000, 0), None, Arc::new(Metrics::new())).expect("open");
        assert!(s.put(vec![block(1, 4001)]).await.is_err());
        assert!(s.put(vec![block(1, 3000), block(2, 3000)]).await.is_err());
        assert_eq!(s.occupancy().0, 0);
    }
}
