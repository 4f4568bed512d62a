//! The `KvAgent` gRPC service: validates requests, calls the store, shapes responses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvmesh_filters::chain::Digest;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::access::{Access, AccessControl};
use crate::config::Limits;
use crate::pb;
use crate::store::{Block, BlockStore, ResidencyChange, Tier};
use crate::telemetry::Scraper;

/// The service state shared by every call.
pub struct KvAgentService {
    store: Arc<BlockStore>,
    scraper: Arc<Scraper>,
    limits: Limits,
    watchers: Arc<AtomicUsize>,
    stopping: tokio::sync::watch::Receiver<bool>,
    access: AccessControl,
}

impl KvAgentService {
    /// A service over `store`, reporting `scraper`'s load, enforcing `limits`. Open
    /// `WatchResidency` streams end when `stopping` turns true, so a graceful stop can drain.
    pub fn new(
        store: Arc<BlockStore>,
        scraper: Arc<Scraper>,
        limits: Limits,
        stopping: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        KvAgentService {
            store,
            scraper,
            limits,
            watchers: Arc::new(AtomicUsize::new(0)),
            stopping,
            access: AccessControl::default(),
        }
    }

    /// The service with `access`'s tokens required on every call.
    pub fn with_access(mut self, access: AccessControl) -> Self {
        self.access = access;
        self
    }

    fn digests(&self, raw: &[bytes::Bytes], field: &str) -> Result<Vec<Digest>, Status> {
        self.check_batch(raw.len(), field)?;
        raw.iter()
            .enumerate()
            .map(|(i, d)| digest(d, || format!("{field}[{i}]")))
            .collect()
    }

    fn check_batch(&self, n: usize, field: &str) -> Result<(), Status> {
        if n > self.limits.max_batch {
            return Err(Status::invalid_argument(format!(
                "{field} has {n} entries; the limit is {} (limits.max_batch)",
                self.limits.max_batch
            )));
        }
        Ok(())
    }
}

/// `field` names the offending field, built only when there is an error (this runs per digest).
fn digest(raw: &[u8], field: impl FnOnce() -> String) -> Result<Digest, Status> {
    let bytes: [u8; 32] = raw.try_into().map_err(|_| {
        Status::invalid_argument(format!(
            "{} must be a 32-byte digest, got {} bytes",
            field(),
            raw.len()
        ))
    })?;
    Ok(Digest(bytes))
}

fn tier(t: Tier) -> pb::Tier {
    match t {
        Tier::Ram => pb::Tier::Ram,
        Tier::Ssd => pb::Tier::Ssd,
    }
}

/// Most digests in one `WatchResidency` message (32 bytes each plus framing: ~2.3 MB). The
/// proxy's feed refuses larger messages, and checks at compile time that this fits.
pub const DIGESTS_PER_UPDATE: usize = 65_536;

/// The longest a `WatchResidency` stream goes without a message: an empty one is sent when
/// nothing changed (`heartbeat_ms` in every message), so that a watcher can tell an idle stream
/// from one that stopped in the middle of a message.
pub const RESIDENCY_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(10);

/// How many messages `change` is sent as (at least one).
fn update_count(change: &ResidencyChange) -> usize {
    change
        .added
        .len()
        .max(change.removed.len())
        .div_ceil(DIGESTS_PER_UPDATE)
        .max(1)
}

/// Message `i` of `change`, built only when it is sent: a watcher holds one message queued and
/// one being built, never a whole snapshot's worth of protobuf (the change itself is shared).
fn update(change: &ResidencyChange, i: usize) -> pb::ResidencyUpdate {
    let part = |ds: &[Digest]| -> Vec<bytes::Bytes> {
        ds.chunks(DIGESTS_PER_UPDATE)
            .nth(i)
            .unwrap_or_default()
            .iter()
            .map(|d| bytes::Bytes::copy_from_slice(&d.0))
            .collect()
    };
    pb::ResidencyUpdate {
        kv_epoch: change.epoch,
        // Only the first message of a snapshot resets; the rest extend it.
        reset: change.reset && i == 0,
        added: part(&change.added),
        removed: part(&change.removed),
        heartbeat_ms: RESIDENCY_HEARTBEAT.as_millis() as u32,
    }
}

#[cfg(test)]
fn updates(change: &ResidencyChange) -> Vec<pb::ResidencyUpdate> {
    (0..update_count(change))
        .map(|i| update(change, i))
        .collect()
}

