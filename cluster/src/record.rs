//! The node record each proxy publishes under the gossip key `node` (DESIGN section 5).

use serde::{Deserialize, Serialize};

/// What a proxy says about itself and the engine it fronts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct NodeRecord {
    /// The proxy's cluster-unique id.
    pub node_id: String,
    /// Where peers reach this proxy (`http://host:port`); a forwarded request goes here.
    pub proxy_url: String,
    /// Where the engine listens; empty for a gateway that fronts no engine of its own.
    pub engine_url: String,
    /// Models the engine serves.
    pub models: Vec<String>,
    /// `both`, `prefill`, `decode`, or `gateway` (no engine of its own).
    pub role: String,
    /// Requests in flight on the engine, as this proxy counts them.
    pub inflight: u64,
    /// Uncached prompt bytes dispatched to the engine and not yet answered.
    pub pending_prefill_bytes: u64,
    /// Requests queued in the engine (0 when unknown).
    pub queue_depth: u64,
    /// KV blocks of the engine (0 when unknown).
    pub kv_blocks_total: u64,
    /// Free KV blocks (0 when unknown).
    pub kv_blocks_free: u64,
    /// The engine's cache generation: when it changes, everything known about its residency is
    /// dropped.
    pub kv_epoch: u64,
    /// The engine is healthy and takes requests.
    pub ready: bool,
    /// The proxy's version.
    pub version: String,
    /// It takes load beacons ([`crate::beacon`]): peers send it their load as it changes.
    /// Absent (older versions): false, and peers send none.
    pub load_beacons: bool,
}

impl NodeRecord {
    /// Whether this node fronts an engine others may route to.
    pub fn has_engine(&self) -> bool {
        !self.engine_url.is_empty() && self.role != "gateway"
    }
}