/// Counts a `WatchResidency` stream while it lives.
struct WatcherSlot {
    count: Arc<AtomicUsize>,
    gauge: prometheus::IntGauge,
}

impl Drop for WatcherSlot {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
        self.gauge.dec();
    }
}

#[tonic::async_trait]
impl pb::kv_agent_server::KvAgent for KvAgentService {
    async fn put_blocks(
        &self,
        request: Request<pb::PutBlocksRequest>,
    ) -> Result<Response<pb::PutBlocksResponse>, Status> {
        self.access.check(request.metadata(), Access::Write)?;
        let raw = request.into_inner().blocks;
        self.check_batch(raw.len(), "blocks")?;
        let mut blocks = Vec::with_capacity(raw.len());
        for (i, b) in raw.into_iter().enumerate() {
            let d = digest(&b.digest, || format!("blocks[{i}].digest"))?;
            if b.model.is_empty() || b.model.len() > self.limits.max_model_bytes {
                return Err(Status::invalid_argument(format!(
                    "blocks[{i}].model must be 1..={} bytes, got {}",
                    self.limits.max_model_bytes,
                    b.model.len()
                )));
            }
            if b.payload.len() as u64 > self.limits.max_block_bytes {
                return Err(Status::invalid_argument(format!(
                    "blocks[{i}].payload has {} bytes; the limit is {} (limits.max_block_bytes)",
                    b.payload.len(),
                    self.limits.max_block_bytes
                )));
            }
            blocks.push(Block {
                digest: d,
                model: b.model.into(),
                token_count: b.token_count,
                // Copied into an allocation of its own: the decoded payload is a slice of the
                // whole request buffer, which it would otherwise keep alive (a 1-byte block sent
                // with megabytes of unknown or repeated fields would pin all of them while being
                // charged for 1 byte).
                payload: bytes::Bytes::copy_from_slice(&b.payload),
            });
        }
        let (stored, kv_epoch) = self
            .store
            .put(blocks)
            .await
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(Response::new(pb::PutBlocksResponse { stored, kv_epoch }))
    }

    type GetBlocksStream = ReceiverStream<Result<pb::GetBlocksResponse, Status>>;

    async fn get_blocks(
        &self,
        request: Request<pb::GetBlocksRequest>,
    ) -> Result<Response<Self::GetBlocksStream>, Status> {
        self.access.check(request.metadata(), Access::Read)?;
        let digests = self.digests(&request.into_inner().digests, "digests")?;
        // Two messages in flight: enough to overlap reading the next block with sending this
        // one, while a slow reader holds at most two payloads here.
        let (tx, rx) = mpsc::channel(2);
        let store = self.store.clone();
        tokio::spawn(async move {
            for d in digests {
                let found = store.get(d).await;
                let msg = pb::GetBlocksResponse {
                    digest: bytes::Bytes::copy_from_slice(&d.0),
                    tier: found
                        .as_ref()
                        .map(|(_, t)| tier(*t))
                        .unwrap_or(pb::Tier::None) as i32,
                    block: found.map(|(b, _)| pb::Block {
                        digest: bytes::Bytes::copy_from_slice(&b.digest.0),
                        model: b.model.to_string(),
                        token_count: b.token_count,
                        payload: b.payload,
                    }),
                };
                if tx.send(Ok(msg)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        self.access.check(request.metadata(), Access::Read)?;
        let digests = self.digests(&request.into_inner().digests, "digests")?;
        let entries = self
            .store
            .lookup(&digests)
            .into_iter()
            .map(|loc| {
                let mut e = pb::LookupEntry::default();
                if let Some(l) = loc {
                    e.set_tier(tier(l.tier));
                    e.size = l.size;
                    e.last_access_unix_ms = l.last_access_unix_ms;
                    e.token_count = l.token_count;
                }
                e
            })
            .collect();
        Ok(Response::new(pb::LookupResponse { entries }))
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        self.access.check(request.metadata(), Access::Write)?;
        let req = request.into_inner();
        if req.all && !req.digests.is_empty() {
            return Err(Status::invalid_argument(
                "give either digests or all = true, not both",
            ));
        }
        if !req.all && req.digests.is_empty() {
            return Err(Status::invalid_argument(
                "nothing to delete: give digests or all = true",
            ));
        }
        let digests = self.digests(&req.digests, "digests")?;
        let (deleted, kv_epoch) = self.store.delete(&digests, req.all).await;
        Ok(Response::new(pb::DeleteResponse { deleted, kv_epoch }))
    }

    async fn stats(
        &self,
        request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        self.access.check(request.metadata(), Access::Read)?;
        let m = &self.store.metrics;
        let (ram_blocks, ram_bytes, ssd_blocks, ssd_bytes) = self.store.occupancy();
        let cfg = self.store.config();
        Ok(Response::new(pb::StatsResponse {
            kv_epoch: self.store.epoch(),
            ram_blocks,
            ram_bytes,
            ram_capacity_bytes: cfg.ram_capacity,
            ssd_blocks,
            ssd_bytes,
            ssd_capacity_bytes: cfg.ssd_capacity,
            hits_ram: m.hits.with_label_values(&["ram"]).get(),
            hits_ssd: m.hits.with_label_values(&["ssd"]).get(),
            misses: m.misses.get(),
            spilled_blocks: m.spilled_blocks.get(),
            promoted_blocks: m.promoted_blocks.get(),
            corrupt_dropped: m.corrupt_dropped.get(),
            expired: m.expired.get(),
            evicted: m.evicted.with_label_values(&["ram"]).get()
                + m.evicted.with_label_values(&["ssd"]).get(),
        }))
    }

    type WatchResidencyStream = ReceiverStream<Result<pb::ResidencyUpdate, Status>>;

    async fn watch_residency(
        &self,
        request: Request<pb::WatchResidencyRequest>,
    ) -> Result<Response<Self::WatchResidencyStream>, Status> {
        self.access.check(request.metadata(), Access::Read)?;
        if self.watchers.fetch_add(1, Ordering::Relaxed) >= self.limits.max_watchers {
            self.watchers.fetch_sub(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "{} residency watchers are open (limits.max_watchers)",
                self.limits.max_watchers
            )));
        }
        self.store.metrics.watchers.inc();
        let slot = WatcherSlot {
            count: self.watchers.clone(),
            gauge: self.store.metrics.watchers.clone(),
        };
        // One message queued while the next is built: a watcher that stops reading holds two
        // (up to 2 x DIGESTS_PER_UPDATE digests), not a queue of them, whatever the store holds.
        let (tx, rx) = mpsc::channel(1);
        let store = self.store.clone();
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let (mut events, snapshot) = store.subscribe();
            let mut change = Arc::new(snapshot);
            loop {
                for i in 0..update_count(&change) {
                    if tx.send(Ok(update(&change, i))).await.is_err() {
                        return;
                    }
                }
                let epoch = change.epoch;
                change = tokio::select! {
                    _ = tx.closed() => return,
                    _ = stopping.wait_for(|s| *s) => return,
                    _ = tokio::time::sleep(RESIDENCY_HEARTBEAT) => Arc::new(ResidencyChange {
                        epoch,
                        reset: false,
                        added: Vec::new(),
                        removed: Vec::new(),
                    }),
                    ev = events.recv() => match ev {
                        Ok(c) => c,
                        // Fell behind: start over from a fresh snapshot rather than guess.
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            let (e, snapshot) = store.subscribe();
                            events = e;
                            Arc::new(snapshot)
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                };
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn node_load(
        &self,
        request: Request<pb::NodeLoadRequest>,
    ) -> Result<Response<pb::NodeLoadResponse>, Status> {
        self.access.check(request.metadata(), Access::Read)?;
        let l = self.scraper.load();
        Ok(Response::new(pb::NodeLoadResponse {
            available: l.available,
            running: l.running,
            waiting: l.waiting,
            kv_usage: l.kv_usage,
            flavor: l.flavor.to_string(),
            scraped_unix_ms: l.scraped_unix_ms,
            error: l.error,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn big_snapshots_are_split_and_only_the_first_part_resets() {
        let change = ResidencyChange {
            epoch: 9,
            reset: true,
            added: (0..DIGESTS_PER_UPDATE as u32 + 5)
                .map(|i| Digest(*blake3::hash(&i.to_le_bytes()).as_bytes()))
                .collect(),
            removed: Vec::new(),
        };
        let u = updates(&change);
        assert_eq!(u.len(), 2);
        assert!(u[0].reset && !u[1].reset);
        assert_eq!(u[0].added.len() + u[1].added.len(), change.added.len());
        // An empty reset (Delete all) still sends one message.
        let empty = updates(&ResidencyChange {
            epoch: 3,
            reset: true,
            ..Default::default()
        });
        assert_eq!(empty.len(), 1);
        assert!(empty[0].reset && empty[0].kv_epoch == 3);
    }
}
